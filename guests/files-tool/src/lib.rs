//! A tool component that works inside a granted directory, mounted at
//! `/workspace`. Without the grant, every call fails with an execution error
//! that says so.
//!
//! Tools: `read_file` (read), `write_file` (idempotent write), `list_files` (read).
//! The directory it sees is configured by the host's grant, not by this code;
//! paths are taken relative to `/workspace`.

use std::path::{Path, PathBuf};

use dex::agents::types::ToolEffect;
use serde::Deserialize;

wit_bindgen::generate!({ path: "../../wit", world: "dex:agents/tool" });

const ROOT: &str = "/workspace";

struct FilesTool;

#[derive(Deserialize)]
struct PathArgs {
    path: String,
}

#[derive(Deserialize)]
struct WriteArgs {
    path: String,
    content: String,
}

fn execution(message: String) -> ToolError {
    ToolError::Execution(message)
}

fn parse<T: for<'de> Deserialize<'de>>(arguments: &str) -> Result<T, ToolError> {
    serde_json::from_str(arguments).map_err(|err| execution(format!("bad arguments: {err}")))
}

fn resolve(relative: &str) -> Result<PathBuf, ToolError> {
    if !Path::new(ROOT).is_dir() {
        return Err(execution(format!("no directory is granted at {ROOT}")));
    }
    Ok(Path::new(ROOT).join(relative.trim_start_matches('/')))
}

fn spec(name: &str, description: &str, effect: ToolEffect) -> ToolSpec {
    ToolSpec {
        name: name.to_string(),
        description: description.to_string(),
        parameters_schema: r#"{"type":"object","properties":{"path":{"type":"string"},"content":{"type":"string"}},"required":["path"]}"#.to_string(),
        effect: Some(effect),
    }
}

impl Guest for FilesTool {
    fn list_tools() -> Vec<ToolSpec> {
        vec![
            spec(
                "read_file",
                "Reads a file of the workspace.",
                ToolEffect::Read,
            ),
            spec(
                "write_file",
                "Writes a file of the workspace.",
                ToolEffect::IdempotentWrite,
            ),
            spec(
                "list_files",
                "Lists a directory of the workspace.",
                ToolEffect::Read,
            ),
        ]
    }

    fn call(call: DeferredToolExecution) -> Result<String, ToolError> {
        let arguments = &call.tool_call.arguments;
        match call.tool_call.tool_name.as_str() {
            "read_file" => {
                let args: PathArgs = parse(arguments)?;
                let path = resolve(&args.path)?;
                std::fs::read_to_string(&path)
                    .map_err(|err| execution(format!("cannot read {}: {err}", args.path)))
            }
            "write_file" => {
                let args: WriteArgs = parse(arguments)?;
                let path = resolve(&args.path)?;
                std::fs::write(&path, args.content.as_bytes())
                    .map_err(|err| execution(format!("cannot write {}: {err}", args.path)))?;
                Ok(format!(
                    "wrote {} bytes to {}",
                    args.content.len(),
                    args.path
                ))
            }
            "list_files" => {
                let args: PathArgs = parse(arguments)?;
                let path = resolve(&args.path)?;
                let mut names = std::fs::read_dir(&path)
                    .map_err(|err| execution(format!("cannot list {}: {err}", args.path)))?
                    .filter_map(|entry| entry.ok())
                    .map(|entry| entry.file_name().to_string_lossy().into_owned())
                    .collect::<Vec<_>>();
                names.sort();
                Ok(names.join("\n"))
            }
            other => Err(execution(format!("files-tool has no tool {other:?}"))),
        }
    }
}

export!(FilesTool);
