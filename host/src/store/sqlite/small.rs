//! Which writes are small enough to run on their caller's thread.
//!
//! A write runs on its caller's thread only when the store is quiet (see
//! [`super::writer::Writer`]), and only when it is small: that thread is a
//! runtime thread other sessions share. A write with a large payload (a big
//! tool result, a long message) or many rows queues for the writer thread
//! like any write under load.
//!
//! What a write does beyond its own rows is bounded by them:
//! - a Step's commit that clears a map (deletes all its keys) is small only
//!   when the store, just before and only if the store is quiet, found
//!   those maps small enough to fit the same budget (`state::maps_fit`), so
//!   the rows a clear deletes count too. That look reads up to 64 rows (and
//!   one a map) whole, which the Step clearing them has just read too;
//! - appending to a full stream trims its oldest entries, as many bytes as
//!   were appended (at most [`MAX_BYTES`]);
//! - a claim, alone or with a commit, reads the inputs and waited messages
//!   of the tasks it leases. Those can be large, but the Steps that run
//!   next handle the same bytes on a runtime thread anyway, so reading them
//!   here adds a like cost, not a stall of a new kind.

use crate::flow::store::StepCommit;
use crate::flow::types::{Json, StateWrite};

/// At most this many rows inserted or deleted by name.
pub(super) const MAX_ROWS: usize = 64;

/// At most about this many bytes of payload (strings and keys as they are,
/// about 8 per number).
const MAX_BYTES: usize = 16 << 10;

/// How small a Step's commit is.
#[derive(Debug, PartialEq)]
pub(super) enum CommitSize {
    /// Small: it may run on its caller's thread.
    Small,
    /// Small if the maps it clears hold at most `rows` rows and `bytes`
    /// bytes of keys and values between them: a clear deletes every key of
    /// a map, however many, so the store looks before the write (see
    /// `state::maps_fit`).
    SmallIfCleared {
        maps: Vec<String>,
        rows: usize,
        bytes: usize,
    },
    /// Not small: it queues for the writer thread.
    Large,
}

/// How small a Step's commit is. Completing the flow deletes all of its
/// tasks, however many, so such a commit is never small.
pub(super) fn commit_size(commit: &StepCommit) -> CommitSize {
    let rows = commit.writes.len() + commit.next.len() + commit.consumed.len();
    if commit.complete_flow || rows > MAX_ROWS {
        return CommitSize::Large;
    }
    let mut budget = Budget(MAX_BYTES);
    let mut maps = Vec::new();
    let fits = budget.take(commit.history.detail.as_ref().map_or(0, String::len))
        && commit.writes.iter().all(|write| match write {
            StateWrite::Clear { name } => {
                maps.push(name.clone());
                budget.take(name.len())
            }
            write => budget.write(write),
        })
        && commit.next.iter().all(|task| budget.json(&task.input));
    match (fits, maps.is_empty()) {
        (false, _) => CommitSize::Large,
        (true, true) => CommitSize::Small,
        (true, false) => CommitSize::SmallIfCleared {
            maps,
            rows: MAX_ROWS - rows,
            bytes: budget.0,
        },
    }
}

/// Whether payloads appended to a stream are small.
pub(super) fn small_payloads(payloads: &[Json]) -> bool {
    let mut budget = Budget(MAX_BYTES);
    payloads.len() <= MAX_ROWS && payloads.iter().all(|payload| budget.json(payload))
}

/// The bytes still allowed.
struct Budget(usize);

impl Budget {
    fn take(&mut self, bytes: usize) -> bool {
        match self.0.checked_sub(bytes) {
            Some(left) => {
                self.0 = left;
                true
            }
            None => false,
        }
    }

    fn write(&mut self, write: &StateWrite) -> bool {
        match write {
            StateWrite::Set { name, key, value } => {
                self.take(name.len() + key.len()) && self.json(value)
            }
            StateWrite::Delete { name, key } => self.take(name.len() + key.len()),
            // Deletes every key, however many: sized by `commit_size`.
            StateWrite::Clear { .. } => false,
            StateWrite::Publish {
                channel,
                key,
                payload,
            } => self.take(channel.len() + key.len()) && self.json(payload),
            StateWrite::Append { stream, payload } => self.take(stream.len()) && self.json(payload),
        }
    }

