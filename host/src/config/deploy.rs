//! Turns a [`DexaConfig`] into what runs: the store, the loaded components
//! and one AgentSessionFlow per agent.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use serde::Deserialize;

use super::versions;
use super::{ComponentConfig, ComponentRole, DexaConfig, ModelConfig, StoreUrl};
use crate::catalog::{CatalogStore, CONFIG_ACTOR, RUNNER_ROLE};
use crate::flow::{FlowClient, FlowStore, Registry, StoreHealth, Worker, WorkerOptions};
use crate::plugin::wit::{MessageRole, ModelMessage, ModelResponse, ModelToolCall, Usage};
use crate::plugin::{
    CacheOutcome, ComponentSettings, Grants, LoadError, ModelProvider, RunnerComponent,
    ToolComponent,
};
use crate::providers::{OpenAiConfig, OpenAiProvider, ScriptedModelProvider};
use crate::session::{
    ActivationWatch, AgentComponents, AgentSessionClient, AgentSessionFlow, CatalogVersions,
};
use crate::store::postgres::{PostgresStore, PostgresUrl};
use crate::store::sqlite::SqliteStore;

/// What loading reports, so a first start that compiles shows progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadProgress {
    Loading {
        component: String,
        index: usize,
        total: usize,
    },
    Loaded {
        component: String,
        /// Whether it was compiled now or read from the cache.
        compiled: bool,
        millis: u128,
    },
}

/// A store and a registry of the configured agents.
pub struct Deployment {
    pub config: DexaConfig,
    pub store: Arc<dyn FlowStore>,
    /// The component catalog, in the same store.
    pub catalog: Arc<dyn CatalogStore>,
    pub registry: Arc<Registry>,
    /// A worker's view of the activation log (none for clients).
    pub watch: Option<Arc<ActivationWatch>>,
    /// Whether the store answers this deployment's workers (see
    /// [`Deployment::worker_with`]); `/readyz` reads it.
    pub store_health: StoreHealth,
}

