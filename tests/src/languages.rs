//! Guests written in other languages (`guests/python`, `guests/js`,
//! `guests/c`), and a one-time compile of them into the shared test cache.
//!
//! The Python and JavaScript components are 12 to 19 MB, and a debug host
//! compiles one in about 20 s. [`precompile_language_guests`] compiles each once per test process,
//! so that tests running in parallel never compile the same one twice and
//! their workers load it from the cache.

use std::path::PathBuf;
use std::sync::OnceLock;

use dexa::plugin::{ComponentInfo, ComponentSettings, World};

use crate::{guests_dir, test_engine};

/// A guest component built by a language's own toolchain.
#[derive(Clone, Copy, Debug)]
pub struct LanguageGuest {
    /// Its file in `target/guests` (without `.wasm`).
    pub guest: &'static str,
    pub world: World,
    /// As the tool reports itself in `*_describe_call`.
    pub language: &'static str,
    /// The prefix of its tool names (`py_echo`, `js_echo`).
    pub prefix: &'static str,
    /// The script that builds it.
    pub build: &'static str,
}

pub const PYTHON_TOOL: LanguageGuest = LanguageGuest {
    guest: "py-tool",
    world: World::Tool,
    language: "python",
    prefix: "py",
    build: "guests/python/build.sh",
};

pub const PYTHON_RUNNER: LanguageGuest = LanguageGuest {
    guest: "py-runner",
    world: World::Runner,
    language: "python",
    prefix: "py",
    build: "guests/python/build.sh",
};

pub const JS_TOOL: LanguageGuest = LanguageGuest {
    guest: "js-tool",
    world: World::Tool,
    language: "javascript",
    prefix: "js",
    build: "guests/js/build.sh",
};

pub const C_TOOL: LanguageGuest = LanguageGuest {
    guest: "c-tool",
    world: World::Tool,
    language: "c",
    prefix: "c",
    build: "guests/c/build.sh",
};

/// Attacks on the sandbox, for `hostile_languages.rs`.
pub const PYTHON_HOSTILE_TOOL: LanguageGuest = LanguageGuest {
    guest: "py-hostile-tool",
    ..PYTHON_TOOL
};

pub const PYTHON_HOSTILE_RUNNER: LanguageGuest = LanguageGuest {
    guest: "py-hostile-runner",
    ..PYTHON_RUNNER
};

pub const JS_HOSTILE_TOOL: LanguageGuest = LanguageGuest {
    guest: "js-hostile-tool",
    ..JS_TOOL
};

pub const LANGUAGE_GUESTS: [LanguageGuest; 7] = [
    PYTHON_TOOL,
    PYTHON_RUNNER,
    JS_TOOL,
    C_TOOL,
    PYTHON_HOSTILE_TOOL,
    PYTHON_HOSTILE_RUNNER,
    JS_HOSTILE_TOOL,
];

impl LanguageGuest {
    /// Its built component; panics with the command that builds it.
    pub fn wasm(&self) -> PathBuf {
        let path = guests_dir().join(format!("{}.wasm", self.guest));
        assert!(
            path.is_file(),
            "{} is missing; build it with {} (./ci.sh does)",
            path.display(),
            self.build
        );
        path
    }

    /// A tool name of this guest: `tool("echo")` is `py_echo`.
    pub fn tool(&self, name: &str) -> String {
        format!("{}_{name}", self.prefix)
    }
}

/// Loads every language guest once in this process, compiling it into the
/// shared test cache (`target/test-component-cache`) unless it is there.
/// Returns what the host learnt of each, in [`LANGUAGE_GUESTS`] order.
pub fn precompile_language_guests() -> &'static [ComponentInfo] {
    static LOADED: OnceLock<Vec<ComponentInfo>> = OnceLock::new();
    LOADED.get_or_init(|| {
        // Its own thread and runtime: callers may be inside a tokio runtime.
        std::thread::spawn(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap_or_else(|err| panic!("runtime: {err}"));
            let engine = test_engine();
            LANGUAGE_GUESTS
                .iter()
                .map(|guest| {
                    let path = guest.wasm();
                    let settings = ComponentSettings::named(guest.guest);
                    let loaded = match guest.world {
                        World::Tool => runtime
                            .block_on(engine.load_tool_file(&path, settings))
                            .map(|tool| tool.info().clone()),
                        World::Runner => engine
                            .load_runner_file(&path, settings)
                            .map(|runner| runner.info().clone()),
                    };
                    loaded.unwrap_or_else(|err| panic!("load {}: {err}", guest.guest))
                })
                .collect()
        })
        .join()
        .unwrap_or_else(|_| panic!("compiling the language guests panicked"))
    })
}
