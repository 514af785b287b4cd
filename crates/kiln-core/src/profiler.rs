//! The profiler: while `profile(|| ...)` runs, every eager prim, compiled region, compiled
//! backward and generated kernel records a span (name, category, thread, start, duration). The
//! result is a table sorted by self time, like `torch.profiler`'s `key_averages().table()`, and a
//! Chrome trace (`chrome://tracing`, Perfetto) with one track per thread.
//!
//! When no profile is running, a span costs one relaxed atomic load: the hooks sit on the eager
//! dispatch path and on every replay of a compiled function.

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use crate::prim::Prim;
use crate::{Device, Error, Result};

static ACTIVE: AtomicBool = AtomicBool::new(false);
/// Whether spans on a device wait for it before they end (`profile_synchronized`).
static SYNCHRONIZED: AtomicBool = AtomicBool::new(false);
static EVENTS: Mutex<Vec<Event>> = Mutex::new(Vec::new());
/// One profile at a time: spans go to one global list.
static SESSION: Mutex<()> = Mutex::new(());
static NEXT_TID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static TID: Cell<u64> = const { Cell::new(0) };
    /// Profiles running on this thread: a profile inside another records into the outer one's
    /// list (it would wait for its own session forever).
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn thread_id() -> u64 {
    TID.with(|t| {
        if t.get() == 0 {
            t.set(NEXT_TID.fetch_add(1, Ordering::Relaxed));
        }
        t.get()
    })
}

/// What a span measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Category {
    /// One eager prim through the dispatcher (including externs a compiled graph calls).
    Op,
    /// One call of a compiled function (trace or replay), PyTorch's "Torch-Compiled Region".
    CompiledRegion,
    /// The compiled backward graph of a compiled region (PyTorch's `CompiledFunctionBackward`).
    CompiledBackward,
    /// One generated kernel.
    Kernel,
    /// A phase of compiling a captured graph (AOT autograd's partition, the backend's planning,
    /// building its kernels): where a cold start's time goes, as PyTorch's compile-time breakdown.
    Compile,
    /// Memory taken from a device's driver (cuMemAlloc), as PyTorch's profiler shows cudaMalloc.
    Memory,
}

impl Category {
    pub fn as_str(self) -> &'static str {
        match self {
            Category::Op => "op",
            Category::CompiledRegion => "compiled_region",
            Category::CompiledBackward => "compiled_backward",
            Category::Kernel => "kernel",
            Category::Compile => "compile",
            Category::Memory => "memory",
        }
    }
}

/// One recorded span.
#[derive(Clone, Debug)]
pub struct Event {
    pub name: Cow<'static, str>,
    pub category: Category,
    pub thread: u64,
    /// Nanoseconds since the process's first profile.
    pub start_ns: u64,
    pub dur_ns: u64,
}

/// Records a span from its creation to its drop, if a profile is running when it is created.
pub struct Span {
    name: Cow<'static, str>,
    category: Category,
    start: Instant,
    /// The device whose queue the span's work went to, waited for at the end of a synchronized
    /// profile.
    device: Device,
}

/// Whether a profile is running.
#[inline]
pub fn enabled() -> bool {
    ACTIVE.load(Ordering::Relaxed)
}

/// A span named by `name()` (called only while profiling), or `None`.
#[inline]
pub fn span(category: Category, name: impl FnOnce() -> Cow<'static, str>) -> Option<Span> {
    if !enabled() {
        return None;
    }
    Some(Span {
        name: name(),
        category,
        start: Instant::now(),
        device: Device::Cpu,
    })
}

/// A span of work queued on `device`: in a synchronized profile it ends when the device has
/// finished that work, so its time is the device's time, not the launch's.
#[inline]
pub fn span_on(
    category: Category,
    device: Device,
    name: impl FnOnce() -> Cow<'static, str>,
) -> Option<Span> {
    span(category, name).map(|mut s| {
        s.device = device;
        s
    })
}

