//! The crash-safety test kit: agents served by real `dexa worker` processes
//! that a test can SIGKILL at an exact point.
//!
//! - [`AgentTestStack`]: a private store and `dexa.toml` in a temp dir, worker
//!   child processes (each in its own process group), kills and replacements;
//! - [`FileGate`]: a tool (`gate-tool`) or the scripted runner (`"gate"` in a
//!   script step) marks `<name>.reached` in the granted `/gates` directory and
//!   waits for `<name>.release`; the test waits until it is reached and kills
//!   the worker there;
//! - [`InvocationLog`]: the real tool and model calls, across processes;
//! - [`wait_until`], [`wait_for_agent_snapshot`] and
//!   [`AgentTestStack::read_step_history`].
//!
//! The workers run `target/<profile>/dexa` (or `$DEXA_BIN`); `cargo test
//! --workspace` builds it.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use dexa::config::{Deployment, DexaConfig, StoreUrl};
use dexa::flow::StepHistoryEntry;
use dexa::session::{AgentSessionClient, ToolEffect};
use serde_json::{json, Value};

pub use crate::session::{wait_for_agent_snapshot, wait_for_turns};
pub use crate::toy::wait_until;
use crate::{guest_wasm, repo_root};

/// The `dexa` binary the workers run.
pub fn dexa_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("DEXA_BIN") {
        return PathBuf::from(path);
    }
    // A test runs as target/<profile>/deps/<test>-<hash>.
    let from_exe = std::env::current_exe().ok().and_then(|exe| {
        exe.parent()
            .and_then(Path::parent)
            .map(|dir| dir.join("dexa"))
    });
    let path = from_exe.unwrap_or_else(|| repo_root().join("target/debug/dexa"));
    assert!(
        path.is_file(),
        "{} is missing; build it with `cargo build -p dexa` (cargo test --workspace does), or set DEXA_BIN",
        path.display()
    );
    path
}

