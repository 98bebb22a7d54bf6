//! `dexa chat <agent>`: an interactive session in the terminal. Text streams
//! as it is produced, tool calls show as they start and finish, approvals are
//! asked y/n, and a restarted `dexa chat` reattaches to the same session.
//!
//! It runs a worker in-process unless `--no-worker` (then `dexa serve` or
//! `dexa worker` must be running on the same store).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tokio::io::{AsyncBufReadExt, BufReader, Lines, Stdin};

use super::worker::log_progress;
use crate::config::{Deployment, DexaConfig};
use crate::flow::FlowStatus;
use crate::session::{
    event_type, new_session_id, AgentSessionClient, CancelOutcome, ResolveInterruptRequest,
};

#[derive(Args, Debug)]
pub struct ChatArgs {
    /// The agent to talk to.
    pub agent: String,
    /// The config file.
    #[arg(long, short, default_value = crate::config::DEFAULT_CONFIG_FILE, env = "DEXA_CONFIG")]
    pub config: PathBuf,
    /// Attach to this session (default: the last chat with this agent, or a
    /// new one).
    #[arg(long)]
    pub session: Option<String>,
    /// Start a new session even if a previous chat can be resumed.
    #[arg(long)]
    pub new: bool,
    /// Do not run a worker here.
    #[arg(long)]
    pub no_worker: bool,
}

/// How often the chat looks for new events.
const POLL: Duration = Duration::from_millis(30);

struct Chat {
    sessions: AgentSessionClient,
    session_id: String,
    lines: Lines<BufReader<Stdin>>,
    /// The last event shown.
    cursor: i64,
    /// Ctrl-C, from the start: one pressed while an RPC runs is seen at
    /// the next wait rather than lost.
    interrupts: tokio::signal::unix::Signal,
}

fn out(text: &str) {
    print!("{text}");
    let _ = std::io::stdout().flush();
}

/// Where the last chat with `agent` is remembered: next to the config.
fn memory_file(config: &DexaConfig, agent: &str) -> PathBuf {
    config
        .local_dir()
        .join("chat")
        .join(format!("{agent}.session"))
}

pub async fn run(args: ChatArgs) -> anyhow::Result<()> {
    let config = DexaConfig::load(&args.config)?;
    if !config.agents.contains_key(&args.agent) {
        let known: Vec<&String> = config.agents.keys().collect();
        anyhow::bail!(config.error(format!(
            "there is no agent {:?}; the agents are {known:?}",
            args.agent
        )));
    }
    let memory = memory_file(&config, &args.agent);
    let deployment = if args.no_worker {
        Deployment::for_clients(config).await?
    } else {
        tracing::info!("loading the agent's components (the first run compiles them)...");
        Deployment::for_workers(config, &log_progress).await?
    };
    let worker =
        (!args.no_worker).then(|| tokio::spawn(deployment.worker().run(std::future::pending())));
    let sessions = deployment.sessions(&args.agent)?;

    // Reattach to the remembered session while it runs.
    let remembered = std::fs::read_to_string(&memory)
        .ok()
        .map(|s| s.trim().to_string());
    let wanted = args
        .session
        .clone()
        .or(if args.new { None } else { remembered });
    let mut attached = None;
    if let Some(id) = wanted {
        match deployment.store.flow(&id).await? {
            Some(flow) if flow.flow_type == args.agent && flow.status == FlowStatus::Running => {
                attached = Some(id)
            }
            Some(flow) if args.session.is_some() => anyhow::bail!(
                "session {id:?} is a {} session and is {}",
                flow.flow_type,
                flow.status.as_str()
            ),
            None if args.session.is_some() => anyhow::bail!("there is no session {id:?}"),
            _ => {}
        }
    }
    let (session_id, fresh) = match attached {
        Some(id) => (id, false),
        None => (
            new_session_id(&format!("chat-{}", args.agent.to_ascii_lowercase())),
            true,
        ),
    };
    if let Some(parent) = memory.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    std::fs::write(&memory, &session_id)
        .with_context(|| format!("cannot write {}", memory.display()))?;

    let mut chat = Chat {
        sessions,
        session_id,
        lines: BufReader::new(tokio::io::stdin()).lines(),
        cursor: 0,
        interrupts: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
            .context("cannot listen for Ctrl-C")?,
    };
    if fresh {
        chat.sessions.start_session(&chat.session_id, "").await?;
        println!(
            "new session {} with {} (/quit to leave; the session stays)",
            chat.session_id, args.agent
        );
    } else {
        chat.reattach().await?;
    }
    let result = chat.talk().await;
    if let Some(worker) = worker {
        worker.abort();
    }
    if result.is_ok() {
        // A read of stdin may still wait on a blocking thread (after Ctrl-C
        // at the prompt), which the runtime would wait for at shutdown.
        let _ = std::io::stdout().flush();
        std::process::exit(0);
    }
    result
}

