//! The web viewer in headless Chromium (Debian's `chromium` and
//! `chromium-driver`, driven over WebDriver): start a session from the page,
//! watch live text appear, approve the tool call, and see its result and the
//! Step timeline.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use dexa_tests::api_server::{ApiServer, TEST_TOKEN};
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;

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
        client.goto(&format!("{}/", server.base)).await?;
        client
            .execute(
                "localStorage.setItem('dexa-token', arguments[0]); location.reload(); return true;",
                vec![json!(TEST_TOKEN)],
            )
            .await?;
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
        // The Step timeline: RunModel twice, the approval and the tool Step.
        let nodes = wait_for_js(
            &client,
            "the Step timeline",
            "const n = [...document.querySelectorAll('#timeline .node')].map(e => e.dataset.stepType + ':' + e.dataset.status + ':' + e.dataset.attempts); return n.length >= 4 ? n : null;",
        )
        .await;
        let nodes: Vec<String> = serde_json::from_value(nodes).unwrap_or_default();
        assert!(nodes.contains(&"CallSingleAttemptTool:execute_completed:1".to_string()), "{nodes:?}");
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
