//! A component project made by `dexa new`, and `dexa build`.
//!
//! `dexa build` runs the project's own `build.sh`, which makes sure a syntax
//! error is named by its file and line (cargo does; the JS build parses
//! with Node first; the Python build asks Python after componentize-py
//! fails), and then loads the component as a worker would: it must
//! implement the project's world against this host's WIT, and a tool's
//! parameter schemas must be valid.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::Args;
use serde::{Deserialize, Serialize};

use super::new::Language;

/// The file `dexa new` writes at a project's root.
pub const PROJECT_FILE: &str = "dexa-project.toml";

/// What `dexa-project.toml` says.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Project {
    /// The project's name.
    pub name: String,
    /// `tool` or `runner`.
    pub world: String,
    /// The guest language.
    pub language: Language,
    /// Where the build script writes the component, relative to the root.
    pub component: PathBuf,
}

impl Project {
    /// The file's text.
    pub fn to_toml(&self) -> anyhow::Result<String> {
        Ok(format!(
            "# Written by `dexa new`; `dexa build` reads it.\n{}",
            toml::to_string(self).context("writing dexa-project.toml")?
        ))
    }

    /// Reads `dir/dexa-project.toml`.
    pub fn load(dir: &Path) -> anyhow::Result<Project> {
        let path = dir.join(PROJECT_FILE);
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "{} not found: dexa build runs in a project made by `dexa new`",
                path.display()
            )
        })?;
        let project: Project =
            toml::from_str(&text).with_context(|| format!("{} is not valid", path.display()))?;
        if project.world != "tool" && project.world != "runner" {
            bail!(
                "{}: world = {:?}; expected \"tool\" or \"runner\"",
                path.display(),
                project.world
            );
        }
        if project.component.is_absolute()
            || project
                .component
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
        {
            bail!(
                "{}: component = {:?} must be a path inside the project",
                path.display(),
                project.component
            );
        }
        Ok(project)
    }

    fn world_arg(&self) -> super::WorldArg {
        if self.world == "runner" {
            super::WorldArg::Runner
        } else {
            super::WorldArg::Tool
        }
    }
}

/// `dexa build`'s arguments.
#[derive(Args, Debug)]
pub struct BuildArgs {
    /// The project's directory.
    #[arg(default_value = ".")]
    pub dir: PathBuf,
    /// Where compiled components are cached (default: the project's
    /// `.dexa/cache/components`).
    #[arg(long, env = "DEXA_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
}

/// The toolchain variables the build scripts read as paths: a relative one
/// means where `dexa build` was started, not the project the script runs
/// in.
const PATH_VARIABLES: [&str; 2] = ["CARGO_TARGET_DIR", "DEXA_PY_TOOLCHAIN"];

/// `dexa build`.
pub async fn build(args: BuildArgs) -> anyhow::Result<()> {
    let project = Project::load(&args.dir)?;
    let script = args.dir.join("build.sh");
    anyhow::ensure!(
        script.is_file(),
        "{} is missing; dexa build runs the project's build script",
        script.display()
    );
    let started = std::time::Instant::now();
    // The script's output goes straight to the terminal, on stderr: the
    // toolchain's errors, with their files and lines, are the message, and
    // stdout stays the report below, for scripts.
    let stderr = std::os::fd::AsFd::as_fd(&std::io::stderr())
        .try_clone_to_owned()
        .context("duplicating stderr for the build script")?;
    let mut command = tokio::process::Command::new("bash");
    command
        .arg("build.sh")
        .current_dir(&args.dir)
        .stdout(std::process::Stdio::from(stderr));
    for name in PATH_VARIABLES {
        if let Some(value) = std::env::var_os(name).filter(|v| !v.is_empty()) {
            let path = PathBuf::from(value);
            if path.is_relative() {
                let here = std::env::current_dir().context("the current directory")?;
                command.env(name, here.join(path));
            }
        }
    }
    let status = command
        .status()
        .await
        .with_context(|| format!("running {}", script.display()))?;
    if !status.success() {
        bail!(
            "the build of {} failed ({status}); the toolchain's errors are above",
            project.name
        );
    }
    let component = args.dir.join(&project.component);
    anyhow::ensure!(
        component.is_file(),
        "build.sh succeeded but wrote no {}",
        component.display()
    );
    let engine = super::EngineArgs {
        cache_dir: args
            .cache_dir
            .clone()
            .unwrap_or_else(|| args.dir.join(".dexa/cache/components")),
    };
    let report = super::describe(&engine, project.world_arg(), &component)
        .await
        .with_context(|| format!("{} does not load", component.display()))?;
    eprintln!(
        "built {} in {:.1} s: a {} component",
        component.display(),
        started.elapsed().as_secs_f64(),
        project.world
    );
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_project_file_round_trips_and_refuses_what_it_does_not_know() {
        let dir = tempfile::tempdir().expect("tempdir");
        let project = Project {
            name: "word-stats".to_string(),
            world: "tool".to_string(),
            language: Language::Python,
            component: PathBuf::from("build/word-stats.wasm"),
        };
        std::fs::write(dir.path().join(PROJECT_FILE), project.to_toml().unwrap()).unwrap();
        assert_eq!(Project::load(dir.path()).unwrap(), project);

        for (bad, why) in [
            ("world = \"plugin\"", "expected \"tool\" or \"runner\""),
            ("component = \"../x.wasm\"", "inside the project"),
            ("language = \"cobol\"", "unknown variant"),
            ("colour = \"red\"", "unknown field"),
        ] {
            let key = bad.split(' ').next().unwrap();
            let mut text: String = project
                .to_toml()
                .unwrap()
                .lines()
                .filter(|l| !l.starts_with(&format!("{key} ")))
                .map(|l| format!("{l}\n"))
                .collect();
            text.push_str(bad);
            std::fs::write(dir.path().join(PROJECT_FILE), text).unwrap();
            let err = format!("{:#}", Project::load(dir.path()).unwrap_err());
            assert!(err.contains(why), "{bad}: {err}");
        }
        let err = Project::load(&dir.path().join("nowhere")).unwrap_err();
        assert!(err.to_string().contains("dexa new"), "{err}");
    }
}
