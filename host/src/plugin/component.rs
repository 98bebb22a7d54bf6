//! Loading components: compile (or load from the cache), check the world,
//! link once into an `InstancePre`, and call exports in fresh instances.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use tokio::sync::Semaphore;
use wasmtime::component::{Component, HasSelf, Linker};

use super::bindings::runner::{Runner, RunnerPre};
use super::bindings::tool::{Tool, ToolPre};
use super::bindings::wit::{
    DeferredToolExecution, FrameworkMessage, ToolError, ToolSpec, TurnOutcome,
};
use super::boundary::run_state_bytes;
use super::cache::{compile, sha256_hex, CacheOutcome};
use super::call::{with_deadline, Call, CallEnv, CallState};
use super::engine::SandboxEngine;
use super::error::{CallError, LoadError};
use super::factors::config::ComponentConfig;
use super::factors::history::{History, TurnInput};
use super::factors::step::StepTag;
use super::grants::Grants;
use super::guest_pool;
use super::limits::ComponentLimits;
use super::tool_schema;

/// How the operator set up one component.
#[derive(Clone, Debug, Default)]
pub struct ComponentSettings {
    /// The name used in logs and errors.
    pub name: String,
    pub grants: Grants,
    pub limits: ComponentLimits,
    /// Values the guest reads through `config.get`.
    pub config: ComponentConfig,
    /// The component's sha256, set when it is loaded: its calls' metrics
    /// are labelled with it, so that two versions of one name stay apart.
    pub digest: String,
    /// Load a tool whose parameter schema fails the check, with a warning,
    /// instead of refusing it: for versions sessions already use, accepted
    /// before the check existed. New versions are always checked.
    pub keep_bad_tool_schemas: bool,
}

impl ComponentSettings {
    /// No grants, default limits, empty config.
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ..Self::default()
        }
    }

    pub fn with_grants(mut self, grants: Grants) -> Self {
        self.grants = grants;
        self
    }

    pub fn with_limits(mut self, limits: ComponentLimits) -> Self {
        self.limits = limits;
        self
    }

    pub fn with_config(mut self, config: BTreeMap<String, String>) -> Self {
        self.config = Arc::new(config);
        self
    }
}

/// The two worlds of `dex:agents`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum World {
    Runner,
    Tool,
}

impl World {
    pub fn name(self) -> &'static str {
        match self {
            World::Runner => "dex:agents/runner@0.2.0",
            World::Tool => "dex:agents/tool@0.2.0",
        }
    }

    fn required_exports(self) -> &'static [&'static str] {
        match self {
            World::Runner => &[
                "build-user-message",
                "run-model-step",
                "execute-deferred-tool-call",
            ],
            World::Tool => &["list-tools", "call"],
        }
    }
}

/// Identity and provenance of a loaded component.
#[derive(Clone, Debug)]
pub struct ComponentInfo {
    pub name: String,
    pub sha256: String,
    pub world: World,
    /// Whether this load compiled the component or took it from the cache.
    pub cache: CacheOutcome,
    /// Exports beyond the world's, which the host never calls: toolchains
    /// add their own (componentize-py exports an `exports` interface with
    /// `init`). Shown by `dexa component inspect`.
    pub extra_exports: Vec<String>,
}

struct Compiled {
    component: Component,
    info: ComponentInfo,
}

impl SandboxEngine {
    fn compile_for(
        &self,
        world: World,
        wasm: &[u8],
        settings: &mut ComponentSettings,
    ) -> Result<Compiled, LoadError> {
        let name = settings.name.clone();
        settings
            .grants
            .resolve()
            .map_err(|reason| LoadError::Grant {
                name: name.clone(),
                reason,
            })?;
        settings
            .limits
            .validate(self)
            .map_err(|reason| LoadError::Limits {
                name: name.clone(),
                reason,
            })?;
        let sha256 = sha256_hex(wasm);
        settings.digest = sha256.clone();
        let (component, cache) = match self.cache() {
            Some(cache) => cache.load_or_compile(self.engine(), &name, &sha256, wasm),
            None => compile(self.engine(), &name, wasm)
                .map(|component| (component, CacheOutcome::CompiledUncached)),
        }
        .map_err(|reason| LoadError::Compile {
            name: name.clone(),
            reason,
        })?;
        super::wit_version::check_imports(self.engine(), &name, &component)?;
        let extra_exports = self.check_exports(world, &name, &component)?;
        if !extra_exports.is_empty() {
            tracing::debug!(component = %name, extra = ?extra_exports, "exports the host does not call");
        }
        Ok(Compiled {
            component,
            info: ComponentInfo {
                name,
                sha256,
                world,
                cache,
                extra_exports,
            },
        })
    }