impl Drop for Span {
    fn drop(&mut self) {
        if self.device != Device::Cpu && SYNCHRONIZED.load(Ordering::Relaxed) {
            // a failed wait surfaces at the caller's next synchronizing op; the span still ends
            let _ = crate::device::synchronize(self.device);
        }
        let end = Instant::now();
        let start_ns = self.start.saturating_duration_since(epoch()).as_nanos() as u64;
        let event = Event {
            name: std::mem::take(&mut self.name),
            category: self.category,
            thread: thread_id(),
            start_ns,
            dur_ns: end.saturating_duration_since(self.start).as_nanos() as u64,
        };
        if enabled() {
            EVENTS.lock().unwrap_or_else(|e| e.into_inner()).push(event);
        }
    }
}

/// The name an eager prim is reported under: the elementwise or reduction op itself (`exp`,
/// `add`, `sum`), not its family.
pub fn prim_label(p: &Prim) -> Cow<'static, str> {
    match p {
        Prim::Unary(op) => format!("{op:?}").to_lowercase().into(),
        Prim::Binary(op) => format!("{op:?}").to_lowercase().into(),
        Prim::Reduce { op, .. } => format!("reduce_{op:?}").to_lowercase().into(),
        other => other.name().into(),
    }
}

/// Runs `f` with the profiler on and returns its result with what was recorded. A profile inside
/// another on the same thread returns the spans that began within it (the outer one keeps them
/// too); a profile on another thread waits for the running one to end.
pub fn profile<R>(f: impl FnOnce() -> R) -> (R, Profile) {
    record(false, f)
}

/// `profile`, with every span of device work waiting for the device before it ends (what
/// `CUDA_LAUNCH_BLOCKING=1` does to PyTorch's profiler): each op's and kernel's time is then the
/// device's time for it, at the cost of the overlap between host and device that a normal run
/// has. The way to find which kernels a GPU step spends its time in.
pub fn profile_synchronized<R>(f: impl FnOnce() -> R) -> (R, Profile) {
    record(true, f)
}

fn record<R>(synchronized: bool, f: impl FnOnce() -> R) -> (R, Profile) {
    if DEPTH.get() > 0 {
        return nested(synchronized, f);
    }
    let _session = SESSION.lock().unwrap_or_else(|e| e.into_inner());
    epoch();
    EVENTS.lock().unwrap_or_else(|e| e.into_inner()).clear();
    SYNCHRONIZED.store(synchronized, Ordering::SeqCst);
    ACTIVE.store(true, Ordering::SeqCst);
    // stop recording even if `f` panics
    struct Stop;
    impl Drop for Stop {
        fn drop(&mut self) {
            ACTIVE.store(false, Ordering::SeqCst);
            SYNCHRONIZED.store(false, Ordering::SeqCst);
            DEPTH.set(0);
        }
    }
    let r = {
        let _stop = Stop;
        DEPTH.set(1);
        f()
    };
    let mut events = std::mem::take(&mut *EVENTS.lock().unwrap_or_else(|e| e.into_inner()));
    sort(&mut events);
    (r, Profile { events })
}

/// A profile inside a running one (same thread): `f` runs with spans synchronized if either
/// asks, and the profile is the spans that began during it, which stay in the outer list.
fn nested<R>(synchronized: bool, f: impl FnOnce() -> R) -> (R, Profile) {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            SYNCHRONIZED.store(self.0, Ordering::SeqCst);
            DEPTH.set(DEPTH.get() - 1);
        }
    }
    let was = SYNCHRONIZED.load(Ordering::SeqCst);
    let start_ns = Instant::now().saturating_duration_since(epoch()).as_nanos() as u64;
    let r = {
        let _restore = Restore(was);
        SYNCHRONIZED.store(was || synchronized, Ordering::SeqCst);
        DEPTH.set(DEPTH.get() + 1);
        f()
    };
    let mut events: Vec<Event> = EVENTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|e| e.start_ns >= start_ns)
        .cloned()
        .collect();
    sort(&mut events);
    (r, Profile { events })
}

