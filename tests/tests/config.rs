//! `dexa.toml` turned into running agents: Deployment::for_workers loads the
//! components, grants and model providers it names.

use std::time::Duration;

use dexa::config::{Deployment, DexaConfig};
use dexa_tests::kit::wait_for_turns;
use dexa_tests::session::last_text;
use dexa_tests::{guest_wasm, repo_root};
use serde_json::json;

fn write_config(dir: &std::path::Path, body: &str) -> DexaConfig {
    let cache = repo_root().join("target").join("test-component-cache");
    let text = format!(
        "store = \"sqlite:store.sqlite\"\ncache_dir = {cache:?}\n\n[worker]\nlease = \"2s\"\npoll_interval = \"50ms\"\n\n{body}"
    );
    let path = dir.join("dexa.toml");
    std::fs::write(&path, &text).unwrap();
    DexaConfig::load(&path).unwrap_or_else(|err| panic!("{err}\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scripted_model_from_the_config_answers_through_the_runner() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("responses.json"),
        json!([{"text": "replayed answer", "usage": {"input": 7, "output": 3}}]).to_string(),
    )
    .unwrap();
    let script = json!({"turns": [{"steps": [{"model": true}]}]}).to_string();
    let config = write_config(
        dir.path(),
        &format!(
            "[components.runner]\npath = {:?}\nconfig = {{ script = {script:?} }}\n\n\
             [models.replay]\nprovider = \"scripted\"\nresponses = \"responses.json\"\n\n\
             [agents.Replay]\nrunner = \"runner\"\nmodel = \"replay\"\n",
            guest_wasm("scripted-runner")
        ),
    );
    let loaded = std::sync::Mutex::new(Vec::new());
    let deployment = Deployment::for_workers(config, &|progress| {
        if let Ok(mut loaded) = loaded.lock() {
            loaded.push(progress);
        }
    })
    .await
    .unwrap_or_else(|err| panic!("{err:#}"));
    assert_eq!(loaded.lock().unwrap().len(), 2, "loading and loaded");
    let worker = tokio::spawn(deployment.worker().run(std::future::pending()));
    let sessions = deployment.sessions("Replay").unwrap();
    sessions.start_session("s1", "hello").await.unwrap();
    let snapshot =
        tokio::time::timeout(Duration::from_secs(30), wait_for_turns(&sessions, "s1", 1))
            .await
            .unwrap();
    worker.abort();
    assert_eq!(last_text(&snapshot).as_deref(), Some("replayed answer"));
    assert_eq!(
        (snapshot.usage.input_tokens, snapshot.usage.output_tokens),
        (7, 3)
    );
    let err = match deployment.sessions("Nobody") {
        Ok(_) => panic!("an unknown agent was accepted"),
        Err(err) => err.to_string(),
    };
    assert!(err.contains("there is no agent \"Nobody\""), "{err}");
}

#[tokio::test]
async fn a_worker_refuses_missing_grants_and_bad_model_files_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let runner = guest_wasm("scripted-runner");
    let echo = guest_wasm("echo-tool");
    let cases = [
        (
            format!(
                "[components.runner]\npath = {runner:?}\n[components.echo]\npath = {echo:?}\nenv = [\"DEXA_TEST_SURELY_UNSET\"]\n\
                 [agents.A]\nrunner = \"runner\"\ntools = [\"echo\"]\n"
            ),
            "component \"echo\" is granted the environment variable DEXA_TEST_SURELY_UNSET, which is not set",
        ),
        (
            format!(
                "[components.runner]\npath = {runner:?}\ndirs = [{{ host = \"nowhere\", guest = \"/data\" }}]\n\
                 [agents.A]\nrunner = \"runner\"\n"
            ),
            "does not exist",
        ),
        (
            format!(
                "[components.runner]\npath = {runner:?}\n[models.m]\nprovider = \"scripted\"\nresponses = \"missing.json\"\n\
                 [agents.A]\nrunner = \"runner\"\nmodel = \"m\"\n"
            ),
            "model \"m\": cannot read",
        ),
        (
            "[components.runner]\npath = \"nope.wasm\"\n[agents.A]\nrunner = \"runner\"\n".to_string(),
            "component \"runner\"",
        ),
    ];
    for (body, needle) in cases {
        let config = write_config(dir.path(), &body);
        let err = match Deployment::for_workers(config, &|_| {}).await {
            Ok(_) => panic!("accepted:\n{body}"),
            Err(err) => format!("{err:#}"),
        };
        assert!(err.contains(needle), "{body}\n=> {err}");
    }
}
