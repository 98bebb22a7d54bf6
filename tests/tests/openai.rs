//! The `openai` model provider against a loopback server that speaks the real
//! streaming protocol (CRLF, keep-alive comments, bodies cut at any byte,
//! interleaved tool-call fragments), directly and through a session.

use std::sync::Arc;
use std::time::Duration;

use dexa::config::{Deployment, DexaConfig, ModelConfig};
use dexa::plugin::wit::{
    MessageRole, ModelError, ModelMessage, ModelRequest, ModelResponse, ToolSpec,
};
use dexa::plugin::{EventWriter, GuestEvent, ModelProvider};
use dexa::providers::{OpenAiConfig, OpenAiProvider, RetryPolicy};
use dexa_tests::chat_server::{openai_fixture, ReceivedRequest, ReplayChatServer, Reply};
use dexa_tests::kit::wait_for_turns;
use dexa_tests::session::last_text;
use dexa_tests::{guest_wasm, repo_root, step_tag, CollectingEvents};
use serde_json::{json, Value};

fn request(tools: Vec<ToolSpec>) -> ModelRequest {
    ModelRequest {
        messages: vec![
            ModelMessage {
                role: MessageRole::System,
                content: Some("You help with tickets.".into()),
                tool_calls: Vec::new(),
                tool_call_id: None,
            },
            ModelMessage {
                role: MessageRole::User,
                content: Some("How many open tickets?".into()),
                tool_calls: Vec::new(),
                tool_call_id: None,
            },
        ],
        tools,
        temperature: Some(0.5),
        max_output_tokens: Some(256),
    }
}

/// Calls the provider once; returns the result and the text deltas it wrote.
async fn complete(
    server: &ReplayChatServer,
    request: ModelRequest,
) -> (Result<ModelResponse, ModelError>, Vec<String>) {
    complete_with(
        OpenAiConfig::new(&server.base_url, "gpt-4o-mini").api_key("sk-test-key"),
        request,
    )
    .await
}

/// Calls a provider of `config` once.
async fn complete_with(
    config: OpenAiConfig,
    request: ModelRequest,
) -> (Result<ModelResponse, ModelError>, Vec<String>) {
    let provider = OpenAiProvider::new(config).unwrap();
    let sink = Arc::new(CollectingEvents::default());
    let writer = EventWriter::new(step_tag("s1", "turn-1", "x1", 1), sink.clone(), 1 << 20);
    let result = provider.complete(request, &writer).await;
    let deltas = sink
        .events()
        .into_iter()
        .filter_map(|e| match e.event {
            GuestEvent::TextDelta { text } => Some(text),
            _ => None,
        })
        .collect();
    (result, deltas)
}

fn only_request(server: &ReplayChatServer) -> ReceivedRequest {
    let requests = server.requests();
    assert_eq!(requests.len(), 1, "{requests:?}");
    requests[0].clone()
}

#[tokio::test]
async fn a_streamed_answer_is_assembled_from_any_split_and_its_deltas_stream_live() {
    // 1-byte pieces cut inside every JSON string; 7-byte pieces elsewhere.
    for piece in [1, 7, 4096] {
        let server = ReplayChatServer::start(vec![Reply::Stream {
            transcript: openai_fixture("text.sse"),
            piece,
        }])
        .await;
        let (result, deltas) = complete(&server, request(Vec::new())).await;
        let response = result.unwrap_or_else(|err| panic!("piece {piece}: {err:?}"));
        assert_eq!(
            response.message.content.as_deref(),
            Some("You have two open tickets.")
        );
        assert_eq!(deltas, vec!["You have ", "two open ", "tickets."]);
        assert_eq!(response.message.role, MessageRole::Assistant);
        assert!(response.message.tool_calls.is_empty());
        assert_eq!(response.finish_reason, "stop");
        assert_eq!(
            (
                response.usage.input_tokens,
                response.usage.output_tokens,
                response.usage.total_tokens
            ),
            (57, 7, 64)
        );
        let sent = only_request(&server);
        assert_eq!(sent.authorization.as_deref(), Some("Bearer sk-test-key"));
        assert_eq!(sent.body["model"], "gpt-4o-mini");
        assert_eq!(sent.body["stream"], true);
        assert_eq!(sent.body["stream_options"]["include_usage"], true);
        assert_eq!(sent.body["temperature"], 0.5);
        assert_eq!(sent.body["max_tokens"], 256);
        assert_eq!(
            sent.body["messages"],
            json!([
                {"role": "system", "content": "You help with tickets."},
                {"role": "user", "content": "How many open tickets?"}
            ])
        );
        assert!(sent.body.get("tools").is_none(), "no tools, no tools field");
    }
}

