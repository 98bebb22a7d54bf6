import unittest

from stats import stats


class StatsTest(unittest.TestCase):
    def test_counts_words_characters_and_lines(self):
        self.assertEqual(
            stats("the quick brown\nfox é"), {"words": 5, "characters": 21, "lines": 2}
        )
        self.assertEqual(stats(""), {"words": 0, "characters": 0, "lines": 0})


if __name__ == "__main__":
    unittest.main()
