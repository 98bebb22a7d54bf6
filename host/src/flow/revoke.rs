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
use std::time::Duration;

use super::store::FlowStore;
use super::types::ClaimedTask;

/// The pause before looking at a lease again when the store did not answer.
const LOOK_AGAIN: Duration = Duration::from_millis(50);

/// Resolves once `task`'s lease is gone (taken, or leased again); never
/// when the store cannot signal takes. `since` is the store's
/// [`FlowStore::revocation_generation`] read before the task was claimed: a
/// wake between that claim and the arming here would otherwise be missed
/// (a wake leaves no permit), so when the generation moved it looks once
/// at once.
pub(super) async fn lease_taken(store: Arc<dyn FlowStore>, task: Arc<ClaimedTask>, since: u64) {
    let Some(signal) = store.revocation_signal(&task.flow_id) else {
        return std::future::pending().await;
    };
    let mut notified = Box::pin(signal.notified());
    notified.as_mut().enable();
    let mut look = store.revocation_generation() != since;
    loop {
        if !look {
            notified.as_mut().await;
            // Armed again before the look, so that a take during it still
            // wakes the next round.
            notified = Box::pin(signal.notified());
            notified.as_mut().enable();
        }
        look = false;
        match store.lease_held(task.task_id, task.lease_token).await {
            Ok(true) => {}
            Ok(false) => return,
            Err(err) => {
                // A wake is spent: look again shortly rather than wait for
                // the next one.
                tracing::debug!(task_id = task.task_id, error = %err, "could not look at a lease");
                tokio::time::sleep(LOOK_AGAIN).await;
                look = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::types::{NewTask, RetryPolicy};
    use crate::store::sqlite::SqliteStore;

    fn task() -> NewTask {
        NewTask {
            step_type: "Step".into(),
            input: serde_json::json!({}),
            wait: None,
            policy: RetryPolicy::default(),
            failure_route: None,
            failure: None,
            locks: Vec::new(),
            not_before: 0,
        }
    }

    /// A take that commits after the claim but before the Step's signal is
    /// armed leaves no permit; the generation read before the claim tells.
    #[tokio::test]
    async fn a_take_between_the_claim_and_the_arming_is_not_missed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store: Arc<dyn FlowStore> = Arc::new(
            SqliteStore::open(dir.path().join("s.sqlite"), Default::default()).expect("open"),
        );
        store.create_flow("f", "T", task()).await.expect("flow");
        let since = store.revocation_generation();
        let claimed = store
            .claim("w", &["T".to_string()], 1, 60_000)
            .await
            .expect("claim")
            .pop()
            .expect("a task");
        let claimed = Arc::new(claimed);
        // Nobody waits on the flow yet: this wake reaches no one.
        store
            .rpc("f", Box::new(|tx| Ok(Box::new(tx.take_tasks()?.len()))))
            .await
            .expect("take");
        // Long enough for the store's own watch to have seen the take too,
        // while nobody waited on the flow.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let stopped = tokio::time::timeout(
            Duration::from_secs(5),
            lease_taken(store.clone(), claimed.clone(), since),
        )
        .await;
        assert!(stopped.is_ok(), "the missed wake was made up for");
        // With nothing taken since, it keeps waiting.
        store.create_flow("g", "T", task()).await.expect("flow");
        let since = store.revocation_generation();
        let held = Arc::new(
            store
                .claim("w", &["T".to_string()], 1, 60_000)
                .await
                .expect("claim")
                .pop()
                .expect("a task"),
        );
        let waited = tokio::time::timeout(
            Duration::from_millis(200),
            lease_taken(store.clone(), held, since),
        )
        .await;
        assert!(waited.is_err(), "a lease still held is not reported taken");
    }
}
