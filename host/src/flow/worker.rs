//! The worker: claims ready Step tasks, runs their handlers under the retry
//! policy's deadlines, and commits their results fenced by the lease.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tokio::task::{AbortHandle, JoinSet};

use super::attempt_span::{self, SpanOutcome};
use super::context::{Heartbeat, StepContext};
use super::drain::DrainState;
use super::outage::{Outage, StoreHealth};
use super::registry::{Registry, StepError};
use super::retry::{self, AttemptError};
use super::store::{AttemptFailure, ClaimNext, FlowStore, StepCommit, StoreError};
use super::types::{history, ClaimedTask, StepHistoryEntry, StepOutcome, StepResult};
use crate::telemetry;

/// Called after a Step's commit with its task and the time from its claim to
/// its commit (for metrics and benchmarks).
pub type StepObserver = Arc<dyn Fn(&ClaimedTask, Duration) + Send + Sync>;

/// How a worker runs.
#[derive(Clone)]
pub struct WorkerOptions {
    /// Unique among live workers.
    pub worker_id: String,
    /// Steps run at once; give at least the largest `go_to_many` fan-out.
    pub max_concurrent_tasks: usize,
    /// A task's lease; the worker renews it every third of this. A worker
    /// that dies is noticed this long after its last renewal.
    pub lease: Duration,
    /// The longest the worker sleeps between looks for work when nothing
    /// wakes it.
    pub poll_interval: Duration,
    /// How often expired leases of dead workers are collected.
    pub reap_interval: Duration,
    pub on_step_committed: Option<StepObserver>,
    /// Test hook (zero in production): how long the reaper waits between
    /// reading expired leases and handing them back, which widens the window
    /// in which a lapsed Step may still record output.
    #[doc(hidden)]
    pub reap_pause: Duration,
    /// Where the worker says whether the store answers its claims.
    pub store_health: StoreHealth,
    /// On shutdown, how long the running Steps may take to finish before
    /// their leases are handed back to other workers (zero: at once).
    pub drain: Duration,
}

impl std::fmt::Debug for WorkerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerOptions")
            .field("worker_id", &self.worker_id)
            .field("max_concurrent_tasks", &self.max_concurrent_tasks)
            .field("lease", &self.lease)
            .field("poll_interval", &self.poll_interval)
            .field("reap_interval", &self.reap_interval)
            .finish_non_exhaustive()
    }
}

impl Default for WorkerOptions {
    fn default() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        Self {
            worker_id: format!("worker-{}-{nanos:x}", std::process::id()),
            max_concurrent_tasks: 32,
            lease: Duration::from_secs(10),
            poll_interval: Duration::from_millis(250),
            reap_interval: Duration::from_millis(200),
            on_step_committed: None,
            reap_pause: Duration::ZERO,
            store_health: StoreHealth::default(),
            drain: DEFAULT_DRAIN,
        }
    }
}

/// How long a stopping worker lets its running Steps finish, by default.
pub const DEFAULT_DRAIN: Duration = Duration::from_secs(30);

/// How soon a busy worker looks again for Steps that fell due.
const BUSY_RECHECK: Duration = Duration::from_millis(25);

pub(super) struct Held {
    pub(super) task: Arc<ClaimedTask>,
    pub(super) heartbeat: Heartbeat,
    /// Stops the Step's handler.
    pub(super) abort: Option<AbortHandle>,
}

/// The Steps a worker runs, by task and lease token: a task redelivered to
/// this same worker while its lapsed first run still winds down is held
/// twice, and each run's renewal, abort and cleanup must reach only its own.
pub(super) type HeldTasks = Arc<Mutex<HashMap<(i64, i64), Held>>>;

/// Runs the Steps of the registry's flow types.
pub struct Worker {
    store: Arc<dyn FlowStore>,
    registry: Arc<Registry>,
    options: WorkerOptions,
}

impl Worker {
    pub fn new(store: Arc<dyn FlowStore>, registry: Arc<Registry>, options: WorkerOptions) -> Self {
        Self {
            store,
            registry,
            options,
        }
    }

