//! A session stack for tests: a private SQLite store in a temp dir, the guest
//! components loaded into a sandbox engine, one AgentSessionFlow per agent,
//! and an in-process worker that can be stopped and started again.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dexa::flow::{FlowClient, FlowStore, Registry, StepHistoryEntry, Worker, WorkerOptions};
use dexa::plugin::{ComponentSettings, DirAccess, Grants, ModelProvider, SandboxEngine};
use dexa::session::{
    AgentComponents, AgentEvent, AgentSessionClient, AgentSessionFlow, AgentSessionOptions,
    AgentSnapshot,
};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::toy::wait_until;
use crate::{guest_bytes, test_engine};

/// One agent of a stack.
pub struct AgentSpec {
    pub flow_type: String,
    pub runner: String,
    pub runner_config: BTreeMap<String, String>,
    /// Guest names of the tool components, each with its grants.
    pub tools: Vec<(String, Grants)>,
    pub options: AgentSessionOptions,
    pub model: Option<Arc<dyn ModelProvider>>,
}

impl AgentSpec {
    /// An agent run by the scripted runner, with no tool components.
    pub fn scripted(flow_type: &str) -> Self {
        Self {
            flow_type: flow_type.to_string(),
            runner: "scripted-runner".to_string(),
            runner_config: BTreeMap::new(),
            tools: Vec::new(),
            options: AgentSessionOptions::default(),
            model: None,
        }
    }

    pub fn tool(mut self, guest: &str, grants: Grants) -> Self {
        self.tools.push((guest.to_string(), grants));
        self
    }

    pub fn options(mut self, options: AgentSessionOptions) -> Self {
        self.options = options;
        self
    }

    pub fn runner_config(mut self, key: &str, value: &str) -> Self {
        self.runner_config
            .insert(key.to_string(), value.to_string());
        self
    }

    pub fn model(mut self, model: Arc<dyn ModelProvider>) -> Self {
        self.model = Some(model);
        self
    }
}

struct RunningWorker {
    shutdown: oneshot::Sender<()>,
    handle: JoinHandle<()>,
}

/// The store, the agents and an in-process worker.
pub struct SessionStack {
    pub dir: tempfile::TempDir,
    pub store: Arc<dyn FlowStore>,
    /// Which backend `store` is.
    pub backend: Backend,
    pub engine: SandboxEngine,
    pub registry: Arc<Registry>,
    flows: Vec<AgentSessionFlow>,
    worker: Option<RunningWorker>,
}

/// Which store backend a [`SessionStack`] opens: the session suite runs
/// every test on each (see its `backends!`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

tokio::task_local! {
    /// The backend of the test running in this task (SQLite when unset).
    pub static BACKEND: Backend;
}

impl Backend {
    /// The backend of the running test.
    pub fn current() -> Self {
        BACKEND
            .try_with(|backend| *backend)
            .unwrap_or(Backend::Sqlite)
    }
}

/// The store of `dir`: its SQLite file, or its schema on the test
/// PostgreSQL server (`DEXA_TEST_POSTGRES`).
async fn open_store(backend: Backend, dir: &std::path::Path) -> Arc<dyn FlowStore> {
    match backend {
        Backend::Sqlite => Arc::new(
            dexa::store::sqlite::SqliteStore::open(dir.join("store.sqlite"), Default::default())
                .unwrap_or_else(|err| panic!("open store: {err}")),
        ),
        Backend::Postgres => {
            let address = crate::toy::postgres_address(dir);
            let url = dexa::store::postgres::PostgresUrl::parse(&address)
                .unwrap_or_else(|err| panic!("{address}: {err}"));
            Arc::new(
                dexa::store::postgres::PostgresStore::connect(url)
                    .await
                    .unwrap_or_else(|err| panic!("open {address}: {err}")),
            )
        }
    }
}

