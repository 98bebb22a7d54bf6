//! Host bindings generated from `wit/` (the `dex:agents@0.2.0` package).
//!
//! The runner world owns the shared interfaces; the tool world reuses them so
//! that one host implementation serves both.

/// Bindings for the `runner` world.
pub mod runner {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "dex:agents/runner",
        imports: {
            "dex:agents/model.complete": async | trappable,
            "dex:agents/types.[method]history.read": async | trappable,
            default: trappable,
        },
        exports: { default: async },
        with: {
            "dex:agents/types.history": crate::plugin::factors::history::History,
        },
    });
}

/// Bindings for the `tool` world.
pub mod tool {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "dex:agents/tool",
        imports: { default: trappable },
        exports: { default: async },
        with: {
            "dex:agents/types": super::runner::dex::agents::types,
            "dex:agents/step": super::runner::dex::agents::step,
            "dex:agents/events": super::runner::dex::agents::events,
            "dex:agents/config": super::runner::dex::agents::config,
        },
    });
}

/// The WIT data types, as Rust types. The session layer converts its records
/// to and from these.
pub mod wit {
    pub use super::runner::dex::agents::types::*;
}
