//! Metrics and traces. Metrics: their names (one place, so that the code that records them and
//! the documentation agree), and the Prometheus recorder behind
//! `GET /metrics` on `dexa serve` and `dexa worker --metrics-listen`.
//!
//! Recording goes through the `metrics` facade: without an installed
//! recorder (tests, `dexa demo`) it costs an atomic load and records
//! nothing.

pub mod traces;

use std::sync::Mutex;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Steps a worker claimed and began, by `flow_type` (an agent's sessions:
/// the agent's name) and `step` (the Step type).
pub const STEPS_STARTED: &str = "dexa_steps_started_total";
/// Steps whose result committed, by `flow_type` and `step`.
pub const STEPS_COMPLETED: &str = "dexa_steps_completed_total";
/// Attempts that failed (retried, routed or failing the flow), by
/// `flow_type` and `step`.
pub const STEPS_FAILED: &str = "dexa_steps_failed_total";
/// From a Step's claim to its commit, in seconds, by `step`.
pub const STEP_CLAIM_TO_COMMIT: &str = "dexa_step_claim_to_commit_seconds";
/// A Step attempt's duration in seconds, from its claim to its end, by
/// `step` and `outcome` (`committed`, `failed`, `not_committed`, `taken`,
/// `stopped`).
pub const STEP_ATTEMPT: &str = "dexa_step_attempt_seconds";
/// Leases renewed by a worker.
pub const LEASE_RENEWALS: &str = "dexa_lease_renewals_total";
/// Leases a worker found taken when it renewed them (its Step is stopped).
pub const LEASES_LOST: &str = "dexa_leases_lost_total";
/// Leases a draining worker handed back at its deadline.
pub const LEASES_RELEASED: &str = "dexa_leases_released_total";
/// 1 while the store takes the worker's claims, 0 during an outage.
pub const STORE_AVAILABLE: &str = "dexa_store_available";
/// Store outages a worker saw begin.
pub const STORE_OUTAGES: &str = "dexa_store_outages_total";

/// Guest calls, by `component` (its name in the config), `export` and
/// `outcome`: `ok`, `trapped`, `timed_out` (the epoch interrupt), `limit`
/// (memory, fuel, output, handles).
pub const GUEST_CALLS: &str = "dexa_guest_calls_total";
/// A guest call's duration in seconds, by `component`, `digest` (its
/// sha256: each version apart) and `export`.
pub const GUEST_CALL_DURATION: &str = "dexa_guest_call_seconds";
/// Requests and connections a guest made that its grants refused, by
/// `kind` (`http`, `tcp`).
pub const GRANTS_REFUSED: &str = "dexa_grants_refused_total";

/// Writes per SQLite group commit (one transaction): each process's writer
/// thread batches what is queued while the last commit ran.
pub const SQLITE_BATCH_WRITES: &str = "dexa_sqlite_batch_writes";
/// A SQLite group commit's time, in seconds, from `BEGIN IMMEDIATE` (which
/// may wait for another process's write lock) to the end of `COMMIT`.
pub const SQLITE_BATCH_COMMIT: &str = "dexa_sqlite_batch_commit_seconds";
/// Tasks of the store by `state`: `ready` (runnable now or after a
/// back-off), `waiting` (for a message or timer), `leased` (running).
/// Read from the store at each scrape.
pub const QUEUE_TASKS: &str = "dexa_queue_tasks";
/// Bytes of session events sent to event-stream clients (SSE `data`).
pub const EVENT_STREAM_BYTES: &str = "dexa_event_stream_bytes_total";

/// Histogram buckets for Step durations (seconds): a Step without a guest
/// takes about a millisecond; a model call, seconds.
const STEP_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0, 120.0,
];

/// Histogram buckets for writes per group commit (at most 256 in a batch).
const BATCH_BUCKETS: [f64; 9] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// How often histogram samples are folded into their buckets. Until then
/// each sample is held in memory, so this must run whether or not anything
/// scrapes.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

static HANDLE: Mutex<Option<PrometheusHandle>> = Mutex::new(None);

/// Installs the process's Prometheus recorder, and a thread that keeps its
/// histograms folded; later calls return the same handle.
pub fn install_prometheus() -> anyhow::Result<PrometheusHandle> {
    let mut installed = HANDLE
        .lock()
        .map_err(|_| anyhow::anyhow!("the metrics recorder's lock is poisoned"))?;
    if let Some(handle) = installed.as_ref() {
        return Ok(handle.clone());
    }
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".to_string()), &STEP_BUCKETS)?
        .set_buckets_for_metric(
            Matcher::Full(SQLITE_BATCH_WRITES.to_string()),
            &BATCH_BUCKETS,
        )?
        .build_recorder();
    let handle = recorder.handle();
    if metrics::set_global_recorder(recorder).is_err() {
        anyhow::bail!("another metrics recorder is installed already in this process");
    }
    let upkeep = handle.clone();
    std::thread::Builder::new()
        .name("dexa-metrics-upkeep".to_string())
        .spawn(move || loop {
            std::thread::sleep(UPKEEP_EVERY);
            upkeep.run_upkeep();
        })?;
    *installed = Some(handle.clone());
    Ok(handle)
}

/// The Prometheus text exposition of everything recorded so far.
pub fn render(handle: &PrometheusHandle) -> String {
    // Histograms are kept in buckets that upkeep drains; a scrape is as good
    // a time as any.
    handle.run_upkeep();
    handle.render()
}
