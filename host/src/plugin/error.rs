//! Typed errors of the plugin layer.

use std::path::PathBuf;
use std::time::Duration;

/// Why a component could not be loaded. Loading never panics on bad input.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read component {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("component `{name}` is not a valid WebAssembly component: {reason}")]
    Compile { name: String, reason: String },
    #[error(
        "component `{name}` does not implement world `{world}`: missing export(s) {missing}; it exports {found}"
    )]
    WrongWorld {
        name: String,
        world: &'static str,
        missing: String,
        found: String,
    },
    #[error(
        "component `{name}` was built against dex:agents@{found}, but this host implements \
         dex:agents@{wanted}: rebuild it against the wit/ of this release and activate the new \
         build (docs/guest-authors.md, \"Upgrading a component to a new WIT version\")"
    )]
    WitVersion {
        name: String,
        found: String,
        wanted: &'static str,
    },
    #[error("component `{name}` cannot be linked as `{world}`: {reason}")]
    Link {
        name: String,
        world: &'static str,
        reason: String,
    },
    #[error("component `{name}`: grant is invalid: {reason}")]
    Grant { name: String, reason: String },
    #[error("component `{name}`: limits are invalid: {reason}")]
    Limits { name: String, reason: String },
    #[error("component `{name}`: `list-tools` failed at load: {source}")]
    ListTools {
        name: String,
        #[source]
        source: Box<CallError>,
    },
    #[error("component `{name}`: tool `{tool}`'s parameters schema {source}")]
    ToolSchema {
        name: String,
        tool: String,
        #[source]
        source: super::tool_schema::SchemaError,
    },
}

/// Why a call into a guest produced no result. The guest's own `result`
/// errors are not here: they come back as the export's value.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error(
        "component `{component}`: `{export}` trapped: {reason}{}",
        stderr_suffix(guest_stderr)
    )]
    Trapped {
        component: String,
        export: &'static str,
        reason: String,
        /// What the guest wrote to stderr (a Rust panic message, for example).
        guest_stderr: String,
        /// The guest's own trap (a panic, an uncaught exception, a stack
        /// overflow), as opposed to a host import refusing what it passed
        /// (whose `reason` the host wrote).
        by_guest: bool,
    },
    #[error(
        "component `{component}`: `{export}` ran past its deadline of {timeout:?} and was stopped"
    )]
    TimedOut {
        component: String,
        export: &'static str,
        timeout: Duration,
    },
    #[error("component `{component}`: `{export}` exceeded a limit: {reason}")]
    LimitExceeded {
        component: String,
        export: &'static str,
        reason: String,
    },
    #[error("component `{component}`: cannot start an instance: {reason}")]
    Instantiate { component: String, reason: String },
    /// The call never reached the guest: no instance was free within its
    /// deadline, or its sandbox could not be set up. Nothing of it ran.
    #[error("component `{component}`: `{export}` did not start: {reason}")]
    NotStarted {
        component: String,
        export: &'static str,
        reason: String,
    },
}

impl CallError {
    /// Whether the guest provably did not run (so a single-attempt call
    /// that ends here failed; its outcome is not unknown).
    pub fn never_ran(&self) -> bool {
        matches!(self, CallError::NotStarted { .. })
    }
}

/// The guest's stderr in an error's text, its control characters escaped
/// (`\n`, `\u{1b}`) and nothing else: the text goes to one-line logs, where
/// a guest's line break must not start a line of its own, and to the Step
/// history, which keeps the rest (quotes too) as the guest wrote it.
fn stderr_suffix(stderr: &str) -> String {
    let trimmed = stderr.trim();
    if trimmed.is_empty() {
        return String::new();
    }
    let mut escaped = String::with_capacity(trimmed.len());
    for c in trimmed.chars() {
        if c.is_control() {
            escaped.extend(c.escape_default());
        } else {
            escaped.push(c);
        }
    }
    format!("; guest stderr: {escaped}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_in_an_error_keeps_one_line_and_the_guests_quotes() {
        let suffix = stderr_suffix("Traceback:\n  PermissionError: '/data/x'\r\n\u{1b}[31mred\n");
        assert_eq!(
            suffix,
            "; guest stderr: Traceback:\\n  PermissionError: '/data/x'\\r\\n\\u{1b}[31mred"
        );
        assert!(!suffix.contains('\n'));
        assert_eq!(stderr_suffix("  \n "), "");
    }
}
