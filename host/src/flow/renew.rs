//! Lease renewal: a worker extends the leases of the Steps it runs every
//! third of a lease, and records their heartbeats as output.

use std::sync::Arc;
use std::time::Duration;

use super::context::Heartbeat;
use super::store::FlowStore;
use super::worker::{HeldTasks, WorkerOptions};
use crate::telemetry;

/// Renews the worker's leases and records heartbeats as output.
pub(super) async fn renew_leases(
    store: Arc<dyn FlowStore>,
    options: WorkerOptions,
    held: HeldTasks,
) {
    let every = (options.lease / 3).max(Duration::from_millis(20));
    let lease_ms = options.lease.as_millis() as i64;
    loop {
        tokio::time::sleep(every).await;
        let snapshot: Vec<((i64, i64), Heartbeat)> = match held.lock() {
            Ok(held) => held
                .iter()
                .map(|(key, h)| (*key, h.heartbeat.clone()))
                .collect(),
            Err(_) => return,
        };
        if snapshot.is_empty() {
            continue;
        }
        let pairs: Vec<(i64, i64)> = snapshot.iter().map(|(key, _)| *key).collect();
        // Renew first: a lease that lapsed while the writer stalled (and was
        // not reaped) is live again, so the heartbeats below can be recorded
        // against it; recording first would be refused and leave the Step
        // running with no output recorded.
        let lost = match store
            .renew_leases(&options.worker_id, &pairs, lease_ms)
            .await
        {
            Ok(lost) => {
                metrics::counter!(telemetry::LEASE_RENEWALS)
                    .increment(pairs.len().saturating_sub(lost.len()) as u64);
                metrics::counter!(telemetry::LEASES_LOST).increment(lost.len() as u64);
                lost
            }
            Err(err) => {
                tracing::warn!(error = %err, "renewing leases failed");
                Vec::new()
            }
        };
        if let Ok(held) = held.lock() {
            for (task_id, token) in &lost {
                match held.get(&(*task_id, *token)) {
                    Some(held) => {
                        tracing::warn!(task_id, "lease lost; stopping the Step");
                        if let Some(abort) = held.abort.as_ref() {
                            abort.abort();
                        }
                    }
                    // Committed (or failed) since the snapshot above: the
                    // lease ended with it, and nothing was lost.
                    None => tracing::debug!(task_id, "a lease ended while it was renewed"),
                }
            }
        }
        for ((task_id, token), heartbeat) in &snapshot {
            if lost.contains(&(*task_id, *token)) || !heartbeat.take_unrecorded() {
                continue;
            }
            if let Err(err) = store.record_output(*task_id, *token).await {
                // Kept for the next round, when a renewal may make the
                // record possible again.
                heartbeat.mark_unrecorded();
                tracing::debug!(task_id, error = %err, "recording a heartbeat failed");
            }
        }
    }
}
