//! The order a backend applies a Step's writes in: every write but the
//! appends in the Step's order, then each stream's appends as one batch.

use crate::flow::types::{Json, StateWrite};

/// A Step's writes, arranged so that each stream is appended to once.
///
/// An append touches only its stream (its entries and its length), and no
/// other write touches a stream, so moving the appends after the other
/// writes changes nothing a reader can see; within one stream they keep
/// their order. A batch reads and writes the stream's length once instead
/// of once per entry: a model Step's commit appends five or more events.
pub(crate) struct WritePlan<'w> {
    /// Every write that is not an append, in the Step's order.
    pub others: Vec<&'w StateWrite>,
    /// Each stream's entries, streams in the order of their first append.
    pub appends: Vec<(&'w str, Vec<Json>)>,
}

impl<'w> WritePlan<'w> {
    pub(crate) fn of(writes: &'w [StateWrite]) -> Self {
        let mut others = Vec::with_capacity(writes.len());
        let mut appends: Vec<(&'w str, Vec<Json>)> = Vec::new();
        for write in writes {
            match write {
                StateWrite::Append { stream, payload } => {
                    match appends
                        .iter_mut()
                        .find(|(name, _)| *name == stream.as_str())
                    {
                        Some((_, entries)) => entries.push(payload.clone()),
                        None => appends.push((stream.as_str(), vec![payload.clone()])),
                    }
                }
                other => others.push(other),
            }
        }
        Self { others, appends }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn append(stream: &str, n: i64) -> StateWrite {
        StateWrite::Append {
            stream: stream.into(),
            payload: json!(n),
        }
    }

    #[test]
    fn appends_are_grouped_by_stream_in_order_and_other_writes_keep_theirs() {
        let set = |key: &str| StateWrite::Set {
            name: "m".into(),
            key: key.into(),
            value: json!(key),
        };
        let writes = vec![
            append("a", 1),
            set("x"),
            append("b", 2),
            append("a", 3),
            set("y"),
            append("b", 4),
        ];
        let plan = WritePlan::of(&writes);
        assert_eq!(plan.others, vec![&writes[1], &writes[4]]);
        assert_eq!(
            plan.appends,
            vec![
                ("a", vec![json!(1), json!(3)]),
                ("b", vec![json!(2), json!(4)])
            ]
        );
    }
}
