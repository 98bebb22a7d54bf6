//! Model providers behind `dex:agents/model`: the real ones. The scripted
//! provider for tests and demos lives with the trait
//! ([`crate::plugin::ScriptedModelProvider`]).

pub mod openai;
mod openai_stream;
pub mod retry;

pub use openai::{OpenAiConfig, OpenAiProvider};
pub use retry::RetryPolicy;
