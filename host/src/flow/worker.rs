//! The worker: claims ready Step tasks, runs their handlers under the retry
//! policy's deadlines, and commits their results fenced by the lease.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::task::{AbortHandle, JoinSet};

use super::context::Heartbeat;
use super::drain::DrainState;
use super::outage::{Outage, StoreHealth};
use super::registry::Registry;
use super::retry::{self, AttemptError};
use super::run_step::{count_failed, run_task, Leased, StepRunner};
use super::slots::Slots;
use super::store::{AttemptFailure, ClaimNext, FlowStore, StoreError};
use super::types::ClaimedTask;

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

/// The most of a flow's next Steps one commit leases to its worker: a
/// quarter of the worker's slots, and only free ones. A fan-out's first
/// share starts without a claim of its own; the rest, and other flows'
/// Steps, go through the fair claim. Several fan-outs committing at once
/// may each take a share before an older due Step of another flow: that
/// Step waits for the next free slot, as behind any running Steps.
fn commit_share(max_concurrent_tasks: usize) -> usize {
    (max_concurrent_tasks / 4).max(1)
}

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
        let slots = Slots::new(self.options.max_concurrent_tasks);
        let runner = Arc::new(StepRunner {
            store: self.store.clone(),
            registry: self.registry.clone(),
            held: held.clone(),
            drain_state: drain_state.clone(),
            observer: self.options.on_step_committed.clone(),
            claim_next: ClaimNext {
                worker_id: self.options.worker_id.clone(),
                max: commit_share(self.options.max_concurrent_tasks),
                lease_ms,
            },
            slots: slots.clone(),
        });
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
            // Taken before the claim, so a commit leasing next Steps cannot
            // take the same slots meanwhile; what the claim leaves goes back.
            let mut taken = slots.take(self.options.max_concurrent_tasks);
            let free = taken.len();
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
                            // The store leases at most `free`: each finds one.
                            let slot = taken.split_one().unwrap_or_else(|| slots.take(0));
                            running.spawn(run_task(runner.clone(), Leased { task, since, slot }));
                        }
                    }
                    Err(err) => back_off = Some(outage.failed("claiming tasks", &err)),
                }
            }
            // The slots the claim found no Step for go back.
            drop(taken);
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
                // A full worker claims again once a Step gives its slot back.
                _ = slots.freed(), if free == 0 => {}
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
