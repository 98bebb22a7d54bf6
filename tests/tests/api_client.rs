//! The OpenAPI document as API clients meet it: it passes a validator, a
//! Python client generated from it by openapi-python-client drives a whole
//! session with typed answers (tests/api-client/drive_session.py), and a
//! property-based tester (Schemathesis) finds every answer as the document
//! says: schema-valid input accepted, schema-invalid input refused, every
//! answer (SSE events too) matching its schema. The tools come from PyPI,
//! pinned in tests/api-client/requirements.txt.

use std::path::{Path, PathBuf};
use std::process::Output;

use dexa_tests::api_server::{ApiServer, TEST_TOKEN};
use dexa_tests::repo_root;
use serde_json::{json, Value};

/// The tools' virtualenv, installed on first use.
fn tools() -> PathBuf {
    let output = std::process::Command::new(repo_root().join("scripts/api-client-tools.sh"))
        .output()
        .unwrap_or_else(|err| panic!("scripts/api-client-tools.sh: {err}"));
    assert!(
        output.status.success(),
        "scripts/api-client-tools.sh failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&output.stdout).trim())
}

async fn run(venv: &Path, program: &str, args: &[&std::ffi::OsStr]) -> Output {
    let path = format!(
        "{}:{}",
        venv.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    tokio::process::Command::new(venv.join("bin").join(program))
        .args(args)
        .env("PATH", path)
        .output()
        .await
        .unwrap_or_else(|err| panic!("{program}: {err}"))
}

fn said(output: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// The Helpdesk agent on a script of two turns: a tool call (which waits
/// for an approval) and its answer, then a plain answer.
async fn serve() -> ApiServer {
    ApiServer::helpdesk(json!({"turns": [
        {"steps": [
            {"tool_calls": [{"id": "pay", "name": "log", "arguments": {"name": "pay"}}]},
            {"text": "paid"}
        ]},
        {"steps": [{"text": "hello again"}]}
    ]}))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_generated_from_the_openapi_document_drives_a_whole_session_with_typed_answers() {
    let venv = tools();
    let server = serve().await;
    let document: Value = reqwest::get(format!("{}/openapi.json", server.base))
        .await
        .expect("GET /openapi.json")
        .json()
        .await
        .expect("JSON");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("openapi.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&document).expect("JSON")).expect("write");

    let validated = run(&venv, "openapi-spec-validator", &[path.as_os_str()]).await;
    assert!(
        validated.status.success(),
        "the validator: {}",
        said(&validated)
    );

    let client = dir.path().join("dexa_client");
    let generated = run(
        &venv,
        "openapi-python-client",
        &[
            "generate".as_ref(),
            "--path".as_ref(),
            path.as_os_str(),
            "--output-path".as_ref(),
            client.as_os_str(),
            "--meta".as_ref(),
            "none".as_ref(),
            "--config".as_ref(),
            repo_root()
                .join("tests/api-client/generator.yaml")
                .as_os_str(),
        ],
    )
    .await;
    let log = said(&generated);
    assert!(generated.status.success(), "the generator: {log}");
    // Every operation is generated, none skipped for what the generator
    // could not read.
    assert!(
        !log.contains("WARNING"),
        "the generator skipped parts: {log}"
    );

    let driven = run(
        &venv,
        "python",
        &[
            repo_root()
                .join("tests/api-client/drive_session.py")
                .as_os_str(),
            dir.path().as_os_str(),
            server.base.as_ref(),
            TEST_TOKEN.as_ref(),
        ],
    )
    .await;
    assert!(driven.status.success(), "the session: {}", said(&driven));
    assert!(said(&driven).contains("a whole session through the generated client: ok"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_property_based_tester_finds_every_answer_as_the_openapi_document_says() {
    let venv = tools();
    let server = serve().await;
    let config = repo_root().join("tests/api-client/schemathesis.toml");
    let url = format!("{}/openapi.json", server.base);
    let auth = format!("Authorization: Bearer {TEST_TOKEN}");
    let dir = tempfile::tempdir().expect("tempdir");
    // A fixed seed and a bounded number of cases: the same run every time.
    let tested = tokio::process::Command::new(venv.join("bin/schemathesis"))
        .current_dir(dir.path())
        .args(["--config-file".as_ref(), config.as_os_str()])
        .args([
            "run",
            &url,
            "-H",
            &auth,
            "--checks",
            "all",
            "--seed",
            "20261202",
            "--max-examples",
            "25",
            "--generation-deterministic",
        ])
        .env("NO_COLOR", "1")
        .output()
        .await
        .expect("run schemathesis");
    assert!(tested.status.success(), "schemathesis: {}", said(&tested));
}
