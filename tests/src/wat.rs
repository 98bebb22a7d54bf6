//! Hostile components written in WebAssembly text, for attacks no guest
//! language can express (several memories in one module, many core
//! instances in one component): `guests/hostile/wat/<name>.wat`, assembled
//! with the `wat` crate into `target/guests/wat-<name>.wasm`.

use std::path::PathBuf;

use crate::{guests_dir, repo_root};

/// Assembles `guests/hostile/wat/<name>.wat` and returns the component's
/// path. Written through a temporary file of its own, so tests that ask at
/// once never see half a file.
pub fn wat_component(name: &str) -> PathBuf {
    let source = repo_root()
        .join("guests/hostile/wat")
        .join(format!("{name}.wat"));
    let bytes = wat::parse_file(&source)
        .unwrap_or_else(|err| panic!("cannot assemble {}: {err}", source.display()));
    let dir = guests_dir();
    std::fs::create_dir_all(&dir).unwrap_or_else(|err| panic!("{}: {err}", dir.display()));
    let path = dir.join(format!("wat-{name}.wasm"));
    let mut temp = tempfile::NamedTempFile::new_in(&dir)
        .unwrap_or_else(|err| panic!("temp file in {}: {err}", dir.display()));
    std::io::Write::write_all(&mut temp, &bytes)
        .unwrap_or_else(|err| panic!("{}: {err}", temp.path().display()));
    temp.persist(&path)
        .unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    path
}
