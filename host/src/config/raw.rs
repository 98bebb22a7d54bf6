//! The file's shape: what `dexa.toml` may say, as serde reads it, with the
//! spans that errors point at. Checked and turned into the typed config by
//! [`super::parse`].

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

use crate::plugin::DirAccess;
use crate::session::{ToolEffect, ToolPolicy};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    pub(super) store: Option<Spanned<String>>,
    pub(super) cache_dir: Option<String>,
    pub(super) cache_max: Option<Spanned<ByteSize>>,
    #[serde(default)]
    pub(super) worker: RawWorker,
    #[serde(default)]
    pub(super) components: BTreeMap<String, Spanned<RawComponent>>,
    #[serde(default)]
    pub(super) models: BTreeMap<String, Spanned<RawModel>>,
    #[serde(default)]
    pub(super) agents: BTreeMap<String, Spanned<RawAgent>>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawWorker {
    pub(super) slots: Option<Spanned<usize>>,
    pub(super) lease: Option<Spanned<String>>,
    pub(super) poll_interval: Option<Spanned<String>>,
    pub(super) reap_interval: Option<Spanned<String>>,
    pub(super) drain: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawComponent {
    pub(super) path: Spanned<String>,
    #[serde(default)]
    pub(super) dirs: Vec<Spanned<RawDir>>,
    #[serde(default)]
    pub(super) env: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) config: BTreeMap<String, String>,
    #[serde(default)]
    pub(super) http: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) tcp_connect: Vec<Spanned<String>>,
    #[serde(default)]
    pub(super) limits: RawLimits,
}

/// `[components.NAME.limits]`; sizes are bytes or strings like "64MiB".
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimits {
    pub(super) memory: Option<Spanned<ByteSize>>,
    pub(super) table_elements: Option<Spanned<u64>>,
    pub(super) instances: Option<Spanned<u64>>,
    pub(super) fuel: Option<Spanned<u64>>,
    pub(super) max_concurrent_calls: Option<Spanned<u64>>,
    pub(super) output: Option<Spanned<ByteSize>>,
    pub(super) run_state: Option<Spanned<ByteSize>>,
    pub(super) events_per_call: Option<Spanned<ByteSize>>,
    pub(super) host_handles: Option<Spanned<u64>>,
}

#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "a size: a whole number of bytes, or a string like \"64MiB\""
)]
pub(super) enum ByteSize {
    Bytes(u64),
    Text(String),
}

impl ByteSize {
    pub(super) fn bytes(&self) -> Result<u64, String> {
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
pub(super) struct RawDir {
    pub(super) host: String,
    pub(super) guest: String,
    #[serde(default = "read_only")]
    pub(super) access: DirAccess,
    /// Create the host directory when it is missing.
    #[serde(default)]
    pub(super) create: bool,
    /// May overlap other components' grants (both must say so).
    #[serde(default)]
    pub(super) shared: bool,
}

fn read_only() -> DirAccess {
    DirAccess::ReadOnly
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, tag = "provider", rename_all = "snake_case")]
pub(super) enum RawModel {
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
pub(super) struct RawAgent {
    pub(super) runner: Spanned<String>,
    #[serde(default)]
    pub(super) tools: Vec<Spanned<String>>,
    pub(super) model: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) tool_policies: BTreeMap<String, ToolPolicy>,
    pub(super) default_effect: Option<ToolEffect>,
    pub(super) interrupt_deadline: Option<Spanned<String>>,
    pub(super) events_capacity: Option<Spanned<u64>>,
    pub(super) tool_attempt_timeout: Option<Spanned<String>>,
    pub(super) model_step_timeout: Option<Spanned<String>>,
    pub(super) turn_limits: Option<RawTurnLimits>,
}

/// `turn_limits = { tool_calls = 256, messages = 1024, tool_output = "512KiB" }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTurnLimits {
    pub(super) tool_calls: Option<Spanned<u32>>,
    pub(super) messages: Option<Spanned<u32>>,
    pub(super) tool_output: Option<Spanned<ByteSize>>,
}