    /// Names the missing exports, which says more than a failed type lookup.
    /// Returns the exports beyond the world's: they are allowed and ignored.
    fn check_exports(
        &self,
        world: World,
        name: &str,
        component: &Component,
    ) -> Result<Vec<String>, LoadError> {
        let exported: Vec<String> = component
            .component_type()
            .exports(self.engine())
            .map(|(export, _)| export.to_string())
            .collect();
        let missing: Vec<&str> = world
            .required_exports()
            .iter()
            .copied()
            .filter(|required| !exported.iter().any(|e| e == required))
            .collect();
        if missing.is_empty() {
            let required = world.required_exports();
            return Ok(exported
                .into_iter()
                .filter(|e| !required.contains(&e.as_str()))
                .collect());
        }
        let quote = |names: Vec<String>| {
            if names.is_empty() {
                "nothing".to_string()
            } else {
                names
                    .iter()
                    .map(|n| format!("`{n}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        Err(LoadError::WrongWorld {
            name: name.to_string(),
            world: world.name(),
            missing: quote(missing.into_iter().map(str::to_string).collect()),
            found: quote(exported),
        })
    }

    fn linker(&self, world: World) -> wasmtime::Result<Linker<CallState>> {
        let mut linker = Linker::new(self.engine());
        wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
        // Linked for every component; only granted authorities are reachable.
        wasmtime_wasi_http::p2::add_only_http_to_linker_async(&mut linker)?;
        match world {
            World::Runner => Runner::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)?,
            World::Tool => Tool::add_to_linker::<_, HasSelf<_>>(&mut linker, |s| s)?,
        }
        Ok(linker)
    }

    fn link_error(world: World, name: &str, err: wasmtime::Error) -> LoadError {
        LoadError::Link {
            name: name.to_string(),
            world: world.name(),
            reason: format!("{err:#}"),
        }
    }

    /// Loads a runner component from its bytes.
    pub fn load_runner(
        &self,
        wasm: &[u8],
        settings: ComponentSettings,
    ) -> Result<RunnerComponent, LoadError> {
        let world = World::Runner;
        let mut settings = settings;
        let compiled = self.compile_for(world, wasm, &mut settings)?;
        let name = &settings.name;
        let instance_pre = self
            .linker(world)
            .and_then(|linker| linker.instantiate_pre(&compiled.component))
            .map_err(|err| Self::link_error(world, name, err))?;
        let pre = RunnerPre::new(instance_pre).map_err(|err| Self::link_error(world, name, err))?;
        Ok(RunnerComponent {
            callable: Callable::new(self, settings, pre),
            info: compiled.info,
        })
    }

    /// Loads a tool component from its bytes and asks it for its tools.
    pub async fn load_tool(
        &self,
        wasm: &[u8],
        settings: ComponentSettings,
    ) -> Result<ToolComponent, LoadError> {
        let world = World::Tool;
        let mut settings = settings;
        let compiled = self.compile_for(world, wasm, &mut settings)?;
        let name = settings.name.clone();
        let instance_pre = self
            .linker(world)
            .and_then(|linker| linker.instantiate_pre(&compiled.component))
            .map_err(|err| Self::link_error(world, &name, err))?;
        let pre = ToolPre::new(instance_pre).map_err(|err| Self::link_error(world, &name, err))?;
        let mut tool = ToolComponent {
            callable: Callable::new(self, settings, pre),
            info: compiled.info,
            tools: Vec::new(),
        };
        let env = CallEnv::new(StepTag {
            flow_id: String::new(),
            turn_id: String::new(),
            step_execution_id: format!("load:{name}"),
            attempt: 1,
        })
        .with_timeout(std::time::Duration::from_secs(30));
        tool.tools = tool
            .list_tools(env)
            .await
            .map_err(|source| LoadError::ListTools {
                name: name.clone(),
                source: Box::new(source),
            })?;
        // A schema the model could not use is refused here, by tool and
        // reason, not found out at the first turn (or sent as another).
        for spec in &tool.tools {
            let Err(source) = tool_schema::check(&spec.parameters_schema) else {
                continue;
            };
            let err = LoadError::ToolSchema {
                name: name.clone(),
                tool: spec.name.clone(),
                source,
            };
            if !tool.callable.settings.keep_bad_tool_schemas {
                return Err(err);
            }
            tracing::warn!(error = %err, "loaded anyway: a version sessions already use");
        }
        Ok(tool)
    }

    /// Loads a runner component from a file.
    pub fn load_runner_file(
        &self,
        path: &Path,
        settings: ComponentSettings,
    ) -> Result<RunnerComponent, LoadError> {
        let wasm = read_component(path)?;
        self.load_runner(&wasm, settings)
    }

    /// Loads a tool component from a file.
    pub async fn load_tool_file(
        &self,
        path: &Path,
        settings: ComponentSettings,
    ) -> Result<ToolComponent, LoadError> {
        let wasm = read_component(path)?;
        self.load_tool(&wasm, settings).await
    }
}

fn read_component(path: &Path) -> Result<Vec<u8>, LoadError> {
    std::fs::read(path).map_err(|source| LoadError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// What one call needs, owned, so that it can run on the guest pool.
struct Callable<P> {
    engine: SandboxEngine,
    settings: Arc<ComponentSettings>,
    /// At most `max_concurrent_calls` calls at once.
    slots: Arc<Semaphore>,
    pre: P,
}

impl<P: Clone> Clone for Callable<P> {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            settings: self.settings.clone(),
            slots: self.slots.clone(),
            pre: self.pre.clone(),
        }
    }
}

impl<P> Callable<P> {
    fn new(engine: &SandboxEngine, settings: ComponentSettings, pre: P) -> Self {
        Self {
            engine: engine.clone(),
            slots: Arc::new(Semaphore::new(settings.limits.max_concurrent_calls)),
            settings: Arc::new(settings),
            pre,
        }
    }

