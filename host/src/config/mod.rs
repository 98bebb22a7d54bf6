//! `dexa.toml`: where the store is, which components exist and what they may
//! reach, and which agents run them. Parsing checks everything that can be
//! checked without loading a component, and every error names the file and
//! the line.
//!
//! ```toml
//! store = "sqlite:.dexa/dexa.sqlite"      # the default; append
//!                                         # ?synchronous=full to fsync
//!                                         # every commit (power loss)
//! cache_dir = ".dexa/cache/components"    # the default
//! cache_max = "1GiB"                      # the default; least recently
//!                                         # used entries go first
//!
//! [worker]
//! slots = 32
//! lease = "10s"
//!
//! [components.ledger-tool]
//! path = "target/guests/ledger-tool.wasm"
//! dirs = [{ host = ".dexa/ledger", guest = "/ledger", access = "read_write" }]
//! env = ["LEDGER_CURRENCY"]
//! config = { currency = "EUR" }
//! http = ["api.example.com:443"]          # outbound wasi:http allow-list
//! tcp_connect = ["127.0.0.1:5432"]        # raw TCP; none by default
//! limits = { memory = "64MiB", fuel = 5_000_000_000, max_concurrent_calls = 8 }
//!
//! [models.replay]
//! provider = "scripted"
//! responses = "responses.json"
//!
//! [agents.Bookkeeper]
//! runner = "scripted-runner"
//! tools = ["ledger-tool"]
//! model = "replay"
//! tool_policies = { record_payment = { effect = "idempotent_write" } }
//! ```
//!
//! Relative paths are relative to the directory of the config file.

pub mod activate;
mod agents;
pub mod check;
mod components;
pub mod deploy;
pub mod gc;
mod grant_layout;
mod locator;
mod models;
mod parse;
mod raw;
mod values;
pub mod versions;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::flow::WorkerOptions;
use crate::plugin::{ComponentLimits, DirGrant, HttpAuthority};
use crate::providers::RetryPolicy;
use crate::session::AgentSessionOptions;
use crate::store::sqlite::SqliteOptions;
use values::config_dir;

pub use deploy::Deployment;
pub use values::expand_env;

/// The file `dexa` reads when none is given.
pub const DEFAULT_CONFIG_FILE: &str = "dexa.toml";

/// A config problem, with where it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{}: {message}", file.display(), line.map(|l| format!(":{l}:{}", column.unwrap_or(1))).unwrap_or_default())]
pub struct ConfigError {
    pub file: PathBuf,
    /// One-based; none when the problem is not in the text (a missing file).
    pub line: Option<usize>,
    pub column: Option<usize>,
    pub message: String,
}

/// The parsed configuration, with paths resolved.
#[derive(Debug, Clone)]
pub struct DexaConfig {
    pub file: PathBuf,
    pub store: StoreUrl,
    pub cache_dir: PathBuf,
    /// The most bytes of compiled components the cache keeps (`cache_max`).
    pub cache_max_bytes: u64,
    pub worker: WorkerConfig,
    pub components: BTreeMap<String, ComponentConfig>,
    pub models: BTreeMap<String, ModelConfig>,
    pub agents: BTreeMap<String, AgentConfig>,
}

/// Where the flows are stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// `sqlite:PATH[?synchronous=normal|full]`.
    Sqlite(PathBuf, SqliteOptions),
    /// `postgres://USER@HOST[:PORT]/DB[?sslmode=...]`, as written (the
    /// password comes from the environment or a file when the store opens;
    /// see `store::postgres::url`).
    Postgres(String),
}

