//! API errors: a status code and a typed JSON body,
//! `{"error": {"code": "...", "message": "..."}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use schemars::JsonSchema;
use serde::Serialize;

use crate::flow::{FlowError, RpcError, StoreError};
use crate::session::SessionError;

/// The `Retry-After` of every 503: long enough for a store to come back or
/// a connection to free, short enough that a client does not wait long
/// after it did.
pub const RETRY_AFTER_SECONDS: &str = "2";

/// Every error code an answer may carry: stable and machine-readable. The
/// OpenAPI document's enum is this type's, so a new code is documented by
/// being added here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    BadRequest,
    InvalidRequest,
    InvalidCursor,
    InvalidIdempotencyKey,
    Unauthorized,
    NotFound,
    InterruptNotFound,
    MethodNotAllowed,
    AlreadyExists,
    Conflict,
    NotRunning,
    Busy,
    NothingToRollBack,
    ActivationLogMoved,
    PayloadTooLarge,
    MessageTooLarge,
    UnsupportedMediaType,
    IdempotencyKeyReused,
    ActivationRefused,
    Internal,
    StoreUnavailable,
    Overloaded,
    // Only from a worker's own `/readyz`: its components are still loading.
    Loading,
}

/// The body of every error answer.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "Error")]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// What went wrong.
#[derive(Debug, Serialize, JsonSchema)]
pub struct ErrorDetail {
    pub code: ErrorCode,
    /// For people: what was wrong and, where it helps, what to do.
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: ErrorCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, ErrorCode::BadRequest, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, ErrorCode::NotFound, message)
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            ErrorCode::Unauthorized,
            "send the API token as `Authorization: Bearer <token>`",
        )
    }

    /// 503 `overloaded`: every connection the server keeps for the API is
    /// taken (see `dexa serve --max-connections`).
    pub fn overloaded() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Overloaded,
            "the server has no free connection for the API; only /healthz is answered now; \
             try again shortly",
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Internal,
            message,
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code,
                message: self.message,
            },
        };
        let mut response = (self.status, axum::Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        // Every 503 is a "not now": say when to try again.
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
        }
        response
    }
}

/// Makes every error answer the JSON error body: axum's own rejections (a
/// path parameter that is not UTF-8, a body over a route's limit) come as
/// plain text, which a client generated from the OpenAPI document cannot
/// read.
pub(crate) async fn json_errors(response: Response) -> Response {
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let is_json = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("application/json"));
    if is_json {
        return response;
    }
    let code = match status {
        StatusCode::BAD_REQUEST => ErrorCode::BadRequest,
        StatusCode::UNAUTHORIZED => ErrorCode::Unauthorized,
        StatusCode::NOT_FOUND => ErrorCode::NotFound,
        StatusCode::METHOD_NOT_ALLOWED => ErrorCode::MethodNotAllowed,
        StatusCode::PAYLOAD_TOO_LARGE => ErrorCode::PayloadTooLarge,
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ErrorCode::UnsupportedMediaType,
        StatusCode::SERVICE_UNAVAILABLE => ErrorCode::Overloaded,
        _ => ErrorCode::Internal,
    };
    // Rejection texts are short; a long one is cut rather than held.
    let text = axum::body::to_bytes(response.into_body(), 4096)
        .await
        .map(|bytes| String::from_utf8_lossy(&bytes).trim().to_string())
        .unwrap_or_default();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        text
    };
    ApiError::new(status, code, message).into_response()
}

impl From<StoreError> for ApiError {
    fn from(err: StoreError) -> Self {
        match &err {
            StoreError::FlowExists { .. } => Self::new(
                StatusCode::CONFLICT,
                ErrorCode::AlreadyExists,
                err.to_string(),
            ),
            StoreError::NoSuchFlow { .. } => Self::not_found(err.to_string()),
            StoreError::FlowEnded { .. } => {
                Self::new(StatusCode::CONFLICT, ErrorCode::NotRunning, err.to_string())
            }
            StoreError::Conflict(_) | StoreError::StaleLease { .. } => {
                Self::new(StatusCode::CONFLICT, ErrorCode::Conflict, err.to_string())
            }
            _ => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::StoreUnavailable,
                err.to_string(),
            ),
        }
    }
}

impl From<RpcError> for ApiError {
    fn from(err: RpcError) -> Self {
        match err {
            RpcError::LockConflict { .. } => Self::new(
                StatusCode::CONFLICT,
                ErrorCode::Busy,
                format!("{err}; a Step holds it, try again shortly"),
            ),
            RpcError::Rejected(message) => Self::bad_request(message),
            RpcError::Store(err) => err.into(),
        }
    }
}

impl From<FlowError> for ApiError {
    fn from(err: FlowError) -> Self {
        match err {
            FlowError::Store(err) => err.into(),
            FlowError::Rpc(err) => err.into(),
            FlowError::Registry(err) => Self::bad_request(err.to_string()),
        }
    }
}

impl From<SessionError> for ApiError {
    fn from(err: SessionError) -> Self {
        match err {
            SessionError::NoSuchSession(_) => Self::not_found(err.to_string()),
            SessionError::NoSuchInterrupt { .. } => Self::new(
                StatusCode::NOT_FOUND,
                ErrorCode::InterruptNotFound,
                err.to_string(),
            ),
            SessionError::NotRunning { .. } => {
                Self::new(StatusCode::CONFLICT, ErrorCode::NotRunning, err.to_string())
            }
            SessionError::MessageTooLarge { .. } => Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorCode::MessageTooLarge,
                err.to_string(),
            ),
            SessionError::InvalidIdempotencyKey(_) => Self::new(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidIdempotencyKey,
                err.to_string(),
            ),
            SessionError::IdempotencyKeyReused { .. } => Self::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::IdempotencyKeyReused,
                err.to_string(),
            ),
            SessionError::SteersPending { .. } | SessionError::Busy { .. } => {
                Self::new(StatusCode::CONFLICT, ErrorCode::Busy, err.to_string())
            }
            SessionError::Invalid(_) => Self::new(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidRequest,
                err.to_string(),
            ),
            SessionError::Flow(err) => err.into(),
            SessionError::Rpc(err) => err.into(),
        }
    }
}