    fn name(&self) -> &str {
        &self.settings.name
    }

    async fn begin(
        &self,
        env: CallEnv,
        export: &'static str,
        model_allowed: bool,
    ) -> Result<Call, CallError> {
        Call::begin(
            &self.engine,
            &self.settings,
            &self.slots,
            env,
            export,
            model_allowed,
        )
        .await
    }

    fn instantiate_error(&self, err: wasmtime::Error) -> CallError {
        CallError::Instantiate {
            component: self.settings.name.clone(),
            reason: format!("{err:#}"),
        }
    }
}

impl Callable<RunnerPre<CallState>> {
    async fn instantiate(&self, call: &mut Call) -> Result<Runner, CallError> {
        self.pre
            .instantiate_async(&mut call.store)
            .await
            .map_err(|err| self.instantiate_error(err))
    }
}

impl Callable<ToolPre<CallState>> {
    async fn instantiate(&self, call: &mut Call) -> Result<Tool, CallError> {
        self.pre
            .instantiate_async(&mut call.store)
            .await
            .map_err(|err| self.instantiate_error(err))
    }
}

/// A loaded runner. Each call runs in a new instance, on the guest pool.
pub struct RunnerComponent {
    callable: Callable<RunnerPre<CallState>>,
    info: ComponentInfo,
}

impl RunnerComponent {
    pub fn info(&self) -> &ComponentInfo {
        &self.info
    }

