//! max-autotune on a device: a generated kernel with several launch shapes
//! (`codegen::cuda::TuneConfig`), timed on the real buffers at its first launch, the fastest
//! kept for the life of the compiled graph and written to disk, so a later process (or a later
//! compile of the same kernel) launches the choice without timing again.
//!
//! Timing runs each candidate on scratch copies of the kernel's outputs: a kernel that updates
//! an input in place (`Alloc::InPlace`, an optimizer step) reads what it writes, and running it
//! repeatedly on live data would apply the update many times. Its inputs are never among its
//! outputs (planning and horizontal fusion keep them apart), so they are read unchanged.
//!
//! A choice is a file per kernel under `cache_root()/autotune/<device>/`, keyed by the name of
//! the kernel's default-shape version (the hash of its source) and the device model, written
//! atomically (temporary file, then rename). A file that cannot be read or names no candidate
//! of the kernel is ignored, and the kernel is timed again and the file rewritten. Where the
//! runtime cannot time work (`DeviceRuntime::time_launches` says not supported), the default
//! shape is launched and nothing is written.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use kiln_core::device::{runtime_for, DeviceKernel};
use kiln_core::{Device, Result, Tensor};

use super::pool;

/// Timed runs per candidate (after one warm-up run).
const REPS: usize = 10;

/// One launch shape of a kernel: the loaded kernel (the name is its source's hash) and its
/// launch dimensions.
#[derive(Clone)]
pub struct Candidate {
    pub kernel: Arc<dyn DeviceKernel>,
    pub name: String,
    pub grid: [u32; 3],
    pub block: u32,
    /// Bytes of dynamic shared memory per block.
    pub shared: u32,
}

/// A kernel whose launch shape is chosen at its first launch.
pub struct Tuned {
    device: Device,
    /// The candidates, the default shape first.
    candidates: Vec<Candidate>,
    /// Where the choice is written (`None`: the runtime cannot name its device).
    file: Option<PathBuf>,
    chosen: OnceLock<usize>,
}

/// What a persisted choice names: a candidate's kernel and launch dimensions.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Choice {
    pub name: String,
    pub grid: [u32; 3],
    pub block: u32,
}

impl Candidate {
    fn choice(&self) -> Choice {
        Choice {
            name: self.name.clone(),
            grid: self.grid,
            block: self.block,
        }
    }
}

/// The file holding the choice for the kernel whose default-shape name is `default_name`, on
/// the device model `device_key`.
pub fn choice_file(device_key: &str, default_name: &str) -> PathBuf {
    let dir: String = device_key
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    kiln_core::cache::cache_root()
        .join("autotune")
        .join(dir)
        .join(format!("{default_name}.json"))
}

/// The choice written in `file`, or `None` when there is none or it cannot be read as one.
pub fn read_choice(file: &std::path::Path) -> Option<Choice> {
    let text = std::fs::read_to_string(file).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let c = v.get("chosen")?;
    let name = c.get("name")?.as_str()?.to_string();
    let dims: Vec<u32> = c
        .get("grid")?
        .as_array()?
        .iter()
        .map(|d| d.as_u64().and_then(|d| u32::try_from(d).ok()))
        .collect::<Option<_>>()?;
    let grid: [u32; 3] = dims.try_into().ok()?;
    let block = u32::try_from(c.get("block")?.as_u64()?).ok()?;
    Some(Choice { name, grid, block })
}

/// Writes `chosen` (with every candidate's time, for whoever reads the file) atomically.
pub fn write_choice(
    file: &std::path::Path,
    device_key: &str,
    chosen: &Choice,
    times: &[(Choice, f64)],
) -> std::io::Result<()> {
    let entry =
        |c: &Choice| serde_json::json!({ "name": c.name, "grid": c.grid, "block": c.block });
    let v = serde_json::json!({
        "device": device_key,
        "chosen": entry(chosen),
        "timed_ms": times
            .iter()
            .map(|(c, t)| {
                let mut e = entry(c);
                e["ms"] = serde_json::json!(t);
                e
            })
            .collect::<Vec<_>>(),
    });
    kiln_core::cache::write_atomically(file, v.to_string().as_bytes())
}

