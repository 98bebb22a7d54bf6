"""What the tool computes, apart from the component's bindings, so that
`python3 -m unittest` runs it without building the component."""


def stats(text: str) -> dict:
    """The words (runs of non-whitespace), characters and lines of `text`."""
    return {
        "words": len(text.split()),
        "characters": len(text),
        "lines": len(text.splitlines()),
    }