impl Chat {
    async fn reattach(&mut self) -> anyhow::Result<()> {
        // The cursor first: an event raised meanwhile is then seen twice at
        // worst (the snapshot and the stream), never missed.
        let (_, next) = self.sessions.read_events(&self.session_id, 0, 1).await?;
        self.cursor = next - 1;
        let snapshot = self.sessions.get_agent_snapshot(&self.session_id).await?;
        println!(
            "resuming session {} ({} messages; /quit to leave)",
            self.session_id,
            snapshot.messages.len()
        );
        let skip = snapshot.messages.len().saturating_sub(6);
        for message in &snapshot.messages[skip..] {
            println!(
                "  {}: {}",
                format!("{:?}", message.role).to_lowercase(),
                message.text.as_deref().unwrap_or("")
            );
        }
        let busy = snapshot
            .state
            .as_ref()
            .is_some_and(|s| s.active_turn_id.is_some())
            || snapshot.queued_message_count > 0;
        for interrupt in snapshot.pending_interrupts {
            let cancelled = self
                .ask(
                    &interrupt.turn_id,
                    &interrupt.interrupt_id,
                    &interrupt.tool_name,
                    &interrupt.arguments,
                )
                .await?;
            if cancelled {
                break;
            }
        }
        if busy {
            self.follow_turn(None).await?;
        }
        Ok(())
    }

    async fn talk(&mut self) -> anyhow::Result<()> {
        loop {
            out("you> ");
            // Ctrl-C cancels a running turn (see `follow_turn`); at the
            // prompt it leaves, as it would without the handler.
            let line = tokio::select! {
                line = self.lines.next_line() => line?,
                _ = self.interrupts.recv() => None,
            };
            let Some(line) = line else {
                println!();
                return Ok(());
            };
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if line == "/quit" || line == "/exit" {
                return Ok(());
            }
            match self
                .sessions
                .send_tracked(&self.session_id, line, None, false)
                .await
            {
                Ok(sent) => self.follow_turn(sent.message_id.as_deref()).await?,
                // Refused before it was queued: say why and keep talking.
                Err(err @ crate::session::SessionError::MessageTooLarge { .. }) => {
                    println!("dexa: {err}");
                }
                Err(err) => return Err(err.into()),
            }
        }
    }