/// The fastest of `n` candidates by `time` (milliseconds), with every time that was taken; a
/// candidate whose timing fails is passed over. `None` when none could be timed.
pub fn fastest(n: usize, mut time: impl FnMut(usize) -> Result<f64>) -> Option<(usize, Vec<f64>)> {
    let times: Vec<f64> = (0..n)
        .map(|i| {
            time(i)
                .ok()
                .filter(|t| t.is_finite())
                .unwrap_or(f64::INFINITY)
        })
        .collect();
    let best = (0..n)
        .filter(|&i| times[i].is_finite())
        .min_by(|&a, &b| times[a].total_cmp(&times[b]))?;
    Some((best, times))
}

impl Tuned {
    /// `candidates`: the default shape first. `device_key`: the runtime's name for the device
    /// model, for the choice file.
    pub fn new(
        device: Device,
        default_name: &str,
        device_key: Option<&str>,
        candidates: Vec<Candidate>,
    ) -> Tuned {
        Tuned {
            device,
            file: device_key.map(|k| choice_file(k, default_name)),
            candidates,
            chosen: OnceLock::new(),
        }
    }

    /// Launches the chosen shape on `params` (inputs then outputs, device addresses), choosing
    /// it first at the first launch (`outs`: the output tensors, copied for the timing).
    pub fn launch(&self, params: &[u64], inputs: &[u64], outs: &[Tensor]) -> Result<()> {
        let i = match self.chosen.get() {
            Some(&i) => i,
            None => {
                let i = self.choose(inputs, outs);
                *self.chosen.get_or_init(|| i)
            }
        };
        let c = &self.candidates[i];
        c.kernel.launch(c.grid, c.block, c.shared, params)
    }

    /// Times every candidate on `inputs` and scratch copies of `outs`; the default shape when
    /// timing is not possible.
    fn choose(&self, inputs: &[u64], outs: &[Tensor]) -> usize {
        let Ok(rt) = runtime_for("max-autotune", self.device) else {
            return 0;
        };
        let scratch: Result<Vec<Tensor>> = outs
            .iter()
            .map(|o| {
                let s = Tensor::empty_on(o.shape(), o.dtype(), self.device)?;
                s.assign(o)?;
                Ok(s)
            })
            .collect();
        let Ok(scratch) = scratch else { return 0 };
        let mut params = inputs.to_vec();
        for s in &scratch {
            match s.device_address() {
                Some(a) => params.push(a),
                None => return 0,
            }
        }
        let picked = fastest(self.candidates.len(), |i| {
            let c = &self.candidates[i];
            rt.time_launches(
                self.device,
                &mut || c.kernel.launch(c.grid, c.block, c.shared, &params),
                REPS,
            )
        });
        let Some((best, times)) = picked else {
            return 0;
        };
        pool::count(|s| s.kernels_tuned += 1);
        if let (Some(file), Some(key)) = (&self.file, rt.device_key(self.device)) {
            let timed: Vec<(Choice, f64)> = self
                .candidates
                .iter()
                .zip(&times)
                .filter(|(_, t)| t.is_finite())
                .map(|(c, &t)| (c.choice(), t))
                .collect();
            // a cache that cannot be written costs the next process a timing, nothing more
            let _ = write_choice(file, &key, &self.candidates[best].choice(), &timed);
        }
        best
    }
}

