//! The warm-cache compile rows rest on `kiln-bench compile-child:KEY`: a child against an empty
//! kiln cache folder must build its kernels, and a second child against the folder the first one
//! filled must build none and find them on disk. Runs bert-base at 1 × 9 tokens on the CPU.

use std::process::Command;

fn child(cache: &std::path::Path) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln-bench"))
        .args([
            "compile-child:bert:bert_base_seq9",
            "--device",
            "cpu",
            "--quick",
        ])
        .env("KILN_CACHE_DIR", cache)
        .env_remove("OUT")
        .output()
        .expect("run kiln-bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON in the child's output: {stdout:?}"))
}

fn count(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("no {k} in {v}"))
}

#[test]
fn a_second_process_finds_the_first_ones_kernels_on_disk() {
    let cache = std::env::temp_dir().join(format!("kiln-bench-child-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    std::fs::create_dir_all(&cache).unwrap();
    let cold = child(&cache);
    let warm = child(&cache);
    let _ = std::fs::remove_dir_all(&cache);
    for v in [&cold, &warm] {
        let s = v["seconds"].as_f64().unwrap_or(-1.0);
        assert!(s > 0.0 && s.is_finite(), "seconds: {v}");
    }
    assert!(count(&cold, "cc_builds") >= 1, "cold: {cold}");
    assert_eq!(count(&cold, "cc_disk_hits"), 0, "cold: {cold}");
    assert_eq!(count(&warm, "cc_builds"), 0, "warm: {warm}");
    assert!(count(&warm, "cc_disk_hits") >= 1, "warm: {warm}");
}