    /// Walks `value` until the budget runs out: the walk costs at most the
    /// budget, however large or deeply nested the value is.
    fn json(&mut self, value: &Json) -> bool {
        let mut pending = vec![value];
        while let Some(value) = pending.pop() {
            let fits = match value {
                Json::String(text) => self.take(text.len() + 2),
                // Each item costs at least 2 bytes: a list longer than the
                // budget allows is refused before it is queued for the walk.
                Json::Array(items) => {
                    self.take(2 + 2 * items.len()) && {
                        pending.extend(items);
                        true
                    }
                }
                Json::Object(fields) => {
                    self.take(2 + 2 * fields.len())
                        && fields.iter().all(|(name, item)| {
                            pending.push(item);
                            self.take(name.len())
                        })
                }
                _ => self.take(8),
            };
            if !fits {
                return false;
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_payload_is_small_up_to_the_budget_and_not_past_it() {
        assert!(small_payloads(&[json!({"role": "user", "text": "hello"})]));
        assert!(small_payloads(&[json!("x".repeat(MAX_BYTES - 2))]));
        assert!(!small_payloads(&[json!("x".repeat(MAX_BYTES - 1))]));
        let halves = json!("x".repeat(MAX_BYTES / 2));
        assert!(!small_payloads(&[halves.clone(), halves]));
        assert!(!small_payloads(&vec![json!(1); MAX_ROWS + 1]));
    }

    #[test]
    fn a_huge_or_deeply_nested_payload_is_not_small() {
        let wide = Json::Array(vec![json!(0); 1_000_000]);
        assert!(!small_payloads(&[wide]));
        let mut deep = json!(0);
        for _ in 0..20_000 {
            deep = Json::Array(vec![deep]);
        }
        assert!(!small_payloads(std::slice::from_ref(&deep)));
        // Dropping a 20,000-deep value recurses past a test thread's stack.
        std::mem::forget(deep);
    }

    fn commit(writes: Vec<StateWrite>) -> StepCommit {
        StepCommit {
            task_id: 1,
            lease_token: 1,
            flow_id: "f".to_string(),
            consumed: Vec::new(),
            writes,
            next: Vec::new(),
            complete_flow: false,
            history: crate::flow::types::StepHistoryEntry {
                event_type: "execute_completed".to_string(),
                step_type: "Step".to_string(),
                step_execution_id: "s".to_string(),
                final_attempt: 1,
                at: 0,
                detail: None,
                started_at: None,
                component: None,
            },
            claim_next: None,
        }
    }

    fn set(key: &str, value: Json) -> StateWrite {
        StateWrite::Set {
            name: "m".to_string(),
            key: key.to_string(),
            value,
        }
    }

    /// A commit that clears maps is small only if those maps fit what its
    /// other rows and bytes leave of the budget; the store looks at them
    /// before the write.
    #[test]
    fn a_commit_that_clears_a_map_is_small_only_if_the_map_fits_what_is_left() {
        assert_eq!(
            commit_size(&commit(vec![set("k", json!(1))])),
            CommitSize::Small
        );
        let clears = commit(vec![
            set("k", json!("x".repeat(100))),
            StateWrite::Clear {
                name: "calls".to_string(),
            },
            StateWrite::Clear {
                name: "asks".to_string(),
            },
        ]);
        assert_eq!(
            commit_size(&clears),
            CommitSize::SmallIfCleared {
                maps: vec!["calls".to_string(), "asks".to_string()],
                rows: MAX_ROWS - 3,
                bytes: MAX_BYTES - ("m".len() + "k".len() + 102 + "calls".len() + "asks".len()),
            }
        );
        let mut full = commit(vec![
            set("k", json!("x".repeat(MAX_BYTES))),
            StateWrite::Clear {
                name: "calls".to_string(),
            },
        ]);
        assert_eq!(commit_size(&full), CommitSize::Large);
        full.writes.remove(0);
        full.complete_flow = true;
        assert_eq!(commit_size(&full), CommitSize::Large);
    }
}
