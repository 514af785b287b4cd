//! Where a slow measurement's CPU went, from Linux's `/proc`: the process's user and system time,
//! page faults and context switches, and each thread's CPU time, before and after. A cold compile
//! that took six times longer in one process than in another (DenseNet-121's, after the eager
//! steps) can then say whether its compile threads ran slower (user time), waited on memory
//! (system time, faults), or shared the cores with another thread of the process.
//!
//! Elsewhere than Linux every figure reads as zero and the report says so.

use std::collections::HashMap;
use std::time::Instant;

/// Clock ticks per second of `/proc`'s CPU times (`sysconf(_SC_CLK_TCK)`, 100 on Linux).
const TICKS: f64 = 100.0;

pub struct Snapshot {
    at: Instant,
    /// user, system (ticks); minor, major faults; user + system of waited-for children (the C
    /// compiler's processes)
    process: [u64; 5],
    /// voluntary, involuntary context switches
    switches: [u64; 2],
    /// thread id → (name, user + system ticks)
    threads: HashMap<String, (String, u64)>,
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The fields of a `stat` line after the `(comm)` one, so that field 3 of proc(5) is index 0.
fn stat_fields(line: &str) -> (String, Vec<u64>) {
    let (open, close) = (line.find('(').unwrap_or(0), line.rfind(')').unwrap_or(0));
    let name = line.get(open + 1..close).unwrap_or("").to_string();
    let rest = line.get(close + 1..).unwrap_or("");
    let fields = rest
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    (name, fields)
}

fn field(fields: &[u64], proc5_index: usize) -> u64 {
    // proc(5) numbers fields from 1; (comm) is field 2, so field k is at index k - 3
    fields.get(proc5_index - 3).copied().unwrap_or(0)
}

fn status_value(status: &str, key: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .map(|v| v.trim_start_matches(':').trim().to_string())
        .unwrap_or_default()
}

impl Snapshot {
    pub fn take() -> Snapshot {
        let (_, p) = stat_fields(&read("/proc/self/stat"));
        let status = read("/proc/self/status");
        let switches = ["voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"]
            .map(|k| status_value(&status, k).parse().unwrap_or(0));
        let mut threads = HashMap::new();
        if let Ok(dir) = std::fs::read_dir("/proc/self/task") {
            for entry in dir.flatten() {
                let tid = entry.file_name().to_string_lossy().to_string();
                let (name, f) = stat_fields(&read(&format!("/proc/self/task/{tid}/stat")));
                threads.insert(tid, (name, field(&f, 14) + field(&f, 15)));
            }
        }
        Snapshot {
            at: Instant::now(),
            process: [
                field(&p, 14),
                field(&p, 15),
                field(&p, 10),
                field(&p, 12),
                field(&p, 16) + field(&p, 17),
            ],
            switches,
            threads,
        }
    }

    /// What happened between `self` and now, as lines for stderr.
    pub fn report(&self, label: &str) -> String {
        let now = Snapshot::take();
        let wall = now.at.duration_since(self.at).as_secs_f64();
        let d = |k: usize| now.process[k].saturating_sub(self.process[k]);
        let secs = |t: u64| t as f64 / TICKS;
        let mut threads: Vec<(String, f64)> = now
            .threads
            .iter()
            .map(|(tid, (name, t))| {
                let was = self.threads.get(tid).map_or(0, |(_, t0)| *t0);
                (format!("{name}[{tid}]"), secs(t.saturating_sub(was)))
            })
            .filter(|(_, s)| *s > 0.0)
            .collect();
        threads.sort_by(|a, b| b.1.total_cmp(&a.1));
        let top: Vec<String> = threads
            .iter()
            .take(8)
            .map(|(n, s)| format!("{n} {s:.2}s"))
            .collect();
        // a thread pinned to fewer cores than the rest (an affinity some library set) shows here
        let mut affinities: Vec<(String, usize)> = Vec::new();
        for tid in now.threads.keys() {
            let a = status_value(
                &read(&format!("/proc/self/task/{tid}/status")),
                "Cpus_allowed_list",
            );
            match affinities.iter_mut().find(|(x, _)| *x == a) {
                Some((_, n)) => *n += 1,
                None => affinities.push((a, 1)),
            }
        }
        let affinities: Vec<String> = affinities
            .iter()
            .map(|(a, n)| format!("{a} ×{n}"))
            .collect();
        let status = read("/proc/self/status");
        let mem = read("/proc/meminfo");
        format!(
            "{label}: wall {wall:.2} s, CPU user {:.2} s sys {:.2} s (child processes {:.2} s), faults minor {} major {}, \
             context switches voluntary {} involuntary {}; threads now {} (busiest: {}); \
             allowed CPUs by thread {}; VmRSS {}; MemAvailable {}; loadavg {}",
            secs(d(0)),
            secs(d(1)),
            secs(d(4)),
            d(2),
            d(3),
            now.switches[0].saturating_sub(self.switches[0]),
            now.switches[1].saturating_sub(self.switches[1]),
            now.threads.len(),
            top.join(", "),
            affinities.join(", "),
            status_value(&status, "VmRSS"),
            status_value(&mem, "MemAvailable"),
            read("/proc/loadavg").trim(),
        )
    }
}