/// Runs `dexa session ARGS --config CONFIG` to its end: the exit code, and
/// what it printed on stdout and stderr.
pub async fn dexa_session(config: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let output = tokio::process::Command::new(dexa_binary())
        .arg("session")
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .await
        .unwrap_or_else(|err| panic!("run dexa session: {err}"));
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// One agent of a stack, run by `scripted-runner` with a script.
pub struct KitAgent {
    pub name: String,
    pub script: Value,
    /// Guest names of its tool components (`gate-tool`, `echo-tool`...).
    pub tools: Vec<String>,
    /// Tool name → (effect, requires_approval).
    pub policies: Vec<(String, ToolEffect, Option<bool>)>,
    /// Extra `key = value` lines for the agent's table.
    pub extra: Vec<String>,
}

impl KitAgent {
    /// `script` is scripted-runner's `{"turns": [...]}`.
    pub fn scripted(name: &str, script: Value) -> Self {
        Self {
            name: name.to_string(),
            script,
            tools: Vec::new(),
            policies: Vec::new(),
            extra: Vec::new(),
        }
    }

    pub fn tool(mut self, guest: &str) -> Self {
        self.tools.push(guest.to_string());
        self
    }

    pub fn policy(
        mut self,
        tool: &str,
        effect: ToolEffect,
        requires_approval: Option<bool>,
    ) -> Self {
        self.policies
            .push((tool.to_string(), effect, requires_approval));
        self
    }

    pub fn extra(mut self, line: &str) -> Self {
        self.extra.push(line.to_string());
        self
    }
}

/// A `dexa worker` child process; SIGKILLed (with its process group) when
/// dropped.
pub struct WorkerProcess {
    child: Child,
    pub name: String,
    pub log: PathBuf,
}

impl WorkerProcess {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL to the worker's process group, then reaps it.
    pub fn kill(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let group = -(self.child.id() as i32);
            // SAFETY: kill(2) with a negative pid signals that process group;
            // the child leads its own group (process_group(0) at spawn).
            unsafe {
                libc::kill(group, libc::SIGKILL);
            }
        }
        let _ = self.child.wait();
    }

    /// Whether it has exited, and how.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGTERM to the worker alone, as a rolling restart sends: it drains.
    pub fn terminate(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: kill(2) with the child's own pid, which it still has
            // (not yet reaped).
            unsafe {
                libc::kill(self.child.id() as i32, libc::SIGTERM);
            }
        }
    }

    /// Waits up to `deadline` for the worker to exit; its status if it did.
    pub async fn wait_for_exit(
        &mut self,
        deadline: std::time::Duration,
    ) -> Option<std::process::ExitStatus> {
        let started = std::time::Instant::now();
        loop {
            if let Some(status) = self.exit_status() {
                return Some(status);
            }
            if started.elapsed() >= deadline {
                return None;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// How the stack's workers run.
#[derive(Clone, Debug)]
pub struct KitSettings {
    pub slots: usize,
    /// A killed worker's Steps are taken over this long after it died.
    pub lease: Duration,
}

impl Default for KitSettings {
    fn default() -> Self {
        Self {
            slots: 16,
            lease: Duration::from_secs(2),
        }
    }
}

/// A private store and config, and `dexa worker` processes serving it.
pub struct AgentTestStack {
    pub dir: tempfile::TempDir,
    pub config_path: PathBuf,
    /// The test's own view: clients of the same store (no components).
    pub deployment: Deployment,
    workers: Vec<WorkerProcess>,
    started: usize,
}

impl AgentTestStack {
    pub fn new(agents: Vec<KitAgent>) -> Self {
        Self::with_settings(agents, KitSettings::default())
    }

    /// Writes `dexa.toml` (every component granted `gates/` at `/gates`,
    /// marked `shared`).
    pub fn with_settings(agents: Vec<KitAgent>, settings: KitSettings) -> Self {
        Self::with_config(|_| render_config(&agents, &settings))
    }

    /// A stack whose `dexa.toml` is `render(stack_dir)`: for tests that need
    /// components, grants or limits the scripted agents do not cover. The
    /// directory already holds `gates/`; relative paths in the file resolve
    /// against it.
    pub fn with_config(render: impl FnOnce(&Path) -> String) -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("temp dir: {err}"));
        std::fs::create_dir_all(dir.path().join("gates"))
            .unwrap_or_else(|err| panic!("gates dir: {err}"));
        let mut config = render(dir.path());
        // The session suite's backend switch: the same stack on PostgreSQL.
        let backend = crate::session::Backend::current();
        if backend == crate::session::Backend::Postgres {
            let sqlite = "store = \"sqlite:store.sqlite\"";
            assert!(
                config.contains(sqlite),
                "the kit's config names its store: {config}"
            );
            let address = crate::toy::postgres_address(dir.path());
            config = config.replace(sqlite, &format!("store = {address:?}"));
        }
        let config_path = dir.path().join("dexa.toml");
        std::fs::write(&config_path, &config).unwrap_or_else(|err| panic!("write config: {err}"));
        let parsed = DexaConfig::load(&config_path)
            .unwrap_or_else(|err| panic!("the kit's config is invalid: {err}\n{config}"));
        // A PostgreSQL store keeps its connections on the test's runtime
        // (a multi-threaded one); SQLite holds nothing on a runtime, so a
        // runtime of its own on a thread of its own opens it from sync code,
        // inside or outside a test's runtime.
        let deployment = match parsed.store {
            StoreUrl::Postgres(_) => tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(Deployment::for_clients(parsed))
            }),
            StoreUrl::Sqlite(..) => std::thread::scope(|scope| {
                scope
                    .spawn(|| {
                        tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .unwrap_or_else(|err| panic!("runtime: {err}"))
                            .block_on(Deployment::for_clients(parsed))
                    })
                    .join()
                    .unwrap_or_else(|_| panic!("opening the deployment panicked"))
            }),
        }
        .unwrap_or_else(|err| panic!("deployment: {err:#}"));
        Self {
            dir,
            config_path,
            deployment,
            workers: Vec::new(),
            started: 0,
        }
    }

    /// Starts a `dexa worker` process with `args` added; returns its index.
    pub fn start_worker_with(&mut self, args: &[&str]) -> usize {
        self.start_worker_with_env(args, &[])
    }

    /// Starts a `dexa worker` process with `args` added and `env` set in its
    /// environment (for components granted environment variables, or for
    /// variables a test checks a guest cannot see).
    pub fn start_worker_with_env(&mut self, args: &[&str], env: &[(&str, &str)]) -> usize {
        self.started += 1;
        let name = format!("worker-{}", self.started);
        let log = self.dir.path().join(format!("{name}.log"));
        let out = std::fs::File::create(&log).unwrap_or_else(|err| panic!("worker log: {err}"));
        let err = out
            .try_clone()
            .unwrap_or_else(|err| panic!("worker log: {err}"));
        let mut command = Command::new(dexa_binary());
        command
            .arg("worker")
            .arg("--config")
            .arg(&self.config_path)
            .arg("--worker-id")
            .arg(&name)
            .args(args)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        // SAFETY: prctl is async-signal-safe; the worker dies with the test.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = command
            .spawn()
            .unwrap_or_else(|err| panic!("spawn {}: {err}", dexa_binary().display()));
        self.workers.push(WorkerProcess { child, name, log });
        self.workers.len() - 1
    }

    pub fn start_worker(&mut self) -> usize {
        self.start_worker_with(&[])
    }

    /// SIGKILLs worker `index`.
    pub fn kill_worker(&mut self, index: usize) {
        self.workers[index].kill();
    }

    pub fn worker(&mut self, index: usize) -> &mut WorkerProcess {
        &mut self.workers[index]
    }

    /// What worker `index` printed.
    /// How many workers were started (killed ones too).
    pub fn worker_count(&self) -> usize {
        self.workers.len()
    }

    pub fn worker_log(&self, index: usize) -> String {
        std::fs::read_to_string(&self.workers[index].log).unwrap_or_default()
    }

    pub fn sessions(&self, agent: &str) -> AgentSessionClient {
        self.deployment
            .sessions(agent)
            .unwrap_or_else(|err| panic!("{err:#}"))
    }

    pub fn gates_dir(&self) -> PathBuf {
        self.dir.path().join("gates")
    }

    pub fn gate(&self, name: &str) -> FileGate {
        FileGate::new(self.gates_dir(), name)
    }

    pub fn invocations(&self) -> InvocationLog {
        InvocationLog::new(self.gates_dir().join("invocations.log"))
    }

    /// The completed Steps of `flow_id`, oldest first.
    pub async fn read_step_history(&self, flow_id: &str) -> Vec<StepHistoryEntry> {
        self.deployment
            .store
            .step_history(flow_id)
            .await
            .unwrap_or_else(|err| panic!("step history: {err}"))
    }
}

