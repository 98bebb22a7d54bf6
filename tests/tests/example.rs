//! The example agent (`examples/bookkeeper`) as a new user runs it: the
//! README's first command (`dexa demo`), on a copy of the example so the
//! repository's `.dexa` is untouched.

use dexa_tests::kit::{example_copy, run_demo};
use dexa_tests::{guests_dir, repo_root};

#[tokio::test]
async fn the_demo_command_runs_the_example_agent_offline() {
    let dir = tempfile::tempdir().unwrap();
    let config = example_copy(dir.path(), "bookkeeper");
    let (stdout, stderr) = run_demo(&config, &[], &[]).await;
    assert!(stdout.contains("(model: replay)"), "{stdout}");
    for line in [
        "[tool lookup_invoice call_lookup started]",
        "[tool lookup_invoice call_lookup succeeded]",
        "agent> Invoice 7 from Acme Paper is open for 120.00 EUR; paying it.",
        "[tool record_payment call_pay succeeded]",
        "[turn-1 completed]",
        "usage: 810 input + 85 output tokens over 3 model calls",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in:\n{stdout}");
    }
    assert!(
        stdout.contains("recorded a payment of 120.00 EUR"),
        "{stdout}"
    );
    assert!(
        stderr.contains("[1/3] loading chat-runner"),
        "progress is shown: {stderr}"
    );
    // The one grant: the ledger directory, created on first use.
    let ledger: Vec<_> = std::fs::read_dir(dir.path().join(".dexa").join("ledger"))
        .unwrap()
        .collect();
    assert_eq!(ledger.len(), 1, "one payment in the granted directory");
}

/// The README's walkthrough, run as written (the port made free), with
/// `dexa` on the PATH.
#[tokio::test]
async fn the_readme_walkthrough_works_as_written() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let block = readme
        .split("<!-- walkthrough -->")
        .nth(1)
        .and_then(|rest| rest.split("<!-- /walkthrough -->").next())
        .expect("the README has a walkthrough block");
    let script = block
        .trim()
        .strip_prefix("```sh")
        .and_then(|s| s.trim_end().strip_suffix("```"))
        .expect("the walkthrough is one sh block");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap();
    let script = script.replace("8080", &port.to_string());

    let dir = tempfile::tempdir().unwrap();
    example_copy(dir.path(), "bookkeeper");
    // Share the tests' compiled-component cache.
    let cache = dir.path().join(".dexa").join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    std::os::unix::fs::symlink(
        repo_root().join("target").join("test-component-cache"),
        cache.join("components"),
    )
    .unwrap();
    let bin_dir = dexa_tests::kit::dexa_binary()
        .parent()
        .unwrap()
        .to_path_buf();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut command = tokio::process::Command::new("bash");
    command
        .arg("-euo")
        .arg("pipefail")
        .arg("-c")
        .arg(&script)
        .current_dir(dir.path())
        .env("PATH", path)
        .env_remove("DEXA_MODEL")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let child = command.spawn().unwrap();
    let pid = child.id().unwrap_or(0) as i32;
    let output = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        child.wait_with_output(),
    )
    .await;
    // Whatever happened, nothing the walkthrough started outlives the test.
    // SAFETY: signals the walkthrough's own process group.
    unsafe {
        libc::kill(-pid, libc::SIGKILL);
    }
    let output = output
        .expect("the walkthrough finished within 120 s")
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the walkthrough failed:\n{stdout}\n{stderr}"
    );
    for expected in [
        r#"{"ok":true}"#,
        r#"{"agent":"Bookkeeper","session_id":"walk-"#,
        "idle",
        "(running)\nturns: 1",
        "session walk-",
        "recorded a payment of 120.00 EUR",
        "CallTool",
        "RunModel",
        r#""next_after_sequence":2"#,
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}\n{stderr}"
        );
    }
}

/// `DEXA_MODEL=openai` and `OPENAI_API_KEY` switch the example to a real
/// OpenAI-compatible model (here a loopback server that speaks the protocol,
/// reached through the optional `DEXA_OPENAI_BASE_URL`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_environment_variables_switch_the_example_to_an_openai_model() {
    use dexa_tests::chat_server::{openai_fixture, ReplayChatServer, Reply};
    let server = ReplayChatServer::start(vec![Reply::Stream {
        transcript: openai_fixture("text.sse"),
        piece: 16,
    }])
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = example_copy(dir.path(), "bookkeeper");
    let (stdout, _) = run_demo(
        &config,
        &[],
        &[
            ("DEXA_MODEL", "openai"),
            ("OPENAI_API_KEY", "sk-example"),
            ("DEXA_OPENAI_BASE_URL", &server.base_url),
        ],
    )
    .await;
    assert!(stdout.contains("(model: openai)"), "{stdout}");
    assert!(
        stdout.contains("agent> You have two open tickets."),
        "{stdout}"
    );
    assert!(
        stdout.contains("usage: 57 input + 7 output tokens over 1 model calls"),
        "{stdout}"
    );
    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(
        requests[0].authorization.as_deref(),
        Some("Bearer sk-example")
    );
    assert_eq!(requests[0].body["model"], "gpt-4o-mini");
    let tools: Vec<&str> = requests[0].body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    assert_eq!(tools, vec!["lookup_invoice", "record_payment"]);
    assert_eq!(requests[0].body["messages"][0]["role"], "system");
    assert_eq!(
        requests[0].body["messages"][1]["content"],
        "Please pay invoice 7."
    );
}

