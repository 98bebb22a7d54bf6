//! `GET /metrics`: the process's metrics in the Prometheus text format
//! (names in [`crate::telemetry`]). Behind the API token like `/v1`, since
//! agent names and load are not for anyone who can reach the port; a
//! Prometheus scrape job sends it with `authorization: {credentials: ...}`.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::ApiState;

/// The Prometheus text exposition format's media type.
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

pub(super) async fn metrics_text(State(state): State<ApiState>) -> Response {
    match &state.metrics {
        Some(handle) => (
            [(header::CONTENT_TYPE, PROMETHEUS_TEXT)],
            crate::telemetry::render(handle),
        )
            .into_response(),
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "this server records no metrics (dexa serve installs its recorder at start)",
        )
        .into_response(),
    }
}
