//! Values with a syntax of their own: `${VAR}` references, store
//! addresses, and where relative paths start.

use std::path::{Path, PathBuf};

use crate::store::sqlite::SqliteOptions;

/// Expands `${NAME}` and `${NAME:-default}` from the environment, so that
/// one file can switch models by environment (`model = "${DEXA_MODEL:-replay}"`).
pub fn expand_env(value: &str) -> Result<String, String> {
    let mut out = String::with_capacity(value.len());
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("{value:?}: `${{` without a closing `}}`"))?;
        let inner = &after[..end];
        let (name, default) = match inner.split_once(":-") {
            Some((name, default)) => (name, Some(default)),
            None => (inner, None),
        };
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!(
                "{value:?}: {name:?} is not an environment variable name"
            ));
        }
        match (std::env::var(name).ok().filter(|v| !v.is_empty()), default) {
            (Some(set), _) => out.push_str(&set),
            (None, Some(default)) => out.push_str(default),
            (None, None) => {
                return Err(format!(
                    "{value:?} needs the environment variable {name}, which is not set"
                ))
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The directory relative paths in `file` are relative to.
pub(super) fn config_dir(file: &Path) -> PathBuf {
    file.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf()
}

pub(super) fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// `sqlite:PATH`, `sqlite://PATH` or a bare path, with optional parameters
/// after `?`: only `synchronous=normal|full`; any other is refused, so that
/// a mistyped setting never silently becomes part of the file name.
pub(super) fn parse_store_url(url: &str) -> Result<(String, SqliteOptions), String> {
    let (url, query) = match url.split_once('?') {
        Some((url, query)) => (url, Some(query)),
        None => (url, None),
    };
    let mut options = SqliteOptions::default();
    for pair in query.into_iter().flat_map(|q| q.split('&')) {
        match pair.split_once('=') {
            Some(("synchronous", value)) => {
                options.synchronous = value
                    .parse()
                    .map_err(|err| format!("store {url:?}: {err}"))?;
            }
            _ => {
                return Err(format!(
                    "store {url:?}: unknown parameter {pair:?}; a SQLite store takes only synchronous=normal|full"
                ))
            }
        }
    }
    let path = parse_store_path(url)?;
    Ok((path, options))
}

fn parse_store_path(url: &str) -> Result<String, String> {
    let path = if let Some(rest) = url.strip_prefix("sqlite://") {
        rest
    } else if let Some(rest) = url.strip_prefix("sqlite:") {
        rest
    } else if url.contains("://") {
        return Err(format!(
            "store {url:?}: unknown scheme; use sqlite:PATH (for example sqlite:.dexa/dexa.sqlite)"
        ));
    } else {
        url
    };
    if path.is_empty() {
        return Err("store: the SQLite path is empty".to_string());
    }
    Ok(path.to_string())
}
