//! `KILN_LOGS=graph_code,graph_breaks,recompiles,guards,output_code,perf_hints,graph_cache` (a comma list, or
//! `all`): each channel is a `tracing` target `kiln::<channel>`, printed to stderr.

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    GraphCode,
    GraphBreaks,
    Recompiles,
    Guards,
    OutputCode,
    PerfHints,
    /// Reads and writes of the compiled-graph cache on disk (`disk_cache.rs`).
    GraphCache,
}

impl Channel {
    const ALL: [Channel; 7] = [
        Channel::GraphCode,
        Channel::GraphBreaks,
        Channel::Recompiles,
        Channel::Guards,
        Channel::OutputCode,
        Channel::PerfHints,
        Channel::GraphCache,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Channel::GraphCode => "graph_code",
            Channel::GraphBreaks => "graph_breaks",
            Channel::Recompiles => "recompiles",
            Channel::Guards => "guards",
            Channel::OutputCode => "output_code",
            Channel::PerfHints => "perf_hints",
            Channel::GraphCache => "graph_cache",
        }
    }
    fn bit(self) -> u32 {
        1 << (self as u32)
    }
}

fn enabled_mask() -> u32 {
    static MASK: OnceLock<u32> = OnceLock::new();
    *MASK.get_or_init(|| {
        let Ok(spec) = std::env::var("KILN_LOGS") else {
            return 0;
        };
        let mut mask = 0;
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let item = item.trim_start_matches('+');
            if item == "all" {
                mask = u32::MAX;
            } else if let Some(c) = Channel::ALL.iter().find(|c| c.name() == item) {
                mask |= c.bit();
            } else {
                eprintln!(
                    "kiln: KILN_LOGS: unknown channel {item:?}; known: {:?}",
                    Channel::ALL.map(|c| c.name())
                );
            }
        }
        if mask != 0 {
            // a subscriber the application installed wins; otherwise print to stderr
            let _ = tracing_subscriber::fmt()
                .with_writer(std::io::stderr)
                .with_target(true)
                .without_time()
                .try_init();
        }
        mask
    })
}

pub fn enabled(c: Channel) -> bool {
    enabled_mask() & c.bit() != 0
}

/// Logs `msg()` on channel `c` when enabled (the message is only built then).
pub fn emit(c: Channel, msg: impl FnOnce() -> String) {
    if !enabled(c) {
        return;
    }
    let m = msg();
    match c {
        Channel::GraphCode => tracing::info!(target: "kiln::graph_code", "\n{m}"),
        Channel::GraphBreaks => tracing::info!(target: "kiln::graph_breaks", "{m}"),
        Channel::Recompiles => tracing::info!(target: "kiln::recompiles", "{m}"),
        Channel::Guards => tracing::info!(target: "kiln::guards", "{m}"),
        Channel::OutputCode => tracing::info!(target: "kiln::output_code", "\n{m}"),
        Channel::PerfHints => tracing::info!(target: "kiln::perf_hints", "{m}"),
        Channel::GraphCache => tracing::info!(target: "kiln::graph_cache", "{m}"),
    }
}
