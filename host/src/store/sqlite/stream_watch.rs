//! Stream appends and task takes seen by a watch of their own: a thread
//! with its own connection looks at `PRAGMA data_version` every 10 ms; when
//! any other connection has committed (another process, or this process's
//! writer), it reads the stream heads of the flows this process's readers
//! wait on and wakes the readers of those whose heads moved, and likewise
//! the revocation counts of the flows this process runs Steps of
//! (`flow_revocations`, moved by a cancel or a stop). A revocation of a
//! flow someone reads wakes its readers too: a stop appends nothing, and an
//! event stream or a waiter learns of it only by looking again. One indexed
//! read per such commit and kind, and only while someone waits: not a wake
//! of every waiter on every commit.
//!
//! A head that moved to exactly the head this process's own last appending
//! commit saw (`StreamSignals::local_head`) wakes nobody: that commit woke
//! its readers itself, after every commit the head holds. Without this
//! check each append of this process would wake its readers twice, and a
//! waiter reads on every wake.
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
            let mut heads = StreamHeads::new(HEADS, true, true);
            // A flow never revoked (no count yet) cannot have been revoked
            // before its Step started waiting; one that was may have been.
            let mut revoked = StreamHeads::new(REVOCATIONS, false, false);
            // The same counts, for the flows readers wait on (a stop by
            // another process ends their streams and waits).
            let mut stopped = StreamHeads::new(REVOCATIONS, false, false).counting_stops();
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
                    stopped.wake_moved(&conn, &signals);
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
    /// Whether `query` reads the heads this process's commits report to
    /// the signals (`StreamSignals::wake_committed`), so that a head one of
    /// them left needs no wake.
    skip_local: bool,
    heads: HashMap<String, i64>,
    /// Whether a move is a take of the flow's tasks, which its readers
    /// count (`StreamSignals::wake_stopped`).
    counts_stops: bool,
}

impl StreamHeads {
    fn new(query: &'static str, wake_new_at_zero: bool, skip_local: bool) -> Self {
        Self {
            query,
            wake_new_at_zero,
            skip_local,
            heads: HashMap::new(),
            counts_stops: false,
        }
    }

    /// The same, for counts of takes that wake readers as stops.
    fn counting_stops(mut self) -> Self {
        self.counts_stops = true;
        self
    }

    /// Wakes `flow_id`'s readers.
    fn wake(&self, signals: &StreamSignals, flow_id: &str, signal: &tokio::sync::Notify) {
        if self.counts_stops {
            signals.wake_stopped(flow_id);
        } else {
            signals.bump();
            signal.notify_waiters();
        }
    }

