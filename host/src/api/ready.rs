//! `GET /readyz`: whether this process can do its work now, for a load
//! balancer or an orchestrator's readiness probe. `/healthz` stays a
//! liveness check: a process whose store is down is alive, and restarting
//! it would not bring the store back.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use std::time::{Duration, Instant, UNIX_EPOCH};

use axum::Json;
use serde_json::json;

use super::error::{ApiError, ErrorCode};
use super::ApiState;

/// How long a store read's answer stands for later probes.
const CACHED_FOR: Duration = Duration::from_secs(1);

/// The longest a probe waits for the store.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The last store read's answer: probes share one read a second, so that a
/// flood of them (the route needs no token) costs the store nothing.
#[derive(Default)]
pub(super) struct ReadyCache {
    last: tokio::sync::Mutex<Option<(Instant, bool)>>,
}

/// 200 when the store answers a read and, if this process runs a worker,
/// the store takes that worker's claims (a full disk reads but refuses
/// every write). The worker's components are loaded before the server
/// listens, so a listening server has them. Otherwise 503
/// `store_unavailable`, saying since when; never the store's own error
/// text, which is for the log, not for anyone who can reach the port.
pub(super) async fn readyz(State(state): State<ApiState>) -> Response {
    if let Some(since_ms) = state.deployment.store_health.unavailable_since_ms() {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::StoreUnavailable,
            format!(
                "the store has refused this process's worker since {} (Unix ms {since_ms}); \
                 the worker backs off and resumes by itself when it answers",
                humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(since_ms)),
            ),
        )
        .into_response();
    }
    if store_answers(&state).await {
        Json(json!({"ok": true, "store": "answers"})).into_response()
    } else {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::StoreUnavailable,
            "the store does not answer reads; see this process's log",
        )
        .into_response()
    }
}

/// Whether the store answered a read within the last second, reading it
/// again (one probe at a time) when that answer is older.
async fn store_answers(state: &ApiState) -> bool {
    let mut last = state.ready.last.lock().await;
    if let Some((at, answered)) = *last {
        if at.elapsed() < CACHED_FOR {
            return answered;
        }
    }
    // Any read of the store: a flow id no session can have.
    let answered = match tokio::time::timeout(PROBE_TIMEOUT, state.deployment.store.flow("")).await
    {
        Ok(Ok(_)) => true,
        Ok(Err(err)) => {
            tracing::warn!(error = %err, "readiness: the store did not answer a read");
            false
        }
        Err(_) => {
            tracing::warn!("readiness: the store did not answer a read within {PROBE_TIMEOUT:?}");
            false
        }
    };
    *last = Some((Instant::now(), answered));
    answered
}
