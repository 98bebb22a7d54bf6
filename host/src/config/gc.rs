//! `dexa component gc`: removes the versions nothing needs.
//!
//! A version is kept while it is **active** (current, or a ramp's) for any
//! agent's role, while it is **in use** (an open turn's runner pin, or the
//! pin of a tool call not yet final), and for a grace period after it was
//! last active or added: a worker's view of the log may be
//! [`crate::session::ActivationWatch::REFRESH`] old, and a turn that took a
//! version just before it was replaced commits its pin only when its first
//! Step ends, so a version that was active a moment ago may be pinned in a
//! moment.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::catalog::{short_digest, CatalogStore, RoleStates};
use crate::flow::{FlowStatus, FlowStore, MapQuery, StoreError, StoreMillis};
use crate::session::{AgentState, AgentToolCall, AGENT_STATE, AGENT_TOOL_CALLS};

/// The default grace period: one hour, longer than the first Step of a turn
/// may take before it commits its pin. That Step is `build-user-message` or,
/// for a turn with no note, its first RunModel, whose model call an agent may
/// allow up to `model_step_timeout` (10 min by default) and which is retried.
/// An operator with longer timeouts passes a longer `--grace-secs`.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(60 * 60);

/// What a gc did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    pub removed: Vec<String>,
    /// Digest → why it stays.
    pub kept: BTreeMap<String, String>,
}

/// The versions pinned by sessions now: digest → by what.
pub async fn pinned_versions(
    store: &dyn FlowStore,
) -> Result<BTreeMap<String, String>, StoreError> {
    let mut pinned = BTreeMap::new();
    for flow in store.list_flows(None, None, usize::MAX).await? {
        if flow.status != FlowStatus::Running {
            continue;
        }
        let state: Option<AgentState> = store
            .get(&flow.flow_id, AGENT_STATE, "")
            .await?
            .and_then(|v| serde_json::from_value(v.value).ok());
        if let Some(digest) = state.and_then(|s| s.runner_digest) {
            pinned
                .entry(digest)
                .or_insert_with(|| format!("the open turn of session {} runs it", flow.flow_id));
        }
        for (key, value) in store
            .read_map(&flow.flow_id, AGENT_TOOL_CALLS, MapQuery::default())
            .await?
        {
            let Ok(record) = serde_json::from_value::<AgentToolCall>(value.value) else {
                continue;
            };
            if record.status.is_final() {
                continue;
            }
            if let Some(digest) = record.digest {
                pinned.entry(digest).or_insert_with(|| {
                    format!(
                        "tool call {key} of session {} is pinned to it",
                        flow.flow_id
                    )
                });
            }
        }
    }
    Ok(pinned)
}

/// Removes every version that is neither active, nor in use, nor within
/// `grace` of being active or added.
pub async fn collect(
    catalog: &dyn CatalogStore,
    store: &dyn FlowStore,
    grace: Duration,
) -> Result<GcReport, StoreError> {
    let now: StoreMillis = store.now().await?;
    let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
    let log = catalog.activations(None).await?;
    let seen_seq = log.last().map_or(0, |a| a.seq);
    // When each version was last active, and why the active ones are.
    let mut states = RoleStates::default();
    let mut last_active: BTreeMap<String, StoreMillis> = BTreeMap::new();
    for activation in &log {
        let before: BTreeSet<String> = states
            .role(&activation.agent, &activation.role)
            .map(|r| r.active().into_iter().map(str::to_string).collect())
            .unwrap_or_default();
        states.apply(activation);
        for digest in before {
            last_active.insert(digest, activation.at);
        }
    }
    let mut kept = BTreeMap::new();
    for ((agent, role), state) in &states.roles {
        for digest in state.active() {
            kept.entry(digest.to_string())
                .or_insert_with(|| format!("active for agent {agent:?} ({role})"));
        }
    }
    for (digest, why) in pinned_versions(store).await? {
        kept.entry(digest).or_insert(why);
    }
    let mut candidates = Vec::new();
    for record in catalog.list_components().await? {
        if kept.contains_key(&record.digest) {
            continue;
        }
        let since = last_active
            .get(&record.digest)
            .copied()
            .unwrap_or(record.added_at)
            .max(record.added_at);
        let age = now.saturating_sub(since);
        if age < grace_ms {
            kept.insert(
                record.digest.clone(),
                format!(
                    "{} {} s ago, within the {} s grace period",
                    if last_active.contains_key(&record.digest) {
                        "last active"
                    } else {
                        "added"
                    },
                    age / 1000,
                    grace.as_secs()
                ),
            );
            continue;
        }
        candidates.push(record.digest);
    }
    // An activation recorded since the log was read keeps its version.
    let removed = catalog.remove_components(&candidates, seen_seq).await?;
    for digest in candidates.into_iter().filter(|d| !removed.contains(d)) {
        kept.insert(
            digest,
            "activated while the gc ran (or removed by another gc)".to_string(),
        );
    }
    tracing::info!(
        removed = removed.len(),
        kept = kept.len(),
        "component gc: {}",
        removed
            .iter()
            .map(|d| short_digest(d))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(GcReport { removed, kept })
}
