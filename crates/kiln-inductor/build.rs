//! `KILN_INDUCTOR_BUILD_ID`: a hash of the sources that decide what the `kiln` backend makes of a
//! graph — this crate's, kiln-compile's (capture, AOT autograd) and kiln-core's (prims, VJP
//! rules) — which keys its entries in the compiled-graph cache on disk, so a changed compiler
//! never reads what an older one stored. (Outside this workspace, where the sibling crates'
//! sources are not beside this one, it covers this crate and the package version.)

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn main() {
    let here = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let dirs = [
        here.join("src"),
        here.join("../kiln-compile/src"),
        here.join("../kiln-core/src"),
    ];
    let mut all = Vec::new();
    for d in &dirs {
        println!("cargo:rerun-if-changed={}", d.display());
        files(d, &mut all);
    }
    all.sort();
    // SipHash with fixed keys: the same sources give the same id on every build
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::env::var("CARGO_PKG_VERSION")
        .unwrap_or_default()
        .hash(&mut h);
    for f in &all {
        f.strip_prefix(&here).unwrap_or(f).hash(&mut h);
        std::fs::read(f).unwrap_or_default().hash(&mut h);
    }
    println!("cargo:rustc-env=KILN_INDUCTOR_BUILD_ID={:016x}", h.finish());
}