impl Deployment {
    /// Everything a worker needs: every component an agent uses is loaded
    /// (compiled on first use, then read from the cache).
    pub async fn for_workers(
        config: DexaConfig,
        progress: &(dyn Fn(LoadProgress) + Sync),
    ) -> anyhow::Result<Self> {
        let (store, catalog) = open_store(&config).await?;
        let engine = versions::config_engine(&config)?;
        let used = config.used_components();
        let mut all_settings = used
            .iter()
            .map(|component| settings(&config, component))
            .collect::<anyhow::Result<Vec<_>>>()?;
        super::grant_layout::resolve_and_check(&config, &mut all_settings)?;
        let by_name: BTreeMap<String, ComponentSettings> = used
            .iter()
            .zip(&all_settings)
            .map(|(c, s)| (c.name.clone(), s.clone()))
            .collect();
        let mut runners: BTreeMap<String, (Arc<RunnerComponent>, Vec<u8>)> = BTreeMap::new();
        let mut tools: BTreeMap<String, (Arc<ToolComponent>, Vec<u8>)> = BTreeMap::new();
        for (index, (component, settings)) in used.iter().zip(all_settings).enumerate() {
            progress(LoadProgress::Loading {
                component: component.name.clone(),
                index: index + 1,
                total: used.len(),
            });
            let started = Instant::now();
            let wasm = std::fs::read(&component.path).map_err(|source| LoadError::Read {
                path: component.path.clone(),
                source,
            });
            let wasm = wasm.with_context(|| format!("component {:?}", component.name))?;
            let cache = match component.role {
                ComponentRole::Runner => {
                    let runner = engine
                        .load_runner(&wasm, settings)
                        .with_context(|| format!("component {:?}", component.name))?;
                    let cache = runner.info().cache;
                    runners.insert(component.name.clone(), (Arc::new(runner), wasm));
                    cache
                }
                ComponentRole::Tool => {
                    let tool = engine
                        .load_tool(&wasm, settings)
                        .await
                        .with_context(|| format!("component {:?}", component.name))?;
                    let cache = tool.info().cache;
                    tools.insert(component.name.clone(), (Arc::new(tool), wasm));
                    cache
                }
            };
            progress(LoadProgress::Loaded {
                component: component.name.clone(),
                compiled: !matches!(cache, CacheOutcome::Hit),
                millis: started.elapsed().as_millis(),
            });
        }
        let mut models: BTreeMap<String, Arc<dyn ModelProvider>> = BTreeMap::new();
        // Only the models an agent uses: another's key need not be set.
        for (name, model) in &config.models {
            if config
                .agents
                .values()
                .any(|a| a.model.as_deref() == Some(name))
            {
                models.insert(name.clone(), model_provider(&config, name, model)?);
            }
        }
        let loader = versions::loader(&config, engine, by_name);
        let watch = Arc::new(ActivationWatch::new(catalog.clone()));
        let mut flows = Vec::new();
        for agent in config.agents.values() {
            let (runner, wasm) = runners
                .get(&agent.runner)
                .cloned()
                .with_context(|| format!("agent {:?}: runner not loaded", agent.name))?;
            let agent_tools = agent
                .tools
                .iter()
                .map(|name| {
                    tools.get(name).cloned().with_context(|| {
                        format!("agent {:?}: tool {name:?} not loaded", agent.name)
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            // The files' tools must fit together, as before versions.
            AgentComponents::new(
                runner.clone(),
                agent_tools.iter().map(|(t, _)| t.clone()).collect(),
            )
            .map_err(|err| config.error(format!("agent {:?}: {err}", agent.name)))?;
            // dexa.toml's files join the catalog; a changed file is activated.
            let path = config
                .components
                .get(&agent.runner)
                .map(|c| c.path.clone())
                .unwrap_or_default();
            let record = versions::runner_record(&runner, wasm.len(), CONFIG_ACTOR);
            versions::bootstrap_role(&*catalog, &agent.name, RUNNER_ROLE, record, wasm, &path)
                .await
                .with_context(|| format!("agent {:?}: recording its runner", agent.name))?;
            for (name, (tool, wasm)) in agent.tools.iter().zip(&agent_tools) {
                let path = config
                    .components
                    .get(name)
                    .map(|c| c.path.clone())
                    .unwrap_or_default();
                let record = versions::tool_record(tool, wasm.len(), CONFIG_ACTOR);
                versions::bootstrap_role(&*catalog, &agent.name, name, record, wasm.clone(), &path)
                    .await
                    .with_context(|| format!("agent {:?}: recording tool {name:?}", agent.name))?;
            }
            let agent_versions = Arc::new(CatalogVersions::new(
                agent.name.clone(),
                agent.tools.clone(),
                watch.clone(),
                catalog.clone(),
                loader.clone(),
            ));
            agent_versions.preloaded_runner(runner);
            for (name, (tool, _)) in agent.tools.iter().zip(agent_tools) {
                agent_versions.preloaded_tool(name, tool);
            }
            // Versions activated explicitly (not the files) load now, so the
            // first turn does not compile; one that fails is logged, and
            // only the turns that take it fail.
            agent_versions.preload().await;
            let mut components = AgentComponents::from_catalog(agent_versions);
            if let Some(model) = agent.model.as_ref().and_then(|m| models.get(m)) {
                components = components.with_model(model.clone());
            }
            flows.push(AgentSessionFlow::new(
                agent.name.clone(),
                components,
                agent.options.clone(),
            ));
        }
        let mut deployment = Self::assemble(config, store, catalog, &flows)?;
        deployment.watch = Some(watch);
        Ok(deployment)
    }

    /// What a client needs: the store and the agents' flow types, with no
    /// component loaded (their Steps refuse to run here).
    pub async fn for_clients(config: DexaConfig) -> anyhow::Result<Self> {
        let (store, catalog) = open_store(&config).await?;
        let flows: Vec<AgentSessionFlow> = config
            .agents
            .values()
            .map(|agent| AgentSessionFlow::for_clients(agent.name.clone(), agent.options.clone()))
            .collect();
        Self::assemble(config, store, catalog, &flows)
    }

    fn assemble(
        config: DexaConfig,
        store: Arc<dyn FlowStore>,
        catalog: Arc<dyn CatalogStore>,
        flows: &[AgentSessionFlow],
    ) -> anyhow::Result<Self> {
        let registry = Arc::new(Registry::new(
            flows.iter().map(AgentSessionFlow::definition),
        )?);
        Ok(Self {
            config,
            store,
            catalog,
            registry,
            watch: None,
            store_health: StoreHealth::default(),
        })
    }

    /// The session client of `agent`.
    pub fn sessions(&self, agent: &str) -> anyhow::Result<AgentSessionClient> {
        if !self.config.agents.contains_key(agent) {
            let known: Vec<&String> = self.config.agents.keys().collect();
            anyhow::bail!(self.config.error(format!(
                "there is no agent {agent:?}; the agents are {known:?}"
            )));
        }
        Ok(AgentSessionClient::new(
            FlowClient::new(self.store.clone(), self.registry.clone()),
            agent,
        ))
    }

    /// A worker for every agent, with the `[worker]` settings.
    pub fn worker(&self) -> Worker {
        self.worker_with(self.config.worker.options())
    }

    /// A worker on this deployment; it reports the store's availability to
    /// [`Deployment::store_health`].
    pub fn worker_with(&self, options: WorkerOptions) -> Worker {
        let options = WorkerOptions {
            store_health: self.store_health.clone(),
            ..options
        };
        Worker::new(self.store.clone(), self.registry.clone(), options)
    }
}

/// The store, as the engine's storage and as the component catalog.
async fn open_store(
    config: &DexaConfig,
) -> anyhow::Result<(Arc<dyn FlowStore>, Arc<dyn CatalogStore>)> {
    match &config.store {
        StoreUrl::Sqlite(path, options) => {
            let store = Arc::new(
                SqliteStore::open(path, options.clone())
                    .with_context(|| format!("cannot open the SQLite store {}", path.display()))?,
            );
            Ok((store.clone(), store))
        }
        StoreUrl::Postgres(url) => {
            let parsed = PostgresUrl::parse(url).map_err(|err| config.error(err))?;
            let store = Arc::new(
                PostgresStore::connect(parsed)
                    .await
                    .with_context(|| format!("cannot open the PostgreSQL store {url}"))?,
            );
            Ok((store.clone(), store))
        }
    }
}

pub(super) fn settings(
    config: &DexaConfig,
    component: &ComponentConfig,
) -> anyhow::Result<ComponentSettings> {
    for dir in &component.create_dirs {
        std::fs::create_dir_all(dir).map_err(|err| {
            config.error(format!(
                "component {:?}: cannot create {}: {err}",
                component.name,
                dir.display()
            ))
        })?;
    }
    let mut grants = Grants::none();
    grants.dirs = component.dirs.clone();
    for name in &component.env {
        let value = std::env::var(name).map_err(|_| {
            config.error(format!(
                "component {:?} is granted the environment variable {name}, which is not set",
                component.name
            ))
        })?;
        grants = grants.env(name.clone(), value);
    }
    grants.http = component.http.clone();
    grants.tcp_connect = component.tcp_connect.clone();
    grants
        .validate()
        .map_err(|err| config.error(format!("component {:?}: {err}", component.name)))?;
    Ok(ComponentSettings::named(component.name.clone())
        .with_grants(grants)
        .with_limits(component.limits.clone())
        .with_config(component.config.clone()))
}

/// One response of a scripted model's file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptedResponse {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    tool_calls: Vec<ScriptedToolCall>,
    #[serde(default)]
    usage: ScriptedUsage,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptedToolCall {
    id: String,
    name: String,
    #[serde(default)]
    arguments: serde_json::Value,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ScriptedUsage {
    #[serde(default)]
    input: u64,
    #[serde(default)]
    output: u64,
}

pub(super) fn model_provider(
    config: &DexaConfig,
    name: &str,
    model: &ModelConfig,
) -> anyhow::Result<Arc<dyn ModelProvider>> {
    match model {
        ModelConfig::Scripted { responses, repeat } => {
            let text = std::fs::read_to_string(responses).map_err(|err| {
                config.error(format!(
                    "model {name:?}: cannot read {}: {err}",
                    responses.display()
                ))
            })?;
            let scripted: Vec<ScriptedResponse> = serde_json::from_str(&text).map_err(|err| {
                config.error(format!(
                    "model {name:?}: {} is not a JSON list of responses: {err}",
                    responses.display()
                ))
            })?;
            let provider = ScriptedModelProvider::new(scripted.into_iter().map(into_response));
            Ok(Arc::new(if *repeat {
                provider.repeating()
            } else {
                provider
            }))
        }
        ModelConfig::OpenAi {
            base_url,
            model,
            api_key_env,
            headers,
            retry,
        } => {
            let mut openai =
                OpenAiConfig::new(base_url.clone(), model.clone()).retry(retry.clone());
            for (header, value) in headers {
                // The message names no part of the value: it may hold a
                // secret around its `${VAR}`.
                let value = super::expand_env(value).map_err(|_| {
                    config.error(format!(
                        "model {name:?}: header {header}: a `${{VAR}}` in its value names an \
                         environment variable that is not set, or is malformed"
                    ))
                })?;
                openai = openai.header(header.clone(), value);
            }
            if let Some(var) = api_key_env {
                let key = std::env::var(var).map_err(|_| {
                    config.error(format!(
                        "model {name:?}: its API key variable {var} is not set"
                    ))
                })?;
                openai = openai.api_key(key);
            }
            Ok(Arc::new(OpenAiProvider::new(openai).map_err(|err| {
                config.error(format!("model {name:?}: {err}"))
            })?))
        }
    }
}

fn into_response(scripted: ScriptedResponse) -> ModelResponse {
    let finish_reason = scripted.finish_reason.unwrap_or_else(|| {
        if scripted.tool_calls.is_empty() {
            "stop".to_string()
        } else {
            "tool_calls".to_string()
        }
    });
    ModelResponse {
        message: ModelMessage {
            role: MessageRole::Assistant,
            content: scripted.text,
            tool_calls: scripted
                .tool_calls
                .into_iter()
                .map(|call| ModelToolCall {
                    id: call.id,
                    name: call.name,
                    arguments: match call.arguments {
                        serde_json::Value::String(text) => text,
                        serde_json::Value::Null => "{}".to_string(),
                        other => other.to_string(),
                    },
                })
                .collect(),
            tool_call_id: None,
        },
        usage: Usage {
            input_tokens: scripted.usage.input,
            output_tokens: scripted.usage.output,
            total_tokens: scripted.usage.input + scripted.usage.output,
        },
        finish_reason,
    }
}
