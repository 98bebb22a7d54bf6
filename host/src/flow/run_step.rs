//! One Step's run on a worker: its handler under the retry policy's
//! deadlines, then its commit fenced by the lease, or its failure; and the
//! flow's next Steps when the commit leased them to this worker.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;

use super::attempt_span::{self, SpanOutcome};
use super::context::{Heartbeat, StepContext};
use super::drain::DrainState;
use super::registry::{Registry, StepError};
use super::retry::{self, AttemptError};
use super::slots::{Slots, Taken};
use super::store::{AttemptFailure, ClaimNext, FlowStore, StepCommit, StoreError};
use super::types::{history, ClaimedTask, StepHistoryEntry, StepOutcome, StepResult};
use super::worker::{Held, HeldTasks, StepObserver};
use crate::telemetry;

/// What a worker's Steps run with: shared by every Step it runs.
pub(super) struct StepRunner {
    pub(super) store: Arc<dyn FlowStore>,
    pub(super) registry: Arc<Registry>,
    pub(super) held: HeldTasks,
    pub(super) drain_state: Arc<DrainState>,
    pub(super) observer: Option<StepObserver>,
    /// The claim a commit makes: its `max` is the most of the flow's next
    /// Steps one commit may lease (a fan-out's first share).
    pub(super) claim_next: ClaimNext,
    pub(super) slots: Arc<Slots>,
}

/// A Step to run and the slot it runs in; `since` is the revocation
/// generation read before it was leased (see `revoke::lease_taken`).
pub(super) struct Leased {
    pub(super) task: ClaimedTask,
    pub(super) since: u64,
    pub(super) slot: Taken,
}

/// Runs a leased Step, then the flow's next Steps its commit leased to this
/// worker, side by side. Each runs in its own slot, which goes back when
/// its run ends; a run that panics ends alone, and its slot goes back too.
pub(super) async fn run_task(runner: Arc<StepRunner>, first: Leased) {
    let mut steps = FuturesUnordered::new();
    steps.push(AssertUnwindSafe(run_one(&runner, first)).catch_unwind());
    while let Some(ran) = steps.next().await {
        match ran {
            Ok(next) => {
                for leased in next {
                    steps.push(AssertUnwindSafe(run_one(&runner, leased)).catch_unwind());
                }
            }
            Err(_) => tracing::error!(
                "a Step's run on this worker panicked; its lease runs out and another worker retries it"
            ),
        }
    }
}

/// Runs one Step; returns the flow's next Steps its commit leased, each in
/// a slot of its own: the first in this Step's, the others in slots taken
/// before the commit.
async fn run_one(runner: &StepRunner, leased: Leased) -> Vec<Leased> {
    let StepRunner {
        store,
        registry,
        held,
        drain_state,
        observer,
        ..
    } = runner;
    let Leased { task, since, slot } = leased;
    let claimed_at = Instant::now();
    let started = SystemTime::now();
    metrics::counter!(
        telemetry::STEPS_STARTED,
        "flow_type" => task.flow_type.clone(),
        "step" => task.step_type.clone()
    )
    .increment(1);
    let task = Arc::new(task);
    let heartbeat = Heartbeat::new();
    if let Ok(mut held) = held.lock() {
        held.insert(
            (task.task_id, task.lease_token),
            Held {
                task: task.clone(),
                heartbeat: heartbeat.clone(),
                abort: None,
            },
        );
    }
    let def = registry
        .flow_type(&task.flow_type)
        .ok()
        .and_then(|flow_type| flow_type.step_def(&task.step_type).cloned());
    let mut handler_ctx = None;
    let result = match def {
        None => Err(AttemptError::Step(StepError::fatal(format!(
            "no handler is registered for step {} of flow type {}",
            task.step_type, task.flow_type
        )))),
        Some(def) => {
            let ctx = StepContext::new(task.clone(), store.clone(), heartbeat.clone());
            handler_ctx = Some(ctx.clone());
            // Its own task, so that a panic fails the attempt, not the worker.
            let handle = tokio::spawn(def.handler.run(ctx));
            if let Ok(mut held) = held.lock() {
                if let Some(entry) = held.get_mut(&(task.task_id, task.lease_token)) {
                    entry.abort = Some(handle.abort_handle());
                }
            }
            // A Step leased with a commit that landed after the drain's cut
            // started after the drain stopped the held handlers: it stops
            // itself, and the drain hands its lease back. The cut is stored
            // before the drain reads the held set, so one of the two sees
            // the other.
            if drain_state.cut.load(Ordering::Acquire) {
                handle.abort();
            }
            let taken = super::revoke::lease_taken(store.clone(), task.clone(), since);
            super::supervise::supervise(handle, &task.policy, &heartbeat, taken).await
        }
    };
    let ctx = handler_ctx.as_ref();
    let component = ctx.and_then(StepContext::component);
    if result.is_err() && drain_state.cut.load(Ordering::Acquire) {
        // Stopped by the drain's deadline: neither a failure to record nor
        // an attempt spent; the drain hands the lease back.
        attempt_span::report(&task, ctx, started, SpanOutcome::Stopped);
        return Vec::new();
    }
    if let Ok(mut held) = held.lock() {
        held.remove(&(task.task_id, task.lease_token));
    }
    match result {
        Ok(step_result) => {
            // The commit may lease the flow's next task: read before it.
            let since = store.revocation_generation();
            // The next Steps the commit may lease: the first runs in this
            // Step's slot, the others in slots taken now (only as many as
            // it starts ready), so the claim loop cannot hand them out
            // meanwhile. A draining worker takes no next Step.
            let mut extra = if drain_state.draining.load(Ordering::Acquire) {
                None
            } else {
                let ready = match &step_result.outcome {
                    StepOutcome::Next(calls) => calls.iter().filter(|c| c.wait.is_none()).count(),
                    StepOutcome::End | StepOutcome::Complete => 0,
                };
                let share = runner.claim_next.max.min(ready.max(1));
                Some(runner.slots.take(share.saturating_sub(1)))
            };
            let claim_next = ClaimNext {
                max: extra.as_ref().map_or(0, |extra| 1 + extra.len()),
                ..runner.claim_next.clone()
            };
            let committed =
                commit(store, registry, &task, step_result, &claim_next, component).await;
            let outcome = match committed {
                Some(_) => SpanOutcome::Committed,
                None => SpanOutcome::NotCommitted,
            };
            attempt_span::report(&task, ctx, started, outcome);
            let Some(claimed) = committed else {
                return Vec::new();
            };
            metrics::counter!(
                telemetry::STEPS_COMPLETED,
                "flow_type" => task.flow_type.clone(),
                "step" => task.step_type.clone()
            )
            .increment(1);
            metrics::histogram!(telemetry::STEP_CLAIM_TO_COMMIT, "step" => task.step_type.clone())
                .record(claimed_at.elapsed().as_secs_f64());
            if let Some(observer) = observer {
                observer(&task, claimed_at.elapsed());
            }
            let mut slot = Some(slot);
            claimed
                .into_iter()
                .map(|task| {
                    let slot = slot
                        .take()
                        .or_else(|| extra.as_mut().and_then(Taken::split_one))
                        .unwrap_or_else(|| {
                            // The store leases at most `max`: never reached.
                            tracing::error!(
                                task_id = task.task_id,
                                "a commit leased more Steps than it asked for"
                            );
                            runner.slots.take(0)
                        });
                    Leased { task, since, slot }
                })
                .collect()
        }
        Err(AttemptError::Taken) => {
            attempt_span::report(&task, ctx, started, SpanOutcome::Taken);
            tracing::info!(
                flow_id = %task.flow_id,
                step = %task.step_type,
                attempt = task.attempt,
                "the Step's task was taken from its flow; the Step was stopped"
            );
            Vec::new()
        }
        Err(err) => {
            let message = err.message();
            fail(store, registry, &task, err, component).await;
            attempt_span::report(&task, ctx, started, SpanOutcome::Failed(&message));
            Vec::new()
        }
    }
}

