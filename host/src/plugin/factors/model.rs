//! `dex:agents/model`: the model behind the host. The runner never sees the
//! provider's credentials, may call it once per `run-model-step`, and the
//! provider streams text deltas into the call's events.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use super::events::{EventWriter, GuestEvent};
use crate::plugin::bindings::runner::dex::agents::model;
use crate::plugin::bindings::wit::{ModelError, ModelRequest, ModelResponse};
use crate::plugin::call::CallState;

pub type ModelFuture<'a> =
    Pin<Box<dyn Future<Output = Result<ModelResponse, ModelError>> + Send + 'a>>;

/// A chat-completion provider.
pub trait ModelProvider: Send + Sync {
    /// Completes `request`, writing text deltas to `events` as they arrive.
    fn complete<'a>(&'a self, request: ModelRequest, events: &'a EventWriter) -> ModelFuture<'a>;
}

/// A **scripted** provider for tests and the offline demo: it replays the
/// given responses in order and never contacts a model.
pub struct ScriptedModelProvider {
    responses: Mutex<VecDeque<ModelResponse>>,
    requests: Mutex<Vec<ModelRequest>>,
    /// Replays the responses again from the start once they run out.
    repeat: bool,
}

impl ScriptedModelProvider {
    pub fn new(responses: impl IntoIterator<Item = ModelResponse>) -> Self {
        Self {
            responses: Mutex::new(responses.into_iter().collect()),
            requests: Mutex::new(Vec::new()),
            repeat: false,
        }
    }

    /// Starts over after the last response instead of running out (for
    /// demos that serve more than one session).
    pub fn repeating(mut self) -> Self {
        self.repeat = true;
        self
    }

    /// The requests received so far, oldest first.
    pub fn requests(&self) -> Vec<ModelRequest> {
        self.requests
            .lock()
            .map(|requests| requests.clone())
            .unwrap_or_default()
    }
}

impl ModelProvider for ScriptedModelProvider {
    fn complete<'a>(&'a self, request: ModelRequest, events: &'a EventWriter) -> ModelFuture<'a> {
        Box::pin(async move {
            if let Ok(mut requests) = self.requests.lock() {
                requests.push(request);
            }
            let next = self.responses.lock().ok().and_then(|mut responses| {
                let next = responses.pop_front()?;
                if self.repeat {
                    responses.push_back(next.clone());
                }
                Some(next)
            });
            let response = next.ok_or_else(|| {
                ModelError::NotAvailable("the scripted model has no responses left".to_string())
            })?;
            if let Some(content) = &response.message.content {
                for word in content.split_inclusive(' ') {
                    // A closed writer only means the call has ended.
                    let _ = events.write(GuestEvent::TextDelta {
                        text: word.to_string(),
                    });
                }
            }
            Ok(response)
        })
    }
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
