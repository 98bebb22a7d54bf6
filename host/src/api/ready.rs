//! `GET /readyz`: whether this process can do its work now, for a load
//! balancer or an orchestrator's readiness probe. `/healthz` stays a
//! liveness check: a process whose store is down is alive, and restarting
//! it would not bring the store back.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::error::ApiError;
use super::ApiState;

/// 200 when the store answers a read and, if this process runs a worker,
/// the store takes that worker's claims (a full disk reads but refuses
/// every write). The worker's components are loaded before the server
/// listens, so a listening server has them. Otherwise 503
/// `store_unavailable`, saying since when.
pub(super) async fn readyz(State(state): State<ApiState>) -> Response {
    if let Some(since_ms) = state.deployment.store_health.unavailable_since_ms() {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            format!(
                "the store has refused this process's worker since {} (Unix ms {since_ms}); \
                 the worker backs off and resumes by itself when it answers",
                humantime::format_rfc3339_millis(
                    std::time::UNIX_EPOCH + std::time::Duration::from_millis(since_ms)
                ),
            ),
        )
        .into_response();
    }
    // Any read of the store: a flow id no session can have.
    match state.deployment.store.flow("").await {
        Ok(_) => Json(json!({"ok": true, "store": "answers"})).into_response(),
        Err(err) => ApiError::from(err).into_response(),
    }
}