    /// `build-user-message`.
    pub async fn build_user_message(
        &self,
        env: CallEnv,
        text: &str,
    ) -> Result<FrameworkMessage, CallError> {
        let this = self.callable.clone();
        let text = text.to_string();
        guest_pool::run(self.callable.name(), async move {
            let mut call = this.begin(env, "build-user-message", false).await?;
            let runner = this.instantiate(&mut call).await?;
            let result = with_deadline(
                call.deadline,
                runner.call_build_user_message(&mut call.store, &text),
            )
            .await;
            call.finish(result)
        })
        .await
    }

    /// `run-model-step`. The only export that may call the model. Takes the
    /// turn by value: a call may move to the guest pool. The history handle
    /// is made in the call's own store.
    pub async fn run_model_step(
        &self,
        env: CallEnv,
        turn: TurnInput,
    ) -> Result<Result<TurnOutcome, String>, CallError> {
        let this = self.callable.clone();
        guest_pool::run(self.callable.name(), async move {
            let mut call = this.begin(env, "run-model-step", true).await?;
            let history = History::new(turn.history.clone());
            let handle = call
                .store
                .data_mut()
                .table()
                .push(history)
                .map_err(|err| this.instantiate_error(err.into()))?;
            let turn = turn.into_context(handle);
            let runner = this.instantiate(&mut call).await?;
            let result = with_deadline(
                call.deadline,
                runner.call_run_model_step(&mut call.store, &turn),
            )
            .await;
            let outcome = call.finish(result)?;
            let bytes = run_state_bytes(&outcome);
            let limit = this.settings.limits.run_state_bytes;
            if bytes > limit {
                return Err(CallError::LimitExceeded {
                    component: this.settings.name.clone(),
                    export: "run-model-step",
                    reason: format!(
                        "its framework run state is {bytes} bytes, over the limit of {limit} bytes"
                    ),
                });
            }
            Ok(outcome)
        })
        .await
    }

    /// `execute-deferred-tool-call`.
    pub async fn execute_deferred_tool_call(
        &self,
        env: CallEnv,
        execution: &DeferredToolExecution,
    ) -> Result<Result<String, ToolError>, CallError> {
        let this = self.callable.clone();
        let execution = execution.clone();
        guest_pool::run(self.callable.name(), async move {
            let mut call = this.begin(env, "execute-deferred-tool-call", false).await?;
            let runner = this.instantiate(&mut call).await?;
            let result = with_deadline(
                call.deadline,
                runner.call_execute_deferred_tool_call(&mut call.store, &execution),
            )
            .await;
            call.finish(result)
        })
        .await
    }
}

/// A loaded tool component and the tools it serves. Each call runs in a new
/// instance, on the guest pool.
pub struct ToolComponent {
    callable: Callable<ToolPre<CallState>>,
    info: ComponentInfo,
    tools: Vec<ToolSpec>,
}

impl ToolComponent {
    pub fn info(&self) -> &ComponentInfo {
        &self.info
    }

    /// The tools `list-tools` returned at load.
    pub fn tools(&self) -> &[ToolSpec] {
        &self.tools
    }

    /// Whether this component serves `tool_name`.
    pub fn serves(&self, tool_name: &str) -> bool {
        self.tools.iter().any(|tool| tool.name == tool_name)
    }

    /// `list-tools`, in a fresh instance.
    pub async fn list_tools(&self, env: CallEnv) -> Result<Vec<ToolSpec>, CallError> {
        let this = self.callable.clone();
        guest_pool::run(self.callable.name(), async move {
            let mut call = this.begin(env, "list-tools", false).await?;
            let tool = this.instantiate(&mut call).await?;
            let result = with_deadline(call.deadline, tool.call_list_tools(&mut call.store)).await;
            call.finish(result)
        })
        .await
    }

    /// `call`, in a fresh instance.
    pub async fn call(
        &self,
        env: CallEnv,
        execution: &DeferredToolExecution,
    ) -> Result<Result<String, ToolError>, CallError> {
        let this = self.callable.clone();
        let execution = execution.clone();
        guest_pool::run(self.callable.name(), async move {
            let mut call = this.begin(env, "call", false).await?;
            let tool = this.instantiate(&mut call).await?;
            let result =
                with_deadline(call.deadline, tool.call_call(&mut call.store, &execution)).await;
            call.finish(result)
        })
        .await
    }
}
