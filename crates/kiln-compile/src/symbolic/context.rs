//! The symbol values a backend is compiling for, when it compiles one size of a symbolic graph
//! (`PerSizeCompiled`). A code generator that makes size-generic kernels reads it: kernels of one
//! symbolic graph at different sizes differ in integer constants only, and those are functions of
//! these values (`kiln-inductor`'s `codegen/template.rs`).

use std::cell::RefCell;

/// A symbolic graph being compiled at one size: an id unique to the graph, and its symbol values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SizeContext {
    pub graph_id: u64,
    pub values: Vec<i64>,
}

thread_local! {
    static CURRENT: RefCell<Option<SizeContext>> = const { RefCell::new(None) };
}

/// Runs `f` with `ctx` as the current size context (restored afterwards, also on error).
pub fn with_context<R>(ctx: SizeContext, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<SizeContext>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let old = self.0.take();
            CURRENT.with(|c| *c.borrow_mut() = old);
        }
    }
    let _restore = Restore(CURRENT.with(|c| c.borrow_mut().replace(ctx)));
    f()
}

/// The size context of the compile running on this thread, if it compiles a symbolic graph.
pub fn current() -> Option<SizeContext> {
    CURRENT.with(|c| c.borrow().clone())
}
