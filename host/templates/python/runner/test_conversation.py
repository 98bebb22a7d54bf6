import unittest

from conversation import item, stored, window


class ConversationTest(unittest.TestCase):
    def test_a_tool_result_without_its_call_in_the_window_is_dropped(self):
        call = item("assistant", None, tool_calls=[{"id": "b", "name": "t", "arguments": "{}"}])
        result_a = item("tool", "done", tool_call_id="a")
        result_b = item("tool", "done", tool_call_id="b")
        self.assertEqual(window([result_a, call, result_b]), [call, result_b])

    def test_a_message_of_another_shape_is_read_by_its_role_and_text(self):
        self.assertEqual(stored("not json", "user", "hello"), item("user", "hello"))


if __name__ == "__main__":
    unittest.main()
