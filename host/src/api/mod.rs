//! The HTTP API of `dexa serve`: JSON for every session RPC, a Server-Sent
//! Events stream per session (resumable with `Last-Event-ID`), the OpenAPI
//! document at `/openapi.json`, and bearer-token auth on everything under
//! `/v1`.

mod answers;
pub mod cors;
pub mod error;
mod events;
pub mod limits;
pub mod listener;
mod messages;
pub mod metrics;
pub mod openapi;
mod pages;
mod ready;
pub mod request_log;
mod versions;
mod viewer;

use std::sync::Arc;

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

pub use error::{ApiError, ErrorCode};

use crate::config::Deployment;
use crate::flow::FlowInfo;
use crate::session::{new_session_id, AgentSessionClient, AgentSnapshot, ResolveInterruptRequest};
use answers::{AgentInfo, AgentList, Resolved, SessionStarted, Stopped};

/// Longest accepted session id, in characters (at most 800 bytes).
pub const MAX_SESSION_ID: usize = 200;
pub use pages::{MAX_HISTORY_PAGE, MAX_SESSION_PAGE};
/// The largest request body, in bytes; a larger one gets a typed 413
/// (`payload_too_large`) and nothing is done. It holds any JSON encoding of
/// a user message at the session client's cap
/// ([`crate::session::MAX_USER_MESSAGE_BYTES`], escaped at up to 6 bytes a
/// byte), so a message over that cap but under this limit gets the more
/// precise `message_too_large`.
pub const MAX_REQUEST_BODY_BYTES: usize = 2 << 20;
/// The header that makes a send idempotent (see `messages::send_message`).
const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// What every handler shares.
#[derive(Clone)]
pub struct ApiState {
    pub deployment: Arc<Deployment>,
    /// The bearer token; none turns auth off (tests and loopback demos only).
    pub token: Option<Arc<String>>,
    /// The sandbox engine that verifies versions before activation, made on
    /// first use.
    engine: versions::EngineCell,
    /// `/readyz`'s last look at the store.
    ready: Arc<ready::ReadyCache>,
    /// The process's metrics, for `/metrics` (none: it answers 404).
    metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    /// Which browser origins may call the API (off by default).
    cors: cors::CorsOrigins,
}

impl ApiState {
    pub fn new(deployment: Arc<Deployment>, token: Option<Arc<String>>) -> Self {
        Self {
            deployment,
            token,
            engine: Default::default(),
            ready: Default::default(),
            metrics: None,
            cors: cors::CorsOrigins::Off,
        }
    }

    /// Lets browser pages of `origins` call the API (see [`cors`]).
    pub fn with_cors(mut self, origins: cors::CorsOrigins) -> Self {
        self.cors = origins;
        self
    }

    /// Serves `handle`'s metrics at `/metrics`.
    pub fn with_metrics(mut self, handle: metrics_exporter_prometheus::PrometheusHandle) -> Self {
        self.metrics = Some(handle);
        self
    }
}

/// The whole application: the API, the OpenAPI document and health.
pub fn router(state: ApiState) -> Router {
    let cors = state.cors.layer();
    let api = Router::new()
        .route("/v1/agents", get(list_agents))
        .route("/v1/agents/{agent}/sessions", post(start_session))
        .route("/v1/sessions", get(pages::list_sessions))
        .route("/v1/sessions/{session_id}", get(get_snapshot))
        .route(
            "/v1/sessions/{session_id}/messages",
            get(messages::list_messages).post(messages::send_message),
        )
        .route(
            "/v1/sessions/{session_id}/interrupts",
            post(resolve_interrupt),
        )
        .route(
            "/v1/sessions/{session_id}/turn/cancel",
            post(messages::cancel_turn),
        )
        .route("/v1/sessions/{session_id}/stop", post(stop_session))
        .route(
            "/v1/sessions/{session_id}/history",
            get(pages::step_history),
        )
        .route("/v1/sessions/{session_id}/events", get(events::events))
        .route("/metrics", get(metrics::metrics_text))
        .merge(versions::routes())
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_token,
        ));
    let app = Router::new()
        .merge(api)
        .route("/openapi.json", get(openapi_json))
        .route("/healthz", get(healthz))
        .route("/readyz", get(ready::readyz))
        // The web viewer: a static page with a strict CSP (see `viewer`).
        .route("/", get(viewer::page))
        .fallback(|| async { ApiError::not_found("no such route; see /openapi.json") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                ErrorCode::MethodNotAllowed,
                "this route does not take that method; see /openapi.json",
            )
        })
        // Set here rather than left to axum's default, so that the limit is
        // a documented part of the API; `body` turns its rejection into JSON.
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BODY_BYTES))
        .layer(axum::middleware::map_response(error::json_errors))
        .with_state(state);
    // Outside the token check: a browser's preflight carries no token.
    let app = match cors {
        Some(cors) => app.layer(cors),
        None => app,
    };
    request_log::around(app)
}

