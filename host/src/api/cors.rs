//! CORS: off unless origins are given (`dexa serve --cors-origin`). Off, no
//! answer carries `access-control-allow-origin`, so a browser page of
//! another origin cannot read the API; on, the listed origins (or any, with
//! `*`) may call it with the bearer token, which a page must hold itself
//! (no cookies are used, so none are allowed).

use std::time::Duration;

use axum::http::{header, HeaderName, HeaderValue, Method};
use tower_http::cors::{AllowOrigin, CorsLayer};

/// How long a browser may keep a preflight's answer.
const PREFLIGHT_MAX_AGE: Duration = Duration::from_secs(600);

/// The origins a browser page may call the API from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum CorsOrigins {
    /// No cross-origin reads (the default).
    #[default]
    Off,
    /// Any origin (`*`).
    Any,
    /// These origins, exactly (`https://app.example.com`).
    List(Vec<HeaderValue>),
}

impl CorsOrigins {
    /// From `--cors-origin` values: each `*` or `scheme://host[:port]`,
    /// with no path. A bad one is an error that names it.
    pub fn parse(origins: &[String]) -> Result<Self, String> {
        if origins.is_empty() {
            return Ok(Self::Off);
        }
        if origins.iter().any(|origin| origin == "*") {
            if origins.len() > 1 {
                return Err("--cors-origin '*' allows every origin; give it alone".into());
            }
            return Ok(Self::Any);
        }
        let mut list = Vec::with_capacity(origins.len());
        for origin in origins {
            let (scheme, rest) = origin.split_once("://").ok_or_else(|| {
                format!("--cors-origin {origin:?}: write an origin like https://app.example.com")
            })?;
            let plain = |c: char| c.is_ascii_alphanumeric() || "-.:[]".contains(c);
            if !matches!(scheme, "http" | "https") || rest.is_empty() || !rest.chars().all(plain) {
                return Err(format!(
                    "--cors-origin {origin:?}: an origin is http(s)://host[:port], with no path"
                ));
            }
            list.push(
                HeaderValue::from_str(origin)
                    .map_err(|_| format!("--cors-origin {origin:?} is not a header value"))?,
            );
        }
        Ok(Self::List(list))
    }

    /// The layer, when CORS is on.
    pub(super) fn layer(&self) -> Option<CorsLayer> {
        let origins = match self {
            Self::Off => return None,
            Self::Any => AllowOrigin::any(),
            Self::List(list) => AllowOrigin::list(list.iter().cloned()),
        };
        Some(
            CorsLayer::new()
                .allow_origin(origins)
                .allow_methods([Method::GET, Method::POST])
                .allow_headers([
                    header::AUTHORIZATION,
                    header::CONTENT_TYPE,
                    HeaderName::from_static("idempotency-key"),
                    HeaderName::from_static("last-event-id"),
                    HeaderName::from_static("traceparent"),
                    HeaderName::from_static(super::request_log::REQUEST_ID),
                ])
                .expose_headers([
                    header::RETRY_AFTER,
                    HeaderName::from_static(super::request_log::REQUEST_ID),
                ])
                .max_age(PREFLIGHT_MAX_AGE),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_parse_strictly() {
        assert_eq!(CorsOrigins::parse(&[]), Ok(CorsOrigins::Off));
        assert_eq!(CorsOrigins::parse(&["*".into()]), Ok(CorsOrigins::Any));
        assert!(matches!(
            CorsOrigins::parse(&["https://app.example.com".into(), "http://127.0.0.1:3000".into()]),
            Ok(CorsOrigins::List(list)) if list.len() == 2
        ));
        for bad in [
            "app.example.com",
            "https://app.example.com/path",
            "ftp://x",
            "https://",
            "https://a b",
            "https://x\r\n",
        ] {
            assert!(CorsOrigins::parse(&[bad.to_string()]).is_err(), "{bad:?}");
        }
        assert!(CorsOrigins::parse(&["*".into(), "https://a".into()]).is_err());
    }
}
