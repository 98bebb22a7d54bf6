//! `dexa check`: everything a worker would refuse at start, found without
//! starting one and without touching the store, for CI pipelines. Every
//! problem is reported (not only the first), each at the line of the table
//! it is about.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::deploy::{model_provider, settings};
use super::{ComponentRole, ConfigError, DexaConfig, ModelConfig};
use crate::plugin::{RunnerComponent, ToolComponent};
use crate::session::AgentComponents;

/// What `check` found; empty when a worker would start.
pub type Problems = Vec<ConfigError>;

/// Checks `config` as a worker's start would: each component an agent uses
/// loads, matches the world its agents use it as, and gets its grants (the
/// directories exist, the environment variables are set); each agent's
/// tools fit together; each model an agent uses can be made (its files read,
/// its key variable set). With `online`, each OpenAI-compatible model's
/// server is also asked for its model list with the configured key.
pub async fn check(config: &DexaConfig, online: bool) -> Problems {
    let text = std::fs::read_to_string(&config.file).unwrap_or_default();
    let at = |table: &str, name: &str, message: String| ConfigError {
        line: table_line(&text, table, name),
        column: None,
        ..config.error(message)
    };
    let mut problems = Vec::new();
    if config.agents.is_empty() {
        problems.push(
            config.error("there are no [agents.NAME] sections, so a worker has no work to do"),
        );
    }
    // The workers' engine, so that what this compiles they find in the
    // cache; without a usable cache (a read-only checkout in CI), one
    // that keeps nothing.
    let engine = match super::versions::config_engine(config) {
        Ok(engine) => engine,
        Err(_) => match crate::plugin::SandboxEngine::new(crate::plugin::SandboxConfig {
            cache_dir: None,
            ..crate::plugin::SandboxConfig::default()
        }) {
            Ok(engine) => engine,
            Err(err) => {
                problems.push(config.error(format!("cannot make the sandbox engine: {err:#}")));
                return problems;
            }
        },
    };
    let used = config.used_components();
    let mut loaded_settings = Vec::new();
    for component in &used {
        match settings(config, component) {
            Ok(s) => loaded_settings.push((component, s)),
            Err(err) => problems.push(at("components", &component.name, message_of(&err))),
        }
    }
    let mut all: Vec<_> = loaded_settings.iter().map(|(_, s)| s.clone()).collect();
    if let Err(err) = super::grant_layout::resolve_and_check(config, &mut all) {
        problems.push(config.error(format!("{err:#}")));
    }
    let mut runners: BTreeMap<&str, Arc<RunnerComponent>> = BTreeMap::new();
    let mut tools: BTreeMap<&str, Arc<ToolComponent>> = BTreeMap::new();
    for ((component, _), settings) in loaded_settings.iter().zip(all) {
        let name = component.name.as_str();
        let wasm = match std::fs::read(&component.path) {
            Ok(wasm) => wasm,
            Err(err) => {
                let path = component.path.display();
                problems.push(at(
                    "components",
                    name,
                    format!("component {name:?}: cannot read {path}: {err}"),
                ));
                continue;
            }
        };
        let loaded = match component.role {
            ComponentRole::Runner => engine
                .load_runner(&wasm, settings)
                .map(|r| drop(runners.insert(name, Arc::new(r)))),
            ComponentRole::Tool => engine
                .load_tool(&wasm, settings)
                .await
                .map(|t| drop(tools.insert(name, Arc::new(t)))),
        };
        if let Err(err) = loaded {
            problems.push(at("components", name, format!("component {name:?}: {err}")));
        }
    }
    for agent in config.agents.values() {
        let (Some(runner), Some(agent_tools)) = (
            runners.get(agent.runner.as_str()),
            agent
                .tools
                .iter()
                .map(|t| tools.get(t.as_str()).cloned())
                .collect::<Option<Vec<_>>>(),
        ) else {
            // A component that did not load is reported above.
            continue;
        };
        if let Err(err) = AgentComponents::new(runner.clone(), agent_tools) {
            problems.push(at(
                "agents",
                &agent.name,
                format!("agent {:?}: {err}", agent.name),
            ));
        }
    }
    for (name, model) in &config.models {
        if !config
            .agents
            .values()
            .any(|a| a.model.as_deref() == Some(name))
        {
            continue;
        }
        if let Err(err) = model_provider(config, name, model) {
            problems.push(at("models", name, message_of(&err)));
            continue;
        }
        if online {
            if let Err(message) = reachable(name, model).await {
                problems.push(at("models", name, message));
            }
        }
    }
    problems
}

/// The problem without the file a [`ConfigError`] inside it names again.
fn message_of(err: &anyhow::Error) -> String {
    match err.downcast_ref::<ConfigError>() {
        Some(inner) => inner.message.clone(),
        None => format!("{err:#}"),
    }
}

/// Asks an OpenAI-compatible server for its model list, with the model's
/// key and headers: a wrong address, key or gateway header shows here.
async fn reachable(name: &str, model: &ModelConfig) -> Result<(), String> {
    let ModelConfig::OpenAi {
        base_url,
        api_key_env,
        headers,
        ..
    } = model
    else {
        return Ok(());
    };
    let url = format!("{}/models", base_url.trim_end_matches('/'));
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        // Never carry the key and headers elsewhere.
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|err| format!("model {name:?}: {err}"))?;
    let mut request = http.get(&url);
    if let Some(key) = api_key_env.as_ref().and_then(|var| std::env::var(var).ok()) {
        request = request.bearer_auth(key);
    }
    for (header, value) in headers {
        let value = super::expand_env(value).unwrap_or_default();
        request = request.header(header.as_str(), value);
    }
    match request.send().await {
        Ok(response) if response.status().is_success() => Ok(()),
        Ok(response) => Err(format!(
            "model {name:?}: GET {url} answered {}",
            response.status()
        )),
        Err(err) => Err(format!("model {name:?}: cannot reach {url}: {err}")),
    }
}

/// The line of `[table.name]` (or `[table."name"]`) in `text`, one-based.
fn table_line(text: &str, table: &str, name: &str) -> Option<usize> {
    let plain = format!("[{table}.{name}]");
    let quoted = format!("[{table}.\"{name}\"]");
    text.lines()
        .position(|line| {
            let line = line.trim();
            line.starts_with(&plain) || line.starts_with(&quoted)
        })
        .map(|index| index + 1)
}

/// Prints `problems` one a line, `file:line:column: message`.
pub fn report(problems: &Problems, file: &Path) {
    if problems.is_empty() {
        println!("{}: ok", file.display());
    }
    for problem in problems {
        eprintln!("{problem}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_found_by_their_header_line() {
        let text = "store = \"x\"\n\n[components.a]\npath = \"a\"\n  [components.\"b\"]\n";
        assert_eq!(table_line(text, "components", "a"), Some(3));
        assert_eq!(table_line(text, "components", "b"), Some(5));
        assert_eq!(table_line(text, "models", "a"), None);
    }
}
