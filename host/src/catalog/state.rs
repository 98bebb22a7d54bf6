//! Folding the activation log into what a new turn takes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::{Activation, ActivationMode};

/// Where a session falls on every ramp: 0..10_000, from a hash of its id
/// alone, so that widening a ramp from 10 % to 20 % keeps the first 10 % on
/// the new version, and a session keeps one version while a ramp stands.
pub fn ramp_bucket(session_id: &str) -> u16 {
    let hash = Sha256::digest(session_id.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&hash[..8]);
    (u64::from_be_bytes(first) % 10_000) as u16
}

/// One role's versions, as its log says now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoleState {
    /// The version every session takes, outside a ramp.
    pub current: Option<String>,
    /// A ramp's version and share in percent.
    pub ramp: Option<(String, u8)>,
    /// The latest activation.
    pub last: Option<Activation>,
    /// Every version that was current, oldest first, one entry per change.
    pub history: Vec<String>,
    /// Every version the log named for this role.
    pub named: BTreeSet<String>,
    /// The versions an upgrade in flight moved turns off (those no new
    /// turn took any more after it), each with the activation that did. A
    /// turn pinned to one moves, at its next RunModel, to the version its
    /// session takes then, even after later activations without the flag:
    /// a turn waiting days on an approval stays rescued. A version made
    /// current again leaves the set, so turns begun on it later keep it.
    pub superseded: BTreeMap<String, Arc<Activation>>,
}

impl RoleState {
    /// Applies the next activation of this role.
    pub fn apply(&mut self, activation: &Activation) {
        match activation.mode {
            ActivationMode::Current => {
                self.ramp = None;
                if self.current.as_deref() != Some(activation.digest.as_str()) {
                    self.history.push(activation.digest.clone());
                }
                self.current = Some(activation.digest.clone());
            }
            ActivationMode::Ramp(percent) => {
                self.ramp = Some((activation.digest.clone(), percent));
            }
        }
        self.last = Some(activation.clone());
        self.named.insert(activation.digest.clone());
        if activation.mode == ActivationMode::Current {
            // A ramp of a superseded version leaves the sessions outside it
            // rescued; a version made current again is not superseded.
            self.superseded.remove(&activation.digest);
        }
        if activation.upgrade_in_flight {
            // The versions no new turn takes any more. One still active
            // (the current one beside a ramp) keeps the turns begun on it
            // later; while this activation is the last, the sessions the
            // ramp takes move off it too (see `moves_turns_off`).
            let by = Arc::new(activation.clone());
            let active: BTreeSet<String> = self.active().into_iter().map(str::to_string).collect();
            for digest in self.named.difference(&active) {
                self.superseded.insert(digest.clone(), by.clone());
            }
        }
    }

    /// The version a new turn of `session_id` takes.
    pub fn choose(&self, session_id: &str) -> Option<&str> {
        if let Some((digest, percent)) = &self.ramp {
            if self.current.is_none() || ramp_bucket(session_id) < u16::from(*percent) * 100 {
                return Some(digest);
            }
        }
        self.current.as_deref()
    }

    /// The versions a new turn may take (the current one and a ramp's).
    pub fn active(&self) -> Vec<&str> {
        let mut active: Vec<&str> = self.current.iter().map(String::as_str).collect();
        if let Some((digest, _)) = &self.ramp {
            if !active.contains(&digest.as_str()) {
                active.push(digest);
            }
        }
        active
    }

    /// Whether the latest activation moves turns pinned elsewhere.
    pub fn upgrades_in_flight(&self) -> bool {
        self.last.as_ref().is_some_and(|a| a.upgrade_in_flight)
    }

    /// The activation that moves a turn of `session_id` pinned to `pinned`
    /// off it, and the version it moves to: when its session takes another
    /// version now, and either `pinned` is superseded or the latest
    /// activation upgrades turns in flight.
    pub fn moves_turns_off(&self, session_id: &str, pinned: &str) -> Option<(&Activation, &str)> {
        let target = self.choose(session_id).filter(|t| *t != pinned)?;
        let by = match self.superseded.get(pinned) {
            Some(by) => by.as_ref(),
            None => self.last.as_ref().filter(|a| a.upgrade_in_flight)?,
        };
        Some((by, target))
    }

    /// What a rollback activates: the current version while a ramp stands
    /// (which ends the ramp), else the version that was current before.
    pub fn rollback_target(&self) -> Option<&str> {
        if self.ramp.is_some() {
            return self.current.as_deref();
        }
        let current = self.current.as_deref()?;
        self.history
            .iter()
            .rev()
            .map(String::as_str)
            .find(|digest| *digest != current)
    }
}

/// Every role of every agent, folded from the log.
#[derive(Clone, Debug, Default)]
pub struct RoleStates {
    pub roles: BTreeMap<(String, String), RoleState>,
    /// The last sequence number applied.
    pub last_seq: i64,
}

impl RoleStates {
    pub fn from_log(log: &[Activation]) -> Self {
        let mut states = Self::default();
        for activation in log {
            states.apply(activation);
        }
        states
    }

