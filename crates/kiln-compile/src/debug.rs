//! `KILN_COMPILE_DEBUG=1`: every graph (and, as passes and code generators land, every stage and
//! kernel) is written to a per-process folder whose path is printed once.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

fn folder() -> Option<&'static PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let on = std::env::var("KILN_COMPILE_DEBUG")
            .map(|v| v != "0" && !v.is_empty())
            .unwrap_or(false);
        if !on {
            return None;
        }
        let base = std::env::var("KILN_DEBUG_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|_| PathBuf::from("kiln_debug"));
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let dir = base.join(format!("run_{stamp}_pid{}", std::process::id()));
        match std::fs::create_dir_all(&dir) {
            Ok(()) => {
                eprintln!(
                    "kiln: KILN_COMPILE_DEBUG: writing graphs to {}",
                    dir.display()
                );
                Some(dir)
            }
            Err(e) => {
                eprintln!(
                    "kiln: KILN_COMPILE_DEBUG: cannot create {}: {e}",
                    dir.display()
                );
                None
            }
        }
    })
    .as_ref()
}

/// Writes `text` as `<seq>_<name>.txt` in the debug folder, when debugging is on.
pub fn dump(name: &str, text: &str) {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    if let Some(dir) = folder() {
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let file: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        if let Err(e) = std::fs::write(dir.join(format!("{n:03}_{file}.txt")), text) {
            eprintln!("kiln: KILN_COMPILE_DEBUG: {e}");
        }
    }
}

pub fn enabled() -> bool {
    folder().is_some()
}