impl SessionStack {
    /// Loads the agents' components. `gate-tool` is always granted the stack's
    /// [`SessionStack::gates_dir`] at `/gates`, read-write.
    pub async fn new(agents: Vec<AgentSpec>) -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("temp dir: {err}"));
        std::fs::create_dir_all(dir.path().join("gates"))
            .unwrap_or_else(|err| panic!("gates dir: {err}"));
        let backend = Backend::current();
        let store = open_store(backend, dir.path()).await;
        let engine = test_engine();
        let mut flows = Vec::new();
        for agent in agents {
            let runner = engine
                .load_runner(
                    &guest_bytes(&agent.runner),
                    ComponentSettings::named(agent.runner.clone()).with_config(agent.runner_config),
                )
                .unwrap_or_else(|err| panic!("load {}: {err}", agent.runner));
            let mut tools = Vec::new();
            for (guest, mut grants) in agent.tools {
                if guest == "gate-tool" {
                    grants = grants.dir(dir.path().join("gates"), "/gates", DirAccess::ReadWrite);
                }
                let tool = engine
                    .load_tool(
                        &guest_bytes(&guest),
                        ComponentSettings::named(guest.clone()).with_grants(grants),
                    )
                    .await
                    .unwrap_or_else(|err| panic!("load {guest}: {err}"));
                tools.push(Arc::new(tool));
            }
            let mut components = AgentComponents::new(Arc::new(runner), tools)
                .unwrap_or_else(|err| panic!("agent {}: {err}", agent.flow_type));
            if let Some(model) = agent.model {
                components = components.with_model(model);
            }
            flows.push(AgentSessionFlow::new(
                agent.flow_type,
                components,
                agent.options,
            ));
        }
        let registry = Arc::new(
            Registry::new(flows.iter().map(AgentSessionFlow::definition))
                .unwrap_or_else(|err| panic!("registry: {err}")),
        );
        Self {
            dir,
            store,
            backend,
            engine,
            registry,
            flows,
            worker: None,
        }
    }

    /// Another handle on the stack's store, as another process opens it.
    pub async fn another_handle(&self) -> Arc<dyn FlowStore> {
        open_store(self.backend, self.dir.path()).await
    }

    /// The directory `/gates` of `gate-tool` maps to.
    pub fn gates_dir(&self) -> PathBuf {
        self.dir.path().join("gates")
    }

    /// Starts the in-process worker.
    pub fn start_worker(&mut self) {
        if self.worker.is_some() {
            return;
        }
        let (shutdown, stop) = oneshot::channel::<()>();
        let worker = Worker::new(
            self.store.clone(),
            self.registry.clone(),
            WorkerOptions {
                poll_interval: Duration::from_millis(50),
                ..WorkerOptions::default()
            },
        );
        let handle = tokio::spawn(worker.run(async move {
            let _ = stop.await;
        }));
        self.worker = Some(RunningWorker { shutdown, handle });
    }

    /// Stops the in-process worker and waits for it.
    pub async fn stop_worker(&mut self) {
        if let Some(worker) = self.worker.take() {
            let _ = worker.shutdown.send(());
            let _ = worker.handle.await;
        }
    }

    pub fn flow_client(&self) -> FlowClient {
        FlowClient::new(self.store.clone(), self.registry.clone())
    }

    /// The session client of agent `flow_type`.
    pub fn sessions(&self, flow_type: &str) -> AgentSessionClient {
        assert!(
            self.flows.iter().any(|f| f.flow_type() == flow_type),
            "no agent {flow_type} in this stack"
        );
        AgentSessionClient::new(self.flow_client(), flow_type)
    }

    pub async fn step_history(&self, session_id: &str) -> Vec<StepHistoryEntry> {
        self.store
            .step_history(session_id)
            .await
            .unwrap_or_else(|err| panic!("step history: {err}"))
    }

    /// Lines of `gate-tool`'s invocation log.
    pub fn invocations(&self) -> Vec<String> {
        std::fs::read_to_string(self.gates_dir().join("invocations.log"))
            .map(|text| text.lines().map(str::to_string).collect())
            .unwrap_or_default()
    }
}

impl Drop for SessionStack {
    fn drop(&mut self) {
        if let Some(worker) = self.worker.take() {
            let _ = worker.shutdown.send(());
            worker.handle.abort();
        }
    }
}

