//! Flow types and their Step handlers.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use super::context::StepContext;
use super::types::{NewTask, RetryPolicy, StepCall, StepResult, StoreMillis};

/// Why a Step attempt failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    /// Try again as the retry policy allows.
    #[error("{0}")]
    Retryable(String),
    /// Do not try again: go to the failure route now.
    #[error("{0}")]
    Fatal(String),
}

impl StepError {
    pub fn retryable(message: impl Into<String>) -> Self {
        StepError::Retryable(message.into())
    }

    pub fn fatal(message: impl Into<String>) -> Self {
        StepError::Fatal(message.into())
    }
}

impl From<super::store::StoreError> for StepError {
    fn from(err: super::store::StoreError) -> Self {
        StepError::Retryable(format!("store: {err}"))
    }
}

pub type StepFuture = Pin<Box<dyn Future<Output = Result<StepResult, StepError>> + Send>>;

/// An async Step handler.
pub trait StepHandler: Send + Sync {
    fn run(&self, ctx: StepContext) -> StepFuture;
}

impl<F, Fut> StepHandler for F
where
    F: Fn(StepContext) -> Fut + Send + Sync,
    Fut: Future<Output = Result<StepResult, StepError>> + Send + 'static,
{
    fn run(&self, ctx: StepContext) -> StepFuture {
        Box::pin(self(ctx))
    }
}

/// One Step type of a flow type.
#[derive(Clone)]
pub struct StepDef {
    pub name: String,
    pub handler: Arc<dyn StepHandler>,
    pub policy: RetryPolicy,
    /// The Step to run, with the same input, when attempts run out.
    pub failure_route: Option<String>,
    /// Attribute names held while the Step runs (RPCs that lock them conflict).
    pub locks: Vec<String>,
}

impl StepDef {
    pub fn new(name: impl Into<String>, handler: impl StepHandler + 'static) -> Self {
        Self {
            name: name.into(),
            handler: Arc::new(handler),
            policy: RetryPolicy::default(),
            failure_route: None,
            locks: Vec::new(),
        }
    }

    pub fn policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    pub fn failure_route(mut self, step: impl Into<String>) -> Self {
        self.failure_route = Some(step.into());
        self
    }

    pub fn locks(mut self, names: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.locks = names.into_iter().map(Into::into).collect();
        self
    }
}

/// A flow type: its name, its first Step and its Step types.
#[derive(Clone)]
pub struct FlowType {
    pub name: String,
    pub start_step: String,
    steps: HashMap<String, StepDef>,
}

impl FlowType {
    pub fn new(name: impl Into<String>, start_step: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            start_step: start_step.into(),
            steps: HashMap::new(),
        }
    }

    pub fn step(mut self, def: StepDef) -> Self {
        self.steps.insert(def.name.clone(), def);
        self
    }

    pub fn step_def(&self, name: &str) -> Option<&StepDef> {
        self.steps.get(name)
    }
}

/// Why a registry or a flow operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("flow type {0:?} is registered twice")]
    Duplicate(String),
    #[error("flow type {flow_type:?}: step {step:?} is not defined")]
    UnknownStep { flow_type: String, step: String },
    #[error("flow type {0:?} is not registered")]
    UnknownFlowType(String),
}

/// The flow types a client or worker knows.
#[derive(Clone, Default)]
pub struct Registry {
    types: HashMap<String, Arc<FlowType>>,
}

impl Registry {
    /// Checks that every start step and failure route names a defined Step.
    pub fn new(types: impl IntoIterator<Item = FlowType>) -> Result<Self, RegistryError> {
        let mut map = HashMap::new();
        for flow_type in types {
            let check = |step: &str| {
                if flow_type.steps.contains_key(step) {
                    Ok(())
                } else {
                    Err(RegistryError::UnknownStep {
                        flow_type: flow_type.name.clone(),
                        step: step.to_string(),
                    })
                }
            };
            check(&flow_type.start_step)?;
            for def in flow_type.steps.values() {
                if let Some(route) = &def.failure_route {
                    check(route)?;
                }
            }
            let name = flow_type.name.clone();
            if map.insert(name.clone(), Arc::new(flow_type)).is_some() {
                return Err(RegistryError::Duplicate(name));
            }
        }
        Ok(Self { types: map })
    }

    pub fn flow_type(&self, name: &str) -> Result<&Arc<FlowType>, RegistryError> {
        self.types
            .get(name)
            .ok_or_else(|| RegistryError::UnknownFlowType(name.to_string()))
    }

    pub fn flow_type_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.types.keys().cloned().collect();
        names.sort();
        names
    }

    /// The stored form of `call`, with its Step type's policy.
    pub fn new_task(
        &self,
        flow_type: &str,
        call: StepCall,
        now: StoreMillis,
        failure: Option<String>,
    ) -> Result<NewTask, RegistryError> {
        let def = self
            .flow_type(flow_type)?
            .step_def(&call.step_type)
            .ok_or_else(|| RegistryError::UnknownStep {
                flow_type: flow_type.to_string(),
                step: call.step_type.clone(),
            })?;
        Ok(NewTask {
            step_type: call.step_type,
            input: call.input,
            wait: call.wait,
            policy: def.policy.clone(),
            failure_route: def.failure_route.clone(),
            failure,
            locks: def.locks.clone(),
            not_before: now,
        })
    }
}