    /// Prints the session's events until the turn followed ends, asking
    /// for approvals on the way. With `message_id` (the message this chat
    /// sent), that message's turn: turns of other clients' messages queued
    /// ahead of it are shown but neither end the follow nor are cancelled,
    /// and a Ctrl-C before its turn started cancels it when it starts.
    /// Without (a chat resuming a busy session), the next turn to end.
    async fn follow_turn(&mut self, message_id: Option<&str>) -> anyhow::Result<()> {
        let mut in_text = false;
        let mut quiet_polls = 0u32;
        // The turn followed, once its `turn_started` was seen.
        let mut turn: Option<String> = None;
        // Ctrl-C came before the message's turn started.
        let mut cancel_at_start = false;
        loop {
            let (events, _) = self
                .sessions
                .read_events(&self.session_id, self.cursor, 200)
                .await?;
            if events.is_empty() {
                // Now and then, check that a turn can still end: the session
                // may have been stopped, or its end event trimmed away.
                quiet_polls += 1;
                if quiet_polls.is_multiple_of(33) {
                    let snapshot = self.sessions.get_agent_snapshot(&self.session_id).await?;
                    if snapshot.flow_status != FlowStatus::Running {
                        println!("\n  [the session is {}]", snapshot.flow_status.as_str());
                        return Ok(());
                    }
                    let idle = snapshot
                        .state
                        .as_ref()
                        .is_some_and(|s| s.active_turn_id.is_none())
                        && snapshot.queued_message_count == 0;
                    if idle {
                        return Ok(());
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(POLL) => {}
                    _ = self.interrupts.recv() => {
                        if in_text {
                            println!();
                            in_text = false;
                        }
                        // Always the turn followed, by name: never one of
                        // another client's messages, nor one that started
                        // after it ended.
                        let outcome = match (&turn, message_id) {
                            (Some(turn), _) => {
                                self.sessions
                                    .cancel_named_turn(&self.session_id, turn)
                                    .await?
                            }
                            // Not started yet, or its start not read yet (a
                            // busy worker, the runner still building it):
                            // cancelled when its start is read, rather than
                            // left to run unseen.
                            (None, Some(_)) => {
                                cancel_at_start = true;
                                println!("  [cancelling the turn when it starts]");
                                continue;
                            }
                            (None, None) => self.sessions.cancel_turn(&self.session_id).await?,
                        };
                        match outcome {
                            CancelOutcome::Cancelled { .. } => println!("  [cancelling the turn]"),
                            // Nothing of this chat's to wait for.
                            CancelOutcome::NoTurn if turn.is_none() => return Ok(()),
                            // It ended meanwhile; its end event follows.
                            CancelOutcome::NoTurn | CancelOutcome::NotThatTurn { .. } => {}
                        }
                    }
                }
                continue;
            }
            quiet_polls = 0;
            for (seq, event) in events {
                self.cursor = seq;
                // Whether an end event ends the follow: one of the turn
                // followed, or of this chat's message given up before its
                // turn ran.
                let followed = event.origin.is_none()
                    && (message_id.is_none()
                        || turn.as_deref() == Some(event.turn_id.as_str())
                        || event.data["message_id"].as_str() == message_id);
                let data = &event.data;
                let field = |name: &str| data[name].as_str().unwrap_or("?").to_string();
                match event.event_type.as_str() {
                    event_type::TURN_STARTED if event.origin.is_none() => {
                        let ours =
                            message_id.is_none() || data["message_id"].as_str() == message_id;
                        if !ours {
                            continue;
                        }
                        turn = Some(event.turn_id.clone());
                        if cancel_at_start {
                            cancel_at_start = false;
                            if let CancelOutcome::Cancelled { .. } = self
                                .sessions
                                .cancel_named_turn(&self.session_id, &event.turn_id)
                                .await?
                            {
                                println!("  [cancelling the turn]");
                            }
                        }
                    }
                    event_type::TEXT_DELTA => {
                        if !in_text {
                            out(&format!("{}> ", "agent"));
                            in_text = true;
                        }
                        out(data["text"].as_str().unwrap_or(""));
                    }
                    event_type::TOOL_CALL_STARTED => {
                        if in_text {
                            println!();
                            in_text = false;
                        }
                        println!("  [{}tool {} started]", by(&event), field("tool_name"));
                    }
                    event_type::TOOL_CALL_FINISHED => {
                        println!(
                            "  [{}tool {} {}]",
                            by(&event),
                            field("tool_name"),
                            field("status")
                        );
                    }
                    event_type::INTERRUPT_RAISED => {
                        if in_text {
                            println!();
                            in_text = false;
                        }
                        let interrupt_id = field("interrupt_id");
                        let arguments = self
                            .sessions
                            .get_agent_snapshot(&self.session_id)
                            .await?
                            .pending_interrupts
                            .into_iter()
                            .find(|i| i.interrupt_id == interrupt_id)
                            .map(|i| i.arguments);
                        // Already answered elsewhere when it is no longer pending.
                        if let Some(arguments) = arguments {
                            self.ask(
                                &event.turn_id,
                                &interrupt_id,
                                &field("tool_name"),
                                &arguments,
                            )
                            .await?;
                        }
                    }
                    // Another client's turn ended: its text line ends too.
                    event_type::TURN_COMPLETED
                    | event_type::TURN_FAILED
                    | event_type::TURN_CANCELLED
                        if !followed && in_text =>
                    {
                        println!();
                        in_text = false;
                    }
                    event_type::TURN_COMPLETED
                    | event_type::TURN_FAILED
                    | event_type::TURN_CANCELLED
                        if !followed => {}
                    event_type::TURN_COMPLETED => {
                        if in_text {
                            println!();
                        }
                        return Ok(());
                    }
                    event_type::TURN_FAILED => {
                        if in_text {
                            println!();
                        }
                        println!("  [the turn failed: {}]", field("error"));
                        return Ok(());
                    }
                    event_type::TURN_CANCELLED => {
                        if in_text {
                            println!();
                        }
                        println!("  [the turn was cancelled]");
                        return Ok(());
                    }
                    _ => {}
                }
            }
        }
    }

    /// Asks whether to approve a pending tool call of `turn_id`. Ctrl-C at
    /// the question cancels that turn (true), as it does while the turn
    /// runs.
    async fn ask(
        &mut self,
        turn_id: &str,
        interrupt_id: &str,
        tool: &str,
        arguments: &str,
    ) -> anyhow::Result<bool> {
        loop {
            out(&format!("  approve {tool} {arguments}? [y/n] "));
            // Reading a line is cancel-safe: nothing typed is lost.
            let line = tokio::select! {
                line = self.lines.next_line() => line?,
                _ = self.interrupts.recv() => {
                    println!();
                    let outcome = self
                        .sessions
                        .cancel_named_turn(&self.session_id, turn_id)
                        .await?;
                    if let CancelOutcome::Cancelled { .. } = outcome {
                        println!("  [cancelling the turn]");
                        return Ok(true);
                    }
                    println!("  (the turn has ended)");
                    return Ok(false);
                }
            };
            let Some(answer) = line else {
                println!("\n  (left unanswered; it stays pending)");
                return Ok(false);
            };
            let approved = match answer.trim().to_ascii_lowercase().as_str() {
                "y" | "yes" => true,
                "n" | "no" => false,
                _ => continue,
            };
            let resolved = self
                .sessions
                .resolve_interrupt(
                    &self.session_id,
                    ResolveInterruptRequest {
                        interrupt_id: interrupt_id.to_string(),
                        approved,
                        rejection_message: (!approved).then(|| "The user declined.".to_string()),
                    },
                )
                .await?;
            if !resolved {
                println!("  (no longer pending: answered elsewhere or expired)");
            }
            return Ok(false);
        }
    }
}

/// How a tool event is labelled: a runner's own report of a tool its
/// framework ran says so, so that it is never read as the host's record.
pub(crate) fn by(event: &crate::session::AgentEvent) -> &'static str {
    if event.origin.is_some() {
        "runner's "
    } else {
        ""
    }
}
