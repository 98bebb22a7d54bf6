//! `GET /metrics`: the process's metrics in the Prometheus text format
//! (names in [`crate::telemetry`]). Behind the API token like `/v1`, since
//! agent names and load are not for anyone who can reach the port; a
//! Prometheus scrape job sends it with `authorization: {credentials: ...}`.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use std::time::Duration;

use super::error::ApiError;
use super::ApiState;
use crate::flow::FlowStore;

/// The Prometheus text exposition format's media type.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The longest a scrape waits for the store's task counts; without them
/// it shows the last ones.
const QUEUE_READ_TIMEOUT: Duration = Duration::from_secs(2);

/// Sets the queue-depth gauges from the store (see
/// [`crate::telemetry::QUEUE_TASKS`]); on a store error or timeout they keep
/// their last values and the error is logged.
pub async fn record_queue_depth(store: &dyn FlowStore) {
    match tokio::time::timeout(QUEUE_READ_TIMEOUT, store.task_counts()).await {
        Ok(Ok(counts)) => {
            for (state, count) in [
                ("ready", counts.ready),
                ("waiting", counts.waiting),
                ("leased", counts.leased),
            ] {
                metrics::gauge!(crate::telemetry::QUEUE_TASKS, "state" => state).set(count as f64);
            }
        }
        Ok(Err(err)) => tracing::warn!(error = %err, "metrics: the store did not count its tasks"),
        Err(_) => tracing::warn!(
            "metrics: the store did not count its tasks within {QUEUE_READ_TIMEOUT:?}"
        ),
    }
}

pub(super) async fn metrics_text(State(state): State<ApiState>) -> Response {
    let Some(handle) = &state.metrics else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "this server records no metrics (dexa serve installs its recorder at start)",
        )
        .into_response();
    };
    record_queue_depth(state.deployment.store.as_ref()).await;
    (
        [(header::CONTENT_TYPE, PROMETHEUS_TEXT)],
        crate::telemetry::render(handle),
    )
        .into_response()
}