/// Counts a failed attempt the store recorded.
pub(super) fn count_failed(task: &ClaimedTask) {
    metrics::counter!(
        telemetry::STEPS_FAILED,
        "flow_type" => task.flow_type.clone(),
        "step" => task.step_type.clone()
    )
    .increment(1);
}

/// Commits the Step's result; `Some` (with the tasks claimed with it) when it
/// was committed.
async fn commit(
    store: &Arc<dyn FlowStore>,
    registry: &Registry,
    task: &ClaimedTask,
    result: StepResult,
    claim_next: &ClaimNext,
    component: Option<String>,
) -> Option<Vec<ClaimedTask>> {
    let now = match store.now().await {
        Ok(now) => now,
        Err(err) => {
            tracing::warn!(error = %err, "store clock unavailable; the lease will expire");
            return None;
        }
    };
    let mut next = Vec::new();
    let mut complete_flow = false;
    match result.outcome {
        StepOutcome::Next(calls) => {
            for call in calls {
                match registry.new_task(&task.flow_type, call, now, None) {
                    Ok(new_task) => next.push(new_task),
                    Err(err) => {
                        let err = AttemptError::Step(StepError::fatal(err.to_string()));
                        fail(store, registry, task, err, component).await;
                        return None;
                    }
                }
            }
        }
        StepOutcome::End => {}
        StepOutcome::Complete => complete_flow = true,
    }
    let commit = StepCommit {
        task_id: task.task_id,
        lease_token: task.lease_token,
        flow_id: task.flow_id.clone(),
        consumed: task.messages.iter().map(|m| m.message_id).collect(),
        writes: result.writes,
        next,
        complete_flow,
        history: StepHistoryEntry {
            component: component.clone(),
            ..retry::entry(task, history::EXECUTE_COMPLETED, now, String::new())
        },
        claim_next: Some(claim_next.clone()),
    };
    match store.commit_step(commit).await {
        Ok(claimed) => Some(claimed),
        Err(StoreError::StaleLease { .. }) => {
            tracing::info!(
                task_id = task.task_id,
                "the lease was lost; the Step's result is dropped"
            );
            None
        }
        Err(err) => {
            let err = AttemptError::Step(StepError::retryable(format!("commit failed: {err}")));
            fail(store, registry, task, err, component).await;
            None
        }
    }
}

async fn fail(
    store: &Arc<dyn FlowStore>,
    registry: &Registry,
    task: &ClaimedTask,
    err: AttemptError,
    component: Option<String>,
) {
    tracing::info!(
        flow_id = %task.flow_id,
        step = %task.step_type,
        attempt = task.attempt,
        error = %err.message(),
        "step attempt failed"
    );
    let Ok(now) = store.now().await else { return };
    let (action, mut history) = retry::after_failure(registry, task, &err, now);
    history.component = component;
    let failure = AttemptFailure::of(task, (action, history), false);
    match store.fail_attempt(failure).await {
        Ok(()) => count_failed(task),
        Err(StoreError::StaleLease { .. }) => {}
        Err(err) => {
            tracing::warn!(error = %err, "recording a failed attempt failed; the lease will expire")
        }
    }
}
