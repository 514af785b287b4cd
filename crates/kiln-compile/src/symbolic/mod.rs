//! Dynamic shapes: symbolic sizes in graphs, so one compiled graph serves many input sizes.
//!
//! Rust code reads sizes as plain `usize` and may branch on them where no tracer sees it, so kiln
//! never trusts a graph at a size it has not traced: symbolic graphs are built by tracing the code
//! at several sizes and unifying the traces (`SymGraph::unify`, `fit.rs`), and a new size is traced
//! again and must instantiate the symbolic graph exactly (`SymGraph::instantiates`) before its
//! compiled code runs there. See ARCHITECTURE.md, "Dynamic shapes".

pub mod compiled;
pub mod context;
pub mod expr;
pub mod fit;
pub mod guards;
pub mod marks;
pub mod slots;
pub mod sym_graph;

pub use expr::{Expr, SymId};
pub use guards::SymGuard;
pub use marks::{mark_dynamic, mark_static};
pub use sym_graph::{SymGraph, Symbol};
