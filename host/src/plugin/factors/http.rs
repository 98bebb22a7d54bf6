//! Outbound HTTP through wasi:http, limited to the component's granted
//! `host:port` authorities. A refused request fails inside the guest with
//! `http-request-denied`; the host remembers it so that a call that then
//! fails can say which request was refused.

use std::sync::{Arc, Mutex};

use wasmtime_wasi_http::{WasiBody, WasiHttpCtx, WasiHttpCtxView, WasiHttpHooks, WasiHttpView};

use super::super::call::CallState;
use super::super::grants::HttpAuthority;

/// Refused requests of one call, as `METHOD scheme://authority` strings.
#[derive(Clone, Default)]
pub struct DeniedRequests(Arc<Mutex<Vec<String>>>);

impl DeniedRequests {
    fn push(&self, request: String) {
        if let Ok(mut denied) = self.0.lock() {
            // A guest retrying in a loop must not grow this without bound.
            if denied.len() < 8 {
                denied.push(request);
            }
        }
    }

    /// What was refused, for an error message; empty when nothing was.
    pub fn describe(&self) -> String {
        match self.0.lock() {
            Ok(denied) if !denied.is_empty() => denied.join(", "),
            _ => String::new(),
        }
    }
}

/// The per-call state of wasi:http.
pub struct HttpState {
    pub(crate) ctx: WasiHttpCtx,
    pub(crate) hooks: AllowListHooks,
}

impl HttpState {
    pub fn new(allowed: Arc<[HttpAuthority]>, component: Arc<str>) -> Self {
        Self {
            ctx: WasiHttpCtx::new(),
            hooks: AllowListHooks {
                allowed,
                component,
                denied: DeniedRequests::default(),
            },
        }
    }

    pub fn denied(&self) -> DeniedRequests {
        self.hooks.denied.clone()
    }
}

/// Sends a request only when its authority is granted.
pub struct AllowListHooks {
    allowed: Arc<[HttpAuthority]>,
    component: Arc<str>,
    denied: DeniedRequests,
}

type SendFuture = Box<
    dyn std::future::Future<
            Output = wasmtime_wasi_http::Result<(
                http::Response<WasiBody>,
                Box<dyn std::future::Future<Output = wasmtime_wasi_http::Result<()>> + Send>,
            )>,
        > + Send,
>;

impl AllowListHooks {
    fn permits(&self, uri: &http::Uri) -> bool {
        let Some(host) = uri.host() else {
            return false;
        };
        let port = uri.port_u16().unwrap_or_else(|| {
            if uri.scheme() == Some(&http::uri::Scheme::HTTP) {
                80
            } else {
                443
            }
        });
        self.allowed.iter().any(|grant| grant.allows(host, port))
    }
}

impl WasiHttpHooks for AllowListHooks {
    fn send_request(
        &mut self,
        request: http::Request<WasiBody>,
        options: Option<wasmtime_wasi_http::RequestOptions>,
        fut: Box<dyn std::future::Future<Output = wasmtime_wasi_http::Result<()>> + Send>,
    ) -> SendFuture {
        if !self.permits(request.uri()) {
            let described = format!("{} {}", request.method(), request.uri());
            tracing::warn!(
                component = %self.component,
                request = %described,
                "outbound HTTP refused: the destination is not granted"
            );
            self.denied.push(described);
            return Box::new(async { Err(wasmtime_wasi_http::Error::HttpRequestDenied) });
        }
        // Granted: the stock sender, with its own connect and TLS handling.
        let _ = fut;
        Box::new(async move {
            use http_body_util::BodyExt;
            let (response, io) = wasmtime_wasi_http::default_send_request(request, options).await?;
            Ok((
                response.map(BodyExt::boxed_unsync),
                Box::new(io) as Box<dyn std::future::Future<Output = _> + Send>,
            ))
        })
    }
}

impl WasiHttpView for CallState {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        let (table, http) = self.table_and_http();
        WasiHttpCtxView {
            ctx: &mut http.ctx,
            table,
            hooks: &mut http.hooks,
        }
    }
}
