//! `[agents.NAME]`: an agent's runner, tools and model, and its session
//! options (tool policies, deadlines, limits).

use std::collections::{BTreeMap, BTreeSet};

use super::locator::{check_name, names, Locator};
use super::raw::{RawAgent, RawConfig};
use super::values::expand_env;
use super::{AgentConfig, ConfigError};
use crate::session::AgentSessionOptions;

/// Every agent of the file (their components' roles were checked first).
pub(super) fn agents(
    raw: &RawConfig,
    loc: &Locator<'_>,
) -> Result<BTreeMap<String, AgentConfig>, ConfigError> {
    let mut agents = BTreeMap::new();
    for (name, agent) in &raw.agents {
        check_name(name, "agent").map_err(|m| loc.at(agent.span(), m))?;
        let raw_agent = agent.get_ref();
        let mut model = None;
        if let Some(wanted) = &raw_agent.model {
            let wanted_name = expand_env(wanted.get_ref()).map_err(|m| loc.at(wanted.span(), m))?;
            if !raw.models.contains_key(wanted_name.as_str()) {
                return Err(loc.at(
                    wanted.span(),
                    format!(
                        "there is no model {wanted_name:?}; the models are {}",
                        names(raw.models.keys())
                    ),
                ));
            }
            model = Some(wanted_name);
        }
        let mut seen = BTreeSet::new();
        for tool in &raw_agent.tools {
            if !seen.insert(tool.get_ref().as_str()) {
                return Err(loc.at(
                    tool.span(),
                    format!("tool component {:?} is listed twice", tool.get_ref()),
                ));
            }
        }
        agents.insert(
            name.clone(),
            AgentConfig {
                name: name.clone(),
                runner: raw_agent.runner.get_ref().clone(),
                tools: raw_agent
                    .tools
                    .iter()
                    .map(|t| t.get_ref().clone())
                    .collect(),
                model,
                options: options(raw_agent, loc)?,
            },
        );
    }
    Ok(agents)
}

/// The agent's session options: each given one checked, the rest defaulted.
fn options(raw: &RawAgent, loc: &Locator<'_>) -> Result<AgentSessionOptions, ConfigError> {
    let mut options = AgentSessionOptions {
        tool_policies: raw.tool_policies.clone(),
        ..AgentSessionOptions::default()
    };
    if let Some(effect) = raw.default_effect {
        options.default_tool_effect = effect;
    }
    if let Some(deadline) = &raw.interrupt_deadline {
        options.interrupt_deadline = Some(loc.duration(deadline, "interrupt_deadline")?);
    }
    if let Some(capacity) = &raw.events_capacity {
        if *capacity.get_ref() == 0 {
            return Err(loc.at(
                capacity.span(),
                "events_capacity must be at least 1 byte".into(),
            ));
        }
        options.events_capacity = *capacity.get_ref();
    }
    options.tool_attempt_timeout = loc.positive(
        &raw.tool_attempt_timeout,
        "tool_attempt_timeout",
        options.tool_attempt_timeout,
    )?;
    options.model_step_timeout = loc.positive(
        &raw.model_step_timeout,
        "model_step_timeout",
        options.model_step_timeout,
    )?;
    if let Some(limits) = &raw.turn_limits {
        options.turn_limits = loc.turn_limits(limits)?;
    }
    Ok(options)
}
