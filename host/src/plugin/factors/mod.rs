//! Host capabilities, one unit each, in the manner of Spin's factors: each has
//! its own configuration and its own per-call state, and implements the WIT
//! interface it backs on [`super::call::CallState`].

pub mod config;
pub mod events;
pub mod history;
pub mod http;
pub mod model;
pub mod policy;
pub mod step;
