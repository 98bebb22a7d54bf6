//! `dex:agents/model`: the model behind the host. The runner never sees the
//! provider's credentials, may call it once per `run-model-step`, and the
//! provider streams text deltas into the call's events. The scripted provider
//! for tests is in [`crate::providers::scripted`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use super::events::EventWriter;
use crate::plugin::bindings::runner::dex::agents::model;
use crate::plugin::bindings::wit::{ModelError, ModelRequest, ModelResponse};
use crate::plugin::call::CallState;

/// What [`ModelProvider::complete`] returns.
pub type ModelFuture<'a> =
    Pin<Box<dyn Future<Output = Result<ModelResponse, ModelError>> + Send + 'a>>;

/// A chat-completion provider.
pub trait ModelProvider: Send + Sync {
    /// Completes `request`, writing text deltas to `events` as they arrive.
    fn complete<'a>(&'a self, request: ModelRequest, events: &'a EventWriter) -> ModelFuture<'a>;
}

/// Per-call model state: present only for `run-model-step`.
pub(crate) struct ModelState {
    pub provider: Option<Arc<dyn ModelProvider>>,
    pub allowed: bool,
    pub called: bool,
}

impl model::Host for CallState {
    async fn complete(
        &mut self,
        request: ModelRequest,
    ) -> wasmtime::Result<Result<ModelResponse, ModelError>> {
        if !self.model.allowed {
            return Ok(Err(ModelError::NotAvailable(
                "model.complete may only be called from run-model-step".to_string(),
            )));
        }
        if self.model.called {
            return Ok(Err(ModelError::AlreadyCalled));
        }
        self.model.called = true;
        let Some(provider) = self.model.provider.clone() else {
            return Ok(Err(ModelError::NotAvailable(
                "no model provider is configured for this agent".to_string(),
            )));
        };
        let events = self.events.clone();
        Ok(provider.complete(request, &events).await)
    }
}