/// `GET /openapi.json`: the document, built once per process.
async fn openapi_json() -> Json<Value> {
    static DOCUMENT: std::sync::OnceLock<Value> = std::sync::OnceLock::new();
    Json(DOCUMENT.get_or_init(openapi::document).clone())
}

/// `GET /healthz`: the process is up and serving HTTP. Also served by the
/// health-check reserve when the API's connections are all taken.
async fn healthz() -> Json<Value> {
    Json(json!({"ok": true}))
}

async fn require_token(State(state): State<ApiState>, request: Request, next: Next) -> Response {
    if let Some(token) = &state.token {
        let presented = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .unwrap_or("");
        // Digests of equal length: the comparison reveals neither the
        // token nor its length.
        let presented = Sha256::digest(presented.as_bytes());
        let expected = Sha256::digest(token.as_bytes());
        let matches: bool = presented.ct_eq(&expected).into();
        if !matches {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(request).await
}

/// The JSON body, or a typed error: 413 `payload_too_large` over
/// [`MAX_REQUEST_BODY_BYTES`], else 400.
fn body<T>(payload: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    payload.map(|Json(value)| value).map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorCode::PayloadTooLarge,
                format!(
                    "the request body is over the limit of {MAX_REQUEST_BODY_BYTES} bytes; \
                     nothing was done"
                ),
            )
        } else if rejection.status() == StatusCode::UNSUPPORTED_MEDIA_TYPE {
            ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                ErrorCode::UnsupportedMediaType,
                "send the body as JSON, with content-type: application/json; nothing was done",
            )
        } else {
            ApiError::bad_request(rejection.body_text())
        }
    })
}

/// The `Idempotency-Key` header, if sent. Several of them, or one that is
/// not visible ASCII, is a 400 `invalid_idempotency_key`; the session client
/// checks the rest (length, characters).
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let invalid = |message: &str| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidIdempotencyKey,
            message.to_string(),
        )
    };
    if values.next().is_some() {
        return Err(invalid("send one Idempotency-Key header, not several"));
    }
    let key = value
        .to_str()
        .map_err(|_| invalid("Idempotency-Key must be printable ASCII"))?;
    Ok(Some(key.to_string()))
}

/// For an optional body field: absent is `None`, but `null` is refused as
/// the wrong type (the schema does not allow it), not read as absent.
pub(crate) fn not_null<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(deserializer).map(Some)
}

fn query<T>(params: Result<Query<T>, QueryRejection>) -> Result<T, ApiError> {
    params
        .map(|Query(value)| value)
        .map_err(|rejection| ApiError::bad_request(rejection.body_text()))
}

impl ApiState {
    fn agent(&self, agent: &str) -> Result<AgentSessionClient, ApiError> {
        if !self.deployment.config.agents.contains_key(agent) {
            return Err(ApiError::not_found(format!("there is no agent {agent:?}")));
        }
        self.deployment
            .sessions(agent)
            .map_err(|err| ApiError::internal(format!("{err:#}")))
    }

    /// The session's client, by the agent that owns it.
    async fn session(&self, session_id: &str) -> Result<(AgentSessionClient, FlowInfo), ApiError> {
        let flow = self
            .deployment
            .store
            .flow(session_id)
            .await?
            .ok_or_else(|| ApiError::not_found(format!("session {session_id:?} does not exist")))?;
        if !self.deployment.config.agents.contains_key(&flow.flow_type) {
            return Err(ApiError::not_found(format!(
                "session {session_id:?} belongs to {:?}, which this server does not serve",
                flow.flow_type
            )));
        }
        Ok((self.agent(&flow.flow_type)?, flow))
    }
}

