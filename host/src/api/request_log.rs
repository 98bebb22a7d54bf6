//! Request ids and request logs (tower-http): every answer carries an
//! `x-request-id` (the client's, or a new UUID), and every request is one
//! `INFO` log line with its method, path, id, status and latency, at the
//! end of the answer's head. Headers and queries are not logged (tokens).

use axum::extract::Request;
use axum::Router;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;

/// The header that carries a request's id.
pub const REQUEST_ID: &str = "x-request-id";

/// `router` with request ids and request logs around it.
pub(super) fn around(router: Router) -> Router {
    router
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(|request: &Request| {
                    let id = request
                        .headers()
                        .get(REQUEST_ID)
                        .and_then(|id| id.to_str().ok())
                        .unwrap_or("");
                    tracing::info_span!(
                        "request",
                        method = %request.method(),
                        path = %request.uri().path(),
                        request_id = %id,
                    )
                })
                .on_response(DefaultOnResponse::new().level(Level::INFO)),
        )
        // Outermost: the id is set before the log's span reads it, and
        // copied to the answer.
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
}
