//! Parsing `dexa.toml`: the file's shape ([`super::raw`]) read with serde,
//! then each section checked and turned into the typed config, every error
//! at its line. The store and worker sections are here; the components,
//! models and agents have a file each.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use toml::Spanned;

use super::locator::{names, Locator};
use super::raw::{RawConfig, RawWorker};
use super::values::{config_dir, is_postgres, parse_store_url};
use super::{ComponentRole, ConfigError, DexaConfig, StoreUrl, WorkerConfig};
use crate::flow::WorkerOptions;
use crate::store::sqlite::SqliteOptions;

/// Resolves the file's relative paths against its directory.
pub(super) struct Paths {
    base: PathBuf,
}

impl Paths {
    pub(super) fn resolve(&self, path: &str) -> PathBuf {
        let path = Path::new(path);
        if path.is_absolute() {
            path.to_path_buf()
        } else {
            self.base.join(path)
        }
    }
}

/// Each component's role, from how the agents use it, and where.
pub(super) type Roles<'a> = BTreeMap<&'a str, (ComponentRole, Range<usize>)>;

impl DexaConfig {
    /// Checks `text` as the contents of `file` (which anchors relative paths).
    pub fn parse(file: impl AsRef<Path>, text: &str) -> Result<Self, ConfigError> {
        let file = file.as_ref();
        let paths = Paths {
            base: config_dir(file),
        };
        let loc = Locator { file, text };
        let raw: RawConfig = toml::from_str(text)
            .map_err(|err| loc.at(err.span().unwrap_or(0..0), err.message().trim().to_string()))?;
        let store = store(&raw.store, &paths, &loc)?;
        let cache_dir = paths.resolve(raw.cache_dir.as_deref().unwrap_or(".dexa/cache/components"));
        let cache_max_bytes = match &raw.cache_max {
            None => crate::plugin::DEFAULT_CACHE_MAX_BYTES,
            Some(max) => {
                let bytes = max
                    .get_ref()
                    .bytes()
                    .map_err(|m| loc.at(max.span(), format!("cache_max: {m}")))?;
                if bytes < crate::plugin::MIN_CACHE_MAX_BYTES {
                    return Err(loc.at(
                        max.span(),
                        "cache_max must be at least 64MiB (a few compiled components)".into(),
                    ));
                }
                bytes
            }
        };
        let worker = worker(&raw.worker, &loc)?;
        let roles = roles(&raw, &loc)?;
        let components = super::components::components(&raw, &roles, &paths, &loc)?;
        let models = super::models::models(&raw, &paths, &loc)?;
        let agents = super::agents::agents(&raw, &loc)?;
        Ok(Self {
            file: file.to_path_buf(),
            store,
            cache_dir,
            cache_max_bytes,
            worker,
            components,
            models,
            agents,
        })
    }
}

/// `store = "..."`: SQLite (the default, next to the file) or PostgreSQL.
fn store(
    url: &Option<Spanned<String>>,
    paths: &Paths,
    loc: &Locator<'_>,
) -> Result<StoreUrl, ConfigError> {
    Ok(match url {
        None => StoreUrl::Sqlite(paths.resolve(".dexa/dexa.sqlite"), SqliteOptions::default()),
        Some(url) if is_postgres(url.get_ref()) => {
            // Checked now, for an error at the line; the password is read
            // when the store opens.
            crate::store::postgres::PostgresUrl::parse_with(url.get_ref(), |_| Some(String::new()))
                .map_err(|message| loc.at(url.span(), message))?;
            StoreUrl::Postgres(url.get_ref().clone())
        }
        Some(url) => parse_store_url(url.get_ref())
            .map(|(path, options)| StoreUrl::Sqlite(paths.resolve(&path), options))
            .map_err(|message| loc.at(url.span(), message))?,
    })
}

/// `[worker]`: each setting checked, the rest defaulted.
fn worker(raw: &RawWorker, loc: &Locator<'_>) -> Result<WorkerConfig, ConfigError> {
    let defaults = WorkerOptions::default();
    Ok(WorkerConfig {
        slots: match &raw.slots {
            Some(slots) if *slots.get_ref() == 0 => {
                return Err(loc.at(slots.span(), "worker.slots must be at least 1".into()))
            }
            Some(slots) => *slots.get_ref(),
            None => defaults.max_concurrent_tasks,
        },
        lease: loc.positive(&raw.lease, "worker.lease", defaults.lease)?,
        poll_interval: loc.positive(
            &raw.poll_interval,
            "worker.poll_interval",
            defaults.poll_interval,
        )?,
        reap_interval: loc.positive(
            &raw.reap_interval,
            "worker.reap_interval",
            defaults.reap_interval,
        )?,
        drain: match &raw.drain {
            Some(drain) => loc.duration(drain, "worker.drain")?,
            None => defaults.drain,
        },
    })
}

/// The components' roles, from the agents: a component used both as a
/// runner and as a tool is refused, and so is a tool component named
/// `runner`.
fn roles<'a>(raw: &'a RawConfig, loc: &Locator<'_>) -> Result<Roles<'a>, ConfigError> {
    let mut roles = Roles::new();
    let mut claim = |name: &Spanned<String>, role: ComponentRole| -> Result<(), ConfigError> {
        let Some((key, _)) = raw.components.get_key_value(name.get_ref().as_str()) else {
            return Err(loc.at(
                name.span(),
                format!(
                    "there is no component {:?}; the components are {}",
                    name.get_ref(),
                    names(raw.components.keys())
                ),
            ));
        };
        match roles.get(key.as_str()) {
            Some((existing, _)) if *existing != role => Err(loc.at(
                name.span(),
                format!(
                    "component {:?} is used both as a runner and as a tool component",
                    name.get_ref()
                ),
            )),
            _ => {
                roles.insert(key.as_str(), (role, name.span()));
                Ok(())
            }
        }
    };
    for agent in raw.agents.values() {
        let agent = agent.get_ref();
        claim(&agent.runner, ComponentRole::Runner)?;
        for tool in &agent.tools {
            // A tool component's name is its role in the activation log,
            // where `runner` is the runner's.
            if tool.get_ref() == crate::catalog::RUNNER_ROLE {
                return Err(loc.at(
                    tool.span(),
                    "a tool component may not be named \"runner\": that name is the runner's \
                     role in the activation log (rename the component)"
                        .to_string(),
                ));
            }
            claim(tool, ComponentRole::Tool)?;
        }
    }
    Ok(roles)
}