async fn list_agents(State(state): State<ApiState>) -> Json<AgentList> {
    let agents = state
        .deployment
        .config
        .agents
        .values()
        .map(|agent| AgentInfo {
            name: agent.name.clone(),
            runner: agent.runner.clone(),
            tool_components: agent.tools.clone(),
            model: agent.model.clone(),
        })
        .collect();
    Json(AgentList { agents })
}

/// `POST /v1/agents/{agent}/sessions`'s body.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "StartSession")]
struct StartSessionBody {
    #[serde(default, deserialize_with = "not_null")]
    #[schemars(
        with = "String",
        length(min = 1, max = MAX_SESSION_ID),
        regex(pattern = SESSION_ID_PATTERN),
        description = format!("Generated when absent. 1 to {MAX_SESSION_ID} characters, not blank, no control characters; another (or null) is a 400")
    )]
    session_id: Option<String>,
    #[serde(default)]
    #[schemars(description = format!(
        "At most {} bytes of UTF-8; blank (the default) starts no turn",
        crate::session::MAX_USER_MESSAGE_BYTES
    ))]
    message: String,
}

/// What [`check_session_id`] accepts, as a JSON Schema pattern: not blank,
/// no control characters.
const SESSION_ID_PATTERN: &str = "^[^\\u0000-\\u001F\\u007F-\\u009F]*[^\\s\\u0000-\\u001F\\u007F-\\u009F][^\\u0000-\\u001F\\u007F-\\u009F]*$";

fn check_session_id(id: &str) -> Result<(), ApiError> {
    if id.trim().is_empty()
        || id.chars().count() > MAX_SESSION_ID
        || id.chars().any(char::is_control)
    {
        return Err(ApiError::bad_request(format!(
            "session_id must be 1 to {MAX_SESSION_ID} characters, not blank, with no control characters"
        )));
    }
    Ok(())
}

async fn start_session(
    State(state): State<ApiState>,
    Path(agent): Path<String>,
    headers: HeaderMap,
    payload: Result<Json<StartSessionBody>, JsonRejection>,
) -> Result<(StatusCode, Json<SessionStarted>), ApiError> {
    let request = body(payload)?;
    let sessions = state.agent(&agent)?;
    let session_id = match request.session_id {
        Some(id) => {
            check_session_id(&id)?;
            id
        }
        None => new_session_id(&agent.to_ascii_lowercase()),
    };
    sessions
        .start_traced(
            &session_id,
            &request.message,
            crate::telemetry::traces::TurnTrace::from_headers(&headers),
        )
        .await?;
    Ok((
        StatusCode::CREATED,
        Json(SessionStarted { session_id, agent }),
    ))
}

async fn get_snapshot(
    State(state): State<ApiState>,
    Path(session_id): Path<String>,
) -> Result<Json<AgentSnapshot>, ApiError> {
    let (sessions, _) = state.session(&session_id).await?;
    Ok(Json(sessions.get_agent_snapshot(&session_id).await?))
}

async fn resolve_interrupt(
    State(state): State<ApiState>,
    Path(session_id): Path<String>,
    payload: Result<Json<ResolveInterruptRequest>, JsonRejection>,
) -> Result<Json<Resolved>, ApiError> {
    let request = body(payload)?;
    let (sessions, _) = state.session(&session_id).await?;
    let resolved = sessions.resolve_interrupt(&session_id, request).await?;
    Ok(Json(Resolved { resolved }))
}

async fn stop_session(
    State(state): State<ApiState>,
    Path(session_id): Path<String>,
) -> Result<Json<Stopped>, ApiError> {
    let (sessions, _) = state.session(&session_id).await?;
    let stopped = sessions.stop_session(&session_id).await?;
    // Wakes this process's event streams of the session, which then end.
    if let Some(signal) = sessions.event_signal(&session_id) {
        signal.notify_waiters();
    }
    Ok(Json(Stopped { stopped }))
}