    /// Works until `shutdown` resolves, then drains: claims nothing more,
    /// lets the running Steps finish for up to [`WorkerOptions::drain`],
    /// and hands back the leases of the rest (see `drain`).
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let flow_types = self.registry.flow_type_names();
        let signal = self.store.work_signal();
        let held: HeldTasks = Arc::new(Mutex::new(HashMap::new()));
        // Set on shutdown: a commit then leases no next Step with it.
        let drain_state = Arc::new(DrainState::default());
        let renewal = tokio::spawn(super::renew::renew_leases(
            self.store.clone(),
            self.options.clone(),
            held.clone(),
        ));
        let mut running = JoinSet::new();
        let lease_ms = self.options.lease.as_millis() as i64;
        let mut last_reap: Option<Instant> = None;
        let mut outage = Outage::new(&self.options.worker_id, self.options.store_health.clone());
        tokio::pin!(shutdown);

        loop {
            // Take the signal before looking for work, so none is missed.
            let notified = signal.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();

            if last_reap.is_none_or(|at| at.elapsed() >= self.options.reap_interval) {
                self.reap(&flow_types, &outage).await;
                last_reap = Some(Instant::now());
            }
            while running.try_join_next().is_some() {}
            let free = self
                .options
                .max_concurrent_tasks
                .saturating_sub(running.len());
            let mut claimed_all = false;
            let mut claimed_any = false;
            let mut back_off = None;
            if free > 0 {
                // Read before the claim: see `revoke::lease_taken`.
                let since = self.store.revocation_generation();
                match self
                    .store
                    .claim(&self.options.worker_id, &flow_types, free, lease_ms)
                    .await
                {
                    Ok(tasks) => {
                        outage.answered();
                        claimed_all = tasks.len() == free;
                        claimed_any = !tasks.is_empty();
                        for task in tasks {
                            running.spawn(run_task(
                                self.store.clone(),
                                self.registry.clone(),
                                held.clone(),
                                drain_state.clone(),
                                (task, since),
                                self.options.on_step_committed.clone(),
                                ClaimNext {
                                    worker_id: self.options.worker_id.clone(),
                                    max: 1,
                                    lease_ms,
                                },
                            ));
                        }
                    }
                    Err(err) => back_off = Some(outage.failed("claiming tasks", &err)),
                }
            }
            if claimed_all {
                continue;
            }
            if let Some(wait) = back_off {
                // Neither a wake-up nor a finished Step may cut the wait
                // short: with a full disk the store still reads (and finds
                // work due) but refuses every claim, and a retry at each
                // wake-up logged hundreds of failures a second.
                tokio::select! {
                    _ = &mut shutdown => break,
                    _ = tokio::time::sleep(wait) => {}
                }
                continue;
            }
            // Busy: commits and finished Steps wake the loop; a short recheck
            // still catches a timer that falls due meanwhile.
            let sleep_for = if free > 0 && claimed_any {
                self.idle_cap().min(BUSY_RECHECK)
            } else {
                self.idle_time(&flow_types, free > 0).await
            };
            tokio::select! {
                _ = &mut shutdown => break,
                _ = &mut notified => {}
                _ = tokio::time::sleep(sleep_for) => {}
                Some(_) = running.join_next(), if !running.is_empty() => {}
            }
        }
        drain_state.draining.store(true, Ordering::Release);
        super::drain::drain(
            &self.store,
            &self.registry,
            &mut running,
            &held,
            &drain_state,
            self.options.drain,
        )
        .await;
        renewal.abort();
    }

    fn idle_cap(&self) -> Duration {
        self.options.poll_interval.min(self.options.reap_interval)
    }

    /// Until the next due task, at most the poll interval.
    async fn idle_time(&self, flow_types: &[String], can_claim: bool) -> Duration {
        let cap = self.idle_cap();
        if !can_claim {
            return cap;
        }
        let (Ok(Some(due)), Ok(now)) = (
            self.store.next_due(flow_types).await,
            self.store.now().await,
        ) else {
            return cap;
        };
        Duration::from_millis((due - now).max(1) as u64).min(cap)
    }

    /// Hands the tasks of dead workers back: the same attempt when the Step
    /// had produced nothing, else the next attempt (or the failure route).
    async fn reap(&self, flow_types: &[String], outage: &Outage) {
        let expired = match self.store.expired_leases(flow_types, 64).await {
            Ok(expired) => expired,
            Err(err) => {
                // The claims judge (and log) an outage; during one, the
                // reap's failures are not logged again.
                if outage.active() {
                    tracing::debug!(error = %err, "looking for expired leases failed");
                } else {
                    tracing::warn!(error = %err, "looking for expired leases failed");
                }
                return;
            }
        };
        if !expired.is_empty() && !self.options.reap_pause.is_zero() {
            tokio::time::sleep(self.options.reap_pause).await;
        }
        for lease in expired {
            let Ok(now) = self.store.now().await else {
                return;
            };
            let task = &lease.task;
            let lost =
                || retry::after_failure(&self.registry, task, &AttemptError::WorkerLost, now);
            let mut failed = lease.output_recorded;
            let decision = if failed {
                lost()
            } else {
                retry::redelivery(task, now)
            };
            let mut outcome = self
                .store
                .fail_attempt(AttemptFailure::of(task, decision, true))
                .await;
            if let Err(StoreError::OutputRecorded { .. }) = outcome {
                // The Step recorded output after the look above: it may have
                // acted, so it gets the next attempt (or its failure route).
                failed = true;
                outcome = self
                    .store
                    .fail_attempt(AttemptFailure::of(task, lost(), true))
                    .await;
            }
            match outcome {
                // A redelivery of the same attempt is no failure.
                Ok(()) if failed => count_failed(task),
                Ok(()) | Err(StoreError::StaleLease { .. }) => {}
                Err(err) => tracing::warn!(error = %err, task_id = task.task_id, "reaping failed"),
            }
        }
    }
}

