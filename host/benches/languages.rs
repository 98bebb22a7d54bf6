//! What a guest's language costs the host, per language, for the same tool
//! (`echo`: return the arguments) built by each toolchain:
//! - Rust: `echo-tool` (`guests/build.sh`);
//! - Python: `py-tool` (componentize-py, `guests/python/build.sh`);
//! - JavaScript: `js-tool` (componentize-js, `guests/js/build.sh`);
//! - C: `c-tool` (wit-bindgen c and clang-19, `guests/c/build.sh`).
//!
//! For each it reports:
//! - **size** of the component;
//! - **compile**: Cranelift, on a cold cache (`--bench` only; `load_tool`
//!   includes one `list-tools` call);
//! - **load**: a new engine loading the compiled component from the cache;
//! - **cold call**: the first instantiate-plus-call after that load (code and
//!   memory image not yet paged in, the pool slot never used);
//! - **warm call**: later instantiate-plus-calls, each still in a fresh
//!   instance, as every Step gets.
//!
//! Run: `guests/build.sh && guests/python/build.sh && guests/js/build.sh &&
//! guests/c/build.sh && cargo bench -p dexa --bench languages`. Without `--bench` (as in `cargo
//! test --all-targets`) it is a smoke run: few samples, no compile timing,
//! and the shared test cache.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use criterion::Criterion;
use dexa::plugin::wit::DeferredToolExecution;
use dexa::plugin::{ComponentSettings, SandboxConfig, SandboxEngine, ToolComponent};

mod common;

struct Language {
    label: &'static str,
    guest: &'static str,
    tool: &'static str,
    build: &'static str,
}

const LANGUAGES: [Language; 4] = [
    Language {
        label: "rust",
        guest: "echo-tool",
        tool: "echo",
        build: "guests/build.sh",
    },
    Language {
        label: "python",
        guest: "py-tool",
        tool: "py_echo",
        build: "guests/python/build.sh",
    },
    Language {
        label: "javascript",
        guest: "js-tool",
        tool: "js_echo",
        build: "guests/js/build.sh",
    },
    Language {
        label: "c",
        guest: "c-tool",
        tool: "c_echo",
        build: "guests/c/build.sh",
    },
];

const ARGUMENTS: &str = r#"{"q":"hello"}"#;

fn repo_path(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(relative)
}

fn wasm(language: &Language) -> Vec<u8> {
    let path = repo_path("target/guests").join(format!("{}.wasm", language.guest));
    std::fs::read(&path).unwrap_or_else(|err| {
        panic!(
            "cannot read {} ({err}); build it with {}",
            path.display(),
            language.build
        )
    })
}

fn engine(cache_dir: PathBuf) -> SandboxEngine {
    SandboxEngine::new(SandboxConfig {
        cache_dir: Some(cache_dir),
        ..SandboxConfig::default()
    })
    .expect("engine")
}

fn call_once(rt: &tokio::runtime::Runtime, tool: &ToolComponent, call: &DeferredToolExecution) {
    let output = rt
        .block_on(tool.call(common::env(), call))
        .expect("call")
        .expect("output");
    assert_eq!(output, ARGUMENTS);
}

fn load(
    rt: &tokio::runtime::Runtime,
    engine: &SandboxEngine,
    language: &Language,
    wasm: &[u8],
) -> ToolComponent {
    rt.block_on(engine.load_tool(wasm, ComponentSettings::named(language.guest)))
        .unwrap_or_else(|err| panic!("load {}: {err}", language.guest))
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn main() {
    // `cargo test --benches` runs this without `--bench`: keep it a smoke run.
    let benchmarking = std::env::args().any(|arg| arg == "--bench");
    let (cold_samples, warm_samples) = if benchmarking { (10, 2_000) } else { (1, 10) };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut criterion = Criterion::default().configure_from_args();
    let mut report = Vec::new();
    for language in &LANGUAGES {
        let wasm = wasm(language);
        let call = common::tool_call(language.tool, ARGUMENTS);
        // A cold cache of its own when benchmarking; the tests' shared cache
        // in a smoke run, where a debug build compiles for tens of seconds.
        let scratch = tempfile::tempdir().expect("temp dir");
        let cache = if benchmarking {
            scratch.path().to_path_buf()
        } else {
            repo_path("target/test-component-cache")
        };
        let compile = benchmarking.then(|| {
            let started = Instant::now();
            load(&rt, &engine(cache.clone()), language, &wasm);
            started.elapsed()
        });

        let mut loads = Vec::new();
        let mut colds = Vec::new();
        let mut warm_tool = None;
        for _ in 0..cold_samples {
            let fresh = engine(cache.clone());
            let started = Instant::now();
            let tool = load(&rt, &fresh, language, &wasm);
            loads.push(started.elapsed());
            let started = Instant::now();
            call_once(&rt, &tool, &call);
            colds.push(started.elapsed());
            warm_tool = Some(tool);
        }
        let tool = warm_tool.expect("at least one load");
        for _ in 0..warm_samples.min(100) {
            call_once(&rt, &tool, &call);
        }
        let mut warms = Vec::with_capacity(warm_samples);
        let started = Instant::now();
        for _ in 0..warm_samples {
            let t = Instant::now();
            call_once(&rt, &tool, &call);
            warms.push(t.elapsed());
        }
        let warm_total = started.elapsed();
        loads.sort();
        colds.sort();
        warms.sort();
        report.push(format!(
            "languages/{:<10} size {:>10} B | compile {:>11} | load p50 {:>9} | cold call p50 {:>9} max {:>9} | warm call p50 {:>9} p99 {:>9} {:>6.0} calls/s",
            language.label,
            wasm.len(),
            compile.map(ms).unwrap_or_else(|| "(smoke run)".into()),
            ms(percentile(&loads, 0.5)),
            us(percentile(&colds, 0.5)),
            us(percentile(&colds, 1.0)),
            us(percentile(&warms, 0.5)),
            us(percentile(&warms, 0.99)),
            warm_samples as f64 / warm_total.as_secs_f64(),
        ));
        criterion.bench_function(&format!("languages/{}/warm-call", language.label), |b| {
            b.iter(|| call_once(&rt, &tool, &call))
        });
    }
    for line in report {
        println!("{line}");
    }
    criterion.final_summary();
}