    /// Applies the next entry of the log; an entry already applied is
    /// ignored.
    pub fn apply(&mut self, activation: &Activation) {
        if activation.seq <= self.last_seq {
            return;
        }
        self.roles
            .entry((activation.agent.clone(), activation.role.clone()))
            .or_default()
            .apply(activation);
        self.last_seq = activation.seq;
    }

    pub fn role(&self, agent: &str, role: &str) -> Option<&RoleState> {
        self.roles.get(&(agent.to_string(), role.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn activation(seq: i64, digest: &str, mode: ActivationMode) -> Activation {
        Activation {
            seq,
            agent: "a".into(),
            role: "runner".into(),
            digest: digest.into(),
            mode,
            upgrade_in_flight: false,
            actor: "test".into(),
            reason: String::new(),
            at: seq,
        }
    }

    #[test]
    fn a_ramp_sends_a_stable_share_and_a_rollback_ends_it() {
        let mut role = RoleState::default();
        role.apply(&activation(1, "old", ActivationMode::Current));
        role.apply(&activation(2, "new", ActivationMode::Ramp(10)));
        let sessions: Vec<String> = (0..1000).map(|n| format!("session-{n}")).collect();
        let on_new = sessions
            .iter()
            .filter(|s| role.choose(s) == Some("new"))
            .count();
        assert!(
            (70..=130).contains(&on_new),
            "{on_new} of 1000 on a 10 % ramp"
        );
        // Widening keeps every session that was on the new version there.
        let mut wider = role.clone();
        wider.apply(&activation(3, "new", ActivationMode::Ramp(30)));
        for session in &sessions {
            if role.choose(session) == Some("new") {
                assert_eq!(wider.choose(session), Some("new"));
            }
        }
        assert_eq!(role.rollback_target(), Some("old"));
        role.apply(&activation(4, "old", ActivationMode::Current));
        assert!(sessions.iter().all(|s| role.choose(s) == Some("old")));
    }

    #[test]
    fn an_upgrade_in_flight_keeps_moving_turns_off_what_it_superseded_until_made_current() {
        let mut role = RoleState::default();
        role.apply(&activation(1, "a", ActivationMode::Current));
        role.apply(&activation(2, "broken", ActivationMode::Current));
        let mut fix = activation(3, "fix", ActivationMode::Current);
        fix.upgrade_in_flight = true;
        role.apply(&fix);
        let superseded = |role: &RoleState| role.superseded.keys().cloned().collect::<Vec<_>>();
        assert_eq!(superseded(&role), ["a", "broken"]);
        // A later plain activation does not undo the rescue.
        role.apply(&activation(4, "next", ActivationMode::Current));
        assert_eq!(superseded(&role), ["a", "broken"]);
        let (by, to) = role.moves_turns_off("s", "broken").unwrap();
        assert_eq!((by.seq, to), (3, "next"));
        assert!(role.moves_turns_off("s", "fix").is_none(), "not superseded");
        // A ramp of it leaves the sessions outside the ramp rescued.
        role.apply(&activation(5, "broken", ActivationMode::Ramp(5)));
        assert_eq!(superseded(&role), ["a", "broken"]);
        // Made current again: turns begun on it now keep it.
        role.apply(&activation(6, "broken", ActivationMode::Current));
        assert_eq!(superseded(&role), ["a"]);
        assert!(role.moves_turns_off("s", "broken").is_none());
    }

    #[test]
    fn a_flagged_ramp_moves_its_share_now_and_leaves_the_current_version_to_later_turns() {
        let mut role = RoleState::default();
        role.apply(&activation(1, "old", ActivationMode::Current));
        role.apply(&activation(2, "cur", ActivationMode::Current));
        let mut ramp = activation(3, "ramped", ActivationMode::Ramp(50));
        ramp.upgrade_in_flight = true;
        role.apply(&ramp);
        // The current version still serves the sessions outside the ramp.
        assert_eq!(role.superseded.keys().collect::<Vec<_>>(), ["old"]);
        let sessions: Vec<String> = (0..100).map(|n| format!("s{n}")).collect();
        let inside = sessions
            .iter()
            .find(|s| role.choose(s) == Some("ramped"))
            .unwrap();
        let outside = sessions
            .iter()
            .find(|s| role.choose(s) == Some("cur"))
            .unwrap();
        assert_eq!(
            role.moves_turns_off(inside, "cur").map(|(_, to)| to),
            Some("ramped")
        );
        assert!(role.moves_turns_off(outside, "cur").is_none());
        // Promoting the ramp without the flag leaves turns begun on `cur`.
        role.apply(&activation(4, "ramped", ActivationMode::Current));
        assert!(role.moves_turns_off(outside, "cur").is_none());
        assert_eq!(
            role.moves_turns_off(outside, "old").map(|(_, to)| to),
            Some("ramped")
        );
    }

    #[test]
    fn a_rollback_returns_to_the_version_current_before() {
        let mut role = RoleState::default();
        assert_eq!(role.rollback_target(), None);
        role.apply(&activation(1, "a", ActivationMode::Current));
        assert_eq!(role.rollback_target(), None, "nothing to go back to");
        role.apply(&activation(2, "b", ActivationMode::Current));
        role.apply(&activation(3, "b", ActivationMode::Current));
        assert_eq!(role.rollback_target(), Some("a"));
    }
}
