//! Component versions for hot-swap tests: variants of a guest's bytes (same
//! behaviour, another digest), the `dexa component|agent` commands run as
//! processes against a kit stack, and which version ran each Step of each
//! turn.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

use dexa::flow::StepHistoryEntry;
use dexa::session::AgentEvent;
use serde_json::Value;

use crate::guest_bytes;
use crate::kit::{dexa_binary, AgentTestStack};

/// `wasm` with a custom section carrying `tag` appended: the same component
/// to the engine, another SHA-256 to the catalog.
pub fn variant(wasm: &[u8], tag: &str) -> Vec<u8> {
    fn leb(mut n: usize, out: &mut Vec<u8>) {
        loop {
            let byte = (n & 0x7f) as u8;
            n >>= 7;
            if n == 0 {
                out.push(byte);
                return;
            }
            out.push(byte | 0x80);
        }
    }
    let name = b"dexa-test-variant";
    let mut body = Vec::new();
    leb(name.len(), &mut body);
    body.extend_from_slice(name);
    body.extend_from_slice(tag.as_bytes());
    let mut out = wasm.to_vec();
    out.push(0);
    leb(body.len(), &mut out);
    out.extend_from_slice(&body);
    out
}

/// The SHA-256 of `bytes`, as the catalog names versions.
pub fn digest_of(bytes: &[u8]) -> String {
    dexa::plugin::cache::sha256_hex(bytes)
}

/// `wasm` with every `@0.2.0` of its names turned into `@{version}`: what
/// the same guest built against that version of `dex:agents` imports (the
/// version has the same length, so the binary stays valid).
pub fn built_against(wasm: &[u8], version: &str) -> Vec<u8> {
    let (from, to) = (
        format!("@{}", dexa::plugin::WIT_VERSION),
        format!("@{version}"),
    );
    assert_eq!(from.len(), to.len());
    let (from, to) = (from.as_bytes(), to.as_bytes());
    let mut out = wasm.to_vec();
    let mut replaced = 0;
    let mut i = 0;
    while i + from.len() <= out.len() {
        if &out[i..i + from.len()] == from {
            out[i..i + from.len()].copy_from_slice(to);
            replaced += 1;
            i += from.len();
        } else {
            i += 1;
        }
    }
    assert!(
        replaced > 0,
        "no {} name in the component",
        dexa::plugin::WIT_PACKAGE
    );
    out
}

/// Writes a variant of guest `guest` into the stack's directory; returns its
/// path and digest.
pub fn write_variant(stack: &AgentTestStack, guest: &str, tag: &str) -> (PathBuf, String) {
    let bytes = variant(&guest_bytes(guest), tag);
    let path = stack.dir.path().join(format!("{guest}-{tag}.wasm"));
    std::fs::write(&path, &bytes).unwrap_or_else(|err| panic!("write {}: {err}", path.display()));
    (path, digest_of(&bytes))
}

/// What a `dexa` command printed.
#[derive(Debug)]
pub struct CliOutput {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

impl CliOutput {
    /// Its stdout as JSON; panics (with both streams) when it failed.
    pub fn json(&self) -> Value {
        assert!(self.success, "the command failed: {self:?}");
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|err| panic!("not JSON ({err}): {self:?}"))
    }
}

/// Runs `dexa ARGS` against the stack's config, as actor `test`, with `env`.
pub fn dexa_cli(stack: &AgentTestStack, args: &[&str], env: &[(&str, &str)]) -> CliOutput {
    let output = Command::new(dexa_binary())
        .args(args)
        .env("DEXA_CONFIG", &stack.config_path)
        .env("USER", "test")
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .current_dir(stack.dir.path())
        .output()
        .unwrap_or_else(|err| panic!("run dexa {args:?}: {err}"));
    CliOutput {
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Turn id → the (Step type, version) of every history entry of that turn
/// that ran a component. A Step execution's turn is the turn of its events.
pub fn versions_by_turn(
    history: &[StepHistoryEntry],
    events: &[AgentEvent],
) -> BTreeMap<String, BTreeSet<(String, String)>> {
    let turn_of: BTreeMap<&str, &str> = events
        .iter()
        .map(|e| (e.step_execution_id.as_str(), e.turn_id.as_str()))
        .collect();
    let mut by_turn: BTreeMap<String, BTreeSet<(String, String)>> = BTreeMap::new();
    for entry in history {
        let Some(component) = &entry.component else {
            continue;
        };
        let turn = turn_of
            .get(entry.step_execution_id.as_str())
            .copied()
            .unwrap_or("(no events)");
        by_turn
            .entry(turn.to_string())
            .or_default()
            .insert((entry.step_type.clone(), component.clone()));
    }
    by_turn
}
