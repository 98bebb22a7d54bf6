//! A worker's orderly stop (SIGTERM in `dexa worker`): it claims nothing
//! more, lets the Steps it runs finish up to a deadline, then hands back
//! the leases of those still running, so that another worker takes them at
//! once instead of when the leases run out.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;

use super::registry::Registry;
use super::retry::{self, AttemptError};
use super::store::{AttemptFailure, FailureAction, FlowStore, StoreError};
use super::types::{history, ClaimedTask};
use super::worker::HeldTasks;
use crate::telemetry;

/// Waits up to `deadline` for the Steps in `running` to finish (their
/// leases are still renewed meanwhile), then stops the rest and releases
/// their leases. Returns how many were released.
pub(super) async fn drain(
    store: &Arc<dyn FlowStore>,
    registry: &Registry,
    running: &mut JoinSet<()>,
    held: &HeldTasks,
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
    // Stop the loops that supervise the Steps first, so that none commits
    // or records a failure (spending an attempt) once the deadline passed;
    // then the handlers (their own tasks), which cannot commit by
    // themselves, so that none acts after its lease is handed back.
    running.abort_all();
    while running.join_next().await.is_some() {}
    let stopping: Vec<Arc<ClaimedTask>> = match held.lock() {
        Ok(held) => held
            .values()
            .map(|h| {
                if let Some(abort) = &h.abort {
                    abort.abort();
                }
                h.task.clone()
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    let mut released = 0;
    for task in &stopping {
        if release(store, registry, task).await {
            released += 1;
        }
    }
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
    if let Err(StoreError::OutputRecorded { .. }) = outcome {
        let lost = retry::after_failure(registry, task, &AttemptError::WorkerStopped, now);
        outcome = store
            .fail_attempt(AttemptFailure::of(task, lost, false))
            .await;
    }
    match outcome {
        Ok(()) => true,
        // Committed or taken meanwhile: nothing to hand back.
        Err(StoreError::StaleLease { .. }) => false,
        Err(err) => {
            tracing::warn!(task_id = task.task_id, error = %err, "releasing a lease failed; it will run out");
            false
        }
    }
}
