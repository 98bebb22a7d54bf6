//! Stopping a Step whose task was taken from its flow while it ran (a
//! cancelled turn: [`crate::flow::StateTx::take_tasks`]; a stopped flow).
//!
//! The commit of such a Step is refused by its lease token whatever
//! happens; this is about stopping the work itself at once rather than at
//! the next lease renewal. While a worker runs a Step it waits on its flow's
//! revocation signal ([`FlowStore::revocation_signal`]), which the store
//! wakes when the flow's tasks are taken: in this process at the commit, in
//! others through PostgreSQL's `NOTIFY` or SQLite's `data_version` watch.
//! Then it asks the store whether its lease still stands (one read), and
//! the worker aborts the Step if not, which drops the guest's future at its
//! next epoch tick. Nothing else wakes it, so a running Step costs the store
//! nothing until its flow is cancelled. A store with no such signal leaves
//! the lease renewal as the only way to notice.

use std::sync::Arc;

use super::store::FlowStore;
use super::types::ClaimedTask;

/// Resolves once `task`'s lease is gone (taken, or leased again); never
/// when the store cannot signal takes.
pub(super) async fn lease_taken(store: Arc<dyn FlowStore>, task: Arc<ClaimedTask>) {
    let Some(signal) = store.revocation_signal(&task.flow_id) else {
        return std::future::pending().await;
    };
    let mut notified = Box::pin(signal.notified());
    notified.as_mut().enable();
    loop {
        notified.as_mut().await;
        // Armed again before the look, so that a take during it still
        // wakes the next round.
        notified = Box::pin(signal.notified());
        notified.as_mut().enable();
        match store.lease_held(task.task_id, task.lease_token).await {
            Ok(true) => {}
            Ok(false) => return,
            Err(err) => {
                tracing::debug!(task_id = task.task_id, error = %err, "could not look at a lease")
            }
        }
    }
}
