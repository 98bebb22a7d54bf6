//! `dexa demo`: one session of the offline example agent on the embedded
//! SQLite store. The runner is `scripted-runner` (it follows a script, not a
//! model); its tools are `echo-tool` (a read) and `ledger-tool` (an
//! idempotent write into a granted directory). Events are printed as they
//! arrive, then the stored messages and the Step history.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use serde_json::json;

use super::EngineArgs;
use crate::flow::{history, FlowClient, FlowStore, Registry, Worker, WorkerOptions};
use crate::plugin::{ComponentSettings, DirAccess, Grants, SandboxConfig, SandboxEngine};
use crate::session::{
    event_type, AgentComponents, AgentSessionClient, AgentSessionFlow, AgentSessionOptions,
    ToolEffect, ToolPolicy,
};
use crate::store::sqlite::SqliteStore;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// The user's message.
    #[arg(long, default_value = "Pay invoice 7 and tell me what you did")]
    pub message: String,
    /// Where the built guests are.
    #[arg(long, default_value = "target/guests")]
    pub guests_dir: PathBuf,
    /// The SQLite store file.
    #[arg(long, default_value = ".dexa/dexa.sqlite")]
    pub store: PathBuf,
    /// The directory granted to ledger-tool as /ledger.
    #[arg(long, default_value = ".dexa/demo-ledger")]
    pub ledger_dir: PathBuf,
    #[command(flatten)]
    pub engine: EngineArgs,
}

const AGENT: &str = "DemoAgent";

/// The script the example runner follows: two tool calls, then an answer.
fn script() -> serde_json::Value {
    json!({"turns": [{"steps": [
        {"tool_calls": [
            {"id": "lookup", "name": "describe_call", "arguments": {"invoice": 7}, "effect": "read"},
            {"id": "pay", "name": "record_payment", "arguments": {"amount": 120}, "effect": "idempotent_write"}
        ], "usage": {"input": 412, "output": 38}},
        {"text": "I looked up invoice 7 and recorded a payment of 120 (once, even if I am retried).",
         "deltas": ["I looked up invoice 7 ", "and recorded a payment of 120 ", "(once, even if I am retried)."],
         "usage": {"input": 530, "output": 24}}
    ]}]})
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let runner_path = args.guests_dir.join("scripted-runner.wasm");
    let echo_path = args.guests_dir.join("echo-tool.wasm");
    let ledger_path = args.guests_dir.join("ledger-tool.wasm");
    for path in [&runner_path, &echo_path, &ledger_path] {
        anyhow::ensure!(
            path.is_file(),
            "{} is missing; build the guests first with guests/build.sh",
            path.display()
        );
    }
    std::fs::create_dir_all(&args.ledger_dir)
        .with_context(|| format!("cannot create {}", args.ledger_dir.display()))?;
    let store: Arc<dyn FlowStore> = Arc::new(SqliteStore::open(&args.store, Default::default())?);
    println!("store: {} (embedded SQLite)", args.store.display());
    println!("loading components (the first run compiles them, a few seconds each)...");
    let started = Instant::now();
    let engine = SandboxEngine::new(SandboxConfig {
        cache_dir: Some(args.engine.cache_dir.clone()),
        ..SandboxConfig::default()
    })?;
    let mut config = BTreeMap::new();
    config.insert("script".to_string(), script().to_string());
    let runner = engine.load_runner_file(
        &runner_path,
        ComponentSettings::named("scripted-runner").with_config(config),
    )?;
    let echo = engine
        .load_tool_file(&echo_path, ComponentSettings::named("echo-tool"))
        .await?;
    let ledger = engine
        .load_tool_file(
            &ledger_path,
            ComponentSettings::named("ledger-tool").with_grants(Grants::none().dir(
                &args.ledger_dir,
                "/ledger",
                DirAccess::ReadWrite,
            )),
        )
        .await?;
    println!(
        "components ready in {:.1} s: scripted-runner (runner), echo-tool, ledger-tool",
        started.elapsed().as_secs_f64()
    );
    let components =
        AgentComponents::new(Arc::new(runner), vec![Arc::new(echo), Arc::new(ledger)])?;
    let options = AgentSessionOptions::default()
        .tool_policy("describe_call", ToolPolicy::new(ToolEffect::Read))
        .tool_policy(
            "record_payment",
            ToolPolicy::new(ToolEffect::IdempotentWrite),
        );
    let flow = AgentSessionFlow::new(AGENT, components, options);
    let registry = Arc::new(Registry::new([flow.definition()])?);
    let worker = tokio::spawn(
        Worker::new(store.clone(), registry.clone(), WorkerOptions::default())
            .run(std::future::pending()),
    );
    let sessions = AgentSessionClient::new(FlowClient::new(store.clone(), registry), AGENT);
    let session_id = format!(
        "demo-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0)
    );
    println!("session {session_id}\nuser> {}", args.message);
    sessions.start_session(&session_id, &args.message).await?;

    let mut after = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    'watch: loop {
        let (events, _) = sessions.read_events(&session_id, after, 500).await?;
        for (seq, event) in events {
            after = seq;
            let data = &event.data;
            match event.event_type.as_str() {
                event_type::TEXT_DELTA => print!("{}", data["text"].as_str().unwrap_or("")),
                event_type::TOOL_CALL_STARTED => println!(
                    "  [tool {} {} started]",
                    data["tool_name"].as_str().unwrap_or("?"),
                    data["tool_call_id"].as_str().unwrap_or("?")
                ),
                event_type::TOOL_CALL_FINISHED => println!(
                    "  [tool {} {} {}]",
                    data["tool_name"].as_str().unwrap_or("?"),
                    data["tool_call_id"].as_str().unwrap_or("?"),
                    data["status"].as_str().unwrap_or("?")
                ),
                event_type::TURN_STARTED => println!("  [{} started]", event.turn_id),
                event_type::TURN_COMPLETED => {
                    println!("\n  [{} completed]", event.turn_id);
                    break 'watch;
                }
                event_type::TURN_FAILED => {
                    println!("\n  [{} failed: {}]", event.turn_id, data["error"]);
                    break 'watch;
                }
                _ => {}
            }
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the turn did not finish within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let snapshot = sessions.get_agent_snapshot(&session_id).await?;
    println!("\nstored messages:");
    for message in &snapshot.messages {
        println!(
            "  {:>3} {:<9} {}",
            message.sequence,
            format!("{:?}", message.role).to_lowercase(),
            message.text.as_deref().unwrap_or("(no text)")
        );
    }
    println!(
        "usage: {} input + {} output tokens over {} model calls",
        snapshot.usage.input_tokens, snapshot.usage.output_tokens, snapshot.usage.model_calls
    );
    println!("steps (each in a fresh sandbox, each committed durably):");
    for entry in store.step_history(&session_id).await? {
        if entry.event_type == history::EXECUTE_COMPLETED {
            println!("  {:<22} attempt {}", entry.step_type, entry.final_attempt);
        }
    }
    println!(
        "the session waits for the next message; it stays in {}",
        args.store.display()
    );
    worker.abort();
    Ok(())
}