/// For a kernel with `candidates` (the default first): the persisted choice among them, if
/// `device_key`'s file for `default_name` names one.
pub fn persisted(
    device_key: Option<&str>,
    default_name: &str,
    candidates: &[Choice],
) -> Option<usize> {
    let chosen = read_choice(&choice_file(device_key?, default_name))?;
    candidates.iter().position(|c| *c == chosen)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Held by tests that point the (process-wide) cache folder at a folder of their own.
    pub(crate) static CACHE_ROOT: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn choice(name: &str, grid: u32, block: u32) -> Choice {
        Choice {
            name: name.into(),
            grid: [grid, 1, 1],
            block,
        }
    }

    #[test]
    fn the_fastest_timed_candidate_wins_and_failures_are_passed_over() {
        let ms = [3.0, 1.5, f64::NAN, 2.0];
        let (best, times) = fastest(4, |i| match i {
            3 => Err(kiln_core::Error::unsupported("time_launches", "failed")),
            _ => Ok(ms[i]),
        })
        .expect("some timed");
        assert_eq!(best, 1);
        assert!(times[2].is_infinite() && times[3].is_infinite());
        // a runtime that cannot time (the mock device): no choice, the caller keeps the default
        let none = fastest(3, |_| {
            Err(kiln_core::Error::unsupported("time_launches", "mock"))
        });
        assert!(none.is_none());
    }

    /// Records its launches' block sizes.
    struct Recorder(std::sync::Mutex<Vec<u32>>);
    impl DeviceKernel for Recorder {
        fn launch(&self, _: [u32; 3], block: u32, _: u32, _: &[u64]) -> Result<()> {
            self.0.lock().unwrap_or_else(|e| e.into_inner()).push(block);
            Ok(())
        }
    }

    /// Where no runtime can time the candidates (none is registered in these tests), the
    /// default shape is launched, every time, with no error and nothing counted as tuned.
    #[test]
    fn without_timing_the_default_shape_is_launched() {
        let k = Arc::new(Recorder(std::sync::Mutex::new(Vec::new())));
        let cand = |block| Candidate {
            kernel: k.clone(),
            name: "k".into(),
            grid: [4, 1, 1],
            shared: 0,
            block,
        };
        let t = Tuned::new(Device::Cuda(0), "k", None, vec![cand(256), cand(128)]);
        let before = pool::stats().kernels_tuned;
        for _ in 0..3 {
            t.launch(&[1, 2], &[1], &[]).expect("launch");
        }
        assert_eq!(*k.0.lock().expect("launches"), vec![256, 256, 256]);
        assert_eq!(pool::stats().kernels_tuned, before);
    }

    #[test]
    fn a_choice_is_written_read_back_and_a_damaged_file_is_ignored_then_rewritten() {
        let dir = std::env::temp_dir().join(format!("kiln-autotune-test-{}", std::process::id()));
        let _root = CACHE_ROOT.lock().unwrap_or_else(|e| e.into_inner());
        let _ = std::fs::remove_dir_all(&dir);
        kiln_core::cache::with_root(dir.clone(), || {
            let key = "Test GPU compute_90 132sm";
            let cands = vec![
                choice("k_a", 4224, 256),
                choice("k_b", 4224, 128),
                choice("k_b", 1056, 128),
            ];
            let file = choice_file(key, "k_a");
            assert!(file.starts_with(dir.join("autotune")));
            assert_eq!(
                persisted(Some(key), "k_a", &cands),
                None,
                "nothing written yet"
            );
            let times: Vec<(Choice, f64)> = cands.iter().cloned().zip([2.0, 1.0, 1.5]).collect();
            write_choice(&file, key, &cands[1], &times).expect("write");
            assert_eq!(read_choice(&file), Some(cands[1].clone()));
            assert_eq!(persisted(Some(key), "k_a", &cands), Some(1));
            // same name, other grid: not the candidate that was chosen
            assert_eq!(persisted(Some(key), "k_a", &cands[2..]), None);
            assert_eq!(
                persisted(None, "k_a", &cands),
                None,
                "no device key, no file"
            );
            assert_eq!(
                persisted(Some("Other GPU"), "k_a", &cands),
                None,
                "another device model"
            );
            for damaged in ["", "{\"chosen\": {\"name\": \"k_b\"", "[1,2]", "\u{0}\u{1}"] {
                std::fs::write(&file, damaged).expect("damage");
                assert_eq!(read_choice(&file), None, "{damaged:?}");
                assert_eq!(persisted(Some(key), "k_a", &cands), None);
            }
            write_choice(&file, key, &cands[2], &times).expect("rewrite");
            assert_eq!(persisted(Some(key), "k_a", &cands), Some(2));
            let leftovers: Vec<_> = std::fs::read_dir(file.parent().expect("dir"))
                .expect("list")
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().contains("tmp"))
                .collect();
            assert!(leftovers.is_empty(), "a temporary file was left behind");
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
}
