//! The component catalog over HTTP, behind the same token as every `/v1`
//! route: upload a version's bytes, list the catalog, read an agent's
//! activation log, activate a version by digest, roll back. The same
//! verification as `dexa agent activate` runs before anything is activated.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use axum::{Json, Router};
use schemars::JsonSchema;
use serde::Deserialize;

use super::answers::{Activated, ComponentAdded, ComponentList};
use super::{body, ApiError, ApiState, ErrorCode};
use crate::catalog::{ActivationMode, AgentVersions, RUNNER_ROLE};
use crate::config::activate::{
    activate, add_component, rollback_reason, rollback_request, versions_report, ActivationRefused,
    ActivationRequest, VersionSource,
};
use crate::config::versions::{config_engine, role_component};
use crate::plugin::SandboxEngine;

/// The largest component an upload may carry (a componentize-py component
/// is about 40 MB).
pub const MAX_COMPONENT_BYTES: usize = 128 << 20;

/// Who the log records for an HTTP activation: the `X-Dexa-Actor` header,
/// else `api`.
const ACTOR_HEADER: &str = "x-dexa-actor";

/// The catalog's routes (the caller adds auth).
pub fn routes() -> Router<ApiState> {
    Router::new()
        .route(
            "/v1/components",
            get(list_components)
                .post(upload_component)
                .layer(DefaultBodyLimit::max(MAX_COMPONENT_BYTES)),
        )
        .route("/v1/agents/{agent}/versions", get(agent_versions))
        .route("/v1/agents/{agent}/activations", post(activate_version))
        .route("/v1/agents/{agent}/rollback", post(roll_back))
}

/// The `X-Dexa-Actor` header: absent is `api`; one that is empty, over
/// 200 characters or not printable ASCII is a 400, never replaced silently.
fn actor(headers: &HeaderMap) -> Result<String, ApiError> {
    let Some(value) = headers.get(ACTOR_HEADER) else {
        return Ok("api".to_string());
    };
    value
        .to_str()
        .ok()
        .map(str::trim)
        .filter(|a| !a.is_empty() && a.len() <= 200)
        .map(str::to_string)
        .ok_or_else(|| {
            ApiError::bad_request(
                "X-Dexa-Actor must be 1 to 200 printable ASCII characters; nothing was done",
            )
        })
}

fn refused(err: ActivationRefused) -> ApiError {
    if err.log_moved {
        return ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::ActivationLogMoved,
            err.to_string(),
        );
    }
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        ErrorCode::ActivationRefused,
        err.to_string(),
    )
}

impl ApiState {
    /// The sandbox engine verification compiles with (made on first use).
    async fn engine(&self) -> Result<&SandboxEngine, ApiError> {
        self.engine
            .get_or_try_init(|| async { config_engine(&self.deployment.config) })
            .await
            .map_err(|err| ApiError::internal(format!("no sandbox engine: {err:#}")))
    }

    fn known_agent(&self, agent: &str) -> Result<(), ApiError> {
        if self.deployment.config.agents.contains_key(agent) {
            Ok(())
        } else {
            Err(ApiError::not_found(format!("there is no agent {agent:?}")))
        }
    }
}

/// `GET /v1/components`.
async fn list_components(State(state): State<ApiState>) -> Result<Json<ComponentList>, ApiError> {
    let components = state.deployment.catalog.list_components().await?;
    Ok(Json(ComponentList { components }))
}

/// `POST /v1/components`: the body is the component's bytes.
async fn upload_component(
    State(state): State<ApiState>,
    headers: HeaderMap,
    bytes: Bytes,
) -> Result<(StatusCode, Json<ComponentAdded>), ApiError> {
    if bytes.is_empty() {
        return Err(ApiError::bad_request(
            "send the component's bytes (application/wasm) as the body",
        ));
    }
    let engine = state.engine().await?;
    let (record, added) = add_component(
        engine,
        &*state.deployment.catalog,
        bytes.to_vec(),
        "upload",
        &actor(&headers)?,
    )
    .await
    .map_err(refused)?;
    let status = if added {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(ComponentAdded {
            component: record,
            added,
        }),
    ))
}

/// `GET /v1/agents/{agent}/versions`.
async fn agent_versions(
    State(state): State<ApiState>,
    Path(agent): Path<String>,
) -> Result<Json<AgentVersions>, ApiError> {
    state.known_agent(&agent)?;
    Ok(Json(
        versions_report(&*state.deployment.catalog, &agent).await?,
    ))
}

/// What `POST /v1/agents/{agent}/activations` takes.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Activate")]
pub struct ActivateBody {
    /// `runner`, or a tool component's name in dexa.toml.
    #[schemars(length(min = 1))]
    pub role: String,
    /// 64 hex digits of an uploaded version.
    #[schemars(regex(pattern = "^[0-9a-fA-F]{64}$"))]
    pub digest: String,
    /// Percent of sessions (stable by session id); absent: every new turn.
    #[serde(default, deserialize_with = "ramp_percent")]
    #[schemars(with = "u8", range(min = 1, max = 99))]
    pub ramp: Option<u8>,
    /// Move turns pinned to another runner at their next RunModel.
    #[serde(default)]
    pub upgrade_in_flight: bool,
    #[serde(default)]
    pub reason: String,
}

