//! Where a problem is: byte spans of the file turned into lines and
//! columns, and the checks of single values (durations, sizes, limits,
//! names) that report at their span.

use std::ops::Range;
use std::path::Path;
use std::time::Duration;

use toml::Spanned;

use super::raw::{ByteSize, RawLimits, RawTurnLimits};
use super::ConfigError;
use crate::plugin::ComponentLimits;
use crate::session::TurnLimits;

/// Places errors in the file's text.
pub(super) struct Locator<'a> {
    pub(super) file: &'a Path,
    pub(super) text: &'a str,
}

impl Locator<'_> {
    pub(super) fn at(&self, span: Range<usize>, message: String) -> ConfigError {
        locate(self.file, self.text, span, message)
    }

    pub(super) fn duration(
        &self,
        value: &Spanned<String>,
        what: &str,
    ) -> Result<Duration, ConfigError> {
        humantime::parse_duration(value.get_ref()).map_err(|err| {
            self.at(
                value.span(),
                format!(
                    "{what}: {:?} is not a duration like \"30s\" or \"5m\": {err}",
                    value.get_ref()
                ),
            )
        })
    }

    /// An agent's turn limits: each given one at least 1, the rest defaulted.
    pub(super) fn turn_limits(&self, raw: &RawTurnLimits) -> Result<TurnLimits, ConfigError> {
        let mut limits = TurnLimits::default();
        let count = |value: &Spanned<u32>, what: &str| -> Result<u32, ConfigError> {
            match *value.get_ref() {
                0 => Err(self.at(
                    value.span(),
                    format!("turn_limits.{what} must be at least 1"),
                )),
                n => Ok(n),
            }
        };
        if let Some(v) = &raw.tool_calls {
            limits.tool_calls = count(v, "tool_calls")?;
        }
        if let Some(v) = &raw.messages {
            limits.messages = count(v, "messages")?;
        }
        if let Some(v) = &raw.tool_output {
            let bytes = v
                .get_ref()
                .bytes()
                .map_err(|m| self.at(v.span(), format!("turn_limits.tool_output: {m}")))?;
            if bytes == 0 {
                return Err(self.at(v.span(), "turn_limits.tool_output must be above 0".into()));
            }
            limits.tool_output_bytes = bytes;
        }
        Ok(limits)
    }

    /// A component's limits: each given one checked, the rest defaulted.
    pub(super) fn limits(&self, raw: &RawLimits) -> Result<ComponentLimits, ConfigError> {
        let mut limits = ComponentLimits::default();
        let size = |value: &Spanned<ByteSize>, what: &str| -> Result<u64, ConfigError> {
            let bytes = value
                .get_ref()
                .bytes()
                .map_err(|m| self.at(value.span(), format!("limits.{what}: {m}")))?;
            if bytes == 0 {
                return Err(self.at(value.span(), format!("limits.{what} must be above 0")));
            }
            Ok(bytes)
        };
        let count = |value: &Spanned<u64>, what: &str| -> Result<u64, ConfigError> {
            match *value.get_ref() {
                0 => Err(self.at(value.span(), format!("limits.{what} must be at least 1"))),
                n => Ok(n),
            }
        };
        let usize_of = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
        if let Some(v) = &raw.memory {
            limits.memory_bytes = usize_of(size(v, "memory")?);
        }
        if let Some(v) = &raw.table_elements {
            limits.table_elements = usize_of(count(v, "table_elements")?);
        }
        if let Some(v) = &raw.instances {
            limits.instances = usize_of(count(v, "instances")?);
        }
        if let Some(v) = &raw.fuel {
            limits.fuel = Some(count(v, "fuel")?);
        }
        if let Some(v) = &raw.max_concurrent_calls {
            limits.max_concurrent_calls = usize_of(count(v, "max_concurrent_calls")?);
        }
        if let Some(v) = &raw.output {
            limits.output_bytes = usize_of(size(v, "output")?);
        }
        if let Some(v) = &raw.run_state {
            limits.run_state_bytes = usize_of(size(v, "run_state")?);
        }
        if let Some(v) = &raw.events_per_call {
            limits.event_bytes_per_call = size(v, "events_per_call")?;
        }
        if let Some(v) = &raw.host_handles {
            limits.host_handles = usize_of(count(v, "host_handles")?);
        }
        Ok(limits)
    }

    /// A duration longer than zero, or `default` when absent.
    pub(super) fn positive(
        &self,
        value: &Option<Spanned<String>>,
        what: &str,
        default: Duration,
    ) -> Result<Duration, ConfigError> {
        let Some(value) = value else {
            return Ok(default);
        };
        let parsed = self.duration(value, what)?;
        if parsed.is_zero() {
            return Err(self.at(value.span(), format!("{what} must be longer than 0")));
        }
        Ok(parsed)
    }
}

pub(super) fn check_name(name: &str, what: &str) -> Result<(), String> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
    {
        return Err(format!(
            "{what} name {name:?} may use only letters, digits, '-', '_' and '.'"
        ));
    }
    Ok(())
}

pub(super) fn names<'a>(keys: impl Iterator<Item = &'a String>) -> String {
    let list: Vec<String> = keys.map(|k| format!("{k:?}")).collect();
    if list.is_empty() {
        "none".to_string()
    } else {
        list.join(", ")
    }
}

/// Turns a byte span into a one-based line and column.
pub(super) fn locate(file: &Path, text: &str, span: Range<usize>, message: String) -> ConfigError {
    let offset = span.start.min(text.len());
    let before = &text[..text.floor_char_boundary(offset)];
    let line = before.matches('\n').count() + 1;
    let column = before
        .rfind('\n')
        .map(|nl| before[nl + 1..].chars().count() + 1)
        .unwrap_or_else(|| before.chars().count() + 1);
    ConfigError {
        file: file.to_path_buf(),
        line: Some(line),
        column: Some(column),
        message,
    }
}
