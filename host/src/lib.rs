//! dexa: a host for durable AI-agent sessions whose runner and tools are
//! sandboxed WebAssembly components.
//!
//! Layers, each depending only on those listed before it:
//! - [`flow`]: the generic durable Flow engine and its storage trait;
//! - [`catalog`]: the component catalog (versions by digest, the activation
//!   log) and its storage trait;
//! - [`store`]: the storage backends (embedded SQLite);
//! - [`plugin`]: the wasmtime layer (engine, cache, sandboxed calls, grants);
//! - [`providers`]: the model providers behind `model.complete` (OpenAI-compatible);
//! - [`session`]: AgentSessionFlow, the durable agent session, and its client;
//! - [`config`]: `dexa.toml`, and the store, components and agents it
//!   describes;
//! - [`api`]: the HTTP+SSE API of `dexa serve`;
//! - [`cli`]: the `dexa` command line.
//!
//! Beside them, [`telemetry`] (metric names, the Prometheus recorder, trace
//! export) depends on none of them, and every layer may use it.

pub mod api;
pub mod catalog;
pub mod cli;
pub mod config;
pub mod flow;
pub mod plugin;
pub mod providers;
pub mod session;
pub mod store;
pub mod telemetry;
