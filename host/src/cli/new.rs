//! `dexa new`: a ready-to-build component project in Rust, Python or
//! JavaScript, from the templates in `host/templates/`.
//!
//! The templates are compiled into the binary, so `dexa new` works from an
//! installed `dexa` with no repository at hand. Each project holds the WIT
//! it is built against, a build script, one test of its own logic, and a
//! `dexa-project.toml` that `dexa build` reads.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};

use super::project::{Project, PROJECT_FILE};

/// `dexa new`'s arguments.
#[derive(Args, Debug)]
pub struct NewArgs {
    /// What to make: a tool component or a runner component.
    pub world: super::WorldArg,
    /// The project's name: lowercase letters, digits and single `-` between
    /// them, starting with a letter (at most 48 characters). The directory,
    /// the component file and (for a tool) the tool's name, with `_` for
    /// `-`, come from it.
    pub name: String,
    /// The guest language.
    #[arg(long, value_enum)]
    pub lang: Language,
    /// The directory to create the project in (default: `./NAME`).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// A guest language `dexa new` has templates for.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Language {
    /// Rust with wit-bindgen, built for wasm32-wasip2.
    Rust,
    /// Python with componentize-py.
    Python,
    /// JavaScript with componentize-js.
    Js,
}

impl Language {
    /// The language's name in a README.
    fn title(self) -> &'static str {
        match self {
            Language::Rust => "Rust",
            Language::Python => "Python",
            Language::Js => "JavaScript",
        }
    }
}

/// The WIT package every project is built against: this host's own.
const WIT: &str = include_str!("../../../wit/agents.wit");
/// The version the WIT's `package` line names.
const WIT_VERSION: &str = "0.2.0";

/// One file of a template: where it goes in the project, its text, and
/// whether it is a script to run.
struct File {
    path: &'static str,
    text: &'static str,
    executable: bool,
}

const fn file(path: &'static str, text: &'static str) -> File {
    File {
        path,
        text,
        executable: false,
    }
}

const fn script(path: &'static str, text: &'static str) -> File {
    File {
        path,
        text,
        executable: true,
    }
}

macro_rules! template {
    ($path:literal) => {
        include_str!(concat!("../../templates/", $path))
    };
}

const RUST_TOOL: &[File] = &[
    file("Cargo.toml", template!("rust/tool/Cargo.toml")),
    file("src/lib.rs", template!("rust/tool/src/lib.rs")),
    file("src/stats.rs", template!("rust/tool/src/stats.rs")),
];
const RUST_RUNNER: &[File] = &[
    file("Cargo.toml", template!("rust/runner/Cargo.toml")),
    file("src/lib.rs", template!("rust/runner/src/lib.rs")),
    file(
        "src/conversation.rs",
        template!("rust/runner/src/conversation.rs"),
    ),
];
const RUST: &[File] = &[
    script("build.sh", template!("rust/build.sh")),
    script("test.sh", template!("rust/test.sh")),
    // The Rust guests' lock, so a project builds with the crate versions
    // the repository's own guests are built and tested with (cargo drops
    // the entries it does not use on the first build).
    file("Cargo.lock", include_str!("../../../guests/Cargo.lock")),
];
const PYTHON_TOOL: &[File] = &[
    file("app.py", template!("python/tool/app.py")),
    file("stats.py", template!("python/tool/stats.py")),
    file("test_stats.py", template!("python/tool/test_stats.py")),
];
const PYTHON_RUNNER: &[File] = &[
    file("app.py", template!("python/runner/app.py")),
    file(
        "conversation.py",
        template!("python/runner/conversation.py"),
    ),
    file(
        "test_conversation.py",
        template!("python/runner/test_conversation.py"),
    ),
];
const PYTHON: &[File] = &[
    script("build.sh", template!("python/build.sh")),
    script("test.sh", template!("python/test.sh")),
    file("requirements.txt", template!("python/requirements.txt")),
];
const JS_TOOL: &[File] = &[
    file("src/component.js", template!("js/tool/src/component.js")),
    file("src/stats.js", template!("js/tool/src/stats.js")),
    file(
        "test/stats.test.js",
        template!("js/tool/test/stats.test.js"),
    ),
];
const JS_RUNNER: &[File] = &[
    file("src/component.js", template!("js/runner/src/component.js")),
    file(
        "src/conversation.js",
        template!("js/runner/src/conversation.js"),
    ),
    file(
        "test/conversation.test.js",
        template!("js/runner/test/conversation.test.js"),
    ),
];
const JS: &[File] = &[
    script("build.sh", template!("js/build.sh")),
    script("test.sh", template!("js/test.sh")),
    // The JS guests' own syntax check, which the build runs on each source.
    script(
        "check-syntax.sh",
        include_str!("../../../guests/js/check-syntax.sh"),
    ),
    file("package.json", template!("js/package.json")),
    // The JS guests' lock, so a project installs exactly the toolchain the
    // repository's own guests are built and tested with.
    file(
        "package-lock.json",
        include_str!("../../../guests/js/package-lock.json"),
    ),
];
const RUNNER: &[File] = &[
    file("dexa.toml", template!("runner/dexa.toml")),
    file("responses.json", template!("runner/responses.json")),
];
const COMMON: &[File] = &[
    file("README.md", template!("README.md")),
    file(".gitignore", template!("gitignore")),
    file("wit/agents.wit", WIT),
];