#[tokio::test]
async fn interleaved_tool_call_fragments_are_assembled_per_index() {
    for piece in [1, 5, 4096] {
        let server = ReplayChatServer::start(vec![Reply::Stream {
            transcript: openai_fixture("tool_calls.sse"),
            piece,
        }])
        .await;
        let tools = vec![ToolSpec {
            name: "search_tickets".into(),
            description: "Searches tickets".into(),
            parameters_schema: r#"{"type":"object","properties":{"status":{"type":"string"}}}"#
                .into(),
            effect: None,
        }];
        let (result, deltas) = complete(&server, request(tools)).await;
        let response = result.unwrap_or_else(|err| panic!("piece {piece}: {err:?}"));
        assert!(deltas.is_empty(), "{deltas:?}");
        assert_eq!(response.finish_reason, "tool_calls");
        let calls: Vec<(String, String, Value)> = response
            .message
            .tool_calls
            .iter()
            .map(|c| {
                (
                    c.id.clone(),
                    c.name.clone(),
                    serde_json::from_str(&c.arguments)
                        .unwrap_or_else(|err| panic!("{}: {err}", c.arguments)),
                )
            })
            .collect();
        assert_eq!(
            calls,
            vec![
                (
                    "call_Xk1".to_string(),
                    "search_tickets".to_string(),
                    json!({"status": "open"})
                ),
                (
                    "call_Yq2".to_string(),
                    "refund_order".to_string(),
                    json!({"order_id": 7, "reason": "damaged étui"})
                ),
            ]
        );
        assert_eq!(
            (response.usage.input_tokens, response.usage.output_tokens),
            (112, 41)
        );
        let sent = only_request(&server);
        assert_eq!(
            sent.body["tools"],
            json!([{"type": "function", "function": {
                "name": "search_tickets", "description": "Searches tickets",
                "parameters": {"type": "object", "properties": {"status": {"type": "string"}}}
            }}])
        );
    }
}

