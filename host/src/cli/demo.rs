//! `dexa demo`: one session of the example agent (`examples/bookkeeper`) on
//! the embedded SQLite store. Offline it runs on the example's `replay` model
//! (scripted responses, no network); `DEXA_MODEL=openai` and
//! `OPENAI_API_KEY` switch it to a real model. Events are printed as they
//! arrive, then the stored messages, the usage and the Step history.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;

use super::worker::log_progress;
use crate::config::{Deployment, DexaConfig};
use crate::flow::history;
use crate::session::{event_type, new_session_id};

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// The example's config.
    #[arg(long, short, default_value = "examples/bookkeeper/dexa.toml")]
    pub config: PathBuf,
    /// The agent to run.
    #[arg(long, default_value = "Bookkeeper")]
    pub agent: String,
    /// The user's message.
    #[arg(long, default_value = "Please pay invoice 7.")]
    pub message: String,
    /// Where compiled components are cached (default: the config's).
    #[arg(long, env = "DEXA_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// How long to wait for the turn.
    #[arg(long, default_value_t = 300)]
    pub timeout_secs: u64,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let mut config = DexaConfig::load(&args.config)?;
    if let Some(cache_dir) = args.cache_dir {
        config.cache_dir = cache_dir;
    }
    for component in config.components.values() {
        anyhow::ensure!(
            component.path.is_file(),
            "{} is missing; build the guests first with guests/build.sh",
            component.path.display()
        );
    }
    println!("store: {}", config.store.describe());
    println!("loading components (the first run compiles each, a few seconds each)...");
    let started = Instant::now();
    let deployment = Deployment::for_workers(config, &log_progress).await?;
    println!(
        "components ready in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let model = deployment
        .config
        .agents
        .get(&args.agent)
        .and_then(|a| a.model.clone())
        .unwrap_or_else(|| "none".to_string());
    let worker = tokio::spawn(deployment.worker().run(std::future::pending()));
    let sessions = deployment.sessions(&args.agent)?;
    let session_id = new_session_id("demo");
    println!(
        "session {session_id} of {} (model: {model})\nuser> {}",
        args.agent, args.message
    );
    sessions.start_session(&session_id, &args.message).await?;

    let mut after = 0;
    let mut in_text = false;
    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    let outcome = 'watch: loop {
        let (events, _) = sessions.read_events(&session_id, after, 500).await?;
        for (seq, event) in events {
            after = seq;
            let data = &event.data;
            let field = |name: &str| data[name].as_str().unwrap_or("?").to_string();
            if in_text && event.event_type != event_type::TEXT_DELTA {
                println!();
                in_text = false;
            }
            match event.event_type.as_str() {
                event_type::TEXT_DELTA => {
                    if !in_text {
                        print!("agent> ");
                        in_text = true;
                    }
                    print!("{}", field("text"));
                }
                event_type::TOOL_CALL_STARTED => println!(
                    "  [{}tool {} {} started]",
                    super::chat::by(&event),
                    field("tool_name"),
                    field("tool_call_id")
                ),
                event_type::TOOL_CALL_FINISHED => println!(
                    "  [{}tool {} {} {}]",
                    super::chat::by(&event),
                    field("tool_name"),
                    field("tool_call_id"),
                    field("status")
                ),
                event_type::INTERRUPT_RAISED => println!(
                    "  [{} waits for approval: dexa session approve {session_id} -c {}]",
                    field("tool_name"),
                    args.config.display()
                ),
                event_type::TURN_STARTED => println!("  [{} started]", event.turn_id),
                event_type::TURN_COMPLETED => {
                    println!("  [{} completed]", event.turn_id);
                    break 'watch Ok(());
                }
                event_type::TURN_FAILED => {
                    println!("  [{} failed: {}]", event.turn_id, field("error"));
                    break 'watch Err(anyhow::anyhow!("the turn failed: {}", field("error")));
                }
                _ => {}
            }
        }
        if Instant::now() >= deadline {
            break Err(anyhow::anyhow!(
                "the turn did not finish within {} s",
                args.timeout_secs
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };

    let snapshot = sessions.get_agent_snapshot(&session_id).await?;
    println!("\nstored messages:");
    for message in &snapshot.messages {
        println!(
            "  {:>3} {:<9} {}",
            message.sequence,
            format!("{:?}", message.role).to_lowercase(),
            message.text.as_deref().unwrap_or("(tool calls)")
        );
    }
    println!(
        "usage: {} input + {} output tokens over {} model calls",
        snapshot.usage.input_tokens, snapshot.usage.output_tokens, snapshot.usage.model_calls
    );
    println!("steps (each in a fresh sandbox, each committed durably):");
    for entry in deployment.store.step_history(&session_id).await? {
        if entry.event_type == history::EXECUTE_COMPLETED {
            let took = entry
                .started_at
                .map(|s| format!("{} ms", entry.at - s))
                .unwrap_or_default();
            println!(
                "  {:<22} attempt {}  {took}",
                entry.step_type, entry.final_attempt
            );
        }
    }
    println!(
        "the session waits for the next message: dexa chat {} -c {} --session {session_id}",
        args.agent,
        args.config.display()
    );
    worker.abort();
    outcome
}
