//! The HTTP server's accept loop, which keeps slow or idle clients from
//! locking everyone out (Slowloris).
//!
//! `axum::serve` reads request headers for as long as a client likes and
//! accepts connections until `accept` fails for want of file descriptors;
//! a thousand half-sent requests then held the API, `/healthz` included,
//! for as long as the attacker kept them open. Here instead:
//!
//! - every connection must send a request's headers within the header
//!   timeout, counted from when it opens or from the end of its previous
//!   response (so an idle keep-alive connection is bounded too); hyper's
//!   `header_read_timeout` is one deadline for the whole head, so a client
//!   sending a byte a second gains nothing;
//! - a response that the client does not read for the write-stall timeout
//!   closes the connection, so a client that pipelines requests for a public
//!   page and never reads the answers cannot hold it either;
//! - at most `max_connections` connections are served the API at once, sized
//!   below the open-file limit (see [`super::limits`]);
//! - beyond them, a small reserve of connections answers only `GET
//!   /healthz` (anything else gets a 503 `overloaded`), one request each,
//!   with a short header timeout, so that a health check still sees the
//!   process alive while the API is full;
//! - when the reserve is full too, a new connection takes the place of the
//!   reserve's oldest, which is closed. A health checker sends its request
//!   as soon as it connects and is answered within milliseconds, so the
//!   oldest is almost always a connection that sent nothing; an attacker
//!   would have to open a reserve's worth of connections between a
//!   checker's connect and its answer to crowd it out. Accepting always
//!   also keeps the listen queue draining and the descriptors bounded.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Semaphore};
use tokio_io_timeout::TimeoutStream;

use super::limits::{ConnectionLimits, MAX_HEADER_BYTES};
use super::ApiError;

/// How long the accept loop pauses after an accept error other than a
/// client's reset: the usual one is running out of descriptors, which only
/// closing connections cures, and retrying at once would spin.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);
/// What a health-check reserve connection may take beyond its header
/// timeout to get its answer out; after that it is closed whatever it is
/// doing, so a client that never reads cannot keep a reserve slot.
const RESERVE_WRITE_ALLOWANCE: Duration = Duration::from_secs(2);
/// The `Retry-After` (seconds) sent with a 503 `overloaded`.
const RETRY_AFTER_SECONDS: &str = "1";

/// Serves `app` on `listener` within `limits` until `shutdown` resolves;
/// then stops accepting, asks every open connection to finish (each closes
/// after its current response) and returns once all have. Connections that
/// never finish (event streams) keep it waiting: the caller bounds that.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let full = Arc::new(Semaphore::new(limits.max_connections));
    let mut reserve = Reserve::new(limits.health_reserve);
    let api_http = connection_builder(limits.header_timeout, true);
    let health_http = connection_builder(limits.reserve_header_timeout(), false);
    let reserve_lifetime = limits.reserve_header_timeout() + RESERVE_WRITE_ALLOWANCE;
    let health = health_only();
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    // Small writes (an SSE event, a short answer) go out at
                    // once: with Nagle's algorithm one waits for the ACK of
                    // the last, which a client may delay by 40 ms.
                    if let Err(err) = stream.set_nodelay(true) {
                        tracing::debug!(error = %err, "cannot set TCP_NODELAY");
                    }
                    stream
                }
                Err(err) => {
                    accept_error(err).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // The permit is held by the connection's task and freed when it
        // ends, however it ends.
        if let Ok(permit) = full.clone().try_acquire_owned() {
            // Reads need no timeout of their own: the header timeout bounds
            // a head, and a body is read only after the token was checked.
            let mut io = TimeoutStream::new(stream);
            io.set_write_timeout(Some(limits.write_stall_timeout()));
            let io = TokioIo::new(Box::pin(io));
            let service = TowerToHyperService::new(app.clone());
            let connection = graceful.watch(api_http.serve_connection(io, service));
            tokio::spawn(async move {
                if let Err(err) = connection.await {
                    tracing::debug!(error = %err, "an API connection ended with an error");
                }
                drop(permit);
            });
        } else {
            let evicted = reserve.admit();
            let service = TowerToHyperService::new(health.clone());
            let connection =
                graceful.watch(health_http.serve_connection(TokioIo::new(stream), service));
            tokio::spawn(async move {
                // Dropping the connection closes its socket.
                tokio::select! {
                    _ = tokio::time::timeout(reserve_lifetime, connection) => {}
                    _ = evicted => {}
                }
            });
        }
    }
    // New connections are refused from here on.
    drop(listener);
    graceful.shutdown().await;
}

/// HTTP/1.1 (all axum serves here) with a header timeout; keep-alive off
/// for the health-check reserve, so each of its slots serves one request.
fn connection_builder(header_timeout: Duration, keep_alive: bool) -> http1::Builder {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .max_header_size(MAX_HEADER_BYTES)
        .keep_alive(keep_alive);
    builder
}

/// The reserve's application: `/healthz`, and a 503 `overloaded` for
/// everything else.
fn health_only() -> Router {
    Router::new()
        .route("/healthz", get(super::healthz))
        .fallback(overloaded)
        .method_not_allowed_fallback(overloaded)
}

async fn overloaded() -> Response {
    let mut response = ApiError::overloaded().into_response();
    response.headers_mut().insert(
        header::RETRY_AFTER,
        HeaderValue::from_static(RETRY_AFTER_SECONDS),
    );
    response
}

/// The health-check reserve's connections, oldest first, each by the
/// sender that closes it. Only the accept loop touches it, so it needs no
/// lock; a connection that ended by itself is seen by its dropped receiver.
struct Reserve {
    slots: usize,
    live: VecDeque<oneshot::Sender<()>>,
}

impl Reserve {
    fn new(slots: usize) -> Self {
        Self {
            slots: slots.max(1),
            live: VecDeque::new(),
        }
    }

    /// Makes room for one more connection, closing the oldest if the
    /// reserve is full; returns what closes the new one.
    fn admit(&mut self) -> oneshot::Receiver<()> {
        self.live.retain(|close| !close.is_closed());
        while self.live.len() >= self.slots {
            if let Some(oldest) = self.live.pop_front() {
                let _ = oldest.send(());
            }
        }
        let (close, closed) = oneshot::channel();
        self.live.push_back(close);
        closed
    }
}

async fn accept_error(err: std::io::Error) {
    use std::io::ErrorKind;
    // A client that gave up before it was accepted: nothing to do.
    if matches!(
        err.kind(),
        ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset | ErrorKind::ConnectionRefused
    ) {
        return;
    }
    tracing::warn!(error = %err, "cannot accept a connection");
    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
}
