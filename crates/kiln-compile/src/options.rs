//! `CompileOptions`: torch.compile's arguments.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::backends::Backend;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    #[default]
    Default,
    ReduceOverhead,
    MaxAutotune,
    MaxAutotuneNoCudagraphs,
}

impl Mode {
    pub const ALL: [Mode; 4] = [
        Mode::Default,
        Mode::ReduceOverhead,
        Mode::MaxAutotune,
        Mode::MaxAutotuneNoCudagraphs,
    ];
    /// The mode named as torch.compile names it (`as_str`'s inverse).
    pub fn from_name(name: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.as_str() == name)
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Default => "default",
            Mode::ReduceOverhead => "reduce-overhead",
            Mode::MaxAutotune => "max-autotune",
            Mode::MaxAutotuneNoCudagraphs => "max-autotune-no-cudagraphs",
        }
    }
}

/// A backend by registered name, or a user value.
#[derive(Clone)]
pub enum BackendChoice {
    Named(String),
    Custom(Arc<dyn Backend>),
}

impl std::fmt::Debug for BackendChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BackendChoice::Named(n) => write!(f, "{n:?}"),
            BackendChoice::Custom(b) => write!(f, "custom({:?})", b.name()),
        }
    }
}

#[derive(Clone, Debug)]
pub struct CompileOptions {
    pub mode: Mode,
    /// A graph break is an error instead of a split.
    pub fullgraph: bool,
    /// `None`: automatic; `Some(false)`: always specialise shapes; `Some(true)`: dynamic from the start.
    pub dynamic: Option<bool>,
    pub backend: BackendChoice,
    /// Key/value settings handed to the backend untouched.
    pub options: BTreeMap<String, String>,
    /// `compile` becomes a no-op: the function runs eagerly.
    pub disable: bool,
    /// Compiles of one function before it falls back to eager (torch's `recompile_limit`).
    pub recompile_limit: usize,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            mode: Mode::Default,
            fullgraph: false,
            dynamic: None,
            backend: BackendChoice::Named("kiln".into()),
            options: BTreeMap::new(),
            disable: false,
            recompile_limit: 8,
        }
    }
}

impl CompileOptions {
    pub fn mode(mut self, m: Mode) -> Self {
        self.mode = m;
        self
    }
    pub fn fullgraph(mut self, on: bool) -> Self {
        self.fullgraph = on;
        self
    }
    pub fn dynamic(mut self, d: Option<bool>) -> Self {
        self.dynamic = d;
        self
    }
    pub fn backend(mut self, name: &str) -> Self {
        self.backend = BackendChoice::Named(name.into());
        self
    }
    pub fn custom_backend(mut self, b: Arc<dyn Backend>) -> Self {
        self.backend = BackendChoice::Custom(b);
        self
    }
    pub fn option(mut self, key: &str, value: &str) -> Self {
        self.options.insert(key.into(), value.into());
        self
    }
    pub fn disable(mut self, on: bool) -> Self {
        self.disable = on;
        self
    }
    pub fn recompile_limit(mut self, n: usize) -> Self {
        self.recompile_limit = n;
        self
    }
}
