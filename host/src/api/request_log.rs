//! Request ids and request logs (tower-http): every answer carries an
//! `x-request-id` (the client's, when it is a short plain token, else a new
//! UUID), and every request is one `INFO` log line with its method, path,
//! id, status and latency, at the end of the answer's head. Headers and
//! queries are not logged (tokens).

use axum::extract::Request;
use axum::http::HeaderValue;
use axum::Router;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;

/// The header that carries a request's id.
pub const REQUEST_ID: &str = "x-request-id";

/// The longest request id taken from a client.
const MAX_CLIENT_ID: usize = 128;

/// Whether a client's request id may be kept (logged with every line of
/// the request, and echoed): at most [`MAX_CLIENT_ID`] letters, digits and
/// `.`, `_`, `:`, `-`.
fn usable(id: &HeaderValue) -> bool {
    let bytes = id.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= MAX_CLIENT_ID
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(b))
}

/// Drops a client's request id that is not [`usable`] (or is given more
/// than once), so that a new one is made.
async fn drop_unusable_id(mut request: Request) -> Request {
    let mut ids = request.headers().get_all(REQUEST_ID).iter();
    let keep = matches!((ids.next(), ids.next()), (Some(id), None) if usable(id));
    if !keep {
        request.headers_mut().remove(REQUEST_ID);
    }
    request
}

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
        .layer(axum::middleware::map_request(drop_unusable_id))
}
