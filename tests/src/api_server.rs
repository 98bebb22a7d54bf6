//! `dexa serve`'s router on a loopback port, with an in-process worker, for
//! API and web-viewer tests.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dexa::api::{router, ApiState};
use dexa::config::{Deployment, DexaConfig};
use serde_json::Value;

use crate::{guest_wasm, repo_root};

/// Serves `app` on a free loopback port for the rest of the test; its base
/// URL (`http://127.0.0.1:<port>`).
pub async fn serve_on_loopback(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|err| panic!("bind: {err}"));
    let address = listener
        .local_addr()
        .unwrap_or_else(|err| panic!("address: {err}"));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{address}")
}

/// The token the test server wants.
pub const TEST_TOKEN: &str = "test-token-7f3a";

/// The server and its worker; both stop when dropped.
pub struct ApiServer {
    /// `http://127.0.0.1:<port>`
    pub base: String,
    pub dir: tempfile::TempDir,
    pub deployment: Arc<Deployment>,
    server: tokio::task::JoinHandle<()>,
    worker: tokio::task::JoinHandle<()>,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.server.abort();
        self.worker.abort();
    }
}

/// Writes `dexa.toml` into `dir` for agent `Helpdesk`: scripted-runner
/// playing `script`, with gate-tool granted `dir/gates` (its `log` tool is a
/// non-idempotent write, so it needs approval). Returns the file.
pub fn helpdesk_config(dir: &Path, script: &Value) -> PathBuf {
    std::fs::create_dir_all(dir.join("gates")).unwrap_or_else(|err| panic!("gates dir: {err}"));
    let text = format!(
        "store = \"sqlite:store.sqlite\"\ncache_dir = {cache:?}\n[worker]\npoll_interval = \"20ms\"\n\
         [components.runner]\npath = {runner:?}\nconfig = {{ script = {script:?} }}\n\
         [components.gates]\npath = {gates:?}\ndirs = [{{ host = \"gates\", guest = \"/gates\", access = \"read_write\" }}]\n\
         [agents.Helpdesk]\nrunner = \"runner\"\ntools = [\"gates\"]\n\
         tool_policies = {{ log = {{ effect = \"non_idempotent_write\" }} }}\n",
        cache = repo_root().join("target").join("test-component-cache"),
        runner = guest_wasm("scripted-runner"),
        gates = guest_wasm("gate-tool"),
        script = script.to_string(),
    );
    let path = dir.join("dexa.toml");
    std::fs::write(&path, text).unwrap_or_else(|err| panic!("write config: {err}"));
    path
}

impl ApiServer {
    /// Serves [`helpdesk_config`] with an in-process worker.
    pub async fn helpdesk(script: Value) -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("temp dir: {err}"));
        let path = helpdesk_config(dir.path(), &script);
        let config = DexaConfig::load(&path).unwrap_or_else(|err| panic!("{err}"));
        let deployment = Arc::new(
            Deployment::for_workers(config, &|_| {})
                .await
                .unwrap_or_else(|err| panic!("deployment: {err:#}")),
        );
        let worker = tokio::spawn(deployment.worker().run(std::future::pending()));
        let app = router(ApiState::new(
            deployment.clone(),
            Some(Arc::new(TEST_TOKEN.to_string())),
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|err| panic!("bind: {err}"));
        let address = listener
            .local_addr()
            .unwrap_or_else(|err| panic!("address: {err}"));
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Self {
            base: format!("http://{address}"),
            dir,
            deployment,
            server,
            worker,
        }
    }
}
