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
pub mod check;
pub mod deploy;
pub mod gc;
mod grant_layout;
pub mod versions;

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use crate::flow::WorkerOptions;
use crate::plugin::{ComponentLimits, DirAccess, DirGrant, HttpAuthority};
use crate::providers::RetryPolicy;
use crate::session::{AgentSessionOptions, ToolEffect, ToolPolicy, TurnLimits};
use crate::store::sqlite::SqliteOptions;

pub use deploy::Deployment;

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

// ---- the file's shape -------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    store: Option<Spanned<String>>,
    cache_dir: Option<String>,
    #[serde(default)]
    worker: RawWorker,
    #[serde(default)]
    components: BTreeMap<String, Spanned<RawComponent>>,
    #[serde(default)]
    models: BTreeMap<String, Spanned<RawModel>>,
    #[serde(default)]
    agents: BTreeMap<String, Spanned<RawAgent>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawWorker {
    slots: Option<Spanned<usize>>,
    lease: Option<Spanned<String>>,
    poll_interval: Option<Spanned<String>>,
    reap_interval: Option<Spanned<String>>,
    drain: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawComponent {
    path: Spanned<String>,
    #[serde(default)]
    dirs: Vec<Spanned<RawDir>>,
    #[serde(default)]
    env: Vec<Spanned<String>>,
    #[serde(default)]
    config: BTreeMap<String, String>,
    #[serde(default)]
    http: Vec<Spanned<String>>,
    #[serde(default)]
    tcp_connect: Vec<Spanned<String>>,
    #[serde(default)]
    limits: RawLimits,
}

/// `[components.NAME.limits]`; sizes are bytes or strings like "64MiB".
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    memory: Option<Spanned<ByteSize>>,
    table_elements: Option<Spanned<u64>>,
    instances: Option<Spanned<u64>>,
    fuel: Option<Spanned<u64>>,
    max_concurrent_calls: Option<Spanned<u64>>,
    output: Option<Spanned<ByteSize>>,
    run_state: Option<Spanned<ByteSize>>,
    events_per_call: Option<Spanned<ByteSize>>,
    host_handles: Option<Spanned<u64>>,
}

#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "a size: a whole number of bytes, or a string like \"64MiB\""
)]
enum ByteSize {
    Bytes(u64),
    Text(String),
}

impl ByteSize {
    fn bytes(&self) -> Result<u64, String> {
        let text = match self {
            ByteSize::Bytes(n) => return Ok(*n),
            ByteSize::Text(text) => text.trim(),
        };
        let split = text
            .find(|c: char| !c.is_ascii_digit() && c != '_')
            .unwrap_or(text.len());
        let (number, unit) = text.split_at(split);
        let number: u64 = number
            .replace('_', "")
            .parse()
            .map_err(|_| format!("{text:?} is not a size like 65536 or \"64MiB\""))?;
        let scale: u64 = match unit.trim() {
            "" | "B" => 1,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            other => {
                return Err(format!(
                    "{text:?}: unknown unit {other:?}; use B, KiB, MiB or GiB"
                ))
            }
        };
        number
            .checked_mul(scale)
            .ok_or_else(|| format!("{text:?} is too large"))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDir {
    host: String,
    guest: String,
    #[serde(default = "read_only")]
    access: DirAccess,
    /// Create the host directory when it is missing.
    #[serde(default)]
    create: bool,
    /// May overlap other components' grants (both must say so).
    #[serde(default)]
    shared: bool,
}

fn read_only() -> DirAccess {
    DirAccess::ReadOnly
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, tag = "provider", rename_all = "snake_case")]
enum RawModel {
    Scripted {
        responses: String,
        #[serde(default)]
        repeat: bool,
    },
    Openai {
        base_url: Option<String>,
        model: String,
        api_key_env: Option<String>,
        #[serde(default)]
        headers: BTreeMap<String, String>,
        retries: Option<u32>,
        // Not `Spanned`: serde buffers a tagged enum's fields, which loses
        // spans; errors point at the model's table.
        max_retry_wait: Option<String>,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAgent {
    runner: Spanned<String>,
    #[serde(default)]
    tools: Vec<Spanned<String>>,
    model: Option<Spanned<String>>,
    #[serde(default)]
    tool_policies: BTreeMap<String, ToolPolicy>,
    default_effect: Option<ToolEffect>,
    interrupt_deadline: Option<Spanned<String>>,
    events_capacity: Option<Spanned<u64>>,
    tool_attempt_timeout: Option<Spanned<String>>,
    model_step_timeout: Option<Spanned<String>>,
    turn_limits: Option<RawTurnLimits>,
}

/// `turn_limits = { tool_calls = 256, messages = 1024, tool_output = "512KiB" }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTurnLimits {
    tool_calls: Option<Spanned<u32>>,
    messages: Option<Spanned<u32>>,
    tool_output: Option<Spanned<ByteSize>>,
}

// ---- parsing ------------------------------------------------------------------

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

