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

/// Refused requests kept (and logged) per call; a guest retrying in a loop
/// must grow neither the list nor the log.
const DENIALS_KEPT: usize = 8;

impl DeniedRequests {
    /// Keeps `request`; false when the list is already full.
    fn push(&self, request: String) -> bool {
        match self.0.lock() {
            Ok(mut denied) if denied.len() < DENIALS_KEPT => {
                denied.push(request);
                true
            }
            _ => false,
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
        let mut ctx = WasiHttpCtx::new();
        // Header maps live in host memory; a component with no HTTP grant
        // has no use for large ones.
        ctx.set_field_size_limit(if allowed.is_empty() {
            1 << 10
        } else {
            64 << 10
        });
        Self {
            ctx,
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
        // The sender connects to the whole authority: userinfo would reach
        // the resolver as part of the name.
        if uri.authority().is_none_or(|a| a.as_str().contains('@')) {
            return false;
        }
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
            metrics::counter!(crate::telemetry::GRANTS_REFUSED, "kind" => "http").increment(1);
            let described = format!("{} {}", request.method(), request.uri());
            if self.denied.push(described.clone()) {
                tracing::warn!(
                    component = %self.component,
                    request = %described,
                    "outbound HTTP refused: the destination is not granted"
                );
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn hooks(grants: &[&str]) -> AllowListHooks {
        let allowed: Vec<HttpAuthority> = grants
            .iter()
            .map(|g| HttpAuthority::parse(g).unwrap_or_else(|e| panic!("{e}")))
            .collect();
        AllowListHooks {
            allowed: allowed.into(),
            component: Arc::from("t"),
            denied: DeniedRequests::default(),
        }
    }

    fn permits(hooks: &AllowListHooks, uri: &str) -> bool {
        let uri: http::Uri = uri.parse().unwrap_or_else(|e| panic!("{uri}: {e}"));
        hooks.permits(&uri)
    }

    #[test]
    fn only_the_granted_host_and_port_pass() {
        let h = hooks(&["api.example.com:443", "127.0.0.1:8080", "[::1]:9000"]);
        assert!(permits(&h, "https://api.example.com/v1"));
        assert!(permits(&h, "https://API.Example.COM:443/v1"));
        assert!(permits(&h, "http://127.0.0.1:8080/x"));
        assert!(permits(&h, "http://[::1]:9000/"));
        // Same host, other port or scheme default.
        assert!(!permits(&h, "http://api.example.com/v1"));
        assert!(!permits(&h, "https://api.example.com:8443/"));
        assert!(!permits(&h, "http://127.0.0.1/"));
        // Other names for a granted address are not the grant.
        assert!(!permits(&h, "http://localhost:8080/"));
        assert!(!permits(&h, "https://api.example.com.:443/"));
        assert!(!permits(&h, "https://api.example.com.evil.net/"));
        assert!(!permits(&h, "http://[::2]:9000/"));
        // Userinfo never passes, even before a granted host.
        assert!(!permits(&h, "https://user@api.example.com/"));
        assert!(!permits(&h, "https://api.example.com:443@evil.net/"));
    }

    #[test]
    fn refusals_are_kept_and_logged_only_up_to_a_bound() {
        let denied = DeniedRequests::default();
        let kept = (0..100)
            .filter(|i| denied.push(format!("GET http://x/{i}")))
            .count();
        assert_eq!(kept, DENIALS_KEPT);
        assert!(denied
            .describe()
            .starts_with("GET http://x/0, GET http://x/1"));
    }
}
