//! `dex:agents/config`: operator-supplied, non-secret settings per component.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::plugin::bindings::runner::dex::agents::config;
use crate::plugin::call::CallState;

/// The `[config]` table of one component.
pub type ComponentConfig = Arc<BTreeMap<String, String>>;

impl config::Host for CallState {
    fn get(&mut self, key: String) -> wasmtime::Result<Option<String>> {
        Ok(self.config.get(&key).cloned())
    }
}
