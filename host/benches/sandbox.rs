//! Instantiate-plus-call cost of a fresh sandbox, per call:
//! - `tool/tiny-echo`: `echo` of `tiny-tool`, a `no_std` component with no
//!   WASI imports: the host's own per-call cost;
//! - `tool/echo`: `echo` of `echo-tool`, a Rust std (wasi-libc) component;
//! - `runner/run-model-step-50`: the scripted runner, given a turn context of
//!   50 messages.
//!
//! Run: `guests/build.sh && cargo bench -p dexa --bench sandbox`. Besides
//! criterion's report it prints p50/p99 over a fixed number of calls.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use criterion::{criterion_group, BatchSize, Criterion};
use std::sync::Arc;

use dexa::plugin::wit::{AgentMessage, DeferredToolExecution, MessageRole};
use dexa::plugin::{
    ComponentSettings, HistorySource, MemoryHistory, RunnerComponent, SandboxConfig, SandboxEngine,
    ToolComponent, TurnInput,
};

mod common;

fn guest(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/guests")
        .join(format!("{name}.wasm"));
    std::fs::read(&path).unwrap_or_else(|err| {
        panic!(
            "cannot read {} ({err}); build the guests with guests/build.sh",
            path.display()
        )
    })
}

fn echo_call() -> DeferredToolExecution {
    common::tool_call("echo", r#"{"q":"hello"}"#)
}

/// A 50-message history; the runner reads its window (all 50) through the
/// history handle.
fn history_of_50_messages() -> Arc<dyn HistorySource> {
    let messages = (1..=50u64)
        .map(|n| AgentMessage {
            sequence: n,
            turn_id: format!("turn-{}", n.div_ceil(2)),
            role: if n % 2 == 1 {
                MessageRole::User
            } else {
                MessageRole::Assistant
            },
            framework_item: format!(
                r#"{{"type":"text","text":"message number {n} of the conversation"}}"#
            ),
            text: Some(format!("message number {n} of the conversation")),
        })
        .collect();
    MemoryHistory::shared(messages)
}

struct Fixture {
    rt: tokio::runtime::Runtime,
    tiny: ToolComponent,
    tool: ToolComponent,
    runner: RunnerComponent,
    call: DeferredToolExecution,
    history: Arc<dyn HistorySource>,
}

impl Fixture {
    fn new() -> Self {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let cache =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench-component-cache");
        let engine = SandboxEngine::new(SandboxConfig {
            cache_dir: Some(cache),
            ..SandboxConfig::default()
        })
        .expect("engine");
        let tool = rt
            .block_on(engine.load_tool(&guest("echo-tool"), ComponentSettings::named("echo-tool")))
            .expect("echo-tool");
        let tiny = rt
            .block_on(engine.load_tool(&guest("tiny-tool"), ComponentSettings::named("tiny-tool")))
            .expect("tiny-tool");
        let runner = engine
            .load_runner(
                &guest("scripted-runner"),
                ComponentSettings::named("scripted-runner"),
            )
            .expect("scripted-runner");
        Self {
            rt,
            tiny,
            tool,
            runner,
            call: echo_call(),
            history: history_of_50_messages(),
        }
    }

    fn echo_once(&self) {
        Self::echo(&self.rt, &self.tool, &self.call);
    }

    fn tiny_echo_once(&self) {
        Self::echo(&self.rt, &self.tiny, &self.call);
    }

    fn echo(rt: &tokio::runtime::Runtime, tool: &ToolComponent, call: &DeferredToolExecution) {
        let output = rt
            .block_on(tool.call(common::env(), call))
            .expect("call")
            .expect("output");
        assert_eq!(output.len(), 13);
    }

    /// The turn is built by the caller (the session builds one per call), so
    /// its copy is not part of the measured call.
    fn turn(&self) -> TurnInput {
        TurnInput {
            flow_id: "bench".into(),
            turn_id: "turn-25".into(),
            attempt: 1,
            history: self.history.clone(),
            compaction: None,
            framework_run_state: None,
            tool_calls: Vec::new(),
            tools: Vec::new(),
        }
    }

    fn run_model_step_once(&self, turn: TurnInput) {
        let outcome = self
            .rt
            .block_on(self.runner.run_model_step(common::env(), turn))
            .expect("call");
        assert!(outcome.is_ok(), "{outcome:?}");
    }
}

fn bench_sandbox(c: &mut Criterion) {
    let fixture = Fixture::new();
    let mut group = c.benchmark_group("sandbox");
    group.bench_function("tool/tiny-echo", |b| b.iter(|| fixture.tiny_echo_once()));
    group.bench_function("tool/echo", |b| b.iter(|| fixture.echo_once()));
    group.bench_function("runner/run-model-step-50", |b| {
        b.iter_batched(
            || fixture.turn(),
            |turn| fixture.run_model_step_once(turn),
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

/// A case gets a fresh copy of the turn, made before its timer starts.
type BenchCase<'a> = &'a dyn Fn(&Fixture, TurnInput);

/// Times each call on its own and prints p50/p99 and throughput.
fn report_percentiles(samples: usize) {
    let fixture = Fixture::new();
    let cases: [(&str, BenchCase); 3] = [
        ("tool/tiny-echo", &|f: &Fixture, _| f.tiny_echo_once()),
        ("tool/echo", &|f: &Fixture, _| f.echo_once()),
        ("runner/run-model-step-50", &|f: &Fixture, turn| {
            f.run_model_step_once(turn)
        }),
    ];
    for (name, run) in cases {
        for _ in 0..samples.min(200) {
            run(&fixture, fixture.turn());
        }
        let mut times = Vec::with_capacity(samples);
        let mut total = Duration::ZERO;
        for _ in 0..samples {
            let turn = fixture.turn();
            let t = Instant::now();
            run(&fixture, turn);
            let took = t.elapsed();
            total += took;
            times.push(took);
        }
        times.sort();
        println!(
            "sandbox/{name}: p50 {:.1} µs, p99 {:.1} µs, {:.0} calls/s over {samples} calls",
            percentile(&times, 0.50).as_secs_f64() * 1e6,
            percentile(&times, 0.99).as_secs_f64() * 1e6,
            samples as f64 / total.as_secs_f64(),
        );
    }
}

criterion_group!(benches, bench_sandbox);

fn main() {
    // `cargo test --benches` runs this without `--bench`: keep it a smoke run.
    let benchmarking = std::env::args().any(|arg| arg == "--bench");
    benches();
    report_percentiles(if benchmarking { 5_000 } else { 20 });
    Criterion::default().configure_from_args().final_summary();
}
