//! `dexa new` as a guest author meets it: for each language, a new tool
//! project and a new runner project pass their own tests, `dexa build`
//! builds them (and loads each as a worker would), `dexa component call`
//! calls the tool, and `dexa demo` runs a turn in which the runner calls
//! the tool. A syntax error fails `dexa build` with its file and line.
//!
//! The toolchains are the ones CI installs for the repository's guests;
//! where a project would download or compile one again, the test shares it
//! (the Rust std for wasm through `CARGO_TARGET_DIR`, a Python virtualenv
//! through `DEXA_PY_TOOLCHAIN` for the runner), and says so.

use std::path::{Path, PathBuf};
use std::process::Output;

use dexa_tests::kit::dexa_binary;
use dexa_tests::repo_root;

/// One guest language's projects and what the test gives its builds.
struct Case {
    lang: &'static str,
    /// Added to every build of the tool project.
    tool_env: Vec<(&'static str, PathBuf)>,
    /// Added to every build of the runner project.
    runner_env: Vec<(&'static str, PathBuf)>,
    /// A source file of the tool project, a line to break it with, and what
    /// the toolchain's message must then name.
    broken: (&'static str, &'static str, String),
}

fn run(command: &mut std::process::Command, what: &str) -> Output {
    command
        .output()
        .unwrap_or_else(|err| panic!("{what}: {err}"))
}

fn text(output: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn dexa(dir: &Path, args: &[&str], env: &[(&'static str, PathBuf)], cache: &Path) -> Output {
    let mut command = std::process::Command::new(dexa_binary());
    command.current_dir(dir).args(args);
    if args.first().is_some_and(|a| *a != "new") {
        command.arg("--cache-dir").arg(cache);
    }
    for (name, value) in env {
        command.env(name, value);
    }
    run(&mut command, &format!("dexa {args:?}"))
}

fn assert_ok(output: &Output, what: &str) {
    assert!(output.status.success(), "{what} failed:\n{}", text(output));
}

/// Removes what a Rust project's build left in the shared target directory,
/// so that `guests/build.sh` (which copies every component there) does not
/// pick it up.
struct Uplifted(Vec<PathBuf>);

impl Drop for Uplifted {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn new_project_builds_passes_its_test_and_runs(case: Case) {
    let lang = case.lang;
    let root = tempfile::tempdir().expect("tempdir");
    let cache = root.path().join("cache");
    let (tool, runner) = (format!("{lang}-stats"), format!("{lang}-chat"));
    let ident = tool.replace('-', "_");
    let _uplifted = Uplifted(
        [&tool, &runner]
            .iter()
            .map(|name| {
                repo_root().join(format!(
                    "target/wasm/wasm32-wasip2/release/{}.wasm",
                    name.replace('-', "_")
                ))
            })
            .collect(),
    );

    for (world, name) in [("tool", &tool), ("runner", &runner)] {
        let made = dexa(
            root.path(),
            &["new", world, name, "--lang", lang],
            &[],
            &cache,
        );
        assert_ok(&made, &format!("dexa new {world} {name}"));
        assert!(
            text(&made).contains(&format!("created {name}")),
            "{}",
            text(&made)
        );
    }
    // A second `dexa new` into the same directory refuses, and writes nothing.
    let again = dexa(
        root.path(),
        &["new", "tool", &tool, "--lang", lang],
        &[],
        &cache,
    );
    assert!(!again.status.success(), "{}", text(&again));
    assert!(text(&again).contains("is not empty"), "{}", text(&again));

    // Each project's own test passes, and it is a real test run.
    for name in [&tool, &runner] {
        let dir = root.path().join(name);
        let mut test = std::process::Command::new(dir.join("test.sh"));
        if lang == "rust" {
            test.env("CARGO_TARGET_DIR", repo_root().join("target/wasm"));
        }
        let tested = run(&mut test, &format!("{name}/test.sh"));
        assert_ok(&tested, &format!("{name}/test.sh"));
        let said = text(&tested);
        let passed = said.contains("test result: ok.")
            || said.contains("\nOK")
            || (said.contains("# pass ") && said.contains("# fail 0"));
        assert!(passed && !said.contains("# pass 0"), "{name}: {said}");
    }

    // dexa build: the component builds and loads for its world. A shared
    // Python toolchain is used as it is, never installed into.
    let shared_toolchain = repo_root().join("target/guest-toolchains/python/.installed");
    let before = std::fs::metadata(&shared_toolchain)
        .and_then(|m| m.modified())
        .ok();
    for (name, world, env) in [
        (&tool, "tool", &case.tool_env),
        (&runner, "runner", &case.runner_env),
    ] {
        let built = dexa(&root.path().join(name), &["build"], env, &cache);
        assert_ok(&built, &format!("dexa build {name}"));
        let report: serde_json::Value = serde_json::from_slice(&built.stdout)
            .unwrap_or_else(|err| panic!("{name}: no JSON report ({err}): {}", text(&built)));
        assert_eq!(
            report["world"],
            format!("dex:agents/{world}@0.2.0"),
            "{report}"
        );
        if world == "tool" {
            assert_eq!(report["tools"][0]["name"], ident.as_str(), "{report}");
            assert_eq!(report["tools"][0]["effect"], "read", "{report}");
        }
    }

    let after = std::fs::metadata(&shared_toolchain)
        .and_then(|m| m.modified())
        .ok();
    assert_eq!(before, after, "the shared Python toolchain was touched");

    // dexa component call: the tool counts, and reads its config.
    let wasm = format!("build/{tool}.wasm");
    let call = |extra: &[&str]| {
        let mut args = vec!["component", "call", wasm.as_str(), ident.as_str()];
        args.extend_from_slice(extra);
        dexa(&root.path().join(&tool), &args, &[], &cache)
    };
    let called = call(&[
        "--args",
        r#"{"text": "the quick brown\nfox é"}"#,
        "--config",
        "note=hello",
    ]);
    assert_ok(&called, "dexa component call");
    let answer: serde_json::Value = serde_json::from_slice(&called.stdout)
        .unwrap_or_else(|err| panic!("the tool's answer is not JSON ({err}): {}", text(&called)));
    assert_eq!(
        answer,
        serde_json::json!({"words": 5, "characters": 21, "lines": 2, "note": "hello"})
    );
    // Every language counts alike: ASCII whitespace only, `\r\n` one break.
    let tricky = call(&["--args", r#"{"text": "a\tb\r\nc\u2028d\n"}"#]);
    assert_ok(&tricky, "dexa component call");
    let answer: serde_json::Value = serde_json::from_slice(&tricky.stdout)
        .unwrap_or_else(|err| panic!("the tool's answer is not JSON ({err}): {}", text(&tricky)));
    assert_eq!(
        answer,
        serde_json::json!({"words": 3, "characters": 9, "lines": 2})
    );
    // A mistake in the arguments is the model's to see, not a crash.
    let refused = call(&["--args", r#"{"txt": 1}"#]);
    assert!(!refused.status.success(), "{}", text(&refused));
    assert!(
        text(&refused).contains("Execution") && text(&refused).contains("text"),
        "{}",
        text(&refused)
    );

    // The runner's own dexa.toml runs a turn on the scripted model.
    let runner_dir = root.path().join(&runner);
    let demo = dexa(
        &runner_dir,
        &[
            "demo",
            "-c",
            "dexa.toml",
            "--agent",
            &runner,
            "--message",
            "Hello",
        ],
        &[],
        &cache,
    );
    assert_ok(&demo, "dexa demo (the runner's dexa.toml)");
    assert!(
        text(&demo).contains(&format!("agent> Hello from {runner}.")),
        "{}",
        text(&demo)
    );
    // And with the tool: the runner defers the model's tool call, the host
    // runs the tool in its own Step, and the runner sends the outcome back.
    let config = std::fs::read_to_string(runner_dir.join("dexa.toml"))
        .expect("the runner's dexa.toml")
        .replace("tools = []", &format!("tools = [\"{tool}\"]"))
        .replace("responses.json", "with-tool.json")
        + &format!("\n[components.{tool}]\npath = \"../{tool}/build/{tool}.wasm\"\n");
    std::fs::write(runner_dir.join("with-tool.toml"), config).expect("write with-tool.toml");
    std::fs::write(
        runner_dir.join("with-tool.json"),
        serde_json::json!([
            {"text": "Counting.", "tool_calls": [
                {"id": "call_1", "name": ident, "arguments": {"text": "one two three"}}
            ], "usage": {"input": 20, "output": 8}},
            {"text": "It has 3 words.", "usage": {"input": 40, "output": 6}}
        ])
        .to_string(),
    )
    .expect("write with-tool.json");
    let turn = dexa(
        &runner_dir,
        &[
            "demo",
            "-c",
            "with-tool.toml",
            "--agent",
            &runner,
            "--message",
            "How many words in: one two three?",
        ],
        &[],
        &cache,
    );
    assert_ok(&turn, "dexa demo with the tool");
    let said = text(&turn);
    for line in [
        format!("[tool {ident} call_1 succeeded]"),
        "agent> It has 3 words.".to_string(),
        "[turn-1 completed]".to_string(),
    ] {
        assert!(said.contains(&line), "missing {line:?} in:\n{said}");
    }
    assert!(
        said.contains(r#""words": 3"#) || said.contains(r#""words":3"#),
        "the tool's answer reached the history:\n{said}"
    );

    // A syntax error: dexa build fails, naming the file and the line.
    let (file, line, expected) = (case.broken.0, case.broken.1, &case.broken.2);
    let path = root.path().join(&tool).join(file);
    let mut source = std::fs::read_to_string(&path).expect("read the source");
    source.push_str(line);
    std::fs::write(&path, source).expect("break the source");
    let broken = dexa(&root.path().join(&tool), &["build"], &case.tool_env, &cache);
    assert!(!broken.status.success(), "{}", text(&broken));
    let said = text(&broken);
    assert!(
        said.contains(expected.as_str()) && said.contains("the toolchain's errors are above"),
        "expected {expected:?} in:\n{said}"
    );
}

/// The last line of `file` in the tool project, after a line is appended.
/// The component's own source, its entry: componentize-js names the file
/// and line of an error in a module it imports, not in the entry.
fn last_line(lang: &str, file: &str) -> usize {
    let template = match (lang, file) {
        ("rust", "src/lib.rs") => include_str!("../../host/templates/rust/tool/src/lib.rs"),
        ("python", "app.py") => include_str!("../../host/templates/python/tool/app.py"),
        ("js", "src/component.js") => include_str!("../../host/templates/js/tool/src/component.js"),
        _ => panic!("no template {lang} {file}"),
    };
    template.lines().count() + 1
}

#[test]
fn a_new_rust_project_builds_passes_its_test_and_runs() {
    let line = last_line("rust", "src/lib.rs");
    new_project_builds_passes_its_test_and_runs(Case {
        lang: "rust",
        // The std for wasm32-wasip2 that guests/build.sh compiled, shared.
        tool_env: vec![("CARGO_TARGET_DIR", repo_root().join("target/wasm"))],
        runner_env: vec![("CARGO_TARGET_DIR", repo_root().join("target/wasm"))],
        broken: (
            "src/lib.rs",
            "fn broken() -> u32 { \"text\" }\n",
            format!("src/lib.rs:{line}"),
        ),
    });
}

#[test]
fn a_new_python_project_builds_passes_its_test_and_runs() {
    let line = last_line("python", "app.py");
    new_project_builds_passes_its_test_and_runs(Case {
        lang: "python",
        // The tool installs its own toolchain, as a new project does; the
        // runner shares the repository's guests' one.
        tool_env: vec![],
        runner_env: vec![(
            "DEXA_PY_TOOLCHAIN",
            repo_root().join("target/guest-toolchains/python"),
        )],
        broken: (
            "app.py",
            "def broken(:\n",
            format!("File \"app.py\", line {line}"),
        ),
    });
}

#[test]
fn a_new_javascript_project_builds_passes_its_test_and_runs() {
    let line = last_line("js", "src/component.js");
    new_project_builds_passes_its_test_and_runs(Case {
        lang: "js",
        tool_env: vec![],
        runner_env: vec![],
        broken: (
            "src/component.js",
            "export function broken() { return [ }; }\n",
            format!("src/component.js:{line}"),
        ),
    });
}
