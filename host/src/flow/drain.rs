//! A worker's orderly stop (SIGTERM in `dexa worker`): it claims nothing
//! more, lets the Steps it runs finish up to a deadline, then hands back
//! the leases of those still running, so that another worker takes them at
//! once instead of when the leases run out.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;

use super::registry::Registry;
use super::retry::{self, AttemptError};
use super::store::{AttemptFailure, FailureAction, FlowStore, StoreError};
use super::types::{history, ClaimedTask};
use super::worker::HeldTasks;
use crate::telemetry;

/// Where a worker's Steps see the drain.
#[derive(Debug, Default)]
pub(super) struct DrainState {
    /// Set on shutdown: a commit leases no next Step with it.
    pub(super) draining: AtomicBool,
    /// Set at the deadline: a Step stopped now records no failure; its
    /// lease is handed back.
    pub(super) cut: AtomicBool,
}

/// How long, after the deadline, a Step's commit already under way may take
/// to land before it is stopped too.
const COMMIT_GRACE: Duration = Duration::from_secs(5);

/// The longest the hand-back of the leases may take.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);

/// Waits up to `deadline` for the Steps in `running` to finish (their
/// leases are still renewed meanwhile), then stops the rest and releases
/// their leases. Returns how many were released.
pub(super) async fn drain(
    store: &Arc<dyn FlowStore>,
    registry: &Registry,
    running: &mut JoinSet<()>,
    held: &HeldTasks,
    state: &DrainState,
    deadline: Duration,
) -> usize {
    if running.is_empty() {
        return 0;
    }
    tracing::info!(
        running = running.len(),
        "draining: claiming nothing more; waiting up to {} for the running Steps",
        humantime::format_duration(deadline)
    );
    let finished = tokio::time::timeout(deadline, async {
        while running.join_next().await.is_some() {}
    })
    .await
    .is_ok();
    if finished {
        tracing::info!("drained: every running Step finished");
        return 0;
    }
    // Stop the handlers; the loops that supervise them see the cut and
    // return without recording a failure (no attempt is spent), while a
    // loop already committing a finished Step lands its commit (its task is
    // no longer held, so it is not handed back) within a grace.
    state.cut.store(true, Ordering::Release);
    if let Ok(held) = held.lock() {
        for h in held.values() {
            if let Some(abort) = &h.abort {
                abort.abort();
            }
        }
    }
    let settled = tokio::time::timeout(COMMIT_GRACE, async {
        while running.join_next().await.is_some() {}
    })
    .await
    .is_ok();
    if !settled {
        running.abort_all();
        while running.join_next().await.is_some() {}
    }
    // Taken out of the held set, so that the renewal does not count them
    // as lost once they are handed back.
    let stopping: Vec<Arc<ClaimedTask>> = match held.lock() {
        Ok(mut held) => held.drain().map(|(_, h)| h.task).collect(),
        Err(_) => Vec::new(),
    };
    // All at once and bounded: a store that hangs must not keep the
    // process past its runtime's grace period (the leases then run out).
    let releases = futures_util::future::join_all(
        stopping
            .iter()
            .map(|task| tokio::time::timeout(RELEASE_TIMEOUT, release(store, registry, task))),
    )
    .await;
    let released = releases
        .into_iter()
        .filter(|r| matches!(r, Ok(true)))
        .count();
    metrics::counter!(telemetry::LEASES_RELEASED).increment(released as u64);
    tracing::warn!(
        released,
        "drain deadline passed: released the leases of the Steps still running, for another worker"
    );
    released
}

/// Hands `task` back: the same attempt when it produced nothing, else (it
/// may have acted) the next attempt or its failure route, as when a worker
/// is lost. True when the store took it.
async fn release(store: &Arc<dyn FlowStore>, registry: &Registry, task: &ClaimedTask) -> bool {
    let Ok(now) = store.now().await else {
        return false;
    };
    let same_attempt = (
        FailureAction::Redeliver,
        retry::entry(
            task,
            history::REDELIVERED,
            now,
            "the worker shut down before the Step produced output (drain deadline passed)"
                .to_string(),
        ),
    );
    let mut outcome = store
        .fail_attempt(AttemptFailure::of(task, same_attempt, false))
        .await;
    let mut failed = false;
    if let Err(StoreError::OutputRecorded { .. }) = outcome {
        failed = true;
        let lost = retry::after_failure(registry, task, &AttemptError::WorkerStopped, now);
        outcome = store
            .fail_attempt(AttemptFailure::of(task, lost, false))
            .await;
    }
    match outcome {
        Ok(()) => {
            if failed {
                super::run_step::count_failed(task);
            }
            true
        }
        // Committed or taken meanwhile: nothing to hand back.
        Err(StoreError::StaleLease { .. }) => false,
        Err(err) => {
            tracing::warn!(task_id = task.task_id, error = %err, "releasing a lease failed; it will run out");
            false
        }
    }
}