/// The files of a project of `world` in `language`.
fn files(world: super::WorldArg, language: Language) -> Vec<&'static File> {
    use super::WorldArg::{Runner, Tool};
    let parts: [&[File]; 4] = match (language, world) {
        (Language::Rust, Tool) => [COMMON, RUST, RUST_TOOL, &[]],
        (Language::Rust, Runner) => [COMMON, RUST, RUST_RUNNER, RUNNER],
        (Language::Python, Tool) => [COMMON, PYTHON, PYTHON_TOOL, &[]],
        (Language::Python, Runner) => [COMMON, PYTHON, PYTHON_RUNNER, RUNNER],
        (Language::Js, Tool) => [COMMON, JS, JS_TOOL, &[]],
        (Language::Js, Runner) => [COMMON, JS, JS_RUNNER, RUNNER],
    };
    parts.into_iter().flatten().collect()
}

/// Why a project name is refused, if it is.
pub fn check_name(name: &str) -> Result<(), String> {
    let valid = !name.is_empty()
        && name.len() <= 48
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.ends_with('-')
        && !name.contains("--");
    if valid {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a project name: use lowercase letters, digits and single `-` \
             between them, starting with a letter, at most 48 characters (e.g. `word-stats`)"
        ))
    }
}

/// The text of `template` for the project `name`.
fn fill(template: &str, name: &str, world: super::WorldArg, language: Language) -> String {
    let world_name = world_name(world);
    let try_line = match world {
        super::WorldArg::Tool => format!(
            "    dexa component call build/{name}.wasm {} --args '{{\"text\": \"a b\"}}'",
            name.replace('-', "_")
        ),
        super::WorldArg::Runner => {
            format!("    dexa demo -c dexa.toml --agent {name} --message \"Hello\"")
        }
    };
    template
        // The JS lock's own name, so `npm ci` sees it matches package.json.
        .replace(
            "\"name\": \"dexa-js-guests\"",
            &format!("\"name\": \"{name}\""),
        )
        .replace("__NAME__", name)
        .replace("__IDENT__", &name.replace('-', "_"))
        .replace("__WORLD__", world_name)
        .replace("__LANGUAGE__", language.title())
        .replace("__WIT_VERSION__", WIT_VERSION)
        .replace("__TRY__", &try_line)
}

fn world_name(world: super::WorldArg) -> &'static str {
    match world {
        super::WorldArg::Tool => "tool",
        super::WorldArg::Runner => "runner",
    }
}

