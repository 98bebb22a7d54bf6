//! The smallest useful tool component: `no_std`, no WASI imports at all, one
//! `echo` tool. It measures the host's own per-call sandbox cost, without a
//! libc to set up. Each call runs in a fresh instance, so a bump allocator
//! that never frees is all it needs.

#![no_std]

extern crate alloc;

use alloc::string::ToString;
use alloc::vec;
use alloc::vec::Vec;
use core::alloc::{GlobalAlloc, Layout};
use core::cell::UnsafeCell;

use dex::agents::types::ToolEffect;

wit_bindgen::generate!({ path: "../../wit", world: "dex:agents/tool" });

const HEAP_BYTES: usize = 256 << 10;

/// A bump allocator over a static arena; the instance dies after one call.
struct Bump {
    arena: UnsafeCell<[u8; HEAP_BYTES]>,
    next: UnsafeCell<usize>,
}

// SAFETY: a component instance runs on one thread.
unsafe impl Sync for Bump {}

unsafe impl GlobalAlloc for Bump {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: single-threaded; offsets stay inside the arena.
        unsafe {
            let next = &mut *self.next.get();
            let start = (*next + layout.align() - 1) & !(layout.align() - 1);
            let end = match start.checked_add(layout.size()) {
                Some(end) if end <= HEAP_BYTES => end,
                _ => return core::ptr::null_mut(),
            };
            *next = end;
            (self.arena.get() as *mut u8).add(start)
        }
    }

    unsafe fn dealloc(&self, _ptr: *mut u8, _layout: Layout) {}
}

#[global_allocator]
static ALLOCATOR: Bump = Bump {
    arena: UnsafeCell::new([0; HEAP_BYTES]),
    next: UnsafeCell::new(0),
};

/// The canonical ABI's allocator entry point (with std, wit-bindgen links a
/// C shim for it; without std the component defines it).
///
/// # Safety
/// Called by the host with the canonical ABI's contract.
#[no_mangle]
pub unsafe extern "C" fn cabi_realloc(
    old: *mut u8,
    old_len: usize,
    align: usize,
    new_len: usize,
) -> *mut u8 {
    if new_len == 0 {
        return align as *mut u8;
    }
    let Ok(layout) = Layout::from_size_align(new_len, align) else {
        core::arch::wasm32::unreachable()
    };
    // SAFETY: `layout` has a non-zero size.
    let new = unsafe { ALLOCATOR.alloc(layout) };
    if new.is_null() {
        core::arch::wasm32::unreachable()
    }
    if !old.is_null() && old_len > 0 {
        // SAFETY: both regions are live and distinct (the arena only grows).
        unsafe { core::ptr::copy_nonoverlapping(old, new, old_len.min(new_len)) };
    }
    new
}

#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    core::arch::wasm32::unreachable()
}

struct TinyTool;

impl Guest for TinyTool {
    fn list_tools() -> Vec<ToolSpec> {
        vec![ToolSpec {
            name: "echo".to_string(),
            description: "Returns its arguments.".to_string(),
            parameters_schema: "{\"type\":\"object\"}".to_string(),
            effect: Some(ToolEffect::Read),
        }]
    }

    fn call(call: DeferredToolExecution) -> Result<alloc::string::String, ToolError> {
        match call.tool_call.tool_name.as_str() {
            "echo" => Ok(call.tool_call.arguments),
            _ => Err(ToolError::Execution(
                "tiny-tool serves only echo".to_string(),
            )),
        }
    }
}

export!(TinyTool);
