//! How a worker lives through a store that stops answering (a full disk, a
//! database restart): it backs off instead of retrying at once, and says so
//! in the log when the outage begins and when it ends, not at every retry.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::store::StoreError;
use crate::telemetry;

/// The first wait after a failed store call.
const FIRST_BACKOFF: Duration = Duration::from_millis(50);

/// The longest wait between two tries of an unavailable store: also how
/// late, at most, the worker notices that it is back.
pub const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// The wait after an error that is not an outage (a corrupt row that fails
/// every claim): the worker keeps trying, quietly, without claiming the
/// store is down.
const OTHER_ERROR_WAIT: Duration = Duration::from_secs(1);

/// How often a long outage is logged again, so that a log that starts
/// mid-outage still shows it.
const REMINDER: Duration = Duration::from_secs(60);

/// Whether the store answers, as a worker last saw it: for readiness checks
/// and metrics. Cheap to clone and to read.
#[derive(Clone, Debug, Default)]
pub struct StoreHealth {
    inner: Arc<HealthInner>,
}

#[derive(Debug, Default)]
struct HealthInner {
    down: AtomicBool,
    /// Unix milliseconds of the first failure of the current outage.
    down_since_ms: AtomicU64,
    outages: AtomicU64,
}

impl StoreHealth {
    /// True unless the last store call of the worker's loop failed.
    pub fn available(&self) -> bool {
        !self.inner.down.load(Ordering::Acquire)
    }

    /// When the current outage began (Unix milliseconds), if there is one.
    pub fn unavailable_since_ms(&self) -> Option<u64> {
        (!self.available()).then(|| self.inner.down_since_ms.load(Ordering::Acquire))
    }

    /// Outages seen since the worker started.
    pub fn outages(&self) -> u64 {
        self.inner.outages.load(Ordering::Acquire)
    }
}

/// A worker loop's view of the store's availability: the back-off it owes
/// after a failure, and the two log lines of an outage.
#[derive(Debug)]
pub(crate) struct Outage {
    /// The worker's id, in each log line.
    worker: String,
    health: StoreHealth,
    /// The first failure of the current outage and the failures since.
    current: Option<(Instant, u32)>,
    last_logged: Option<Instant>,
}

impl Outage {
    pub(crate) fn new(worker: &str, health: StoreHealth) -> Self {
        metrics::gauge!(telemetry::STORE_AVAILABLE).set(1.0);
        Self {
            worker: worker.to_string(),
            health,
            current: None,
            last_logged: None,
        }
    }

    /// Whether an outage is under way.
    pub(crate) fn active(&self) -> bool {
        self.current.is_some()
    }

    /// Records a failed store call of `what`; returns how long to wait before
    /// the next try (doubling from 50 ms up to [`MAX_BACKOFF`], with jitter so
    /// that workers restarted together do not retry together). Only a store
    /// that does not answer (a backend error) is an outage; another error
    /// (a corrupt row) is logged as itself and waited on, and leaves the
    /// store's health alone.
    pub(crate) fn failed(&mut self, what: &str, err: &StoreError) -> Duration {
        let now = Instant::now();
        if !matches!(err, StoreError::Backend(_)) {
            if self
                .last_logged
                .is_none_or(|at| now.duration_since(at) >= REMINDER)
            {
                tracing::warn!(worker = %self.worker, error = %err, during = what, "a store call failed");
                self.last_logged = Some(now);
            }
            return OTHER_ERROR_WAIT;
        }
        let (since, failures) = self.current.get_or_insert((now, 0));
        *failures = failures.saturating_add(1);
        let (since, failures) = (*since, *failures);
        if failures == 1 {
            let unix_ms = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            self.health
                .inner
                .down_since_ms
                .store(unix_ms, Ordering::Release);
            self.health.inner.down.store(true, Ordering::Release);
            self.health.inner.outages.fetch_add(1, Ordering::AcqRel);
            metrics::counter!(telemetry::STORE_OUTAGES).increment(1);
            metrics::gauge!(telemetry::STORE_AVAILABLE).set(0.0);
            tracing::warn!(
                worker = %self.worker,
                error = %err,
                during = what,
                "store unavailable; the worker backs off (up to {} s between tries) until it answers",
                MAX_BACKOFF.as_secs()
            );
            self.last_logged = Some(now);
        } else if self
            .last_logged
            .is_none_or(|at| now.duration_since(at) >= REMINDER)
        {
            tracing::warn!(
                worker = %self.worker,
                error = %err,
                during = what,
                failures,
                "store still unavailable, since {} s ago",
                now.duration_since(since).as_secs()
            );
            self.last_logged = Some(now);
        } else {
            tracing::debug!(worker = %self.worker, error = %err, during = what, failures, "store still unavailable");
        }
        backoff(failures)
    }

    /// Records a store call that worked; ends an outage, if there was one.
    pub(crate) fn answered(&mut self) {
        if let Some((since, failures)) = self.current.take() {
            self.health.inner.down.store(false, Ordering::Release);
            metrics::gauge!(telemetry::STORE_AVAILABLE).set(1.0);
            tracing::info!(
                worker = %self.worker,
                failures,
                "store back after {:.1} s",
                since.elapsed().as_secs_f64()
            );
        }
    }
}

/// The wait after the `failures`-th failure in a row: 50 ms doubled each
/// time, capped, then spread over its upper half.
fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    let full = FIRST_BACKOFF
        .saturating_mul(1u32 << doublings)
        .min(MAX_BACKOFF);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    // Half fixed, half spread by the clock's sub-second part (jitter needs
    // no strong randomness).
    let half = full / 2;
    half + half.mul_f64(f64::from(nanos) / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_back_off_doubles_from_fifty_milliseconds_to_its_cap() {
        assert!(backoff(1) >= Duration::from_millis(25) && backoff(1) <= FIRST_BACKOFF);
        assert!(backoff(2) >= Duration::from_millis(50) && backoff(2) <= 2 * FIRST_BACKOFF);
        for failures in [8, 20, u32::MAX] {
            let wait = backoff(failures);
            assert!(wait >= MAX_BACKOFF / 2 && wait <= MAX_BACKOFF, "{wait:?}");
        }
    }

    #[test]
    fn an_outage_shows_in_the_health_until_the_store_answers() {
        let health = StoreHealth::default();
        let mut outage = Outage::new("w", health.clone());
        assert!(health.available());
        let err = StoreError::Backend("database or disk is full".into());
        outage.failed("claim", &err);
        outage.failed("claim", &err);
        assert!(!health.available());
        assert!(health.unavailable_since_ms().is_some());
        assert_eq!(health.outages(), 1);
        outage.answered();
        assert!(health.available());
        outage.failed("claim", &err);
        assert_eq!(health.outages(), 2);
        outage.answered();
        // A corrupt row is no outage.
        let wait = outage.failed("claim", &StoreError::Corrupt("bad row".into()));
        assert_eq!(wait, OTHER_ERROR_WAIT);
        assert!(health.available());
        assert!(!outage.active());
    }
}
