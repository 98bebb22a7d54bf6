//! The component catalog over `dexa serve`'s HTTP API: upload, list,
//! activate by digest, the activation log, rollback, and the typed errors,
//! behind the same token; a turn after an activation runs the new version
//! on the server's own worker.

use std::time::Duration;

use dexa_tests::api_server::{ApiServer, TEST_TOKEN};
use dexa_tests::guest_bytes;
use dexa_tests::versions::{digest_of, variant};
use reqwest::StatusCode;
use serde_json::{json, Value};

struct Api {
    server: ApiServer,
    http: reqwest::Client,
}

impl Api {
    async fn start() -> Self {
        let server = ApiServer::helpdesk(json!({"turns": [{"steps": [{"text": "hi"}]}]})).await;
        Self {
            server,
            http: reqwest::Client::new(),
        }
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> (StatusCode, Value) {
        let response = request.send().await.unwrap();
        let status = response.status();
        let text = response.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.server.base)
    }

    async fn upload(&self, bytes: Vec<u8>) -> (StatusCode, Value) {
        self.send(
            self.http
                .post(self.url("/v1/components"))
                .bearer_auth(TEST_TOKEN)
                .header("content-type", "application/wasm")
                .body(bytes),
        )
        .await
    }

    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.send(
            self.http
                .post(self.url(path))
                .bearer_auth(TEST_TOKEN)
                .header("x-dexa-actor", "release-bot")
                .json(&body),
        )
        .await
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.send(self.http.get(self.url(path)).bearer_auth(TEST_TOKEN))
            .await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_are_uploaded_activated_and_rolled_back_over_http() {
    let api = Api::start().await;
    let v1 = digest_of(&guest_bytes("scripted-runner"));
    let bytes = variant(&guest_bytes("scripted-runner"), "http-v2");
    let v2 = digest_of(&bytes);
    let (status, added) = api.upload(bytes.clone()).await;
    assert_eq!(status, StatusCode::CREATED, "{added}");
    assert_eq!(added["component"]["digest"], json!(v2));
    assert_eq!(added["component"]["world"], json!("runner"));
    assert_eq!(added["component"]["added_by"], json!("api"));
    let (status, again) = api.upload(bytes).await;
    assert_eq!(
        (status, again["added"].clone()),
        (StatusCode::OK, json!(false))
    );
    let (_, list) = api.get("/v1/components").await;
    let digests: Vec<&str> = list["components"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["digest"].as_str())
        .collect();
    assert!(
        digests.contains(&v1.as_str()) && digests.contains(&v2.as_str()),
        "{list}"
    );

    let (status, activated) = api
        .post(
            "/v1/agents/Helpdesk/activations",
            json!({"role": "runner", "digest": v2, "reason": "http test"}),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{activated}");
    assert_eq!(activated["activation"]["actor"], json!("release-bot"));
    let (_, versions) = api.get("/v1/agents/Helpdesk/versions").await;
    assert_eq!(
        versions["roles"]["runner"]["current"],
        json!(v2),
        "{versions}"
    );
    assert_eq!(
        versions["log"].as_array().map(Vec::len),
        Some(3),
        "runner, gates, v2"
    );

    // The server's own worker takes it for the next turn.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (status, _) = api
        .post(
            "/v1/agents/Helpdesk/sessions",
            json!({"session_id": "h1", "message": "go"}),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED);
    let mut ran = Vec::new();
    for _ in 0..500 {
        let (_, history) = api.get("/v1/sessions/h1/history").await;
        ran = history["steps"]
            .as_array()
            .map(|steps| {
                steps
                    .iter()
                    .filter(|s| s["step_type"] == "RunModel")
                    .filter_map(|s| s["component"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        if !ran.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(ran, vec![v2.clone()]);

    let (status, rolled) = api.post("/v1/agents/Helpdesk/rollback", json!({})).await;
    assert_eq!(status, StatusCode::CREATED, "{rolled}");
    assert_eq!(rolled["activation"]["digest"], json!(v1));
    assert_eq!(
        rolled["activation"]["reason"],
        json!(format!("rollback to {}", &v1[..12]))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_catalog_requests_get_typed_errors_and_change_nothing() {
    let api = Api::start().await;
    let (_, before) = api.get("/v1/agents/Helpdesk/versions").await;
    let gates = digest_of(&guest_bytes("gate-tool"));
    let cases = [
        (
            "/v1/agents/Helpdesk/activations",
            json!({"role": "runner", "digest": "not-hex"}),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "/v1/agents/Nobody/activations",
            json!({"role": "runner", "digest": gates}),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "/v1/agents/Helpdesk/activations",
            json!({"role": "nope", "digest": gates}),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "/v1/agents/Helpdesk/activations",
            json!({"role": "runner", "digest": gates, "ramp": 0}),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "/v1/agents/Helpdesk/activations",
            json!({"role": "runner", "digest": gates, "ramp": 20.5}),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            // A tool component as the runner: the wrong world.
            "/v1/agents/Helpdesk/activations",
            json!({"role": "runner", "digest": gates}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "activation_refused",
        ),
        (
            "/v1/agents/Helpdesk/activations",
            json!({"role": "runner", "digest": "a".repeat(64)}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "activation_refused",
        ),
        (
            // A reason over the 1 KiB the log keeps.
            "/v1/agents/Helpdesk/activations",
            json!({"role": "runner", "digest": gates, "reason": "x".repeat(1025)}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "activation_refused",
        ),
        (
            "/v1/agents/Helpdesk/rollback",
            json!({"role": "gates"}),
            StatusCode::CONFLICT,
            "nothing_to_roll_back",
        ),
        (
            "/v1/agents/Helpdesk/rollback",
            json!({"role": "runner", "surprise": 1}),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        // A null where the schema has a string or an integer: refused, not
        // read as absent.
        (
            "/v1/agents/Helpdesk/rollback",
            json!({"role": null}),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            "/v1/agents/Helpdesk/activations",
            json!({"role": "runner", "digest": gates, "ramp": null}),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
    ];
    for (path, body, status, code) in cases {
        let (got, answer) = api.post(path, body.clone()).await;
        assert_eq!(
            (got, answer["error"]["code"].as_str()),
            (status, Some(code)),
            "{body}: {answer}"
        );
    }
    let (_, refused) = api
        .post(
            "/v1/agents/Helpdesk/activations",
            json!({"role": "runner", "digest": gates}),
        )
        .await;
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&gates) && message.contains("does not implement world"),
        "{refused}"
    );
    let (status, empty) = api.upload(Vec::new()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{empty}");
    let (status, garbage) = api.upload(b"\0asm garbage".to_vec()).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{garbage}");
    // Its own client: the server answers before it reads the body and
    // closes that connection.
    let unauthorized = reqwest::Client::new()
        .post(api.url("/v1/components"))
        .body(guest_bytes("scripted-runner"))
        .send()
        .await
        .unwrap();
    assert_eq!(unauthorized.status(), StatusCode::UNAUTHORIZED);
    let (_, after) = api.get("/v1/agents/Helpdesk/versions").await;
    assert_eq!(before, after, "nothing changed");
    let (_, list) = api.get("/v1/components").await;
    assert_eq!(
        list["components"].as_array().map(Vec::len),
        Some(2),
        "{list}"
    );
}