/// Runs `task`, then, in the same slot, the flow's next task when its commit
/// leased one to this worker.
async fn run_task(
    store: Arc<dyn FlowStore>,
    registry: Arc<Registry>,
    held: HeldTasks,
    drain_state: Arc<DrainState>,
    task: (ClaimedTask, u64),
    observer: Option<StepObserver>,
    claim_next: ClaimNext,
) {
    let mut next = Some(task);
    while let Some((task, since)) = next.take() {
        next = run_one(
            &store,
            &registry,
            &held,
            &drain_state,
            task,
            since,
            observer.as_ref(),
            &claim_next,
        )
        .await;
    }
}

#[allow(clippy::too_many_arguments)]
async fn run_one(
    store: &Arc<dyn FlowStore>,
    registry: &Arc<Registry>,
    held: &HeldTasks,
    drain_state: &DrainState,
    task: ClaimedTask,
    since: u64,
    observer: Option<&StepObserver>,
    claim_next: &ClaimNext,
) -> Option<(ClaimedTask, u64)> {
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
        return None;
    }
    if let Ok(mut held) = held.lock() {
        held.remove(&(task.task_id, task.lease_token));
    }
    match result {
        Ok(step_result) => {
            // The commit may lease the flow's next task: read before it.
            let since = store.revocation_generation();
            // A draining worker takes no next Step with the commit.
            let claim_next = if drain_state.draining.load(Ordering::Acquire) {
                &ClaimNext {
                    max: 0,
                    ..claim_next.clone()
                }
            } else {
                claim_next
            };
            let committed =
                commit(store, registry, &task, step_result, claim_next, component).await;
            let outcome = match committed {
                Some(_) => SpanOutcome::Committed,
                None => SpanOutcome::NotCommitted,
            };
            attempt_span::report(&task, ctx, started, outcome);
            let claimed = committed?;
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
            claimed.into_iter().next().map(|next| (next, since))
        }
        Err(AttemptError::Taken) => {
            attempt_span::report(&task, ctx, started, SpanOutcome::Taken);
            tracing::info!(
                flow_id = %task.flow_id,
                step = %task.step_type,
                attempt = task.attempt,
                "the Step's task was taken from its flow; the Step was stopped"
            );
            None
        }
        Err(err) => {
            let message = err.message();
            fail(store, registry, &task, err, component).await;
            attempt_span::report(&task, ctx, started, SpanOutcome::Failed(&message));
            None
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