/// Writes the project for `args` and returns its directory.
pub fn create(args: &NewArgs) -> anyhow::Result<PathBuf> {
    check_name(&args.name).map_err(anyhow::Error::msg)?;
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(&args.name));
    if let Ok(found) = std::fs::symlink_metadata(&dir) {
        if !found.is_dir() && !dir.is_dir() {
            bail!(
                "{} exists and is not a directory; dexa new writes into a new or empty directory",
                dir.display()
            );
        }
        let empty = std::fs::read_dir(&dir)
            .with_context(|| format!("{} exists and cannot be read", dir.display()))?
            .next()
            .is_none();
        if !empty {
            bail!(
                "{} exists and is not empty; dexa new writes into a new or empty directory",
                dir.display()
            );
        }
    }
    let project = Project {
        name: args.name.clone(),
        world: world_name(args.world).to_string(),
        language: args.lang,
        component: PathBuf::from(format!("build/{}.wasm", args.name)),
    };
    let mut written = vec![(PROJECT_FILE.to_string(), project.to_toml()?, false)];
    for f in files(args.world, args.lang) {
        let text = fill(f.text, &args.name, args.world, args.lang);
        written.push((f.path.to_string(), text, f.executable));
    }
    for (path, text, executable) in written {
        write(&dir.join(&path), &text, executable)?;
    }
    Ok(dir)
}

fn write(path: &Path, text: &str, executable: bool) -> anyhow::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    if executable {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("making {} executable", path.display()))?;
    }
    Ok(())
}

/// `text` as one shell word: as it is when it is plain, else single-quoted.
fn shell_quoted(text: &str) -> String {
    let plain = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./+,:@%".contains(c));
    if plain {
        text.to_string()
    } else {
        format!("'{}'", text.replace('\'', "'\\''"))
    }
}

/// `dexa new`.
pub fn run(args: NewArgs) -> anyhow::Result<()> {
    let dir = create(&args)?;
    let world = world_name(args.world);
    println!(
        "created {} ({} {world} component, dex:agents@{WIT_VERSION})",
        dir.display(),
        args.lang.title()
    );
    println!("  cd {}", shell_quoted(&dir.display().to_string()));
    println!("  ./test.sh                 # its own tests");
    println!(
        "  dexa build                # or ./build.sh -> build/{}.wasm",
        args.name
    );
    println!(
        "{}",
        fill("__TRY__", &args.name, args.world, args.lang).replace("    ", "  ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_project_name_is_lowercase_words_joined_by_single_hyphens() {
        for good in ["word-stats", "a", "tool2", "a-b-c"] {
            assert_eq!(check_name(good), Ok(()), "{good}");
        }
        let long = "a".repeat(49);
        for bad in [
            "", "Word", "2tool", "-a", "a-", "a--b", "a_b", "a b", "é", "../x", &long,
        ] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn every_placeholder_is_filled_in_every_template() {
        use super::super::WorldArg::{Runner, Tool};
        for language in [Language::Rust, Language::Python, Language::Js] {
            for world in [Tool, Runner] {
                for f in files(world, language) {
                    let text = fill(f.text, "word-stats", world, language);
                    let left = text.split("__").skip(1).step_by(2).find(|word| {
                        !word.is_empty() && word.chars().all(|c| c.is_ascii_uppercase() || c == '_')
                    });
                    assert_eq!(left, None, "{} in {language:?}", f.path);
                }
            }
        }
    }

    #[test]
    fn a_directory_is_printed_as_one_shell_word() {
        assert_eq!(shell_quoted("word-stats"), "word-stats");
        assert_eq!(shell_quoted("a dir"), "'a dir'");
        assert_eq!(shell_quoted("it's"), "'it'\\''s'");
    }

    #[test]
    fn the_wit_is_the_hosts_and_names_its_version() {
        assert!(WIT.contains(&format!("package dex:agents@{WIT_VERSION};")));
    }

    /// The templates pin the toolchains the repository's own guests are
    /// built and tested with: a bump there must bump them too.
    #[test]
    fn the_templates_pin_the_guests_toolchains() {
        let python = include_str!("../../../guests/python/requirements.txt");
        for pin in template!("python/requirements.txt")
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        {
            assert!(python.lines().any(|l| l == pin), "{pin}");
        }
        let js = include_str!("../../../guests/js/package.json");
        let guests: serde_json::Value = serde_json::from_str(js).expect("guests' package.json");
        let ours: serde_json::Value =
            serde_json::from_str(template!("js/package.json")).expect("template's package.json");
        assert_eq!(ours["devDependencies"], guests["devDependencies"]);
    }
}
