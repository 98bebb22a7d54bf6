//! Stopping a Step whose task was taken from its flow while it ran (a
//! cancelled turn, say: [`crate::flow::StateTx::take_tasks`]).
//!
//! The commit of such a Step is refused by its lease token whatever
//! happens; this is about stopping the work itself at once rather than at
//! the next lease renewal. The transaction that takes the tasks also appends
//! to the flow's streams, and a stream append wakes the flow's readers in
//! every process (in-process at once; another process through PostgreSQL's
//! `NOTIFY` or SQLite's `data_version` watch). So while a worker runs a
//! Step it listens to its flow's stream signal, and when the streams move
//! it asks the store whether its lease still stands; appends come in bursts
//! (a Step's own live events), so it asks at most once per
//! [`MIN_LOOK_GAP`]. A store that cannot push appends leaves the lease
//! renewal as the only way to notice.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::store::FlowStore;
use super::types::ClaimedTask;

/// The least time between two looks at one lease.
pub const MIN_LOOK_GAP: Duration = Duration::from_millis(20);

/// Resolves once `task`'s lease is gone (taken, or leased again); never
/// when the store cannot push stream appends.
pub(super) async fn lease_taken(store: Arc<dyn FlowStore>, task: Arc<ClaimedTask>) {
    let Some(signal) = store.stream_signal(&task.flow_id) else {
        return std::future::pending().await;
    };
    let mut notified = Box::pin(signal.notified());
    notified.as_mut().enable();
    let mut last_look: Option<Instant> = None;
    loop {
        notified.as_mut().await;
        // Armed again before the look, so that an append during it still
        // wakes the next round.
        notified = Box::pin(signal.notified());
        notified.as_mut().enable();
        if let Some(at) = last_look {
            tokio::time::sleep_until(at + MIN_LOOK_GAP).await;
        }
        last_look = Some(Instant::now());
        match store.lease_held(task.task_id, task.lease_token).await {
            Ok(true) => {}
            Ok(false) => return,
            Err(err) => {
                tracing::debug!(task_id = task.task_id, error = %err, "could not look at a lease")
            }
        }
    }
}
