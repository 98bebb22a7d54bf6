//! Hostile components written in WebAssembly text, for attacks no guest
//! language can express (several memories in one module, many core
//! instances in one component): `guests/hostile/wat/<name>.wat`, assembled
//! with the `wat` crate into `target/guests/wat-<name>.wasm`.

use std::path::PathBuf;

use crate::{guests_dir, repo_root};

/// Assembles `guests/hostile/wat/<name>.wat` and returns the component's
/// path. Written through a temporary file, so tests that ask at once never
/// see half a file.
pub fn wat_component(name: &str) -> PathBuf {
    let source = repo_root()
        .join("guests/hostile/wat")
        .join(format!("{name}.wat"));
    let bytes = wat::parse_file(&source)
        .unwrap_or_else(|err| panic!("cannot assemble {}: {err}", source.display()));
    let dir = guests_dir();
    std::fs::create_dir_all(&dir).unwrap_or_else(|err| panic!("{}: {err}", dir.display()));
    let path = dir.join(format!("wat-{name}.wasm"));
    let temp = dir.join(format!("wat-{name}.wasm.{}", std::process::id()));
    std::fs::write(&temp, &bytes).unwrap_or_else(|err| panic!("{}: {err}", temp.display()));
    std::fs::rename(&temp, &path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    path
}
