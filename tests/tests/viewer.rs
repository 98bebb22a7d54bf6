//! The web viewer in headless Chromium (Debian's `chromium` and
//! `chromium-driver`, driven over WebDriver): start a session from the page,
//! watch live text appear, approve the tool call, and see its result and the
//! Step timeline, with the component version each Step ran.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use dexa_tests::api_server::{ApiServer, TEST_TOKEN};
use dexa_tests::guest_bytes;
use dexa_tests::kit::dexa_binary;
use dexa_tests::session::wait_for_turns;
use dexa_tests::versions::{digest_of, variant};
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};

/// chromedriver on a free loopback port; killed when dropped.
struct Driver {
    child: Child,
    url: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|err| panic!("free port: {err}"))
}

async fn start_driver() -> Driver {
    let binary = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
        .into_iter()
        .find(|p| std::path::Path::new(p).is_file())
        .unwrap_or_else(|| {
            panic!("chromedriver is missing; ./ci.sh installs it (apt-get install chromium chromium-driver)")
        });
    let port = free_port();
    let child = Command::new(binary)
        .arg(format!("--port={port}"))
        .arg("--allowed-ips=127.0.0.1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|err| panic!("start {binary}: {err}"));
    let driver = Driver {
        child,
        url: format!("http://127.0.0.1:{port}"),
    };
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return driver;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("chromedriver did not listen on {port}");
}

async fn browser(driver: &Driver) -> Client {
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".to_string(),
        json!({
            "binary": "/usr/bin/chromium",
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"]
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .unwrap_or_else(|err| panic!("connect to chromedriver: {err}"))
}

/// Waits (up to 30 s) until the script returns a truthy value; returns it.
/// Opens the viewer at `base` with the test token in its storage.
async fn open_viewer(client: &Client, base: &str) -> Result<(), fantoccini::error::CmdError> {
    client.goto(&format!("{base}/")).await?;
    client
        .execute(
            "localStorage.setItem('dexa-token', arguments[0]); location.reload(); return true;",
            vec![json!(TEST_TOKEN)],
        )
        .await?;
    Ok(())
}

async fn wait_for_js(client: &Client, description: &str, script: &str) -> serde_json::Value {
    for _ in 0..600 {
        if let Ok(value) = client.execute(script, vec![]).await {
            let truthy = match &value {
                serde_json::Value::Null | serde_json::Value::Bool(false) => false,
                serde_json::Value::String(s) => !s.is_empty(),
                serde_json::Value::Array(a) => !a.is_empty(),
                _ => true,
            };
            if truthy {
                return value;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let page = client.source().await.unwrap_or_default();
    panic!("timed out waiting for {description}; the page:\n{page}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_viewer_starts_a_session_shows_live_text_and_approves_a_tool_call() {
    let server = ApiServer::helpdesk(json!({"turns": [{"steps": [
        // Attempt 1 streams its text, then fails; attempt 2 streams it again.
        {"text": "Let me pay that.", "deltas": ["Let me ", "pay that."], "fail_after_deltas": 1,
         "tool_calls": [{"id": "pay", "name": "log", "arguments": {"name": "pay"}}]},
        {"text": "Paid.", "deltas": ["Paid."]}
    ]}]}))
    .await;
    let driver = start_driver().await;
    let client = browser(&driver).await;
    let result = async {
        open_viewer(&client, &server.base).await?;
        let message = client.wait().for_element(Locator::Id("start-message")).await?;
        message.send_keys("Pay invoice 7").await?;
        client.find(Locator::Id("start-button")).await?.click().await?;

        // Live text streams in while the tool waits for approval. The UI
        // rule: within one Step execution only the highest attempt's text
        // stays, so attempt 1's partial text is gone once attempt 2 streams.
        let live = wait_for_js(
            &client,
            "attempt 2's live text",
            "const b = [...document.querySelectorAll('#live .live-block')]; return b.some(e => e.dataset.attempt === '2') ? b.map(e => [e.dataset.turn, e.dataset.attempt, e.textContent]) : null;",
        )
        .await;
        let blocks = live.as_array().cloned().unwrap_or_default();
        assert_eq!(blocks.len(), 1, "{live}");
        assert_eq!(blocks[0][1], "2");
        assert!(blocks[0][2].as_str().unwrap_or("").ends_with("attempt 2Let me pay that."), "{live}");
        // Attempt 1's text did reach the stream: the page dropped it.
        let session_id = client.current_url().await?.fragment().unwrap_or_default().trim_start_matches("/s/").to_string();
        let sessions = server.deployment.sessions("Helpdesk").unwrap();
        let (events, _) = sessions.read_events(&session_id, 0, 1000).await.unwrap();
        let first_attempt: String = events
            .iter()
            .filter(|(_, e)| e.event_type == "text_delta" && e.attempt == 1)
            .filter_map(|(_, e)| e.data["text"].as_str())
            .collect();
        assert_eq!(first_attempt, "Let me pay that.");
        // Found and clicked in one script: the page redraws the approvals
        // as events arrive, so a held element could go stale.
        let clicked = wait_for_js(
            &client,
            "the approval's button",
            "const b = document.querySelector('.approval button.approve'); if (!b) return null; const id = b.parentElement.dataset.interrupt; b.click(); return id;",
        )
        .await;
        assert_eq!(clicked, json!("turn-1/pay"));

        // The tool's result (gate-tool's log returns the idempotency key) and
        // the final answer become stored messages; live text gives way.
        let messages = wait_for_js(
            &client,
            "the tool's result and the answer",
            "const m = [...document.querySelectorAll('#messages .msg')].map(e => e.dataset.role + ':' + e.textContent); return m.some(t => t.endsWith('Paid.')) ? m : null;",
        )
        .await;
        let messages: Vec<String> = serde_json::from_value(messages).unwrap_or_default();
        assert_eq!(
            messages,
            vec![
                "user:userPay invoice 7".to_string(),
                "assistant:assistantLet me pay that.".to_string(),
                // The runner's tool-call item: no text of its own.
                "assistant:assistant(no text)".to_string(),
                format!("tool:tool{session_id}/turn-1/pay"),
                "assistant:assistantPaid.".to_string(),
            ]
        );
        wait_for_js(&client, "the live text to be replaced", "return document.querySelectorAll('#live .live-block').length === 0;").await;
        // The Step timeline: the session's start (it ran the runner, so it
        // shows), RunModel twice, the approval and the tool Step.
        let nodes = wait_for_js(
            &client,
            "the Step timeline",
            "const n = [...document.querySelectorAll('#timeline .node')].map(e => e.dataset.stepType + ':' + e.dataset.status + ':' + e.dataset.attempts); \
             return n.filter(t => t.startsWith('RunModel:execute_completed')).length >= 2 && n.some(t => t.startsWith('CallSingleAttemptTool')) ? n : null;",
        )
        .await;
        let nodes: Vec<String> = serde_json::from_value(nodes).unwrap_or_default();
        assert!(nodes.contains(&"CallSingleAttemptTool:execute_completed:1".to_string()), "{nodes:?}");
        assert!(nodes.contains(&"StartAgentSession:execute_completed:1".to_string()), "{nodes:?}");
        // One runner version and one tool version: no version change.
        let changes = client
            .execute("return document.querySelectorAll('#timeline .version-change, #timeline .version-changed').length;", vec![])
            .await?;
        assert_eq!(changes, json!(0));
        assert_eq!(nodes.iter().filter(|n| n.starts_with("RunModel:execute_completed")).count(), 2, "{nodes:?}");
        assert!(nodes.iter().any(|n| n.starts_with("AwaitToolApproval")), "{nodes:?}");
        let approvals = client.find(Locator::Id("approvals")).await?.text().await?;
        assert_eq!(approvals.trim(), "none");
        Ok::<(), fantoccini::error::CmdError>(())
    }
    .await;
    let _ = client.close().await;
    if let Err(err) = result {
        panic!("browser: {err}");
    }
}

/// The page's cancel button names the turn it shows (`?turn_id=`), so a
/// click on a stale page cannot cancel the turn after it; a click on a live
/// one cancels the running turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_viewers_cancel_button_cancels_the_turn_it_shows() {
    let server = ApiServer::helpdesk(json!({"turns": [
        {"steps": [{"text": "too late", "sleep_ms": 30000}]}
    ]}))
    .await;
    let driver = start_driver().await;
    let client = browser(&driver).await;
    let result = async {
        open_viewer(&client, &server.base).await?;
        let message = client.wait().for_element(Locator::Id("start-message")).await?;
        message.send_keys("think for a long time").await?;
        client.find(Locator::Id("start-button")).await?.click().await?;
        let shown = wait_for_js(
            &client,
            "the cancel button, enabled for the running turn",
            "const b = document.querySelector('#cancel-button'); return b && !b.disabled ? b.dataset.turn : null;",
        )
        .await;
        assert_eq!(shown, json!("turn-1"));
        client
            .execute("document.querySelector('#cancel-button').click(); return true;", vec![])
            .await?;
        let session_id = client.current_url().await?.fragment().unwrap_or_default().trim_start_matches("/s/").to_string();
        let sessions = server.deployment.sessions("Helpdesk").unwrap();
        let mut cancelled = false;
        for _ in 0..600 {
            let (events, _) = sessions.read_events(&session_id, 0, 1000).await.unwrap();
            if events.iter().any(|(_, e)| e.event_type == "turn_cancelled" && e.turn_id == "turn-1") {
                cancelled = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(cancelled, "the click cancelled turn-1");
        wait_for_js(&client, "the button disabled once no turn runs", "return document.querySelector('#cancel-button').disabled;").await;
        Ok::<(), fantoccini::error::CmdError>(())
    }
    .await;
    let _ = client.close().await;
    if let Err(err) = result {
        panic!("browser: {err}");
    }
}

/// Markup and script that must show up as text, never run or become DOM.
const IMG: &str = r#"<img src=x onerror="window.__pwned=1">"#;
const SCRIPT: &str = "<script>window.__pwned=2</script>";
const SVG: &str = r#""><svg onload=window.__pwned=3>"#;
const LINK: &str = r#"<a href="javascript:window.__pwned=4">click me</a>"#;
const JS_URL: &str = "javascript:window.__pwned=5";

fn hostile(label: &str) -> String {
    format!("{label} {IMG} {SCRIPT} {SVG} {LINK} {JS_URL}")
}

/// What a page of the viewer must never contain: the marker set by any
/// hostile script, markup elements the page itself never makes, a second
/// script, inline handlers, and `javascript:` URLs. Returns what it found.
const INJECTED: &str = r#"
const found = [];
if (window.__pwned !== undefined) found.push('window.__pwned = ' + window.__pwned);
for (const e of document.querySelectorAll('img, svg, iframe, object, embed, video, audio, math, base, link, form, meta[http-equiv]'))
  found.push('element ' + e.outerHTML.slice(0, 80));
if (document.scripts.length !== 1) found.push(document.scripts.length + ' scripts');
for (const e of document.querySelectorAll('*'))
  for (const a of e.attributes) {
    if (a.name.startsWith('on')) found.push(e.tagName + ' has ' + a.name);
    if (/^\s*javascript:/i.test(a.value)) found.push(e.tagName + ' ' + a.name + '=' + a.value);
  }
for (const a of document.querySelectorAll('a[href]'))
  if (!a.getAttribute('href').startsWith('#')) found.push('link to ' + a.getAttribute('href'));
return found;
"#;

async fn assert_nothing_injected(client: &Client, phase: &str) {
    let found = client
        .execute(INJECTED, vec![])
        .await
        .unwrap_or_else(|err| panic!("{phase}: {err}"));
    assert_eq!(found, json!([]), "{phase}: hostile text became DOM or ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_markup_in_every_field_renders_as_text_and_never_runs_in_the_viewer() {
    // The session id, the user's message, the assistant's text and live
    // deltas, a custom event, tool names, ids, arguments, an output and an
    // error: each carries markup.
    let script = json!({"turns": [{"steps": [
        {"text": hostile("assistant"), "deltas": [hostile("live")],
         "events": [{"type": "javascript:window.__pwned", "payload": {"html": hostile("event"), "href": JS_URL}}],
         "tool_calls": [
            {"id": "ok", "name": format!("tool {IMG}"), "arguments": {"arg": SCRIPT}, "effect": "read"},
            {"id": "bad", "name": "runner_fail", "arguments": hostile("error"), "effect": "read"},
            {"id": SVG, "name": format!("ask {SVG}"), "arguments": hostile("arguments"), "effect": "read", "requires_approval": true}
         ]},
        {"text": "done"}
    ]}]});
    let server = ApiServer::helpdesk(script).await;
    let http = reqwest::Client::new();
    let started = http
        .post(format!("{}/v1/agents/Helpdesk/sessions", server.base))
        .bearer_auth(TEST_TOKEN)
        .json(&json!({"session_id": SVG, "message": hostile("user")}))
        .send()
        .await
        .unwrap_or_else(|err| panic!("start: {err}"));
    assert_eq!(started.status(), 201, "{:?}", started.text().await);
    let driver = start_driver().await;
    let client = browser(&driver).await;
    let result = async {
        open_viewer(&client, &server.base).await?;
        // The list: the session id is a link's text, and its href stays a
        // fragment of this page.
        let link = wait_for_js(
            &client,
            "the session's link",
            "const a = document.querySelector('a.session-link'); return a ? a.textContent : null;",
        )
        .await;
        assert_eq!(link, json!(SVG));
        assert_nothing_injected(&client, "the session list").await;
        client.execute("document.querySelector('a.session-link').click(); return true;", vec![]).await?;

        // Waiting for approval: the live text, the stored messages so far and
        // the pending call's name and arguments are all on the page.
        let pending = wait_for_js(
            &client,
            "the pending approval",
            "const c = document.querySelector('.approval code'); return c ? c.textContent : null;",
        )
        .await;
        assert_eq!(pending, json!(format!("ask {SVG} {}", hostile("arguments"))));
        let interrupt = client
            .execute("return document.querySelector('.approval').dataset.interrupt;", vec![])
            .await?;
        assert_eq!(interrupt, json!(format!("turn-1/{SVG}")));
        let live = wait_for_js(
            &client,
            "the live text",
            "const b = document.querySelector('#live .live-block'); return b ? b.childNodes[1].textContent : null;",
        )
        .await;
        assert_eq!(live, json!(hostile("live")));
        let where_ = client.find(Locator::Id("where")).await?.text().await?;
        assert_eq!(where_, format!("session {SVG}"));
        assert_nothing_injected(&client, "waiting for approval").await;

        let clicked = wait_for_js(
            &client,
            "the approval's button",
            "const b = document.querySelector('.approval button.approve'); if (!b) return null; b.click(); return true;",
        )
        .await;
        assert_eq!(clicked, json!(true));
        let messages = wait_for_js(
            &client,
            "the answer after the tools",
            "const m = [...document.querySelectorAll('#messages .msg')].map(e => e.childNodes[1].textContent); return m.includes('done') ? m : null;",
        )
        .await;
        let messages: Vec<String> = serde_json::from_value(messages).unwrap_or_default();
        let has = |text: &str| messages.iter().any(|m| m.contains(text));
        assert!(messages.contains(&hostile("user")), "{messages:#?}");
        assert!(messages.contains(&hostile("assistant")), "{messages:#?}");
        // The tool's output (scripted-runner echoes the call as JSON), the
        // failed call's error, and the approved call's output.
        let escaped = |text: &str| text.replace('"', "\\\"");
        assert!(
            messages
                .iter()
                .any(|m| m.contains(&format!("\"tool\":\"tool {}\"", escaped(IMG))) && m.contains(SCRIPT)),
            "{messages:#?}"
        );
        assert!(has(&format!("runner tool failed: {}", hostile("error"))), "{messages:#?}");
        assert!(has(&escaped(&hostile("arguments"))), "{messages:#?}");
        assert_nothing_injected(&client, "after the tools").await;

        // The second layer: under the page's policy (Trusted Types), no
        // string can become markup, an inline handler or a script.
        let sinks = client
            .execute(
                "const tries = { \
                   innerHTML: () => { document.createElement('div').innerHTML = '<b>x</b>'; }, \
                   handler: () => { document.createElement('img').setAttribute('onerror', 'window.__csp = 1'); }, \
                   script: () => { document.createElement('script').text = 'window.__csp = 2'; }, \
                 }; \
                 const out = {}; \
                 for (const [name, attempt] of Object.entries(tries)) { \
                   try { attempt(); out[name] = 'allowed'; } catch (e) { out[name] = e.name; } \
                 } \
                 return out;",
                vec![],
            )
            .await?;
        Ok::<_, fantoccini::error::CmdError>(sinks)
    }
    .await;
    let _ = client.close().await;
    let sinks = result.unwrap_or_else(|err| panic!("browser: {err}"));
    // The custom event reached the stream the page follows.
    let sessions = server.deployment.sessions("Helpdesk").expect("agent");
    let (events, _) = sessions.read_events(SVG, 0, 1000).await.expect("events");
    assert!(
        events
            .iter()
            .any(|(_, e)| e.event_type == "javascript:window.__pwned"
                && e.data["html"] == json!(hostile("event"))),
        "the hostile custom event was not written"
    );
    let page = http
        .get(format!("{}/", server.base))
        .send()
        .await
        .unwrap_or_else(|err| panic!("page: {err}"));
    let policy = page
        .headers()
        .get("content-security-policy")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    assert!(
        policy.contains("script-src 'sha256-") && !policy.contains("unsafe"),
        "the viewer needs a strict Content-Security-Policy, got {policy:?}"
    );
    assert_eq!(
        sinks,
        json!({"innerHTML": "TypeError", "handler": "TypeError", "script": "TypeError"}),
        "strings must not reach HTML or script sinks under {policy:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_timeline_shows_each_step_s_version_and_marks_where_the_runner_changed() {
    // Two turns; between them `dexa agent activate` makes another version
    // of the runner (the same guest with another digest) current.
    let server = ApiServer::helpdesk(json!({"turns": [
        {"steps": [{"text": "one"}]},
        {"steps": [{"text": "two"}]}
    ]}))
    .await;
    let http = reqwest::Client::new();
    let started = http
        .post(format!("{}/v1/agents/Helpdesk/sessions", server.base))
        .bearer_auth(TEST_TOKEN)
        .json(&json!({"session_id": "swapped", "message": "first"}))
        .send()
        .await
        .unwrap_or_else(|err| panic!("start: {err}"));
    assert_eq!(started.status(), 201, "{:?}", started.text().await);
    let sessions = server.deployment.sessions("Helpdesk").expect("agent");
    wait_for_turns(&sessions, "swapped", 1).await;

    let old = digest_of(&guest_bytes("scripted-runner"));
    let bytes = variant(&guest_bytes("scripted-runner"), "viewer");
    let new = digest_of(&bytes);
    assert_ne!(old, new);
    let path = server.dir.path().join("scripted-runner-viewer.wasm");
    std::fs::write(&path, &bytes).unwrap_or_else(|err| panic!("write {}: {err}", path.display()));
    let activated = Command::new(dexa_binary())
        .arg("agent")
        .arg("activate")
        .arg("Helpdesk")
        .arg("--runner")
        .arg(&path)
        .args(["--reason", "viewer test"])
        .env("DEXA_CONFIG", server.dir.path().join("dexa.toml"))
        .env("USER", "test")
        .env("RUST_LOG", "warn")
        .current_dir(server.dir.path())
        .output()
        .unwrap_or_else(|err| panic!("run dexa agent activate: {err}"));
    assert!(
        activated.status.success(),
        "dexa agent activate failed: {}",
        String::from_utf8_lossy(&activated.stderr)
    );
    // The worker's view of the activation log is at most 250 ms old.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let sent = http
        .post(format!("{}/v1/sessions/swapped/messages", server.base))
        .bearer_auth(TEST_TOKEN)
        .json(&json!({"text": "second"}))
        .send()
        .await
        .unwrap_or_else(|err| panic!("send: {err}"));
    assert!(sent.status().is_success(), "{:?}", sent.text().await);
    wait_for_turns(&sessions, "swapped", 2).await;

    // The API's history names the version each runner Step ran: turn 1 the
    // built runner, turn 2 (from the Step that took its message) the new one.
    let history: Value = http
        .get(format!("{}/v1/sessions/swapped/history", server.base))
        .bearer_auth(TEST_TOKEN)
        .send()
        .await
        .unwrap_or_else(|err| panic!("history: {err}"))
        .json()
        .await
        .unwrap_or_else(|err| panic!("history JSON: {err}"));
    let ran: Vec<(String, String)> = history["steps"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .filter_map(|e| {
            Some((
                e["step_type"].as_str()?.to_string(),
                e["component"].as_str()?.to_string(),
            ))
        })
        .collect();
    let step = |step_type: &str, digest: &str| (step_type.to_string(), digest.to_string());
    assert_eq!(
        ran,
        vec![
            step("StartAgentSession", &old),
            step("RunModel", &old),
            step("AwaitUserMessage", &new),
            step("RunModel", &new),
        ],
        "{history}"
    );

    let driver = start_driver().await;
    let client = browser(&driver).await;
    let result = async {
        open_viewer(&client, &server.base).await?;
        client.wait().for_element(Locator::Css("a.session-link")).await?;
        client.execute("location.hash = '#/s/swapped'; return true;", vec![]).await?;
        // Each Step that ran a component shows its short digest (the full
        // one in its title); the first Step on the new version says so.
        let nodes = wait_for_js(
            &client,
            "the timeline with versions",
            "const n = [...document.querySelectorAll('#timeline .node')].filter(e => e.querySelector('.digest')); \
             return n.length >= 4 && document.querySelector('#timeline .version-change') \
               ? n.map(e => [e.dataset.stepType, e.querySelector('.digest').textContent, e.querySelector('.digest').getAttribute('title'), \
                             [...e.querySelectorAll('.version-change')].map(m => m.textContent)]) \
               : null;",
        )
        .await;
        Ok::<_, fantoccini::error::CmdError>(nodes)
    }
    .await;
    let _ = client.close().await;
    let nodes = result.unwrap_or_else(|err| panic!("browser: {err}"));
    let short = |d: &str| d[..12].to_string();
    let marker = format!("version changed: {}… → {}…", short(&old), short(&new));
    assert_eq!(
        nodes,
        json!([
            ["StartAgentSession", short(&old), old, []],
            ["RunModel", short(&old), old, []],
            ["AwaitUserMessage", short(&new), new, [marker]],
            ["RunModel", short(&new), new, []],
        ]),
        "the timeline's versions"
    );
}
