import json
import unittest

from conversation import item, run_state, stored, window


class ConversationTest(unittest.TestCase):
    def test_a_tool_result_without_its_call_in_the_window_is_dropped(self):
        call = item("assistant", None, tool_calls=[{"id": "b", "name": "t", "arguments": "{}"}])
        result_a = item("tool", "done", tool_call_id="a")
        result_b = item("tool", "done", tool_call_id="b")
        self.assertEqual(window([result_a, call, result_b]), [call, result_b])

    def test_a_message_of_another_shape_is_read_by_its_role_and_text(self):
        self.assertEqual(stored("not json", "user", "hello"), item("user", "hello"))
        for other in ['{"role": "robot"}', '{"role": "user", "content": [1]}', '[]', "null"]:
            self.assertEqual(stored(other, "user", "hello"), item("user", "hello"), other)

    def test_a_run_state_of_another_shape_is_refused(self):
        self.assertEqual(run_state(None), {"items": [], "pending": []})
        state = {"items": [item("tool", "done", tool_call_id="a")], "pending": ["a"]}
        self.assertEqual(run_state(json.dumps(state)), state)
        for other in ["[]", "{}", '{"items": [], "pending": [1]}', "not json"]:
            with self.assertRaises(ValueError, msg=other):
                run_state(other)


if __name__ == "__main__":
    unittest.main()
