//! `dexa session ...`: the session RPCs from the command line, for scripts.
//! They work on the store named in `dexa.toml` directly; a worker (`dexa
//! worker` or `dexa serve`) runs the turns. `--json` prints machine-readable
//! output.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use serde_json::json;

use crate::config::{Deployment, DexaConfig};
use crate::session::{
    new_session_id, AgentSessionClient, AgentSnapshot, CancelOutcome, ResolveInterruptRequest,
    SendOutcome, TurnWait, MAX_TURN_WAIT,
};
use crate::telemetry::traces::TurnTrace;

#[derive(Args, Debug)]
pub struct SessionArgs {
    /// The config file.
    #[arg(long, short, default_value = crate::config::DEFAULT_CONFIG_FILE, env = "DEXA_CONFIG", global = true)]
    pub config: PathBuf,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: SessionCommand,
}

#[derive(Subcommand, Debug)]
pub enum SessionCommand {
    /// Sessions, newest first.
    List {
        #[arg(long)]
        agent: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// Start a session of AGENT; a non-blank MESSAGE starts its first turn.
    Start {
        agent: String,
        #[arg(default_value = "")]
        message: String,
        /// The session id (default: generated).
        #[arg(long)]
        id: Option<String>,
    },
    /// A session's state, pending approvals and messages.
    Show {
        session_id: String,
        /// Messages to show, newest last.
        #[arg(long, default_value_t = 20)]
        messages: usize,
    },
    /// Queue a user message.
    Send {
        session_id: String,
        text: String,
        /// Queue it at most once per KEY on this session: a script that
        /// retries the same send with the same key (after a timeout, say)
        /// queues nothing the second time. 1 to 255 printable ASCII
        /// characters; the session remembers a key for at least 24 h.
        #[arg(long, value_name = "KEY")]
        idempotency_key: Option<String>,
        /// Wait up to SECONDS (at most 300) for the turn the message starts
        /// and print its new messages. Exits 0 when the turn completed, 1
        /// when it failed, was cancelled or the session was stopped, 2 when
        /// it still runs or waits for an approval (the turn goes on either
        /// way).
        #[arg(long, value_name = "SECONDS")]
        wait: Option<u64>,
        /// Steer: cancel the running turn and start the next one with this
        /// message (queued as usual when no turn runs).
        #[arg(long)]
        interrupt: bool,
    },
    /// Cancel the running turn: its guest calls stop, its unfinished tool
    /// calls are recorded, a note goes into the history; queued messages
    /// stay queued.
    Cancel {
        session_id: String,
        /// Only if this turn is the one running (a cancel sent late must
        /// not cancel the next turn).
        #[arg(long, value_name = "TURN_ID")]
        turn: Option<String>,
    },
    /// Approve a pending tool call (the only one when no id is given).
    Approve {
        session_id: String,
        interrupt_id: Option<String>,
    },
    /// Reject a pending tool call, optionally telling the model why.
    Reject {
        session_id: String,
        interrupt_id: Option<String>,
        #[arg(long)]
        message: Option<String>,
    },
    /// Stop a session; its state stays readable.
    Stop { session_id: String },
    /// The session's Step history.
    History { session_id: String },
    /// Wait until the session is idle: no turn running, no message queued
    /// (or an approval is pending). Exits non-zero on timeout.
    Wait {
        session_id: String,
        #[arg(long, default_value_t = 120)]
        timeout_secs: u64,
    },
}

/// The client of the agent that owns `session_id`.
pub async fn session_client(
    deployment: &Deployment,
    session_id: &str,
) -> anyhow::Result<AgentSessionClient> {
    let flow = deployment
        .store
        .flow(session_id)
        .await?
        .with_context(|| format!("there is no session {session_id:?}"))?;
    deployment.sessions(&flow.flow_type)
}

/// `dexa session send`: queues the message and, with `wait`, waits for the
/// turn it starts (see [`AgentSessionClient::wait_for_turn`]).
struct SendArgs {
    idempotency_key: Option<String>,
    wait: Option<std::time::Duration>,
    interrupt: bool,
}

async fn send(
    sessions: &AgentSessionClient,
    session_id: &str,
    text: &str,
    args: SendArgs,
    print: &impl Fn(serde_json::Value, String),
) -> anyhow::Result<()> {
    let SendArgs {
        idempotency_key,
        wait,
        interrupt,
    } = args;
    if wait.is_some_and(|wait| wait > MAX_TURN_WAIT) {
        bail!(
            "--wait is at most {} seconds; nothing was queued",
            MAX_TURN_WAIT.as_secs()
        );
    }
    // Read for a keyed send too, and remembered with the key: a retry's
    // wait starts there (see the API's send).
    let head = match (wait, &idempotency_key) {
        (None, None) => None,
        _ => Some(sessions.event_head(session_id).await?),
    };
    let sent = sessions
        .send_traced(
            session_id,
            text,
            idempotency_key.as_deref(),
            interrupt,
            TurnTrace::new_root(),
            head,
        )
        .await?;
    let replayed = sent.outcome == SendOutcome::Replayed;
    let mut answer = match (sent.outcome, &idempotency_key) {
        (SendOutcome::Blank, _) => bail!("the message is blank; nothing was queued"),
        (_, None) => json!({"queued": true}),
        (_, Some(key)) => json!({"queued": true, "idempotency_key": key, "replayed": replayed}),
    };
    answer["message_id"] = json!(sent.message_id);
    if interrupt {
        answer["interrupted"] = json!(sent.interrupted);
    }
    let queued = match (&idempotency_key, &sent.interrupted) {
        (_, Some(turn)) => format!("cancelled {turn}; the message starts the next turn"),
        (Some(key), _) if replayed => {
            format!("already queued with idempotency key {key:?}; nothing queued now")
        }
        _ => "queued".to_string(),
    };
    let (Some(wait), Some(head), Some(message_id)) = (wait, head, sent.message_id) else {
        print(answer, queued);
        return Ok(());
    };
    let after = if replayed {
        sent.events_after.unwrap_or(0)
    } else {
        head
    };
    let waited = sessions
        .wait_for_turn(session_id, &message_id, after, wait)
        .await?;
    if let (Some(answer), serde_json::Value::Object(waited)) =
        (answer.as_object_mut(), serde_json::to_value(&waited)?)
    {
        answer.extend(waited);
    }
    match &waited {
        TurnWait::Completed { messages, .. } => {
            let text: Vec<String> = messages
                .iter()
                .map(|m| {
                    format!(
                        "{}: {}",
                        format!("{:?}", m.role).to_lowercase(),
                        m.text.as_deref().unwrap_or("")
                    )
                })
                .collect();
            print(answer, text.join("\n"));
            Ok(())
        }
        TurnWait::Failed { error, .. } => {
            print(answer, format!("the turn failed: {error}"));
            std::process::exit(1);
        }
        TurnWait::Cancelled { turn_id } => {
            print(answer, format!("{turn_id} was cancelled"));
            std::process::exit(1);
        }
        TurnWait::SessionEnded { session_status, .. } => {
            print(
                answer,
                format!("the session is {session_status}: the turn never ends"),
            );
            std::process::exit(1);
        }
        TurnWait::WaitingForApproval { interrupts, .. } => {
            let ids: Vec<&str> = interrupts.iter().map(|i| i.interrupt_id.as_str()).collect();
            print(
                answer,
                format!("{queued}; the turn waits for approval of {ids:?}"),
            );
            std::process::exit(2);
        }
        TurnWait::Running { turn_id } => {
            let what = match turn_id {
                Some(turn) => format!("{turn} still runs"),
                None => "the message is still queued".to_string(),
            };
            print(
                answer,
                format!("{queued}; {what} after {} s", wait.as_secs()),
            );
            std::process::exit(2);
        }
    }
}

/// The interrupt to answer: the given one, or the only pending one.
fn pick_interrupt(snapshot: &AgentSnapshot, given: Option<String>) -> anyhow::Result<String> {
    if let Some(id) = given {
        return Ok(id);
    }
    match snapshot.pending_interrupts.as_slice() {
        [] => bail!("session {:?} has no pending approval", snapshot.session_id),
        [only] => Ok(only.interrupt_id.clone()),
        several => {
            let ids: Vec<&str> = several.iter().map(|i| i.interrupt_id.as_str()).collect();
            bail!("several approvals are pending; name one of {ids:?}")
        }
    }
}

pub async fn run(args: SessionArgs) -> anyhow::Result<()> {
    let config = DexaConfig::load(&args.config)?;
    let deployment = Deployment::for_clients(config).await?;
    let print = |value: serde_json::Value, text: String| {
        if args.json {
            println!("{value}");
        } else {
            println!("{text}");
        }
    };
    match args.command {
        SessionCommand::List { agent, limit } => {
            if let Some(agent) = &agent {
                deployment.sessions(agent)?;
            }
            let flows = deployment
                .store
                .list_flows(agent.as_deref(), None, limit.clamp(1, 1000))
                .await?;
            let value = serde_json::to_value(&flows)?;
            let mut text = String::new();
            for flow in &flows {
                text.push_str(&format!(
                    "{}\t{}\t{}\n",
                    flow.flow_id,
                    flow.flow_type,
                    flow.status.as_str()
                ));
            }
            print(value, text.trim_end().to_string());
        }
        SessionCommand::Start { agent, message, id } => {
            let sessions = deployment.sessions(&agent)?;
            let id = id.unwrap_or_else(|| new_session_id(&agent.to_ascii_lowercase()));
            sessions.start_session(&id, &message).await?;
            print(json!({"session_id": id, "agent": agent}), id.clone());
        }
        SessionCommand::Show {
            session_id,
            messages,
        } => {
            let sessions = session_client(&deployment, &session_id).await?;
            let snapshot = sessions.get_agent_snapshot(&session_id).await?;
            let value = serde_json::to_value(&snapshot)?;
            print(value, describe(&snapshot, messages));
        }
        SessionCommand::Send {
            session_id,
            text,
            idempotency_key,
            wait,
            interrupt,
        } => {
            let sessions = session_client(&deployment, &session_id).await?;
            let wait = wait.map(std::time::Duration::from_secs);
            let send_args = SendArgs {
                idempotency_key,
                wait,
                interrupt,
            };
            send(&sessions, &session_id, &text, send_args, &print).await?;
        }
        SessionCommand::Cancel { session_id, turn } => {
            let sessions = session_client(&deployment, &session_id).await?;
            let outcome = match &turn {
                Some(turn) => sessions.cancel_named_turn(&session_id, turn).await?,
                None => sessions.cancel_turn(&session_id).await?,
            };
            match outcome {
                CancelOutcome::Cancelled { turn_id } => print(
                    json!({"cancelled": true, "turn_id": turn_id}),
                    format!("cancelled {turn_id}"),
                ),
                CancelOutcome::NoTurn => print(
                    json!({"cancelled": false}),
                    "no turn is running".to_string(),
                ),
                CancelOutcome::NotThatTurn { running } => print(
                    json!({"cancelled": false, "running_turn_id": running}),
                    format!("{running} is running, not the turn given; nothing was cancelled"),
                ),
            }
        }
        SessionCommand::Approve {
            session_id,
            interrupt_id,
        } => {
            answer(&deployment, &session_id, interrupt_id, true, None, &print).await?;
        }
        SessionCommand::Reject {
            session_id,
            interrupt_id,
            message,
        } => {
            answer(
                &deployment,
                &session_id,
                interrupt_id,
                false,
                message,
                &print,
            )
            .await?;
        }
        SessionCommand::Stop { session_id } => {
            let sessions = session_client(&deployment, &session_id).await?;
            let stopped = sessions.stop_session(&session_id).await?;
            print(
                json!({"stopped": stopped}),
                if stopped {
                    "stopped"
                } else {
                    "it was not running"
                }
                .to_string(),
            );
        }
        SessionCommand::Wait {
            session_id,
            timeout_secs,
        } => {
            let sessions = session_client(&deployment, &session_id).await?;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(timeout_secs);
            loop {
                let snapshot = sessions.get_agent_snapshot(&session_id).await?;
                let idle = snapshot
                    .state
                    .as_ref()
                    .is_some_and(|s| s.active_turn_id.is_none())
                    && snapshot.queued_message_count == 0;
                let waiting = !snapshot.pending_interrupts.is_empty();
                if idle || waiting || snapshot.flow_status != crate::flow::FlowStatus::Running {
                    let state = if waiting {
                        "waiting for approval"
                    } else if idle {
                        "idle"
                    } else {
                        snapshot.flow_status.as_str()
                    };
                    print(json!({"state": state}), state.to_string());
                    break;
                }
                if std::time::Instant::now() >= deadline {
                    bail!("session {session_id:?} was still busy after {timeout_secs} s");
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
        SessionCommand::History { session_id } => {
            session_client(&deployment, &session_id).await?;
            let steps = deployment.store.step_history(&session_id).await?;
            let mut text = String::new();
            for step in &steps {
                text.push_str(&format!(
                    "{}\t{:<26}\tattempt {}\t{}{}\n",
                    step.at,
                    step.step_type,
                    step.final_attempt,
                    step.event_type,
                    step.detail
                        .as_deref()
                        .map(|d| format!("\t{d}"))
                        .unwrap_or_default()
                ));
            }
            print(serde_json::to_value(&steps)?, text.trim_end().to_string());
        }
    }
    Ok(())
}

async fn answer(
    deployment: &Deployment,
    session_id: &str,
    interrupt_id: Option<String>,
    approved: bool,
    rejection_message: Option<String>,
    print: &dyn Fn(serde_json::Value, String),
) -> anyhow::Result<()> {
    let sessions = session_client(deployment, session_id).await?;
    let snapshot = sessions.get_agent_snapshot(session_id).await?;
    let interrupt_id = pick_interrupt(&snapshot, interrupt_id)?;
    let resolved = sessions
        .resolve_interrupt(
            session_id,
            ResolveInterruptRequest {
                interrupt_id: interrupt_id.clone(),
                approved,
                rejection_message,
            },
        )
        .await?;
    if !resolved {
        bail!("{interrupt_id} is no longer pending (already answered, or expired)");
    }
    print(
        json!({"resolved": true, "interrupt_id": interrupt_id}),
        format!(
            "{} {interrupt_id}",
            if approved { "approved" } else { "rejected" }
        ),
    );
    Ok(())
}

/// A snapshot for people.
pub fn describe(snapshot: &AgentSnapshot, last_messages: usize) -> String {
    let mut out = format!(
        "session {} ({})\n",
        snapshot.session_id,
        snapshot.flow_status.as_str()
    );
    if let Some(state) = &snapshot.state {
        out.push_str(&format!(
            "turns: {}{}\n",
            state.turn_count,
            state
                .active_turn_id
                .as_deref()
                .map(|t| format!(", {t} running"))
                .unwrap_or_default()
        ));
        if let Some(error) = &state.last_turn_error {
            out.push_str(&format!("last turn failed: {error}\n"));
        }
    }
    out.push_str(&format!(
        "usage: {} input + {} output tokens over {} model calls\n",
        snapshot.usage.input_tokens, snapshot.usage.output_tokens, snapshot.usage.model_calls
    ));
    for interrupt in &snapshot.pending_interrupts {
        out.push_str(&format!(
            "pending approval {}: {} {}\n",
            interrupt.interrupt_id, interrupt.tool_name, interrupt.arguments
        ));
    }
    let skip = snapshot.messages.len().saturating_sub(last_messages);
    for message in &snapshot.messages[skip..] {
        out.push_str(&format!(
            "{:>4} {:<9} {}\n",
            message.sequence,
            format!("{:?}", message.role).to_lowercase(),
            message.text.as_deref().unwrap_or("(no text)")
        ));
    }
    out.trim_end().to_string()
}
