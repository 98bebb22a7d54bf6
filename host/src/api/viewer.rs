//! The web viewer: one static page (`viewer.html`) that calls the API with
//! the token the user pastes (kept in the browser's localStorage).
//!
//! Everything it shows (messages, tool names, arguments, outputs, event
//! payloads, session ids) comes from guests and users, so the page builds
//! its DOM with text nodes and `setAttribute` only, never markup from data.
//! As a second layer it is served with a strict Content-Security-Policy:
//! only its own inline script and style run (by SHA-256), it may only talk
//! to its own origin, it loads nothing else, and Trusted Types forbid
//! string-to-HTML sinks such as `innerHTML`. An injected `<script>`,
//! `<img onerror>` or `javascript:` URL would not run even if some future
//! change let markup through.

use std::sync::LazyLock;

use axum::http::header;
use axum::response::{Html, IntoResponse, Response};
use base64::Engine as _;
use sha2::{Digest, Sha256};

/// The viewer's page.
const PAGE: &str = include_str!("viewer.html");

/// The page's Content-Security-Policy, made once from the page itself so
/// that the hashes always match what is served.
static POLICY: LazyLock<String> = LazyLock::new(|| policy(PAGE));

/// The text between `<tag>` and `</tag>`, exactly as the browser hashes it.
fn inline<'a>(page: &'a str, tag: &str) -> &'a str {
    let open = format!("<{tag}>");
    let close = format!("</{tag}>");
    page.split_once(&open)
        .and_then(|(_, rest)| rest.split_once(&close))
        .map_or("", |(inside, _)| inside)
}

/// CSP's `'sha256-...'` source for `text`.
fn hash_source(text: &str) -> String {
    let digest = Sha256::digest(text.as_bytes());
    format!(
        "'sha256-{}'",
        base64::engine::general_purpose::STANDARD.encode(digest)
    )
}

fn policy(page: &str) -> String {
    format!(
        "default-src 'none'; script-src {script}; style-src {style}; connect-src 'self'; \
         base-uri 'none'; form-action 'none'; frame-ancestors 'none'; \
         require-trusted-types-for 'script'; trusted-types 'none'",
        script = hash_source(inline(page, "script")),
        style = hash_source(inline(page, "style")),
    )
}

/// `GET /`: the page, with its security headers.
pub(crate) async fn page() -> Response {
    (
        [
            (header::CONTENT_SECURITY_POLICY, POLICY.as_str()),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::X_FRAME_OPTIONS, "DENY"),
        ],
        Html(PAGE),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_allows_exactly_the_page_s_one_script_and_one_style() {
        // The policy names one script and one style: a second inline block,
        // or an inline handler or style attribute, would not run.
        assert_eq!(PAGE.matches("<script").count(), 1);
        assert_eq!(PAGE.matches("<style").count(), 1);
        assert!(!PAGE.contains(" style="), "no inline style attributes");
        assert!(!inline(PAGE, "script").is_empty());
        assert!(!inline(PAGE, "style").is_empty());
        let policy = policy(PAGE);
        assert!(policy.contains(&hash_source(inline(PAGE, "script"))));
        assert!(!policy.contains("unsafe"), "{policy}");
    }
}
