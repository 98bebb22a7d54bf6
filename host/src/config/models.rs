//! `[models.NAME]`: the scripted provider (tests, offline demos) and
//! OpenAI-compatible servers, with their headers and retry settings.

use std::collections::BTreeMap;
use std::time::Duration;

use super::locator::{check_name, Locator};
use super::parse::Paths;
use super::raw::{RawConfig, RawModel};
use super::values::expand_env;
use super::{ConfigError, ModelConfig, OPENAI_BASE_URL};
use crate::providers::RetryPolicy;

/// The most retries a model may make within one call.
const MAX_MODEL_RETRIES: u32 = 10;

/// Headers the provider sets itself or that frame the request.
const RESERVED_HEADERS: [&str; 6] = [
    "content-type",
    "content-length",
    "transfer-encoding",
    "host",
    "connection",
    "accept",
];

/// Refuses headers a request could not carry or that would be dropped or
/// break it: an invalid name or value, one the provider sets itself, a
/// name given twice (names are case-insensitive), and `authorization`
/// beside `api_key_env`. A value is checked as written; its `${VAR}`s are
/// expanded when the provider is made.
fn check_headers(headers: &BTreeMap<String, String>, has_key: bool) -> Result<(), String> {
    let mut seen = std::collections::BTreeSet::new();
    for (name, value) in headers {
        let parsed = reqwest::header::HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("{name:?} is not a valid header name"))?;
        if RESERVED_HEADERS.contains(&parsed.as_str()) {
            return Err(format!("header {name:?} is set by the provider itself"));
        }
        if parsed == reqwest::header::AUTHORIZATION && has_key {
            return Err(
                "header \"authorization\" and api_key_env both set it; keep one".to_string(),
            );
        }
        if !seen.insert(parsed.as_str().to_string()) {
            return Err(format!("header {name:?} is given twice"));
        }
        reqwest::header::HeaderValue::from_str(value)
            .map_err(|_| format!("header {name}: its value is not a valid header value"))?;
    }
    Ok(())
}

/// Every model of the file.
pub(super) fn models(
    raw: &RawConfig,
    paths: &Paths,
    loc: &Locator<'_>,
) -> Result<BTreeMap<String, ModelConfig>, ConfigError> {
    let mut models = BTreeMap::new();
    for (name, model) in &raw.models {
        check_name(name, "model").map_err(|m| loc.at(model.span(), m))?;
        // Tagged enums lose their fields' spans: errors point at the table.
        let at = |message: String| loc.at(model.span(), format!("model {name:?}: {message}"));
        let config = match model.get_ref() {
            RawModel::Scripted { responses, repeat } => ModelConfig::Scripted {
                responses: paths.resolve(responses),
                repeat: *repeat,
            },
            RawModel::Openai {
                base_url,
                model: model_name,
                api_key_env,
                headers,
                retries,
                max_retry_wait,
            } => {
                let base_url =
                    expand_env(base_url.as_deref().unwrap_or(OPENAI_BASE_URL)).map_err(&at)?;
                let model_name = expand_env(model_name).map_err(&at)?;
                if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
                    return Err(at(format!(
                        "base_url {base_url:?} must start with http:// or https://"
                    )));
                }
                if model_name.trim().is_empty() {
                    return Err(at("model is empty".to_string()));
                }
                // Expanded only where the provider is made (a worker), so
                // that clients of the same file need not hold the secret.
                check_headers(headers, api_key_env.is_some()).map_err(&at)?;
                let retry = retry_policy(*retries, max_retry_wait.as_deref()).map_err(&at)?;
                ModelConfig::OpenAi {
                    base_url,
                    model: model_name,
                    api_key_env: api_key_env.clone(),
                    headers: headers
                        .iter()
                        .map(|(n, v)| (n.clone(), v.clone()))
                        .collect(),
                    retry,
                }
            }
        };
        models.insert(name.clone(), config);
    }
    Ok(models)
}

/// `retries` (at most [`MAX_MODEL_RETRIES`]) and `max_retry_wait` (at
/// least 1 s), over the defaults.
fn retry_policy(retries: Option<u32>, max_wait: Option<&str>) -> Result<RetryPolicy, String> {
    let mut retry = RetryPolicy::default();
    if let Some(retries) = retries {
        if retries > MAX_MODEL_RETRIES {
            return Err(format!("retries is at most {MAX_MODEL_RETRIES}"));
        }
        retry.retries = retries;
    }
    if let Some(wait) = max_wait {
        retry.max_wait = humantime::parse_duration(wait).map_err(|err| {
            format!("max_retry_wait: {wait:?} is not a duration like \"30s\": {err}")
        })?;
        if retry.max_wait < Duration::from_secs(1) {
            return Err(
                "max_retry_wait is at least 1s (retries = 0 turns retries off)".to_string(),
            );
        }
    }
    Ok(retry)
}