/// A ramp's percent: an integer, written as JSON writes it (`20` or
/// `20.0`, as JSON Schema counts both integers); never `null`. Its range is
/// checked with the mode.
fn ramp_percent<'de, D>(deserializer: D) -> Result<Option<u8>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let number = f64::deserialize(deserializer)?;
    if number.fract() != 0.0 || !(0.0..=255.0).contains(&number) {
        return Err(serde::de::Error::custom(format!(
            "ramp must be a whole percent from 1 to 99, not {number}"
        )));
    }
    Ok(Some(number as u8))
}

async fn run_activation(
    state: &ApiState,
    request: ActivationRequest,
) -> Result<(StatusCode, Json<Activated>), ApiError> {
    role_component(&state.deployment.config, &request.agent, &request.role)
        .map_err(ApiError::not_found)?;
    let engine = state.engine().await?;
    let activation = activate(
        &state.deployment.config,
        engine,
        &*state.deployment.catalog,
        request,
    )
    .await
    .map_err(refused)?;
    Ok((
        StatusCode::CREATED,
        Json(Activated {
            activation: activation.into(),
        }),
    ))
}

/// `POST /v1/agents/{agent}/activations`.
async fn activate_version(
    State(state): State<ApiState>,
    Path(agent): Path<String>,
    headers: HeaderMap,
    payload: Result<Json<ActivateBody>, JsonRejection>,
) -> Result<(StatusCode, Json<Activated>), ApiError> {
    state.known_agent(&agent)?;
    let request = body(payload)?;
    let VersionSource::Digest(digest) = VersionSource::parse(&request.digest) else {
        return Err(ApiError::bad_request(
            "digest must be the 64 hex digits of a version uploaded to /v1/components",
        ));
    };
    let mode = match request.ramp {
        Some(percent) => ActivationMode::ramp(percent).map_err(ApiError::bad_request)?,
        None => ActivationMode::Current,
    };
    run_activation(
        &state,
        ActivationRequest {
            agent,
            role: request.role,
            source: VersionSource::Digest(digest),
            mode,
            upgrade_in_flight: request.upgrade_in_flight,
            actor: actor(&headers)?,
            reason: request.reason,
            after_seq: None,
        },
    )
    .await
}

/// What `POST /v1/agents/{agent}/rollback` takes.
#[derive(Deserialize, Default, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(rename = "Rollback")]
pub struct RollbackBody {
    /// `runner` (the default) or a tool component's name.
    #[serde(default, deserialize_with = "super::not_null")]
    #[schemars(with = "String", length(min = 1))]
    pub role: Option<String>,
    #[serde(default)]
    pub upgrade_in_flight: bool,
    #[serde(default)]
    pub reason: String,
}

/// `POST /v1/agents/{agent}/rollback`.
async fn roll_back(
    State(state): State<ApiState>,
    Path(agent): Path<String>,
    headers: HeaderMap,
    payload: Result<Json<RollbackBody>, JsonRejection>,
) -> Result<(StatusCode, Json<Activated>), ApiError> {
    state.known_agent(&agent)?;
    let request = body(payload)?;
    let role = request.role.unwrap_or_else(|| RUNNER_ROLE.to_string());
    role_component(&state.deployment.config, &agent, &role).map_err(ApiError::not_found)?;
    let target = rollback_request(&*state.deployment.catalog, &agent, &role)
        .await
        .map_err(|err| {
            ApiError::new(
                StatusCode::CONFLICT,
                ErrorCode::NothingToRollBack,
                err.reason,
            )
        })?;
    run_activation(
        &state,
        ActivationRequest {
            agent,
            role,
            reason: rollback_reason(&target.digest, request.reason),
            source: VersionSource::Digest(target.digest),
            after_seq: Some(target.after_seq),
            mode: ActivationMode::Current,
            upgrade_in_flight: request.upgrade_in_flight,
            actor: actor(&headers)?,
        },
    )
    .await
}

/// Where [`ApiState`] keeps the engine, once made.
pub(super) type EngineCell = Arc<tokio::sync::OnceCell<SandboxEngine>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rollback_that_lost_its_race_is_a_conflict_and_a_bad_version_is_unprocessable() {
        let refusal = |log_moved| ActivationRefused {
            digest: Some("d".into()),
            reason: "why".into(),
            log_moved,
        };
        let moved = refused(refusal(true));
        assert_eq!(
            (moved.status, moved.code),
            (StatusCode::CONFLICT, ErrorCode::ActivationLogMoved)
        );
        let bad = refused(refusal(false));
        assert_eq!(
            (bad.status, bad.code),
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::ActivationRefused
            )
        );
        assert!(bad.message.contains("why"));
    }
}