/// `dexa component inspect` describes a tool component in the config's own
/// terms: effects as `read`, not as Rust names; each parameter schema as the
/// JSON it is (checked at load).
#[test]
fn dexa_component_inspect_lists_tools_with_their_effects_and_schemas() {
    let described =
        dexa_tests::kit::inspect_component("tool", &guests_dir().join("echo-tool.wasm"));
    let echo = described["tools"]
        .as_array()
        .and_then(|tools| tools.iter().find(|t| t["name"] == "echo"))
        .unwrap_or_else(|| panic!("no echo tool in {described}"));
    assert_eq!(echo["effect"], "read");
    assert_eq!(
        echo["parameters_schema"],
        serde_json::json!({"type": "object"})
    );
    assert_eq!(described["world"], "dex:agents/tool@0.2.0");
    // A Rust guest exports its world and nothing else.
    assert_eq!(described["extra_exports"], serde_json::json!([]));
}

/// The licence file is the licence Cargo.toml names, in full.
#[test]
fn the_licence_file_is_the_one_cargo_toml_names() {
    let cargo = std::fs::read_to_string(repo_root().join("Cargo.toml")).unwrap();
    let manifest: toml::Value = toml::from_str(&cargo).unwrap();
    assert_eq!(
        manifest["workspace"]["package"]["license"].as_str(),
        Some("Apache-2.0")
    );
    let licence = std::fs::read_to_string(repo_root().join("LICENSE")).unwrap();
    let words: Vec<&str> = licence.split_whitespace().collect();
    assert_eq!(&words[..4], ["Apache", "License", "Version", "2.0,"]);
    assert!(licence.contains("END OF TERMS AND CONDITIONS"));
    assert!(licence.contains("APPENDIX: How to apply the Apache License to your work."));
}

/// The Containerfile's stages agree with the README and Cargo.toml: the
/// build stage's Rust is the workspace's rust-version, the run stage copies
/// the binary the build stage makes, and the port, volume and listen
/// address are the ones the README's commands use. (No container is built:
/// CI has no Docker.)
#[test]
fn the_containerfile_agrees_with_the_readme_and_cargo_toml() {
    let file = std::fs::read_to_string(repo_root().join("Containerfile")).unwrap();
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let cargo: toml::Value =
        toml::from_str(&std::fs::read_to_string(repo_root().join("Cargo.toml")).unwrap()).unwrap();
    let rust = cargo["workspace"]["package"]["rust-version"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let instructions: Vec<&str> = file
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let froms: Vec<&str> = instructions
        .iter()
        .copied()
        .filter(|l| l.starts_with("FROM "))
        .collect();
    assert_eq!(froms.len(), 2, "two stages: {froms:?}");
    let build_image = format!("rust:{rust}-slim-trixie");
    assert!(
        froms[0].contains(&build_image) && froms[0].ends_with(" AS build"),
        "{}",
        froms[0]
    );
    assert!(froms[1].ends_with(" AS run"), "{}", froms[1]);
    assert!(instructions.contains(&"RUN cargo build --release --locked -p dexa"));
    assert!(
        instructions.contains(&"COPY --from=build /src/target/release/dexa /usr/local/bin/dexa")
    );
    assert!(instructions.contains(&"EXPOSE 8080"));
    assert!(instructions.contains(&"VOLUME /data"));
    assert!(instructions.contains(&"ENV DEXA_CONFIG=/data/dexa.toml"));
    assert!(instructions.contains(&"USER dexa"));
    assert!(instructions.contains(&r#"CMD ["serve", "--listen", "0.0.0.0:8080"]"#));
    // The README's commands and words match.
    for needle in [
        "podman build -t dexa -f Containerfile .",
        "podman run -p 8080:8080 -v ./deploy:/data:U dexa",
        &format!("`{build_image}`"),
        "`0.0.0.0:8080`",
        "`/data`",
        &format!("Rust {rust}"),
    ] {
        assert!(
            readme.contains(needle),
            "the README does not say {needle:?}"
        );
    }
    // The image is built from the sources, not the multi-GB target dir.
    for ignore in [".containerignore", ".dockerignore"] {
        let text = std::fs::read_to_string(repo_root().join(ignore)).unwrap();
        for pattern in ["**/target/", "**/.dexa/", ".git"] {
            assert!(
                text.lines().any(|l| l.trim() == pattern),
                "{ignore}: {pattern}"
            );
        }
    }
}

/// The documents a clone has link only to files it has: every relative
/// Markdown link of the README, SECURITY.md and `docs/` names a file in the
/// repository, and none points outside it (`../shared`, which a clone does
/// not have).
#[test]
fn the_readme_and_docs_link_only_to_files_in_the_repository() {
    let root = repo_root();
    let mut documents = vec![root.join("README.md"), root.join("SECURITY.md")];
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                documents.push(path);
            }
        }
    }
    assert!(documents.len() >= 5, "{documents:?}");
    let mut checked = 0;
    for document in &documents {
        let text = std::fs::read_to_string(document).unwrap();
        assert!(
            !text.contains("../shared"),
            "{} points outside the repository",
            document.display()
        );
        for (_, rest) in text
            .match_indices("](")
            .map(|(at, _)| ("", &text[at + 2..]))
        {
            let Some(target) = rest.split(')').next() else {
                continue;
            };
            let target = target.split('#').next().unwrap_or_default();
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let resolved = document.parent().unwrap().join(target);
            assert!(
                resolved.exists(),
                "{} links to {target}, which is not in the repository",
                document.display()
            );
            assert!(
                resolved.canonicalize().unwrap().starts_with(&root),
                "{} links outside the repository: {target}",
                document.display()
            );
            checked += 1;
        }
    }
    assert!(checked >= 5, "only {checked} links checked");
}