/// The `dexa.toml` of `agents` (see [`AgentTestStack::with_settings`]), for a
/// test that adds to it.
pub fn render_config(agents: &[KitAgent], settings: &KitSettings) -> String {
    // Every component shares the one gates directory, on purpose.
    let gates =
        json!([{"host": "gates", "guest": "/gates", "access": "read_write", "shared": true}]);
    let mut components = serde_json::Map::new();
    let mut agent_tables = serde_json::Map::new();
    for agent in agents {
        let runner = format!("{}-runner", agent.name);
        components.insert(
            runner.clone(),
            json!({
                "path": guest_wasm("scripted-runner"),
                "dirs": gates,
                "config": {"script": agent.script.to_string()},
            }),
        );
        for tool in &agent.tools {
            components.insert(
                tool.clone(),
                json!({"path": guest_wasm(tool), "dirs": gates}),
            );
        }
        let policies: serde_json::Map<String, Value> = agent
            .policies
            .iter()
            .map(|(tool, effect, approval)| {
                let mut policy = json!({"effect": effect.as_str()});
                if let Some(approval) = approval {
                    policy["requires_approval"] = json!(approval);
                }
                (tool.clone(), policy)
            })
            .collect();
        agent_tables.insert(
            agent.name.clone(),
            json!({"runner": runner, "tools": agent.tools, "tool_policies": policies}),
        );
    }
    let document = json!({
        "store": "sqlite:store.sqlite",
        "cache_dir": repo_root().join("target").join("test-component-cache"),
        "worker": {
            "slots": settings.slots,
            "lease": format!("{}ms", settings.lease.as_millis()),
            "poll_interval": "50ms",
            "reap_interval": "100ms",
        },
        "components": components,
        "agents": agent_tables,
    });
    let mut text =
        toml::to_string(&document).unwrap_or_else(|err| panic!("render dexa.toml: {err}"));
    // Extra agent lines go under each agent's own table.
    for agent in agents {
        if agent.extra.is_empty() {
            continue;
        }
        let header = format!("[agents.{}]\n", agent.name);
        let at = text
            .find(&header)
            .unwrap_or_else(|| panic!("no table for agent {} in\n{text}", agent.name));
        let lines: String = agent.extra.iter().map(|l| format!("{l}\n")).collect();
        text.insert_str(at + header.len(), &lines);
    }
    text
}

/// (event, attempt) of every Step history entry of `step_type`.
pub fn entries(history: &[dexa::flow::StepHistoryEntry], step_type: &str) -> Vec<(String, u32)> {
    history
        .iter()
        .filter(|e| e.step_type == step_type)
        .map(|e| (e.event_type.clone(), e.final_attempt))
        .collect()
}

/// A gate in the stack's `/gates` directory.
#[derive(Clone, Debug)]
pub struct FileGate {
    dir: PathBuf,
    pub name: String,
}

impl FileGate {
    pub fn new(dir: PathBuf, name: &str) -> Self {
        Self {
            dir,
            name: name.to_string(),
        }
    }

    pub fn is_reached(&self) -> bool {
        self.dir.join(format!("{}.reached", self.name)).exists()
    }

    /// Waits (up to 30 s) until a call has reached the gate.
    pub async fn wait_until_reached(&self) {
        let gate = self.clone();
        wait_until(
            &format!("gate {} to be reached", self.name),
            Duration::from_secs(30),
            || {
                let reached = gate.is_reached();
                async move { reached.then_some(()) }
            },
        )
        .await
    }

