"""What the tool computes, apart from the component's bindings, so that
`python3 -m unittest` runs it without building the component. The Rust and
JavaScript templates count the same way, and test the same cases."""

import re

# ASCII whitespace only: str.split() would also split at Unicode spaces,
# and count differently from the other languages.
WHITESPACE = re.compile("[ \t\n\x0b\x0c\r]+")


def stats(text: str) -> dict:
    """The words (runs of characters other than ASCII whitespace),
    characters (code points) and lines (split at each newline, a last one
    ending the last line rather than starting another) of `text`."""
    breaks = text.count("\n")
    return {
        "words": len([word for word in WHITESPACE.split(text) if word]),
        "characters": len(text),
        "lines": 0 if not text else breaks if text.endswith("\n") else breaks + 1,
    }
