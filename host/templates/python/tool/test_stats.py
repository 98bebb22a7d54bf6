import unittest

from stats import stats

# text, words, characters, lines: the same cases as the Rust and JavaScript
# templates.
CASES = [
    ("the quick brown\nfox é", 5, 21, 2),
    ("", 0, 0, 0),
    ("\n", 0, 1, 1),
    ("a\tb\r\nc\u2028d\n", 3, 9, 2),
    ("a\rb", 2, 3, 1),
    ("a\u00a0b\n\n", 1, 5, 2),
]


class StatsTest(unittest.TestCase):
    def test_counts_words_characters_and_lines(self):
        for text, words, characters, lines in CASES:
            with self.subTest(text=text):
                self.assertEqual(
                    stats(text), {"words": words, "characters": characters, "lines": lines}
                )


if __name__ == "__main__":
    unittest.main()