#[tokio::test]
async fn errors_are_typed_rejected_or_transient() {
    let server = ReplayChatServer::start(vec![
        Reply::Error {
            status: 401,
            message: "Incorrect API key provided".into(),
        },
        Reply::Error {
            status: 400,
            message: "messages is required".into(),
        },
        Reply::Error {
            status: 429,
            message: "Rate limit reached".into(),
        },
        Reply::Error {
            status: 503,
            message: "overloaded".into(),
        },
        Reply::Truncated {
            transcript: openai_fixture("text.sse"),
        },
    ])
    .await;
    type Check = fn(&ModelError) -> bool;
    let expect: [(&str, Check); 5] = [
        ("Incorrect API key provided", |e| {
            matches!(e, ModelError::Rejected(_))
        }),
        ("messages is required", |e| {
            matches!(e, ModelError::Rejected(_))
        }),
        ("Rate limit reached", |e| {
            matches!(e, ModelError::Transient(_))
        }),
        ("overloaded", |e| matches!(e, ModelError::Transient(_))),
        ("ended before data: [DONE]", |e| {
            matches!(e, ModelError::Transient(_))
        }),
    ];
    // Each answer once: no retry within the call (see the retry tests).
    let once = RetryPolicy {
        retries: 0,
        ..RetryPolicy::default()
    };
    for (needle, kind) in expect {
        let (result, _) = complete_with(
            OpenAiConfig::new(&server.base_url, "gpt-4o-mini").retry(once.clone()),
            request(Vec::new()),
        )
        .await;
        let err = match result {
            Ok(response) => panic!("{needle}: got {response:?}"),
            Err(err) => err,
        };
        assert!(kind(&err), "{needle}: {err:?}");
        assert!(format!("{err:?}").contains(needle), "{err:?}");
    }
    // Nobody listening: transient, and the message names the URL.
    let closed = OpenAiProvider::new(OpenAiConfig::new("http://127.0.0.1:9/v1", "m")).unwrap();
    let sink = Arc::new(CollectingEvents::default());
    let writer = EventWriter::new(step_tag("s", "turn-1", "x", 1), sink, 1 << 20);
    match closed.complete(request(Vec::new()), &writer).await {
        Err(ModelError::Transient(message)) => {
            assert!(message.contains("127.0.0.1:9"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(OpenAiProvider::new(OpenAiConfig::new("ftp://x", "m")).is_err());
}

/// dexa.toml names an `openai` model; a session's RunModel streams from the
/// loopback server, records its usage, and the key never reaches the runner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_runs_on_the_openai_provider_named_in_dexa_toml() {
    let server = ReplayChatServer::start(vec![Reply::Stream {
        transcript: openai_fixture("text.sse"),
        piece: 3,
    }])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let script = json!({"turns": [{"steps": [{"model": true}]}]}).to_string();
    let text = format!(
        "store = \"sqlite:store.sqlite\"\ncache_dir = {cache:?}\n\
         [components.runner]\npath = {runner:?}\nconfig = {{ script = {script:?} }}\n\
         [models.gpt]\nprovider = \"openai\"\nbase_url = {base:?}\nmodel = \"gpt-4o-mini\"\napi_key_env = \"DEXA_TEST_OPENAI_KEY\"\n\
         [agents.Helpdesk]\nrunner = \"runner\"\nmodel = \"gpt\"\n",
        cache = repo_root().join("target").join("test-component-cache"),
        runner = guest_wasm("scripted-runner"),
        base = server.base_url,
    );
    let path = dir.path().join("dexa.toml");
    std::fs::write(&path, &text).unwrap();
    let config = DexaConfig::load(&path).unwrap_or_else(|err| panic!("{err}"));
    // The key variable must be set; its absence is a named error.
    let missing = Deployment::for_workers(config.clone(), &|_| {}).await;
    let err = match missing {
        Ok(_) => panic!("loaded without the key"),
        Err(err) => format!("{err:#}"),
    };
    assert!(
        err.contains("its API key variable DEXA_TEST_OPENAI_KEY is not set"),
        "{err}"
    );
    // A variable that is set, without changing this process's environment:
    // cargo gives test processes CARGO_PKG_NAME.
    let mut config = config;
    let key = std::env::var("CARGO_PKG_NAME").unwrap();
    for model in config.models.values_mut() {
        if let ModelConfig::OpenAi { api_key_env, .. } = model {
            *api_key_env = Some("CARGO_PKG_NAME".to_string());
        }
    }
    let deployment = Deployment::for_workers(config, &|_| {}).await.unwrap();
    let worker = tokio::spawn(deployment.worker().run(std::future::pending()));
    let sessions = deployment.sessions("Helpdesk").unwrap();
    sessions
        .start_session("s1", "How many open tickets?")
        .await
        .unwrap();
    let snapshot =
        tokio::time::timeout(Duration::from_secs(30), wait_for_turns(&sessions, "s1", 1))
            .await
            .unwrap();
    worker.abort();
    assert_eq!(
        last_text(&snapshot).as_deref(),
        Some("You have two open tickets.")
    );
    assert_eq!(
        (
            snapshot.usage.input_tokens,
            snapshot.usage.output_tokens,
            snapshot.usage.model_calls
        ),
        (57, 7, 1)
    );
    let sent = only_request(&server);
    assert_eq!(sent.authorization, Some(format!("Bearer {key}")));
    assert_eq!(
        sent.body["messages"][0]["content"],
        "How many open tickets?"
    );
    let deltas: Vec<String> = dexa_tests::session::all_events(&sessions, "s1")
        .await
        .into_iter()
        .filter(|e| e.event_type == dexa::session::event_type::TEXT_DELTA)
        .filter_map(|e| e.data["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(deltas.concat(), "You have two open tickets.");
}

fn text_stream() -> Reply {
    Reply::Stream {
        transcript: openai_fixture("text.sse"),
        piece: 16,
    }
}

fn rate_limited(retry_after: &str) -> Reply {
    Reply::Refused {
        status: 429,
        retry_after: retry_after.to_string(),
    }
}

#[tokio::test]
async fn a_429_with_retry_after_1_waits_a_second_within_the_attempt_and_succeeds() {
    let server = ReplayChatServer::start(vec![rate_limited("1"), text_stream()]).await;
    let (result, deltas) = complete(&server, request(Vec::new())).await;
    let response = result.unwrap_or_else(|err| panic!("{err:?}"));
    assert_eq!(
        response.message.content.as_deref(),
        Some("You have two open tickets.")
    );
    assert_eq!(deltas.concat(), "You have two open tickets.");
    let sent = server.requests();
    assert_eq!(sent.len(), 2, "asked again once");
    let waited = sent[1].at.duration_since(sent[0].at);
    assert!(
        waited >= Duration::from_secs(1),
        "the second request came {waited:?} after the first, before Retry-After"
    );
    assert_eq!(sent[0].body, sent[1].body, "the same request again");
}

#[tokio::test]
async fn server_faults_without_retry_after_are_asked_again_after_a_back_off() {
    let fault = |status| Reply::Error {
        status,
        message: "upstream connect error".into(),
    };
    let server = ReplayChatServer::start(vec![fault(503), fault(502), text_stream()]).await;
    let (result, _) = complete(&server, request(Vec::new())).await;
    assert!(result.is_ok(), "{result:?}");
    let sent = server.requests();
    assert_eq!(sent.len(), 3);
    // 500 ms doubled, each spread over its upper half.
    assert!(sent[1].at.duration_since(sent[0].at) >= Duration::from_millis(250));
    assert!(sent[2].at.duration_since(sent[1].at) >= Duration::from_millis(500));
}

#[tokio::test]
async fn retries_run_out_and_a_long_retry_after_fails_the_call_at_once_as_transient() {
    let policy = RetryPolicy {
        retries: 1,
        max_wait: Duration::from_secs(5),
    };
    let fault = Reply::Error {
        status: 500,
        message: "internal".into(),
    };
    let server = ReplayChatServer::start(vec![fault.clone(), fault, text_stream()]).await;
    let config = OpenAiConfig::new(&server.base_url, "m").retry(policy.clone());
    match complete_with(config, request(Vec::new())).await.0 {
        Err(ModelError::Transient(message)) => {
            assert!(message.contains("gave up after 2 request(s)"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(server.requests().len(), 2);

    // Longer than max_retry_wait: the Step's retry policy takes over.
    let server = ReplayChatServer::start(vec![rate_limited("3600"), text_stream()]).await;
    let config = OpenAiConfig::new(&server.base_url, "m").retry(policy);
    match complete_with(config, request(Vec::new())).await.0 {
        Err(ModelError::Transient(message)) => {
            assert!(message.contains("wait 3600 s"), "{message}");
            assert!(message.contains("max_retry_wait"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(server.requests().len(), 1);

    // A refusal is not asked again.
    let server = ReplayChatServer::start(vec![
        Reply::Error {
            status: 401,
            message: "Incorrect API key provided".into(),
        },
        text_stream(),
    ])
    .await;
    let (result, _) = complete(&server, request(Vec::new())).await;
    assert!(matches!(result, Err(ModelError::Rejected(_))), "{result:?}");
    assert_eq!(server.requests().len(), 1);
}

/// Gateways and Azure OpenAI's `api-key`: headers from dexa.toml (a secret
/// from the environment) reach the provider, with the retry settings; a
/// header that cannot be sent is refused at load with its line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dexa_toml_headers_and_retry_settings_reach_the_provider() {
    let server = ReplayChatServer::start(vec![rate_limited("1"), text_stream()]).await;
    let dir = tempfile::tempdir().unwrap();
    let script = json!({"turns": [{"steps": [{"model": true}]}]}).to_string();
    let config_text = |headers: &str| {
        format!(
            "store = \"sqlite:store.sqlite\"\ncache_dir = {cache:?}\n\
             [components.runner]\npath = {runner:?}\nconfig = {{ script = {script:?} }}\n\
             [models.azure]\nprovider = \"openai\"\nbase_url = {base:?}\nmodel = \"gpt-4o-mini\"\n\
             headers = {headers}\nretries = 2\nmax_retry_wait = \"3s\"\n\
             [agents.Helpdesk]\nrunner = \"runner\"\nmodel = \"azure\"\n",
            cache = repo_root().join("target").join("test-component-cache"),
            runner = guest_wasm("scripted-runner"),
            base = server.base_url,
        )
    };
    let path = dir.path().join("dexa.toml");
    let refused = [
        (
            "{ \"bad name\" = \"x\" }",
            "\"bad name\" is not a valid header name",
        ),
        (
            "{ \"x\" = \"a\\r\\nb\" }",
            "header x: its value is not a valid header value",
        ),
        (
            "{ \"Content-Type\" = \"text/plain\" }",
            "is set by the provider itself",
        ),
        (
            "{ \"X-Team\" = \"a\", \"x-team\" = \"b\" }",
            "is given twice",
        ),
    ];
    for (headers, why) in refused {
        std::fs::write(&path, config_text(headers)).unwrap();
        let err = DexaConfig::load(&path).map(|_| ()).unwrap_err().to_string();
        assert!(
            err.contains("dexa.toml:") && err.contains(why),
            "{headers}: {err}"
        );
    }
    for (from, to, why) in [
        ("retries = 2", "retries = 11", "retries is at most 10"),
        (
            "max_retry_wait = \"3s\"",
            "max_retry_wait = \"0s\"",
            "max_retry_wait is at least 1s",
        ),
    ] {
        std::fs::write(&path, config_text("{}").replace(from, to)).unwrap();
        let err = DexaConfig::load(&path).map(|_| ()).unwrap_err().to_string();
        assert!(err.contains(why), "{to}: {err}");
    }
    // A header whose variable is unset fails where the provider is made,
    // without repeating the value; a client of the file never needs it.
    std::fs::write(
        &path,
        config_text("{ \"api-key\" = \"sk-literal-part-${DEXA_TEST_UNSET_VARIABLE}\" }"),
    )
    .unwrap();
    let config = DexaConfig::load(&path).unwrap_or_else(|err| panic!("{err}"));
    let err = match Deployment::for_workers(config, &|_| {}).await {
        Ok(_) => panic!("made a provider without the header's variable"),
        Err(err) => format!("{err:#}"),
    };
    assert!(err.contains("header api-key"), "{err}");
    assert!(!err.contains("sk-literal-part"), "{err}");
    // cargo gives test processes CARGO_PKG_NAME: a variable that is set.
    let secret = std::env::var("CARGO_PKG_NAME").unwrap();
    std::fs::write(
        &path,
        config_text("{ \"api-key\" = \"${CARGO_PKG_NAME}\", \"x-gateway\" = \"team-a\" }"),
    )
    .unwrap();
    let config = DexaConfig::load(&path).unwrap_or_else(|err| panic!("{err}"));
    let model = &config.models["azure"];
    assert!(
        !format!("{model:?}").contains(&secret),
        "the parsed config keeps `${{VAR}}`, not the secret: {model:?}"
    );
    let deployment = Deployment::for_workers(config, &|_| {}).await.unwrap();
    let worker = tokio::spawn(deployment.worker().run(std::future::pending()));
    let sessions = deployment.sessions("Helpdesk").unwrap();
    sessions.start_session("s1", "How many?").await.unwrap();
    let snapshot =
        tokio::time::timeout(Duration::from_secs(30), wait_for_turns(&sessions, "s1", 1))
            .await
            .unwrap();
    worker.abort();
    assert_eq!(
        last_text(&snapshot).as_deref(),
        Some("You have two open tickets.")
    );
    let sent = server.requests();
    assert_eq!(sent.len(), 2, "the 429 was asked again within the attempt");
    for request in &sent {
        assert_eq!(request.headers.get("api-key"), Some(&secret));
        assert_eq!(
            request.headers.get("x-gateway").map(String::as_str),
            Some("team-a")
        );
        assert_eq!(request.authorization, None, "no api_key_env, no bearer");
    }
    let history = deployment
        .store
        .step_history("s1")
        .await
        .unwrap_or_default();
    let model_attempts = history
        .iter()
        .filter(|e| e.step_type == dexa::session::step::RUN_MODEL)
        .filter(|e| e.event_type == dexa::flow::history::EXECUTE_COMPLETED)
        .count();
    assert_eq!(model_attempts, 1, "one attempt: {history:?}");
    assert!(
        history
            .iter()
            .all(|e| e.event_type != dexa::flow::history::EXECUTE_FAILED),
        "no attempt failed: {history:?}"
    );
}
