//! An agent's versions as people and API clients read them: the
//! activation log, flat, and what each role takes now.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::Serialize;

use super::{Activation, ActivationMode, RoleStates};
use crate::flow::StoreMillis;

/// One entry of an agent's activation log.
#[derive(Debug, Serialize, JsonSchema)]
#[schemars(rename = "Activation")]
pub struct ActivationEntry {
    pub seq: i64,
    pub agent: String,
    /// `runner`, or a tool component's name.
    pub role: String,
    pub digest: String,
    pub mode: ActivationModeName,
    /// Only for a ramp: percent of sessions, 1 to 99.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "u8")]
    pub percent: Option<u8>,
    pub upgrade_in_flight: bool,
    pub actor: String,
    pub reason: String,
    /// ms, on the store's clock.
    pub at: StoreMillis,
}

/// How an activation routes new turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ActivationModeName {
    // Every new turn takes the version.
    Current,
    // A stable share of sessions takes it.
    Ramp,
}

impl From<Activation> for ActivationEntry {
    fn from(entry: Activation) -> Self {
        let (mode, percent) = match entry.mode {
            ActivationMode::Current => (ActivationModeName::Current, None),
            ActivationMode::Ramp(percent) => (ActivationModeName::Ramp, Some(percent)),
        };
        Self {
            seq: entry.seq,
            agent: entry.agent,
            role: entry.role,
            digest: entry.digest,
            mode,
            percent,
            upgrade_in_flight: entry.upgrade_in_flight,
            actor: entry.actor,
            reason: entry.reason,
            at: entry.at,
        }
    }
}

/// `GET /v1/agents/{agent}/versions`.
#[derive(Debug, Serialize, JsonSchema)]
pub struct AgentVersions {
    pub agent: String,
    /// By role: what it takes now.
    pub roles: BTreeMap<String, RoleVersions>,
    /// The agent's activation log, oldest first.
    pub log: Vec<ActivationEntry>,
}

/// What one role takes now.
#[derive(Debug, Serialize, JsonSchema)]
pub struct RoleVersions {
    /// The version every new turn takes (outside a ramp's share).
    pub current: Option<String>,
    /// A ramp in progress.
    pub ramp: Option<Ramp>,
    /// Whether turns pinned to older versions move at their next RunModel.
    pub upgrade_in_flight: bool,
    /// Versions an upgrade in flight moves open turns off, at their next
    /// RunModel.
    pub moving_off: Vec<String>,
}

/// A version taken by a share of sessions.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Ramp {
    pub digest: String,
    pub percent: u8,
}

impl AgentVersions {
    /// The report of `agent`'s activation `log` (oldest first).
    pub fn from_log(agent: &str, log: Vec<Activation>) -> Self {
        let states = RoleStates::from_log(&log);
        let roles = states
            .roles
            .iter()
            .map(|((_, role), state)| {
                (
                    role.clone(),
                    RoleVersions {
                        current: state.current.clone(),
                        ramp: state.ramp.as_ref().map(|(digest, percent)| Ramp {
                            digest: digest.clone(),
                            percent: *percent,
                        }),
                        upgrade_in_flight: state.upgrades_in_flight(),
                        moving_off: state.superseded.keys().cloned().collect(),
                    },
                )
            })
            .collect();
        Self {
            agent: agent.to_string(),
            roles,
            log: log.into_iter().map(ActivationEntry::from).collect(),
        }
    }
}