/// Per thread, by start time, an enclosing span before the spans it contains.
fn sort(events: &mut [Event]) {
    events.sort_by_key(|e| (e.thread, e.start_ns, std::cmp::Reverse(e.dur_ns)));
}

/// A row of the profile table: every span of one name and category.
#[derive(Clone, Debug)]
pub struct Row {
    pub name: String,
    pub category: Category,
    pub calls: usize,
    pub total_ns: u64,
    /// Total minus the time of spans nested inside (on the same thread).
    pub self_ns: u64,
}

/// What one `profile` call recorded.
#[derive(Clone, Debug, Default)]
pub struct Profile {
    /// Per thread, by start time (an enclosing span before the spans it contains).
    pub events: Vec<Event>,
}

impl Profile {
    /// Each event's self time: its duration minus its direct children's, per thread.
    fn self_times(&self) -> Vec<u64> {
        let mut self_ns: Vec<u64> = self.events.iter().map(|e| e.dur_ns).collect();
        let mut stack: Vec<usize> = Vec::new();
        for (i, e) in self.events.iter().enumerate() {
            while let Some(&top) = stack.last() {
                let t = &self.events[top];
                if t.thread == e.thread && e.start_ns < t.start_ns + t.dur_ns {
                    break;
                }
                stack.pop();
            }
            if let Some(&parent) = stack.last() {
                self_ns[parent] = self_ns[parent].saturating_sub(e.dur_ns);
            }
            stack.push(i);
        }
        self_ns
    }

    /// One row per (name, category), sorted by self time, largest first.
    pub fn rows(&self) -> Vec<Row> {
        let self_ns = self.self_times();
        let mut rows: HashMap<(&str, Category), Row> = HashMap::new();
        for (e, s) in self.events.iter().zip(self_ns) {
            let row = rows.entry((&e.name, e.category)).or_insert_with(|| Row {
                name: e.name.to_string(),
                category: e.category,
                calls: 0,
                total_ns: 0,
                self_ns: 0,
            });
            row.calls += 1;
            row.total_ns += e.dur_ns;
            row.self_ns += s;
        }
        let mut rows: Vec<Row> = rows.into_values().collect();
        rows.sort_by(|a, b| b.self_ns.cmp(&a.self_ns).then(a.name.cmp(&b.name)));
        rows
    }

    /// The table, at most `limit` rows, sorted by self time.
    pub fn table(&self, limit: usize) -> String {
        let rows = self.rows();
        let total_self: u64 = rows.iter().map(|r| r.self_ns).sum::<u64>().max(1);
        let width = rows
            .iter()
            .take(limit)
            .map(|r| r.name.len())
            .max()
            .unwrap_or(4)
            .clamp(4, 60);
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<width$}  {:<17}  {:>7}  {:>11}  {:>7}  {:>11}  {:>11}",
            "name", "category", "calls", "self", "self %", "total", "avg"
        );
        for r in rows.iter().take(limit) {
            let name: String = r.name.chars().take(width).collect();
            let _ = writeln!(
                out,
                "{name:<width$}  {:<17}  {:>7}  {:>11}  {:>6.1}%  {:>11}  {:>11}",
                r.category.as_str(),
                r.calls,
                fmt_ns(r.self_ns),
                100.0 * r.self_ns as f64 / total_self as f64,
                fmt_ns(r.total_ns),
                fmt_ns(r.total_ns / r.calls.max(1) as u64),
            );
        }
        out
    }

    /// The Chrome trace event format (complete events, microseconds), one track per thread.
    pub fn chrome_trace(&self) -> String {
        let mut out = String::from("{\"traceEvents\":[");
        for (i, e) in self.events.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let _ = write!(
                out,
                "{{\"name\":\"{}\",\"cat\":\"{}\",\"ph\":\"X\",\"pid\":1,\"tid\":{},\"ts\":{:.3},\"dur\":{:.3}}}",
                json_escape(&e.name),
                e.category.as_str(),
                e.thread,
                e.start_ns as f64 / 1000.0,
                e.dur_ns as f64 / 1000.0
            );
        }
        out.push_str("],\"displayTimeUnit\":\"ns\"}");
        out
    }

    /// Writes `chrome_trace()` to `path`.
    pub fn save_chrome_trace(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.chrome_trace()).map_err(|e| {
            Error::arg(
                "save_chrome_trace",
                format!("cannot write {}: {e}", path.display()),
            )
        })
    }
}