    /// Checks `text` as the contents of `file` (which anchors relative paths).
    pub fn parse(file: impl AsRef<Path>, text: &str) -> Result<Self, ConfigError> {
        let file = file.as_ref();
        let base = config_dir(file);
        let loc = Locator { file, text };
        let raw: RawConfig = toml::from_str(text)
            .map_err(|err| loc.at(err.span().unwrap_or(0..0), err.message().trim().to_string()))?;
        let resolve = |path: &str| -> PathBuf {
            let path = Path::new(path);
            if path.is_absolute() {
                path.to_path_buf()
            } else {
                base.join(path)
            }
        };

        let store = match &raw.store {
            None => StoreUrl::Sqlite(
                base.join(".dexa").join("dexa.sqlite"),
                SqliteOptions::default(),
            ),
            Some(url) if is_postgres(url.get_ref()) => {
                // Checked now, for an error at the line; the password is read
                // when the store opens.
                crate::store::postgres::PostgresUrl::parse_with(url.get_ref(), |_| {
                    Some(String::new())
                })
                .map_err(|message| loc.at(url.span(), message))?;
                StoreUrl::Postgres(url.get_ref().clone())
            }
            Some(url) => parse_store_url(url.get_ref())
                .map(|(path, options)| StoreUrl::Sqlite(resolve(&path), options))
                .map_err(|message| loc.at(url.span(), message))?,
        };
        let cache_dir = resolve(raw.cache_dir.as_deref().unwrap_or(".dexa/cache/components"));

        let defaults = WorkerOptions::default();
        let worker = WorkerConfig {
            slots: match &raw.worker.slots {
                Some(slots) if *slots.get_ref() == 0 => {
                    return Err(loc.at(slots.span(), "worker.slots must be at least 1".into()))
                }
                Some(slots) => *slots.get_ref(),
                None => defaults.max_concurrent_tasks,
            },
            lease: loc.positive(&raw.worker.lease, "worker.lease", defaults.lease)?,
            poll_interval: loc.positive(
                &raw.worker.poll_interval,
                "worker.poll_interval",
                defaults.poll_interval,
            )?,
            reap_interval: loc.positive(
                &raw.worker.reap_interval,
                "worker.reap_interval",
                defaults.reap_interval,
            )?,
            drain: match &raw.worker.drain {
                Some(drain) => loc.duration(drain, "worker.drain")?,
                None => defaults.drain,
            },
        };

        // Roles come from the agents; a component used both ways is refused.
        let mut roles: BTreeMap<&str, (ComponentRole, Range<usize>)> = BTreeMap::new();
        let mut claim = |name: &Spanned<String>, role: ComponentRole| -> Result<(), ConfigError> {
            if !raw.components.contains_key(name.get_ref().as_str()) {
                return Err(loc.at(
                    name.span(),
                    format!(
                        "there is no component {:?}; the components are {}",
                        name.get_ref(),
                        names(raw.components.keys())
                    ),
                ));
            }
            match roles.get(name.get_ref().as_str()) {
                Some((existing, _)) if *existing != role => Err(loc.at(
                    name.span(),
                    format!(
                        "component {:?} is used both as a runner and as a tool component",
                        name.get_ref()
                    ),
                )),
                _ => {
                    roles.insert(
                        raw.components
                            .get_key_value(name.get_ref().as_str())
                            .map(|(k, _)| k.as_str())
                            .unwrap_or_default(),
                        (role, name.span()),
                    );
                    Ok(())
                }
            }
        };
        for agent in raw.agents.values() {
            let agent = agent.get_ref();
            claim(&agent.runner, ComponentRole::Runner)?;
            for tool in &agent.tools {
                // A tool component's name is its role in the activation
                // log, where `runner` is the runner's.
                if tool.get_ref() == crate::catalog::RUNNER_ROLE {
                    return Err(loc.at(
                        tool.span(),
                        "a tool component may not be named \"runner\": that name is the runner's \
                         role in the activation log (rename the component)"
                            .to_string(),
                    ));
                }
                claim(tool, ComponentRole::Tool)?;
            }
        }

        let mut components = BTreeMap::new();
        for (name, component) in &raw.components {
            check_name(name, "component").map_err(|m| loc.at(component.span(), m))?;
            let raw_component = component.get_ref();
            let mut dirs = Vec::new();
            let mut create_dirs = Vec::new();
            for dir in &raw_component.dirs {
                let grant = dir.get_ref();
                if !grant.guest.starts_with('/') {
                    return Err(loc.at(
                        dir.span(),
                        format!("guest path {:?} must be absolute", grant.guest),
                    ));
                }
                if dirs.iter().any(|d: &DirGrant| d.guest_path == grant.guest) {
                    return Err(loc.at(
                        dir.span(),
                        format!("guest path {:?} is granted twice", grant.guest),
                    ));
                }
                if grant.create {
                    create_dirs.push(resolve(&grant.host));
                }
                dirs.push(DirGrant {
                    host_path: resolve(&grant.host),
                    guest_path: grant.guest.clone(),
                    access: grant.access,
                    shared: grant.shared,
                    resolved: false,
                });
            }
            for var in &raw_component.env {
                if var.get_ref().is_empty() || var.get_ref().contains('=') {
                    return Err(loc.at(
                        var.span(),
                        format!("environment variable name {:?} is invalid", var.get_ref()),
                    ));
                }
            }
            let mut http = Vec::new();
            for authority in &raw_component.http {
                http.push(
                    HttpAuthority::parse(authority.get_ref())
                        .map_err(|m| loc.at(authority.span(), m))?,
                );
            }
            let mut tcp_connect = Vec::new();
            for addr in &raw_component.tcp_connect {
                tcp_connect.push(addr.get_ref().parse().map_err(|_| {
                    loc.at(
                        addr.span(),
                        format!(
                            "tcp_connect {:?} must be an IP address and port, like \"127.0.0.1:5432\"",
                            addr.get_ref()
                        ),
                    )
                })?);
            }
            let limits = loc.limits(&raw_component.limits)?;
            components.insert(
                name.clone(),
                ComponentConfig {
                    name: name.clone(),
                    path: resolve(raw_component.path.get_ref()),
                    // A component no agent uses is checked as a tool.
                    role: roles
                        .get(name.as_str())
                        .map(|(role, _)| *role)
                        .unwrap_or(ComponentRole::Tool),
                    dirs,
                    create_dirs,
                    env: raw_component
                        .env
                        .iter()
                        .map(|v| v.get_ref().clone())
                        .collect(),
                    config: raw_component.config.clone(),
                    http,
                    tcp_connect,
                    limits,
                },
            );
        }

        let mut models = BTreeMap::new();
        for (name, model) in &raw.models {
            check_name(name, "model").map_err(|m| loc.at(model.span(), m))?;
            let config = match model.get_ref() {
                RawModel::Scripted { responses, repeat } => ModelConfig::Scripted {
                    responses: resolve(responses),
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
                    let expand = |v: &str| {
                        expand_env(v)
                            .map_err(|m| loc.at(model.span(), format!("model {name:?}: {m}")))
                    };
                    let base_url = expand(base_url.as_deref().unwrap_or(OPENAI_BASE_URL))?;
                    let model_name = expand(model_name)?;
                    let base_url = base_url.as_str();
                    if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
                        return Err(loc.at(
                            model.span(),
                            format!("model {name:?}: base_url {base_url:?} must start with http:// or https://"),
                        ));
                    }
                    if model_name.trim().is_empty() {
                        return Err(loc.at(model.span(), format!("model {name:?}: model is empty")));
                    }
                    // Expanded only where the provider is made (a worker), so
                    // that clients of the same file need not hold the secret.
                    check_headers(headers, api_key_env.is_some())
                        .map_err(|m| loc.at(model.span(), format!("model {name:?}: {m}")))?;
                    let mut retry = RetryPolicy::default();
                    if let Some(retries) = retries {
                        if *retries > MAX_MODEL_RETRIES {
                            return Err(loc.at(
                                model.span(),
                                format!("model {name:?}: retries is at most {MAX_MODEL_RETRIES}"),
                            ));
                        }
                        retry.retries = *retries;
                    }
                    if let Some(wait) = max_retry_wait {
                        retry.max_wait = humantime::parse_duration(wait).map_err(|err| {
                            loc.at(
                                model.span(),
                                format!(
                                    "model {name:?}: max_retry_wait: {wait:?} is not a duration like \"30s\": {err}"
                                ),
                            )
                        })?;
                        if retry.max_wait < Duration::from_secs(1) {
                            return Err(loc.at(
                                model.span(),
                                format!(
                                    "model {name:?}: max_retry_wait is at least 1s (retries = 0 turns retries off)"
                                ),
                            ));
                        }
                    }
                    ModelConfig::OpenAi {
                        base_url: base_url.to_string(),
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

        let mut agents = BTreeMap::new();
        for (name, agent) in &raw.agents {
            check_name(name, "agent").map_err(|m| loc.at(agent.span(), m))?;
            let raw_agent = agent.get_ref();
            let mut model_name = None;
            if let Some(model) = &raw_agent.model {
                let name = expand_env(model.get_ref()).map_err(|m| loc.at(model.span(), m))?;
                if !raw.models.contains_key(name.as_str()) {
                    return Err(loc.at(
                        model.span(),
                        format!(
                            "there is no model {name:?}; the models are {}",
                            names(raw.models.keys())
                        ),
                    ));
                }
                model_name = Some(name);
            }
            let mut seen = std::collections::BTreeSet::new();
            for tool in &raw_agent.tools {
                if !seen.insert(tool.get_ref().as_str()) {
                    return Err(loc.at(
                        tool.span(),
                        format!("tool component {:?} is listed twice", tool.get_ref()),
                    ));
                }
            }
            let mut options = AgentSessionOptions {
                tool_policies: raw_agent.tool_policies.clone(),
                ..AgentSessionOptions::default()
            };
            if let Some(effect) = raw_agent.default_effect {
                options.default_tool_effect = effect;
            }
            if let Some(deadline) = &raw_agent.interrupt_deadline {
                options.interrupt_deadline = Some(loc.duration(deadline, "interrupt_deadline")?);
            }
            if let Some(capacity) = &raw_agent.events_capacity {
                if *capacity.get_ref() == 0 {
                    return Err(loc.at(
                        capacity.span(),
                        "events_capacity must be at least 1 byte".into(),
                    ));
                }
                options.events_capacity = *capacity.get_ref();
            }
            options.tool_attempt_timeout = loc.positive(
                &raw_agent.tool_attempt_timeout,
                "tool_attempt_timeout",
                options.tool_attempt_timeout,
            )?;
            options.model_step_timeout = loc.positive(
                &raw_agent.model_step_timeout,
                "model_step_timeout",
                options.model_step_timeout,
            )?;
            if let Some(raw) = &raw_agent.turn_limits {
                options.turn_limits = loc.turn_limits(raw)?;
            }
            agents.insert(
                name.clone(),
                AgentConfig {
                    name: name.clone(),
                    runner: raw_agent.runner.get_ref().clone(),
                    tools: raw_agent
                        .tools
                        .iter()
                        .map(|t| t.get_ref().clone())
                        .collect(),
                    model: model_name,
                    options,
                },
            );
        }

        Ok(Self {
            file: file.to_path_buf(),
            store,
            cache_dir,
            worker,
            components,
            models,
            agents,
        })
    }

    /// `.dexa` next to the config file: where generated state (the API
    /// token, remembered chats) lives.
    pub fn local_dir(&self) -> PathBuf {
        config_dir(&self.file).join(".dexa")
    }

    /// An error about this file with no line (found after parsing).
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

    pub fn error(&self, message: impl Into<String>) -> ConfigError {
        ConfigError {
            file: self.file.clone(),
            line: None,
            column: None,
            message: message.into(),
        }
    }
}

/// Places errors in the file's text.
struct Locator<'a> {
    file: &'a Path,
    text: &'a str,
}

impl Locator<'_> {
    fn at(&self, span: Range<usize>, message: String) -> ConfigError {
        locate(self.file, self.text, span, message)
    }

    fn duration(&self, value: &Spanned<String>, what: &str) -> Result<Duration, ConfigError> {
        humantime::parse_duration(value.get_ref()).map_err(|err| {
            self.at(
                value.span(),
                format!(
                    "{what}: {:?} is not a duration like \"30s\" or \"5m\": {err}",
                    value.get_ref()
                ),
            )
        })
    }

    /// An agent's turn limits: each given one at least 1, the rest defaulted.
    fn turn_limits(&self, raw: &RawTurnLimits) -> Result<TurnLimits, ConfigError> {
        let mut limits = TurnLimits::default();
        let count = |value: &Spanned<u32>, what: &str| -> Result<u32, ConfigError> {
            match *value.get_ref() {
                0 => Err(self.at(
                    value.span(),
                    format!("turn_limits.{what} must be at least 1"),
                )),
                n => Ok(n),
            }
        };
        if let Some(v) = &raw.tool_calls {
            limits.tool_calls = count(v, "tool_calls")?;
        }
        if let Some(v) = &raw.messages {
            limits.messages = count(v, "messages")?;
        }
        if let Some(v) = &raw.tool_output {
            let bytes = v
                .get_ref()
                .bytes()
                .map_err(|m| self.at(v.span(), format!("turn_limits.tool_output: {m}")))?;
            if bytes == 0 {
                return Err(self.at(v.span(), "turn_limits.tool_output must be above 0".into()));
            }
            limits.tool_output_bytes = bytes;
        }
        Ok(limits)
    }

    /// A component's limits: each given one checked, the rest defaulted.
    fn limits(&self, raw: &RawLimits) -> Result<ComponentLimits, ConfigError> {
        let mut limits = ComponentLimits::default();
        let size = |value: &Spanned<ByteSize>, what: &str| -> Result<u64, ConfigError> {
            let bytes = value
                .get_ref()
                .bytes()
                .map_err(|m| self.at(value.span(), format!("limits.{what}: {m}")))?;
            if bytes == 0 {
                return Err(self.at(value.span(), format!("limits.{what} must be above 0")));
            }
            Ok(bytes)
        };
        let count = |value: &Spanned<u64>, what: &str| -> Result<u64, ConfigError> {
            match *value.get_ref() {
                0 => Err(self.at(value.span(), format!("limits.{what} must be at least 1"))),
                n => Ok(n),
            }
        };
        let usize_of = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
        if let Some(v) = &raw.memory {
            limits.memory_bytes = usize_of(size(v, "memory")?);
        }
        if let Some(v) = &raw.table_elements {
            limits.table_elements = usize_of(count(v, "table_elements")?);
        }
        if let Some(v) = &raw.instances {
            limits.instances = usize_of(count(v, "instances")?);
        }
        if let Some(v) = &raw.fuel {
            limits.fuel = Some(count(v, "fuel")?);
        }
        if let Some(v) = &raw.max_concurrent_calls {
            limits.max_concurrent_calls = usize_of(count(v, "max_concurrent_calls")?);
        }
        if let Some(v) = &raw.output {
            limits.output_bytes = usize_of(size(v, "output")?);
        }
        if let Some(v) = &raw.run_state {
            limits.run_state_bytes = usize_of(size(v, "run_state")?);
        }
        if let Some(v) = &raw.events_per_call {
            limits.event_bytes_per_call = size(v, "events_per_call")?;
        }
        if let Some(v) = &raw.host_handles {
            limits.host_handles = usize_of(count(v, "host_handles")?);
        }
        Ok(limits)
    }

    /// A duration longer than zero, or `default` when absent.
    fn positive(
        &self,
        value: &Option<Spanned<String>>,
        what: &str,
        default: Duration,
    ) -> Result<Duration, ConfigError> {
        let Some(value) = value else {
            return Ok(default);
        };
        let parsed = self.duration(value, what)?;
        if parsed.is_zero() {
            return Err(self.at(value.span(), format!("{what} must be longer than 0")));
        }
        Ok(parsed)
    }
}

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
fn config_dir(file: &Path) -> PathBuf {
    file.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf()
}

fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// `sqlite:PATH`, `sqlite://PATH` or a bare path, with optional parameters
/// after `?`: only `synchronous=normal|full`; any other is refused, so that
/// a mistyped setting never silently becomes part of the file name.
fn parse_store_url(url: &str) -> Result<(String, SqliteOptions), String> {
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

fn check_name(name: &str, what: &str) -> Result<(), String> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
    {
        return Err(format!(
            "{what} name {name:?} may use only letters, digits, '-', '_' and '.'"
        ));
    }
    Ok(())
}

fn names<'a>(keys: impl Iterator<Item = &'a String>) -> String {
    let list: Vec<String> = keys.map(|k| format!("{k:?}")).collect();
    if list.is_empty() {
        "none".to_string()
    } else {
        list.join(", ")
    }
}

/// Turns a byte span into a one-based line and column.
fn locate(file: &Path, text: &str, span: Range<usize>, message: String) -> ConfigError {
    let offset = span.start.min(text.len());
    let before = &text[..text.floor_char_boundary(offset)];
    let line = before.matches('\n').count() + 1;
    let column = before
        .rfind('\n')
        .map(|nl| before[nl + 1..].chars().count() + 1)
        .unwrap_or_else(|| before.chars().count() + 1);
    ConfigError {
        file: file.to_path_buf(),
        line: Some(line),
        column: Some(column),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
        assert_eq!(cases.len(), 37, "the fixture's cases");
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