    /// Lets every call waiting at the gate (and every later one) through.
    pub fn release(&self) {
        let path = self.dir.join(format!("{}.release", self.name));
        std::fs::write(&path, b"").unwrap_or_else(|err| panic!("release {}: {err}", self.name));
    }
}

/// `/gates/invocations.log`: one line `<name> <key>` per real call, written
/// by `gate-tool` (key: the idempotency key) and by the scripted runner's
/// `log`/`gate` steps (key: `<flow>/<turn>#<attempt>`).
#[derive(Clone, Debug)]
pub struct InvocationLog {
    path: PathBuf,
}

impl InvocationLog {
    pub fn new(path: PathBuf) -> Self {
        Self { path }
    }

    /// Every (name, key), in the order they were written.
    pub fn entries(&self) -> Vec<(String, String)> {
        std::fs::read_to_string(&self.path)
            .unwrap_or_default()
            .lines()
            .filter_map(|line| {
                line.split_once(' ')
                    .map(|(name, key)| (name.to_string(), key.to_string()))
            })
            .collect()
    }

    /// How many calls `name` has had.
    pub fn count(&self, name: &str) -> usize {
        self.keys(name).len()
    }

    /// The keys of `name`'s calls, oldest first.
    pub fn keys(&self, name: &str) -> Vec<String> {
        self.entries()
            .into_iter()
            .filter(|(n, _)| n == name)
            .map(|(_, key)| key)
            .collect()
    }

    /// Waits (up to 30 s) until `name` has had at least `n` calls.
    pub async fn wait_for_count(&self, name: &str, n: usize) {
        self.wait_for_count_within(name, n, Duration::from_secs(30))
            .await
    }

    /// [`Self::wait_for_count`] with its own bound on the wait.
    pub async fn wait_for_count_within(&self, name: &str, n: usize, deadline: Duration) {
        let log = self.clone();
        wait_until(&format!("{n} call(s) of {name}"), deadline, || {
            let count = log.count(name);
            async move { (count >= n).then_some(()) }
        })
        .await
    }
}

/// What the host says of a component: `dexa component inspect --world
/// <world> <wasm>` on the tests' component cache, as JSON.
pub fn inspect_component(world: &str, wasm: &Path) -> Value {
    let output = Command::new(dexa_binary())
        .args(["component", "inspect", "--world", world])
        .arg(wasm)
        .arg("--cache-dir")
        .arg(repo_root().join("target").join("test-component-cache"))
        .output()
        .unwrap_or_else(|err| panic!("run {}: {err}", dexa_binary().display()));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "dexa component inspect {}: {stdout}\n{}",
        wasm.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(&stdout)
        .unwrap_or_else(|err| panic!("inspect printed no JSON ({err}): {stdout}"))
}

/// A copy of `examples/<name>` at the same depth under `root`, with
/// `target/guests` linked to the built guests, so that its relative paths
/// hold and the repository's `.dexa` is untouched. Returns the copied config.
pub fn example_copy(root: &Path, name: &str) -> PathBuf {
    let example = root.join("examples").join(name);
    std::fs::create_dir_all(&example).unwrap_or_else(|err| panic!("example dir: {err}"));
    for file in ["dexa.toml", "responses.json"] {
        std::fs::copy(
            repo_root().join("examples").join(name).join(file),
            example.join(file),
        )
        .unwrap_or_else(|err| panic!("copy examples/{name}/{file}: {err}"));
    }
    std::fs::create_dir_all(root.join("target")).unwrap_or_else(|err| panic!("target: {err}"));
    std::os::unix::fs::symlink(crate::guests_dir(), root.join("target").join("guests"))
        .unwrap_or_else(|err| panic!("link the guests: {err}"));
    example.join("dexa.toml")
}

/// Runs `dexa demo` on `config` with `args` added, the tests' component
/// cache and `env` (without `DEXA_MODEL` unless given); returns stdout and
/// stderr of a run that succeeded.
pub async fn run_demo(config: &Path, args: &[&str], env: &[(&str, &str)]) -> (String, String) {
    let mut command = tokio::process::Command::new(dexa_binary());
    command
        .arg("demo")
        .arg("--config")
        .arg(config)
        .args(args)
        .arg("--cache-dir")
        .arg(repo_root().join("target").join("test-component-cache"))
        .env_remove("DEXA_MODEL")
        .kill_on_drop(true);
    for (name, value) in env {
        command.env(name, value);
    }
    let output = command
        .output()
        .await
        .unwrap_or_else(|err| panic!("run {}: {err}", dexa_binary().display()));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        output.status.success(),
        "dexa demo failed:\n{stdout}\n{stderr}"
    );
    (stdout, stderr)
}