impl StoreUrl {
    /// The store, for people: its file or its address.
    pub fn describe(&self) -> String {
        match self {
            StoreUrl::Sqlite(path, _) => format!("{} (embedded SQLite)", path.display()),
            StoreUrl::Postgres(url) => format!("{url} (PostgreSQL)"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerConfig {
    pub slots: usize,
    pub lease: Duration,
    pub poll_interval: Duration,
    pub reap_interval: Duration,
    /// How long a stopping worker lets its running Steps finish.
    pub drain: Duration,
}

impl WorkerConfig {
    pub fn options(&self) -> WorkerOptions {
        WorkerOptions {
            max_concurrent_tasks: self.slots,
            lease: self.lease,
            poll_interval: self.poll_interval,
            reap_interval: self.reap_interval,
            drain: self.drain,
            ..WorkerOptions::default()
        }
    }
}

/// Whether a component is an agent's runner or one of its tool components;
/// known from how the agents use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComponentRole {
    Runner,
    Tool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComponentConfig {
    pub name: String,
    pub path: PathBuf,
    pub role: ComponentRole,
    pub dirs: Vec<DirGrant>,
    /// Granted host directories to create when missing.
    pub create_dirs: Vec<PathBuf>,
    /// Names of host environment variables the component may read.
    pub env: Vec<String>,
    pub config: BTreeMap<String, String>,
    /// Where outbound wasi:http requests may go.
    pub http: Vec<HttpAuthority>,
    /// Addresses raw TCP sockets may connect to.
    pub tcp_connect: Vec<std::net::SocketAddr>,
    pub limits: ComponentLimits,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelConfig {
    /// Replays the responses in a JSON file, in order. For tests and offline
    /// demos; it never contacts a model.
    Scripted { responses: PathBuf, repeat: bool },
    /// An OpenAI-compatible chat-completions server.
    OpenAi {
        base_url: String,
        model: String,
        /// The environment variable holding the key; none sends no key.
        api_key_env: Option<String>,
        /// Headers sent with every request, as written: `${VAR}` in a value
        /// is expanded when the provider is made, so that a secret never
        /// sits in the parsed config.
        headers: Vec<(String, String)>,
        /// How a 429 or a 5xx is asked again within one call.
        retry: RetryPolicy,
    },
}

/// Where `provider = "openai"` goes when no `base_url` is given.
pub const OPENAI_BASE_URL: &str = "https://api.openai.com/v1";

#[derive(Debug, Clone, PartialEq)]
pub struct AgentConfig {
    /// The flow type of the agent's sessions.
    pub name: String,
    pub runner: String,
    pub tools: Vec<String>,
    pub model: Option<String>,
    pub options: AgentSessionOptions,
}

impl DexaConfig {
    /// Reads and checks `file`.
    pub fn load(file: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let file = file.as_ref();
        let text = std::fs::read_to_string(file).map_err(|err| ConfigError {
            file: file.to_path_buf(),
            line: None,
            column: None,
            message: format!("cannot read the config file: {err}"),
        })?;
        Self::parse(file, &text)
    }

    /// `.dexa` next to the config file: where generated state (the API
    /// token, remembered chats) lives.
    pub fn local_dir(&self) -> PathBuf {
        config_dir(&self.file).join(".dexa")
    }

    /// The components some agent uses, as its runner or as a tool: what a
    /// worker loads (and `dexa check` checks).
    pub fn used_components(&self) -> Vec<&ComponentConfig> {
        self.components
            .values()
            .filter(|c| {
                self.agents
                    .values()
                    .any(|a| a.runner == c.name || a.tools.contains(&c.name))
            })
            .collect()
    }

    /// An error about this file with no line (found after parsing).
    pub fn error(&self, message: impl Into<String>) -> ConfigError {
        ConfigError {
            file: self.file.clone(),
            line: None,
            column: None,
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::DirAccess;
    use crate::session::{ToolEffect, ToolPolicy};
    use crate::store::sqlite::Synchronous;

    fn parse(text: &str) -> Result<DexaConfig, ConfigError> {
        DexaConfig::parse("/srv/agents/dexa.toml", text)
    }

    const GOOD: &str = r#"
store = "sqlite:data/dexa.sqlite"

[worker]
slots = 4
lease = "2s"

[components.runner]
path = "guests/runner.wasm"
config = { greeting = "hi" }

[components.ledger]
path = "/opt/ledger.wasm"
dirs = [{ host = "ledger", guest = "/ledger", access = "read_write" }]
env = ["CURRENCY"]

[models.replay]
provider = "scripted"
responses = "replay.json"

[agents.Bookkeeper]
runner = "runner"
tools = ["ledger"]
model = "replay"
default_effect = "read"
interrupt_deadline = "1h"
tool_policies = { pay = { effect = "non_idempotent_write", requires_approval = false } }
"#;

    #[test]
    fn a_good_config_resolves_paths_against_its_directory() {
        let config = parse(GOOD).unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(
            config.store,
            StoreUrl::Sqlite(
                "/srv/agents/data/dexa.sqlite".into(),
                SqliteOptions::default()
            )
        );
        assert_eq!(
            config.cache_dir,
            PathBuf::from("/srv/agents/.dexa/cache/components")
        );
        assert_eq!(config.worker.slots, 4);
        assert_eq!(config.worker.lease, Duration::from_secs(2));
        let ledger = &config.components["ledger"];
        assert_eq!(ledger.role, ComponentRole::Tool);
        assert_eq!(ledger.path, PathBuf::from("/opt/ledger.wasm"));
        assert_eq!(
            ledger.dirs[0].host_path,
            PathBuf::from("/srv/agents/ledger")
        );
        assert_eq!(ledger.dirs[0].access, DirAccess::ReadWrite);
        assert_eq!(ledger.env, vec!["CURRENCY".to_string()]);
        assert_eq!(config.components["runner"].role, ComponentRole::Runner);
        let agent = &config.agents["Bookkeeper"];
        assert_eq!(agent.options.default_tool_effect, ToolEffect::Read);
        assert_eq!(
            agent.options.interrupt_deadline,
            Some(Duration::from_secs(3600))
        );
        assert_eq!(
            agent.options.tool_policies["pay"],
            ToolPolicy::new(ToolEffect::NonIdempotentWrite).requires_approval(false)
        );
        assert_eq!(agent.model.as_deref(), Some("replay"));
    }

    #[test]
    fn grants_and_limits_parse_with_units_and_defaults() {
        let text = r#"
[components.t]
path = "t.wasm"
http = ["API.example.com:443", "[::1]:8080"]
tcp_connect = ["127.0.0.1:5432"]
limits = { memory = "64MiB", fuel = 1_000, max_concurrent_calls = 2, output = 4096, run_state = "2KiB" }
"#;
        let config = parse(text).unwrap_or_else(|err| panic!("{err}"));
        let tool = &config.components["t"];
        assert_eq!(
            tool.http,
            vec![
                HttpAuthority::parse("api.example.com:443").unwrap_or_else(|e| panic!("{e}")),
                HttpAuthority::parse("[::1]:8080").unwrap_or_else(|e| panic!("{e}")),
            ]
        );
        assert!(tool.http[0].allows("api.EXAMPLE.com", 443));
        assert!(!tool.http[0].allows("api.example.com", 80));
        assert!(tool.http[1].allows("[::1]", 8080));
        assert_eq!(
            tool.tcp_connect,
            vec!["127.0.0.1:5432".parse().unwrap_or_else(|e| panic!("{e}"))]
        );
        let defaults = ComponentLimits::default();
        assert_eq!(
            tool.limits,
            ComponentLimits {
                memory_bytes: 64 << 20,
                fuel: Some(1000),
                max_concurrent_calls: 2,
                output_bytes: 4096,
                run_state_bytes: 2048,
                ..defaults.clone()
            }
        );
        let bare =
            parse("[components.b]\npath = \"b.wasm\"\n").unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(bare.components["b"].limits, defaults);
        assert!(bare.components["b"].http.is_empty());
    }

    #[test]
    fn an_empty_config_has_defaults() {
        let config = parse("").unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(
            config.store,
            StoreUrl::Sqlite(
                "/srv/agents/.dexa/dexa.sqlite".into(),
                SqliteOptions::default()
            )
        );
        assert!(config.agents.is_empty());
        assert_eq!(
            config.worker.slots,
            WorkerOptions::default().max_concurrent_tasks
        );
        assert_eq!(config.cache_max_bytes, 1 << 30);
        let bounded = parse("cache_max = \"64MiB\"\n").unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(bounded.cache_max_bytes, 64 << 20);
    }

    /// Each bad config names the file, the line and the problem.
    #[test]
    fn the_store_url_sets_sqlite_durability_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
        let file = dir.path().join("dexa.toml");
        for (url, synchronous) in [
            ("sqlite:db.sqlite", Synchronous::Normal),
            ("sqlite:db.sqlite?synchronous=full", Synchronous::Full),
            ("sqlite://db.sqlite?synchronous=NORMAL", Synchronous::Normal),
        ] {
            std::fs::write(&file, format!("store = {url:?}\n"))
                .unwrap_or_else(|err| panic!("{err}"));
            let config = DexaConfig::load(&file).unwrap_or_else(|err| panic!("{url}: {err}"));
            let StoreUrl::Sqlite(path, options) = config.store else {
                panic!("{url} is not a SQLite store");
            };
            assert_eq!(
                path,
                dir.path().join("db.sqlite"),
                "{url}: the path has no query"
            );
            assert_eq!(options.synchronous, synchronous, "{url}");
        }
    }

    /// A `postgres://` store is kept as written; its password is never in it.
    #[test]
    fn a_postgres_store_is_kept_as_written() {
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("{err}"));
        let file = dir.path().join("dexa.toml");
        let url = "postgres://dexa@db.internal:5432/dexa?sslmode=require&password_env=DEXA_DB_PW";
        std::fs::write(&file, format!("store = {url:?}\n")).unwrap_or_else(|err| panic!("{err}"));
        let config = DexaConfig::load(&file).unwrap_or_else(|err| panic!("{url}: {err}"));
        assert_eq!(config.store, StoreUrl::Postgres(url.to_string()));
        assert_eq!(config.store.describe(), format!("{url} (PostgreSQL)"));
    }

    #[test]
    fn bad_configs_name_the_file_the_line_and_the_problem() {
        // Shared with `dexa check`'s test (tests/tests/config.rs).
        let fixture = include_str!("../../../tests/fixtures/bad-configs.txt");
        let cases: Vec<(String, usize, String)> = fixture
            .split("\n### ")
            .skip(1)
            .map(|case| {
                let (header, body) = case.split_once('\n').unwrap_or((case, ""));
                let (line, needle) = header.split_once(' ').unwrap_or((header, ""));
                let line = line.parse().unwrap_or_else(|err| panic!("{header}: {err}"));
                let body = format!("{}\n", body.trim_end_matches('\n'));
                (body, line, needle.to_string())
            })
            .collect();
        assert_eq!(cases.len(), 39, "the fixture's cases");
        for (text, line, needle) in &cases {
            let err = match parse(text) {
                Ok(_) => panic!("accepted:\n{text}"),
                Err(err) => err,
            };
            assert_eq!(err.file, PathBuf::from("/srv/agents/dexa.toml"), "{text}");
            assert_eq!(err.line, Some(*line), "{text}\n=> {err}");
            assert!(err.message.contains(needle.as_str()), "{text}\n=> {err}");
            let shown = err.to_string();
            assert!(
                shown.starts_with(&format!("/srv/agents/dexa.toml:{line}:")),
                "{shown}"
            );
        }
    }

    /// The example in the README is a valid config.
    #[test]
    fn the_readme_example_parses() {
        let readme = include_str!("../../../README.md");
        let section = readme
            .split("## Configuration: `dexa.toml`")
            .nth(1)
            .unwrap_or_else(|| panic!("README has no configuration section"));
        let example = section
            .split("```toml\n")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .unwrap_or_else(|| panic!("the configuration section has no toml block"));
        let config = parse(example).unwrap_or_else(|err| panic!("{err}"));
        let agent = &config.agents["Bookkeeper"];
        assert_eq!(agent.tools, vec!["ledger-tool".to_string()]);
        assert_eq!(
            agent.options.tool_policies["record_payment"],
            ToolPolicy::new(ToolEffect::IdempotentWrite).requires_approval(false)
        );
    }

    #[test]
    fn environment_references_expand_with_defaults() {
        // PATH and HOME are set in any test environment; the other is not.
        let path = std::env::var("PATH").unwrap_or_default();
        assert_eq!(expand_env("a-${PATH}-b"), Ok(format!("a-{path}-b")));
        assert_eq!(
            expand_env("${DEXA_SURELY_UNSET_VAR:-replay}"),
            Ok("replay".to_string())
        );
        assert_eq!(expand_env("plain"), Ok("plain".to_string()));
        let err = expand_env("${DEXA_SURELY_UNSET_VAR}").unwrap_err();
        assert!(
            err.contains("DEXA_SURELY_UNSET_VAR, which is not set"),
            "{err}"
        );
        assert!(expand_env("${oops").is_err());
        assert!(expand_env("${bad name}").is_err());
        let config = parse(
            "[components.r]\npath = \"r.wasm\"\n[models.replay]\nprovider = \"scripted\"\nresponses = \"x.json\"\n\
             [agents.A]\nrunner = \"r\"\nmodel = \"${DEXA_SURELY_UNSET_VAR:-replay}\"\n",
        )
        .unwrap_or_else(|err| panic!("{err}"));
        assert_eq!(config.agents["A"].model.as_deref(), Some("replay"));
    }

    #[test]
    fn a_missing_file_is_named() {
        let err = match DexaConfig::load("/nonexistent/dexa.toml") {
            Ok(_) => panic!("loaded a missing file"),
            Err(err) => err,
        };
        assert!(
            err.to_string()
                .starts_with("/nonexistent/dexa.toml: cannot read"),
            "{err}"
        );
    }
}