    /// Wakes the readers of every flow whose streams grew since the last
    /// look; a flow not looked at before counts as grown (a spurious wake
    /// costs a reader one read, a missed one a wait). Returns how many
    /// flows it woke.
    fn wake_moved(&mut self, conn: &Connection, signals: &StreamSignals) -> usize {
        let mut woken = 0;
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
                    for (flow_id, signal) in chunk {
                        self.wake(signals, flow_id, signal);
                    }
                    woken += chunk.len();
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
                // Read after the head: a commit of this process that lands
                // in between leaves a head the read did not see, so it
                // cannot make this look skip a head of another's commit.
                let woken_here = self.skip_local && signals.local_head(flow_id) == Some(head);
                if moved && !woken_here {
                    self.wake(signals, flow_id, signal);
                    woken += 1;
                }
            }
        }
        woken
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::{FlowStore, NewTask, RetryPolicy};
    use crate::store::sqlite::SqliteStore;
    use serde_json::json;

    /// A look of the watch (by hand, not on its thread: the stores' own
    /// watches run too, and may wake the same readers), and how many flows
    /// it woke.
    fn look(heads: &mut StreamHeads, conn: &Connection, signals: &StreamSignals) -> usize {
        heads.wake_moved(conn, signals)
    }

    async fn append(store: &SqliteStore, n: i64) {
        store
            .append_stream("f", "events", vec![json!(n)])
            .await
            .unwrap_or_else(|err| panic!("append {n}: {err}"));
    }

    /// The readers of a flow are woken once for an append of this process
    /// (by its commit) and once for another process's (by the watch),
    /// whatever the order of the two between the watch's looks: a head an
    /// append of this process left is skipped, one past it is not.
    #[test]
    fn the_watch_wakes_readers_for_another_processs_append_not_again_for_this_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        let here = SqliteStore::open_normal_for_test(dir.path());
        // Another process: a store of its own on the same file, whose
        // commits this process's signals know nothing of.
        let other = SqliteStore::open_normal_for_test(dir.path());
        let conn = super::super::connection::connect(
            &dir.path().join("store.db"),
            &super::super::SqliteOptions::default(),
        )
        .expect("the watch's connection");
        let signals = here.inner.streams.clone();
        let mut reader = signals.stream("f");
        let mut heads = StreamHeads::new(HEADS, true, true);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let first = NewTask {
                step_type: "Step".into(),
                input: json!({}),
                wait: None,
                policy: RetryPolicy::default(),
                failure_route: None,
                failure: None,
                locks: Vec::new(),
                not_before: 0,
            };
            here.create_flow("f", "Agent", first).await.expect("a flow");
            assert_eq!(
                look(&mut heads, &conn, &signals),
                1,
                "a flow not looked at before"
            );
            assert_eq!(look(&mut heads, &conn, &signals), 0, "nothing new");

            append(&here, 1).await;
            assert_eq!(
                look(&mut heads, &conn, &signals),
                0,
                "this process's append woke them"
            );

            append(&other, 2).await;
            assert_eq!(
                look(&mut heads, &conn, &signals),
                1,
                "another process's append"
            );

            append(&here, 3).await;
            append(&other, 4).await;
            assert_eq!(
                look(&mut heads, &conn, &signals),
                1,
                "another process's append after this process's"
            );

            append(&other, 5).await;
            append(&here, 6).await;
            assert_eq!(
                look(&mut heads, &conn, &signals),
                0,
                "this process's append after another's woke them after both"
            );

            // A reader that lets go of its signal between two reads (as a
            // waiter does after each) and takes it again.
            // The watch looks while nobody reads, and forgets the flow.
            drop(reader);
            append(&here, 7).await;
            assert_eq!(look(&mut heads, &conn, &signals), 0, "nobody reads it");
            reader = signals.stream("f");
            assert_eq!(
                look(&mut heads, &conn, &signals),
                0,
                "a reader that took its signal again after this process's append, \
                 at the watch's first look at the flow since"
            );

            // An RPC that appends (a send queues its message so).
            here.rpc(
                "f",
                Box::new(|tx| {
                    tx.append("events", json!(8))?;
                    Ok(Box::new(()) as Box<dyn std::any::Any + Send>)
                }),
            )
            .await
            .map_err(|err| format!("{err:?}"))
            .expect("an appending RPC");
            assert_eq!(
                look(&mut heads, &conn, &signals),
                0,
                "an RPC of this process"
            );

            // A commit of this process that appended and was never
            // reported (its caller went away before it could wake): the
            // head moved past what the signals know.
            here.write_quietly(|tx, now| {
                super::super::streams::append_stream(tx, now, "f", "events", &[json!(9)])
            })
            .await
            .expect("an unreported append");
            assert_eq!(
                look(&mut heads, &conn, &signals),
                1,
                "an append nobody reported"
            );
            drop(reader);
        });
    }

    /// A stop appends nothing: the store's watch wakes the readers of a
    /// flow another process stopped through its revocation count, so that
    /// their event streams and waits end at once rather than at a fallback
    /// (which this test does not have: without the wake it waits 10 s and
    /// fails).
    #[test]
    fn the_watch_wakes_readers_of_a_flow_another_process_stopped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let here = SqliteStore::open_normal_for_test(dir.path());
        let other = SqliteStore::open_normal_for_test(dir.path());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let first = NewTask {
                step_type: "Step".into(),
                input: json!({}),
                wait: None,
                policy: RetryPolicy::default(),
                failure_route: None,
                failure: None,
                locks: Vec::new(),
                not_before: 0,
            };
            here.create_flow("f", "Agent", first).await.expect("a flow");
            let signal = here.inner.streams.stream("f");
            // The watch learns the flow's head at another process's append.
            let appended = signal.notified();
            tokio::pin!(appended);
            appended.as_mut().enable();
            append(&other, 1).await;
            tokio::time::timeout(Duration::from_secs(10), appended)
                .await
                .expect("woken for another process's append");
            let stopped = signal.notified();
            tokio::pin!(stopped);
            stopped.as_mut().enable();
            assert!(other.stop_flow("f").await.expect("the stop"));
            tokio::time::timeout(Duration::from_secs(10), stopped)
                .await
                .expect("woken for another process's stop");
            // Counted as a stop: a reader woken by it together with an
            // append looks at the flow's status all the same.
            assert_eq!(here.inner.streams.stops("f"), 1);
        });
    }
}
