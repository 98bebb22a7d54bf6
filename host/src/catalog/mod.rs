//! The component catalog: content-addressed component versions kept in the
//! store, and, per agent and role, an append-only log of which version is
//! active.
//!
//! - A version is the SHA-256 of the component's bytes ([`ComponentRecord`]);
//!   the bytes live in the store, so a worker needs no file of its own.
//! - An [`Activation`] makes a version `current`, or sends a stable share of
//!   sessions to it (`ramp N%`). A rollback is a new activation of an older
//!   version: the log is never rewritten.
//! - [`RoleState`] folds a role's log into what a new turn takes.
//!
//! The catalog knows neither sessions nor sandboxes: `agent` and `role` are
//! names, and verifying a component before it is activated is the caller's
//! job (`config::versions`).

mod report;
mod state;

pub use report::{ActivationEntry, ActivationModeName, AgentVersions, Ramp, RoleVersions};
pub use state::{ramp_bucket, RoleState, RoleStates};

use async_trait::async_trait;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::flow::{StoreError, StoreMillis};

/// The role of an agent's runner in the activation log; a tool component's
/// role is its component name.
pub const RUNNER_ROLE: &str = "runner";

/// Who recorded an activation that `dexa.toml` asked for.
pub const CONFIG_ACTOR: &str = "config";

/// One tool a tool component serves, as it answered `list-tools`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CatalogTool {
    pub name: String,
    /// The effect it declares (`read`, `write`...), if any.
    pub effect: Option<String>,
}

/// A component version and what the host learned when it verified it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ComponentRecord {
    /// The SHA-256 of its bytes, in hex.
    pub digest: String,
    /// `runner` or `tool`.
    #[schemars(extend("enum" = ["runner", "tool"]))]
    pub world: String,
    /// The WIT package it implements (`dex:agents@0.2.0`).
    pub wit_package: String,
    /// For a tool component, the tools it serves.
    pub tools: Vec<CatalogTool>,
    pub size: u64,
    pub added_at: StoreMillis,
    pub added_by: String,
}

impl ComponentRecord {
    /// The first 12 hex digits, for people.
    pub fn short(&self) -> &str {
        short_digest(&self.digest)
    }
}

/// The first 12 hex digits of a digest.
pub fn short_digest(digest: &str) -> &str {
    digest.get(..12).unwrap_or(digest)
}

/// How an activation routes new turns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode", content = "percent")]
pub enum ActivationMode {
    /// Every new turn takes this version.
    Current,
    /// A stable share of sessions (by a hash of the session id), in percent
    /// from 1 to 99, takes this version; the rest keep the current one.
    Ramp(u8),
}

impl ActivationMode {
    /// Refuses a ramp outside 1..=99 (0 % and 100 % are a rollback and a
    /// plain activation).
    pub fn ramp(percent: u8) -> Result<Self, String> {
        if (1..=99).contains(&percent) {
            Ok(ActivationMode::Ramp(percent))
        } else {
            Err(format!(
                "a ramp sends 1 to 99 % of sessions to the new version, not {percent} %"
            ))
        }
    }
}

impl std::fmt::Display for ActivationMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ActivationMode::Current => write!(f, "current"),
            ActivationMode::Ramp(percent) => write!(f, "ramp {percent}%"),
        }
    }
}

/// An activation to record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewActivation {
    pub agent: String,
    pub role: String,
    pub digest: String,
    pub mode: ActivationMode,
    /// Move turns pinned to another runner to this one at their next
    /// RunModel (a forward fix).
    pub upgrade_in_flight: bool,
    pub actor: String,
    pub reason: String,
    /// Append only if the role's newest activation is still this one
    /// (`Some(0)`: the role has none yet); `None` appends in any case. A
    /// rollback decides its target from the log, and an activation since
    /// would otherwise be undone by it unseen.
    pub after_seq: Option<i64>,
}

/// One entry of the activation log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Activation {
    pub seq: i64,
    pub agent: String,
    pub role: String,
    pub digest: String,
    #[serde(flatten)]
    pub mode: ActivationMode,
    pub upgrade_in_flight: bool,
    pub actor: String,
    pub reason: String,
    pub at: StoreMillis,
}

/// When [`CatalogStore::activate`] appends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivateIf {
    Always,
    /// `dexa.toml`'s bootstrap: the store remembers every version the
    /// config has named for the role, and appends only for one it never
    /// named. So `dexa.toml` activates its file when a new file is
    /// deployed, an explicit activation stands while it is not, and a
    /// worker still on an older `dexa.toml` (a rolling deploy) does not
    /// activate the older file again. The first version a store sees for a
    /// role is activated unless the role was already activated explicitly
    /// (an operator who activated before any worker started keeps that
    /// version).
    ConfigChanged,
}

/// Why the catalog refused something.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("component {digest} is not in the registry")]
    NoSuchComponent { digest: String },
    #[error(
        "the activation log of agent {agent:?} ({role}) changed meanwhile: its newest entry is \
         {found}, not {expected}"
    )]
    Moved {
        agent: String,
        role: String,
        expected: i64,
        found: i64,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The catalog's storage, implemented by every store backend.
#[async_trait]
pub trait CatalogStore: Send + Sync + 'static {
    /// Adds a component; idempotent by digest (the first record stays).
    /// True when it was new.
    async fn add_component(
        &self,
        record: ComponentRecord,
        bytes: Vec<u8>,
    ) -> Result<bool, StoreError>;
    async fn component(&self, digest: &str) -> Result<Option<ComponentRecord>, StoreError>;
    async fn component_bytes(&self, digest: &str) -> Result<Option<Vec<u8>>, StoreError>;
    async fn list_components(&self) -> Result<Vec<ComponentRecord>, StoreError>;
    /// Removes components and their bytes, except any that an activation
    /// after `seen_seq` names: a gc decided from the log up to `seen_seq`,
    /// and an activation recorded since may have made a version active
    /// again. The check and the removal are one transaction, and
    /// [`CatalogStore::activate`] checks the version is still there in its
    /// own, so an activation and a gc never leave an active version without
    /// bytes. Activations that name removed versions stay. Returns the
    /// digests removed.
    async fn remove_components(
        &self,
        digests: &[String],
        seen_seq: i64,
    ) -> Result<Vec<String>, StoreError>;
    /// Appends an activation in one transaction that also checks that the
    /// digest is in the registry. `None` when `only_if` held it back.
    async fn activate(
        &self,
        activation: NewActivation,
        only_if: ActivateIf,
    ) -> Result<Option<Activation>, CatalogError>;
    /// The log, oldest first: all of it, or one agent's.
    async fn activations(&self, agent: Option<&str>) -> Result<Vec<Activation>, StoreError>;
    /// The entries after `seq` (what a worker has not seen yet).
    async fn activations_after(&self, seq: i64) -> Result<Vec<Activation>, StoreError>;
}
