//! `GET /metrics`: the process's metrics in the Prometheus text format
//! (names in [`crate::telemetry`]). Behind the API token like `/v1`, since
//! agent names and load are not for anyone who can reach the port; a
//! Prometheus scrape job sends it with `authorization: {credentials: ...}`.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use std::time::{Duration, Instant};

use super::error::{ApiError, ErrorCode};
use super::ApiState;
use crate::flow::FlowStore;

/// The Prometheus text exposition format's media type.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The longest a scrape waits for the store's task counts; without them
/// it shows the last ones.
const QUEUE_READ_TIMEOUT: Duration = Duration::from_secs(2);

/// How long a count of the queue stands for later scrapes.
const QUEUE_COUNT_FOR: Duration = Duration::from_secs(5);

/// When the queue was last counted: scrapes (the worker's need no token)
/// share one count at a time, and one every [`QUEUE_COUNT_FOR`].
static LAST_COUNT: tokio::sync::Mutex<Option<Instant>> = tokio::sync::Mutex::const_new(None);

/// Sets the queue-depth gauges from the store (see
/// [`crate::telemetry::QUEUE_TASKS`]), at most once every
/// [`QUEUE_COUNT_FOR`] however many scrape; on a store error or timeout
/// they keep their last values and the error is logged.
pub async fn record_queue_depth(store: &dyn FlowStore) {
    let mut last = LAST_COUNT.lock().await;
    if last.is_some_and(|at| at.elapsed() < QUEUE_COUNT_FOR) {
        return;
    }
    *last = Some(Instant::now());
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
            ErrorCode::NotFound,
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
