//! Model providers behind `dex:agents/model` (the trait is
//! [`crate::plugin::ModelProvider`]): OpenAI-compatible servers, and the
//! **scripted** provider for tests and the offline demo.

pub mod openai;
mod openai_stream;
pub mod retry;
pub mod scripted;

pub use openai::{OpenAiConfig, OpenAiProvider};
pub use retry::RetryPolicy;
pub use scripted::{MessageSummary, RequestSummary, ScriptedModelProvider};