fn fmt_ns(ns: u64) -> String {
    match ns {
        0..=9_999 => format!("{ns} ns"),
        10_000..=9_999_999 => format!("{:.1} us", ns as f64 / 1e3),
        10_000_000..=9_999_999_999 => format!("{:.1} ms", ns as f64 / 1e6),
        _ => format!("{:.2} s", ns as f64 / 1e9),
    }
}

fn json_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(thread: u64, start_ns: u64, dur_ns: u64, name: &'static str) -> Event {
        Event {
            name: name.into(),
            category: Category::Op,
            thread,
            start_ns,
            dur_ns,
        }
    }

    #[test]
    fn self_time_subtracts_direct_children_per_thread() {
        let p = Profile {
            events: vec![
                ev(1, 0, 100, "outer"),
                ev(1, 10, 30, "a"),
                ev(1, 15, 10, "inner"),
                ev(1, 50, 20, "a"),
                ev(2, 20, 500, "other thread"),
            ],
        };
        let rows: HashMap<String, Row> =
            p.rows().into_iter().map(|r| (r.name.clone(), r)).collect();
        assert_eq!(rows["outer"].self_ns, 100 - 30 - 20);
        assert_eq!(
            (rows["a"].calls, rows["a"].total_ns, rows["a"].self_ns),
            (2, 50, 40)
        );
        assert_eq!(rows["inner"].self_ns, 10);
        assert_eq!(rows["other thread"].self_ns, 500);
        assert_eq!(p.rows()[0].name, "other thread");
    }

    fn names(p: &Profile) -> Vec<&str> {
        p.events.iter().map(|e| e.name.as_ref()).collect()
    }

    /// A profile inside another on one thread returns what began within it, the outer one gets
    /// everything, and both end (it used to wait for the outer session forever); the profiler
    /// is off after both, and a panic inside the inner one leaves it off too.
    #[test]
    fn a_profile_inside_another_returns_its_own_spans() {
        let ((), outer) = profile(|| {
            drop(span(Category::Compile, || "before".into()));
            let ((), inner) = profile_synchronized(|| {
                assert!(SYNCHRONIZED.load(Ordering::SeqCst));
                drop(span(Category::Compile, || "within".into()));
            });
            assert!(
                !SYNCHRONIZED.load(Ordering::SeqCst),
                "the outer one's setting is back"
            );
            assert!(names(&inner).contains(&"within"));
            assert!(!names(&inner).contains(&"before"));
            drop(span(Category::Compile, || "after".into()));
        });
        for n in ["before", "within", "after"] {
            assert!(names(&outer).contains(&n), "{n}: {:?}", names(&outer));
        }
        assert!(!enabled());
        let panicked = std::panic::catch_unwind(|| {
            profile(|| profile(|| panic!("inside")));
        });
        assert!(panicked.is_err());
        assert!(!enabled());
        assert_eq!(DEPTH.get(), 0);
    }

    #[test]
    fn chrome_trace_escapes_names() {
        let p = Profile {
            events: vec![ev(1, 1500, 2000, "say \"hi\"\n")],
        };
        let t = p.chrome_trace();
        assert!(t.contains(r#""name":"say \"hi\"\u000a""#), "{t}");
        assert!(t.contains(r#""ts":1.500,"dur":2.000"#), "{t}");
    }
}