/// Polls the snapshot until `accept` returns something, for up to 20 s.
pub async fn wait_for_agent_snapshot<T>(
    sessions: &AgentSessionClient,
    session_id: &str,
    description: &str,
    accept: impl Fn(&AgentSnapshot) -> Option<T>,
) -> T {
    wait_for_agent_snapshot_within(sessions, session_id, description, WAIT, accept).await
}

/// How long the waits above poll before they fail the test.
const WAIT: Duration = Duration::from_secs(20);

/// [`wait_for_agent_snapshot`] with its own bound on the wait.
pub async fn wait_for_agent_snapshot_within<T>(
    sessions: &AgentSessionClient,
    session_id: &str,
    description: &str,
    deadline: Duration,
    accept: impl Fn(&AgentSnapshot) -> Option<T>,
) -> T {
    wait_until(description, deadline, || {
        let sessions = sessions.clone();
        let accept = &accept;
        async move {
            let snapshot = sessions.get_agent_snapshot(session_id).await.ok()?;
            accept(&snapshot)
        }
    })
    .await
}

/// Waits until the session has completed or failed `turns` turns and waits
/// for the next message.
pub async fn wait_for_turns(
    sessions: &AgentSessionClient,
    session_id: &str,
    turns: u64,
) -> AgentSnapshot {
    wait_for_turns_within(sessions, session_id, turns, WAIT).await
}

/// [`wait_for_turns`] with its own bound on the wait.
pub async fn wait_for_turns_within(
    sessions: &AgentSessionClient,
    session_id: &str,
    turns: u64,
    deadline: Duration,
) -> AgentSnapshot {
    wait_for_agent_snapshot_within(
        sessions,
        session_id,
        &format!("{turns} finished turn(s)"),
        deadline,
        |s| {
            let state = s.state.as_ref()?;
            (state.turn_count >= turns
                && state.active_turn_id.is_none()
                && s.queued_message_count == 0)
                .then(|| s.clone())
        },
    )
    .await
}

/// Every event of the session so far.
pub async fn all_events(sessions: &AgentSessionClient, session_id: &str) -> Vec<AgentEvent> {
    let mut events = Vec::new();
    let mut after = 0;
    loop {
        let (page, _next) = sessions
            .read_events(session_id, after, 1000)
            .await
            .unwrap_or_else(|err| panic!("read events: {err}"));
        let Some((last, _)) = page.last() else {
            return events;
        };
        after = *last;
        events.extend(page.into_iter().map(|(_, e)| e));
    }
}

/// The text of the session's last message.
pub fn last_text(snapshot: &AgentSnapshot) -> Option<String> {
    snapshot.messages.last().and_then(|m| m.text.clone())
}

/// The texts of the session's messages of `role`, oldest first.
pub fn texts_of(snapshot: &AgentSnapshot, role: dexa::session::MessageRole) -> Vec<String> {
    snapshot
        .messages
        .iter()
        .filter(|m| m.role == role)
        .filter_map(|m| m.text.clone())
        .collect()
}

/// A model answer of `text` with no tool calls (1 input and 1 output token),
/// for a scripted model provider.
pub fn text_answer(text: &str) -> dexa::plugin::wit::ModelResponse {
    use dexa::plugin::wit::{MessageRole, ModelMessage, ModelResponse, Usage};
    ModelResponse {
        message: ModelMessage {
            role: MessageRole::Assistant,
            content: Some(text.to_string()),
            tool_calls: Vec::new(),
            tool_call_id: None,
        },
        usage: Usage {
            input_tokens: 1,
            output_tokens: 1,
            total_tokens: 2,
        },
        finish_reason: "stop".to_string(),
    }
}

/// Runs each named async test function once per store backend, as
/// `sqlite::<name>` and `postgres::<name>` (`DEXA_TEST_POSTGRES`), on a
/// two-thread runtime with [`BACKEND`] set for the stacks it opens.
#[macro_export]
macro_rules! on_each_backend {
    ($($test:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    $crate::session::BACKEND
                        .scope($crate::session::Backend::Sqlite, super::$test())
                        .await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    $crate::session::BACKEND
                        .scope($crate::session::Backend::Postgres, super::$test())
                        .await;
                }
            )*
        }
    };
}
