//! Stream appends and task takes seen by a watch of their own: a thread
//! with its own connection looks at `PRAGMA data_version` every 10 ms; when
//! any other connection has committed (another process, or this process's
//! writer), it reads the stream heads of the flows this process's readers
//! wait on and wakes the readers of those whose heads moved, and likewise
//! the revocation counts of the flows this process runs Steps of
//! (`flow_revocations`, moved by a cancel or a stop). One indexed read per
//! such commit and kind, and only while someone waits: not a wake of every
//! waiter on every commit.
//!
//! Its own thread, not the writer's: the read never holds up a write, a
//! writer waiting for the lock does not hold up the readers, and an append
//! whose caller went away before it could wake them (a Step aborted at its
//! timeout) still wakes them within the interval.

use std::collections::{HashMap, HashSet};
use std::sync::Weak;
use std::time::Duration;

use rusqlite::Connection;

use crate::flow::store::StoreError;
use crate::store::stream_signals::StreamSignals;

/// How often the watch looks for commits.
const WATCH_INTERVAL: Duration = Duration::from_millis(10);

/// Starts the watch on `conn`, until the store (and `signals` with it) is
/// gone. The first `data_version` is read here, before the thread starts,
/// so that a commit made right after the store opened is seen.
pub(super) fn spawn_stream_watch(
    conn: Connection,
    signals: Weak<StreamSignals>,
    revocations: Weak<StreamSignals>,
) -> Result<(), StoreError> {
    let mut last_version = data_version(&conn);
    std::thread::Builder::new()
        .name("dexa-sqlite-streams".to_string())
        .spawn(move || {
            let mut heads = StreamHeads::new(HEADS, true);
            // A flow never revoked (no count yet) cannot have been revoked
            // before its Step started waiting; one that was may have been.
            let mut revoked = StreamHeads::new(REVOCATIONS, false);
            loop {
                std::thread::sleep(WATCH_INTERVAL);
                let (Some(signals), Some(revocations)) = (signals.upgrade(), revocations.upgrade())
                else {
                    return;
                };
                let version = data_version(&conn);
                if version != last_version {
                    last_version = version;
                    heads.wake_moved(&conn, &signals);
                    revoked.wake_moved(&conn, &revocations);
                }
            }
        })
        .map_err(|err| StoreError::Backend(format!("cannot start the stream watch: {err}")))?;
    Ok(())
}

fn data_version(conn: &Connection) -> Option<i64> {
    conn.query_row("PRAGMA data_version", [], |row| row.get(0))
        .ok()
}

/// Flows per read of their heads.
const CHUNK: usize = 500;

/// Each flow's head: the sum of its streams' next sequence numbers, which
/// grows with every append to any of them.
const HEADS: &str = "SELECT flow_id, SUM(next_seq) FROM streams
     WHERE flow_id IN (SELECT value FROM json_each(?1)) GROUP BY flow_id";

/// Each flow's revocation count, which grows with every take of its tasks.
const REVOCATIONS: &str = "SELECT flow_id, seq FROM flow_revocations
     WHERE flow_id IN (SELECT value FROM json_each(?1))";

/// The heads last seen (by `query`), per flow someone waits on.
struct StreamHeads {
    query: &'static str,
    /// Whether a flow first seen at head 0 counts as moved.
    wake_new_at_zero: bool,
    heads: HashMap<String, i64>,
}

impl StreamHeads {
    fn new(query: &'static str, wake_new_at_zero: bool) -> Self {
        Self {
            query,
            wake_new_at_zero,
            heads: HashMap::new(),
        }
    }

    /// Wakes the readers of every flow whose streams grew since the last
    /// look; a flow not looked at before counts as grown (a spurious wake
    /// costs a reader one read, a missed one a wait).
    fn wake_moved(&mut self, conn: &Connection, signals: &StreamSignals) {
        let live = signals.read();
        let reading: HashSet<&str> = live.iter().map(|(flow_id, _)| flow_id.as_str()).collect();
        self.heads
            .retain(|flow_id, _| reading.contains(flow_id.as_str()));
        for chunk in live.chunks(CHUNK) {
            let heads = match read_heads(conn, self.query, chunk.iter().map(|(flow_id, _)| flow_id))
            {
                Ok(heads) => heads,
                Err(err) => {
                    tracing::debug!(error = %err, "cannot read stream heads; waking their readers");
                    signals.bump();
                    for (_, signal) in chunk {
                        signal.notify_waiters();
                    }
                    continue;
                }
            };
            for (flow_id, signal) in chunk {
                let head = heads.get(flow_id).copied().unwrap_or(0);
                let before = self.heads.insert(flow_id.clone(), head);
                let moved = match before {
                    Some(before) => before != head,
                    None => head != 0 || self.wake_new_at_zero,
                };
                if moved {
                    signals.bump();
                    signal.notify_waiters();
                }
            }
        }
    }
}

/// The heads `query` reads for `flows`.
fn read_heads<'a>(
    conn: &Connection,
    query: &str,
    flows: impl Iterator<Item = &'a String>,
) -> Result<HashMap<String, i64>, rusqlite::Error> {
    let flows: Vec<&String> = flows.collect();
    let list = serde_json::to_string(&flows).unwrap_or_else(|_| "[]".to_string());
    let mut statement = conn.prepare_cached(query)?;
    let rows = statement.query_map([list], |row| Ok((row.get(0)?, row.get(1)?)))?;
    rows.collect()
}
