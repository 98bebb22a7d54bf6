//! A tool component for crash and concurrency tests: file gates in a granted
//! directory mounted at `/gates`, and a log of real invocations.
//!
//! Tools (all declare no effect; a test sets the policy it needs):
//! - `gate` `{"name": "a", "await": ["b"], "timeout_ms": 10000}`: appends
//!   `<name>` to `/gates/invocations.log`, creates `/gates/<name>.reached`,
//!   then waits until every gate in `await` is reached too, or, when `await`
//!   is empty, until `/gates/<name>.release` exists, then creates
//!   `/gates/<name>.passed`. It fails with an
//!   execution error when the wait times out, so two gates that await each
//!   other pass only when their calls really overlap.
//! - `log` `{"name": "a"}`: appends `<name>` to `/gates/invocations.log`
//!   and returns the idempotency key.
//!
//! Both take `"hold_ms"`: how long to run on before returning (after the
//! gate opened), so that a soak's kills can land inside tool calls.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Deserialize;

wit_bindgen::generate!({ path: "../../wit", world: "dex:agents/tool" });

const ROOT: &str = "/gates";

struct GateTool;

#[derive(Deserialize)]
struct GateArgs {
    name: String,
    #[serde(default, rename = "await")]
    await_gates: Vec<String>,
    #[serde(default = "default_timeout")]
    timeout_ms: u64,
    #[serde(default)]
    hold_ms: u64,
}

fn default_timeout() -> u64 {
    10_000
}

fn execution(message: String) -> ToolError {
    ToolError::Execution(message)
}

fn check_name(name: &str) -> Result<(), ToolError> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(execution(format!(
            "gate name {name:?} must be [A-Za-z0-9_-]+"
        )));
    }
    Ok(())
}

fn log_invocation(name: &str, key: &str) -> Result<(), ToolError> {
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(format!("{ROOT}/invocations.log"))
        .map_err(|err| {
            ToolError::Internal(format!("no gate directory granted at {ROOT}: {err}"))
        })?;
    // One write per line, so that concurrent calls do not interleave.
    log.write_all(format!("{name} {key}\n").as_bytes())
        .map_err(|err| ToolError::Internal(err.to_string()))
}

fn gate(args: GateArgs, key: &str) -> Result<String, ToolError> {
    check_name(&args.name)?;
    for other in &args.await_gates {
        check_name(other)?;
    }
    log_invocation(&args.name, key)?;
    std::fs::write(format!("{ROOT}/{}.reached", args.name), key)
        .map_err(|err| ToolError::Internal(err.to_string()))?;
    let started = Instant::now();
    let timeout = Duration::from_millis(args.timeout_ms);
    loop {
        let open = if args.await_gates.is_empty() {
            Path::new(&format!("{ROOT}/{}.release", args.name)).exists()
        } else {
            args.await_gates
                .iter()
                .all(|other| Path::new(&format!("{ROOT}/{other}.reached")).exists())
        };
        if open {
            // Proof that the call ran on past its gate (a cancel test
            // looks for its absence).
            std::fs::write(format!("{ROOT}/{}.passed", args.name), key)
                .map_err(|err| ToolError::Internal(err.to_string()))?;
            std::thread::sleep(Duration::from_millis(args.hold_ms));
            return Ok(format!("gate {} passed", args.name));
        }
        if started.elapsed() >= timeout {
            return Err(execution(format!(
                "gate {} timed out after {} ms",
                args.name, args.timeout_ms
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

impl Guest for GateTool {
    fn list_tools() -> Vec<ToolSpec> {
        let spec = |name: &str, description: &str| ToolSpec {
            name: name.to_string(),
            description: description.to_string(),
            parameters_schema:
                r#"{"type":"object","properties":{"name":{"type":"string"}},"required":["name"]}"#
                    .to_string(),
            effect: None,
        };
        vec![
            spec(
                "gate",
                "Marks a gate as reached and waits for its release or its peers",
            ),
            spec("log", "Records one invocation"),
        ]
    }

    fn call(call: DeferredToolExecution) -> Result<String, ToolError> {
        let record = &call.tool_call;
        match record.tool_name.as_str() {
            "gate" => {
                let args: GateArgs = serde_json::from_str(&record.arguments)
                    .map_err(|err| execution(format!("bad arguments: {err}")))?;
                gate(args, &call.idempotency_key)
            }
            "log" => {
                #[derive(Deserialize)]
                struct LogArgs {
                    name: String,
                    #[serde(default)]
                    hold_ms: u64,
                }
                let args: LogArgs = serde_json::from_str(&record.arguments)
                    .map_err(|err| execution(format!("bad arguments: {err}")))?;
                check_name(&args.name)?;
                log_invocation(&args.name, &call.idempotency_key)?;
                std::thread::sleep(Duration::from_millis(args.hold_ms));
                Ok(call.idempotency_key.clone())
            }
            other => Err(execution(format!("gate-tool has no tool {other:?}"))),
        }
    }
}

export!(GateTool);
