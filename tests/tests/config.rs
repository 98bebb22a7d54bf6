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

/// Runs `dexa check --config <path>`; (exit code, stdout, stderr).
async fn dexa_check(path: &std::path::Path, env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let output = tokio::process::Command::new(dexa_tests::kit::dexa_binary())
        .arg("check")
        .arg("--config")
        .arg(path)
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .output()
        .await
        .unwrap_or_else(|err| panic!("run dexa check: {err}"));
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// `dexa check` refuses, with file:line, what a worker's start refuses,
/// every problem of a file at once, and passes the README's example and
/// the example agent.
#[tokio::test]
async fn dexa_check_finds_what_a_worker_would_refuse_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let runner = guest_wasm("scripted-runner");
    let echo = guest_wasm("echo-tool");
    // (body, the problems' lines in the body, what each says); the body
    // starts at line 8 of the file (see write_config).
    let cases: Vec<(String, Vec<(usize, &str)>)> = vec![
        (
            format!(
                "[components.runner]\npath = {runner:?}\n[components.echo]\npath = {echo:?}\nenv = [\"DEXA_TEST_SURELY_UNSET\"]\n\
                 [agents.A]\nrunner = \"runner\"\ntools = [\"echo\"]\n"
            ),
            vec![(3, "is granted the environment variable DEXA_TEST_SURELY_UNSET, which is not set")],
        ),
        (
            format!(
                "[components.runner]\npath = {runner:?}\ndirs = [{{ host = \"nowhere\", guest = \"/data\" }}]\n\
                 [agents.A]\nrunner = \"runner\"\n"
            ),
            vec![(1, "does not exist")],
        ),
        (
            format!(
                "[components.runner]\npath = {runner:?}\n[models.m]\nprovider = \"scripted\"\nresponses = \"missing.json\"\n\
                 [agents.A]\nrunner = \"runner\"\nmodel = \"m\"\n"
            ),
            vec![(3, "model \"m\": cannot read")],
        ),
        // Two problems in one file: both are reported.
        (
            format!(
                "[components.runner]\npath = \"nope.wasm\"\n[components.tool]\npath = {runner:?}\n\
                 [agents.A]\nrunner = \"runner\"\ntools = [\"tool\"]\n"
            ),
            vec![(1, "component \"runner\": cannot read"), (3, "component \"tool\"")],
        ),
    ];
    for (body, expected) in cases {
        write_config(dir.path(), &body);
        let path = dir.path().join("dexa.toml");
        let (code, _, stderr) = dexa_check(&path, &[]).await;
        assert_eq!(code, Some(1), "{body}\n=> {stderr}");
        for (line, needle) in &expected {
            let prefix = format!("{}:{}:", path.display(), line + 7);
            assert!(
                stderr
                    .lines()
                    .any(|l| l.starts_with(&prefix) && l.contains(needle)),
                "no {prefix} ... {needle:?} in:\n{stderr}"
            );
        }
        assert!(
            stderr.contains(&format!("{} problem(s)", expected.len())),
            "{stderr}"
        );
    }

    // Every config the parser refuses (the config unit tests' cases):
    // exit 1, at the line of the problem, saying what it is.
    let path = dir.path().join("dexa.toml");
    let fixture =
        std::fs::read_to_string(repo_root().join("tests/fixtures/bad-configs.txt")).unwrap();
    let mut checked = 0;
    for case in fixture.split("\n### ").skip(1) {
        let (header, body) = case.split_once('\n').unwrap();
        let (line, needle) = header.split_once(' ').unwrap();
        std::fs::write(&path, format!("{}\n", body.trim_end_matches('\n'))).unwrap();
        let (code, _, stderr) = dexa_check(&path, &[]).await;
        assert_eq!(code, Some(1), "{body}\n=> {stderr}");
        assert!(
            stderr.contains(&format!("{}:{line}:", path.display())) && stderr.contains(needle),
            "{body}\n=> no line {line} saying {needle:?} in:\n{stderr}"
        );
        checked += 1;
    }
    assert_eq!(checked, 39);

    // The README's example, with its files at hand, and the example agent.
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let example = readme
        .split("## Configuration: `dexa.toml`")
        .nth(1)
        .and_then(|s| s.split("```toml\n").nth(1))
        .and_then(|s| s.split("```").next())
        .unwrap_or_else(|| panic!("the README has no configuration example"));
    let guests = repo_root().join("target").join("guests");
    let cache = repo_root().join("target").join("test-component-cache");
    let example = example
        .replace("\"target/guests/", &format!("\"{}/", guests.display()))
        .replace(
            "cache_dir = \".dexa/cache/components\"",
            &format!("cache_dir = {cache:?}"),
        );
    std::fs::write(dir.path().join("responses.json"), "[{\"text\": \"hi\"}]").unwrap();
    std::fs::write(&path, example).unwrap();
    let (code, stdout, stderr) = dexa_check(&path, &[("LEDGER_CURRENCY", "EUR")]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains(": ok"), "{stdout}");
    let example = repo_root()
        .join("examples")
        .join("bookkeeper")
        .join("dexa.toml");
    let (code, _, stderr) = dexa_check(&example, &[("LEDGER_CURRENCY", "EUR")]).await;
    assert_eq!(code, Some(0), "{stderr}");
}

/// `dexa check --online` asks each OpenAI-compatible model's server for its
/// model list with the model's key: a missing key or a closed port shows.
#[tokio::test]
async fn dexa_check_online_reaches_the_model_server_with_its_key() {
    let server = dexa_tests::chat_server::ReplayChatServer::start(Vec::new()).await;
    let dir = tempfile::tempdir().unwrap();
    let runner = guest_wasm("scripted-runner");
    let body = |base: &str, key: &str| {
        format!(
            "[components.runner]\npath = {runner:?}\n\
             [models.gpt]\nprovider = \"openai\"\nbase_url = {base:?}\nmodel = \"gpt-4o-mini\"\n{key}\n\
             [agents.A]\nrunner = \"runner\"\nmodel = \"gpt\"\n"
        )
    };
    let path = dir.path().join("dexa.toml");
    let online = |env: &'static [(&'static str, &'static str)]| {
        let path = path.clone();
        async move {
            let output = tokio::process::Command::new(dexa_tests::kit::dexa_binary())
                .args(["check", "--online", "--config"])
                .arg(&path)
                .envs(env.iter().copied())
                .output()
                .await
                .unwrap();
            (
                output.status.code(),
                String::from_utf8_lossy(&output.stderr).into_owned(),
            )
        }
    };
    write_config(
        dir.path(),
        &body(&server.base_url, "api_key_env = \"DEXA_TEST_CHECK_KEY\""),
    );
    let (code, stderr) = online(&[("DEXA_TEST_CHECK_KEY", "sk-test")]).await;
    assert_eq!(code, Some(0), "{stderr}");
    write_config(dir.path(), &body(&server.base_url, ""));
    let (code, stderr) = online(&[]).await;
    assert_eq!(code, Some(1));
    assert!(
        stderr.contains(&format!("{}:10:", path.display()))
            && stderr.contains("/models answered 401"),
        "{stderr}"
    );
    write_config(dir.path(), &body("http://127.0.0.1:9/v1", ""));
    let (code, stderr) = online(&[]).await;
    assert_eq!(code, Some(1));
    assert!(
        stderr.contains("cannot reach http://127.0.0.1:9/v1/models"),
        "{stderr}"
    );
    // Offline, the same file passes: nothing is contacted.
    let output = tokio::process::Command::new(dexa_tests::kit::dexa_binary())
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(0));
}
