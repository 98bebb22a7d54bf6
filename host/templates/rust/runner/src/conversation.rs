//! The runner's own message format and turn state, apart from the
//! component's bindings, so that `cargo test` runs them natively.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

/// A model message as JSON: the `framework-item` this runner stores, so a
/// later turn replays the conversation exactly, tool calls included.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Item {
    pub role: String,
    #[serde(default)]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ItemToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// One tool call the model asked for.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ItemToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

impl Item {
    /// A message with text only.
    pub fn text(role: &str, content: Option<String>) -> Self {
        Item {
            role: role.to_string(),
            content,
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// A stored message back as an item. A message this runner did not
    /// write (the host's turn-failure note, an imported history) is taken
    /// by its role and text.
    pub fn stored(framework_item: &str, role: &str, text: Option<&str>) -> Self {
        serde_json::from_str(framework_item)
            .unwrap_or_else(|_| Item::text(role, text.map(str::to_string)))
    }
}

/// What the runner keeps between the model calls of one turn: the host
/// drops the instance after every call, so it travels as the run state.
#[derive(Serialize, Deserialize, Default, Debug, PartialEq)]
pub struct RunState {
    /// This turn's messages after the user's: tool calls and their results.
    pub items: Vec<Item>,
    /// The tool calls of the last answer, waiting for their outcomes.
    pub pending: Vec<String>,
}

/// The stored messages a model may be sent: a tool result whose call is
/// not among them (cut off by the window) is dropped, since a model API
/// refuses one.
pub fn window(items: Vec<Item>) -> Vec<Item> {
    let mut announced = HashSet::new();
    let mut kept = Vec::new();
    for item in items {
        if item.role == "tool"
            && !item
                .tool_call_id
                .as_ref()
                .is_some_and(|id| announced.contains(id))
        {
            continue;
        }
        announced.extend(item.tool_calls.iter().map(|c| c.id.clone()));
        kept.push(item);
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool_result(id: &str) -> Item {
        Item {
            tool_call_id: Some(id.to_string()),
            ..Item::text("tool", Some("done".to_string()))
        }
    }

    #[test]
    fn a_tool_result_without_its_call_in_the_window_is_dropped() {
        let call = Item {
            tool_calls: vec![ItemToolCall {
                id: "b".to_string(),
                name: "t".to_string(),
                arguments: "{}".to_string(),
            }],
            ..Item::text("assistant", None)
        };
        let kept = window(vec![tool_result("a"), call.clone(), tool_result("b")]);
        assert_eq!(kept, vec![call, tool_result("b")]);
    }

    #[test]
    fn a_message_of_another_shape_is_read_by_its_role_and_text() {
        let item = Item::stored("not json", "user", Some("hello"));
        assert_eq!(item, Item::text("user", Some("hello".to_string())));
        let state = RunState {
            items: vec![item],
            pending: vec!["a".to_string()],
        };
        let text = serde_json::to_string(&state).expect("serializes");
        assert_eq!(serde_json::from_str::<RunState>(&text).ok(), Some(state));
    }
}
