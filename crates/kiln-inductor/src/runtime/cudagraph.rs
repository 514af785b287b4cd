//! `Mode::ReduceOverhead` on a device: a compiled graph's launches recorded once into a device
//! graph (CUDA graphs) and replayed with one launch per call, as PyTorch's cudagraph trees do.
//!
//! The first call runs normally (kernels load, libraries set up their workspaces). The second
//! records, reading where they lie the captured tensors (`Graph::static_inputs`: parameters,
//! buffers, optimizer state), which keep their storage from call to call and are read and
//! written where they are; what other recordings read or write at fixed addresses (a training
//! step's forward hands its backward the activations it saved — hundreds of megabytes a step,
//! which a replay of the forward writes at the same addresses every time, as PyTorch's
//! cudagraph trees share one memory pool between a forward and its backward — and the weights
//! it multiplied by); and, until a call passes another tensor there, the call's device
//! arguments themselves (the recording holds them, so their memory stays theirs: an inference
//! loop that fills one input tensor, or a benchmark, copies nothing). Such an input is read
//! where it lies for as long as the calls pass it; a call that passes another tensor in its
//! place records anew, and an argument that changed from call to call is from then on copied
//! into a buffer of the recording's before every replay, as are CPU scalars (PyTorch copies
//! every argument it was not told is static). Everything the recorded work allocates
//! belongs to the graph while it lives (kiln-cuda's allocator), so a replay writes the same
//! buffers again: an output of one call is overwritten by the next. That is PyTorch's contract;
//! a caller who still holds an output when the graph runs again gets a warning (once), telling
//! them to clone it.
//!
//! Graphs that draw random numbers, and graphs whose recording fails (work that reads values
//! back to the host, such as the host path of an op without a device kernel), run normally.

use std::sync::{Arc, Mutex, Once};

use kiln_compile::graph::Graph;
use kiln_compile::CompiledGraph;
use kiln_core::device::{runtime_for, DeviceGraph};
use kiln_core::{no_grad, Device, Result, Tensor, WeakTensor};

pub struct CudaGraphed {
    inner: Arc<dyn CompiledGraph>,
    device: Device,
    static_inputs: Vec<bool>,
    calls: Mutex<Calls>,
}

/// What the calls so far have left.
struct Calls {
    state: State,
    /// Per input: a call has passed a tensor other than the one recorded there, so a recording
    /// copies it instead of holding it.
    varies: Vec<bool>,
}

enum State {
    /// Not called yet: the first call runs normally.
    Fresh,
    /// Called once: the next call records. The arguments of the call before (when it ran
    /// without a recording), to see which the recording call passes anew.
    Warm(Vec<WeakTensor>),
    Recorded(Recording),
    /// Recording failed or cannot work here: every call runs normally.
    Off,
}

struct Recording {
    graph: Arc<dyn DeviceGraph>,
    /// What the recorded work reads: the graph's own buffers, or the static inputs and other
    /// recordings' outputs themselves.
    inputs: Vec<Tensor>,
    /// For each input: read where it lies (not copied into a buffer of the recording's).
    in_place: Vec<bool>,
    outputs: Vec<Tensor>,
    /// For each output: whether it is one of `inputs` (an in-place update), handed back as is.
    output_is_input: Vec<bool>,
    /// The handles last given to the caller, to see whether they are still held.
    handed_out: Vec<WeakTensor>,
}

impl CudaGraphed {
    pub fn new(inner: Arc<dyn CompiledGraph>, graph: &Graph) -> CudaGraphed {
        let device = graph.device();
        let cpu_output = graph
            .outputs
            .iter()
            .any(|&o| graph.nodes[o].device != device);
        // a recording would replay the same random numbers on every call; an output the caller
        // receives on the CPU is read back from the device, which a recording cannot do (as
        // PyTorch, which skips CUDA graphs for graphs with CPU tensors)
        let state = match graph.rng_span > 0 || cpu_output {
            true => State::Off,
            false => State::Fresh,
        };
        CudaGraphed {
            inner,
            device,
            static_inputs: graph.static_inputs.clone(),
            calls: Mutex::new(Calls {
                state,
                varies: vec![false; graph.num_inputs],
            }),
        }
    }

    fn is_static(&self, i: usize, t: &Tensor) -> bool {
        self.static_inputs.get(i).copied().unwrap_or(false) && t.device() == self.device
    }

    /// Marks as varying each argument that is not the tensor the call `before` passed there.
    fn note_varying(varies: &mut [bool], before: &[WeakTensor], inputs: &[Tensor]) {
        for ((w, t), v) in before.iter().zip(inputs).zip(varies.iter_mut()) {
            let same = w
                .upgrade()
                .is_some_and(|b| b.shares_storage(t) && b.layout() == t.layout());
            *v |= !same;
        }
    }

    /// Records one run, reading where they lie the static inputs, other recordings' outputs and
    /// the device arguments no call has varied; the rest from buffers of the recording's own.
    fn record(&self, inputs: &[Tensor], varies: &[bool]) -> Result<Recording> {
        let mut mine = Vec::with_capacity(inputs.len());
        let mut in_place = Vec::with_capacity(inputs.len());
        for (i, t) in inputs.iter().enumerate() {
            let on_device = t.device() == self.device;
            let read_there = self.is_static(i, t)
                || (on_device && recorded_elsewhere(t, self.id()))
                // held, unless it is this recording's own earlier output (the replay would
                // write it while reading it)
                || (on_device
                    && !varies.get(i).copied().unwrap_or(true)
                    && !recorded_by(t, self.id()));
            in_place.push(read_there);
            mine.push(match read_there {
                true => t.clone(),
                false => copy_to_device(t, self.device)?,
            });
        }
        let rt = runtime_for("reduce-overhead", self.device)?;
        rt.begin_capture(self.device)?;
        let run = self.inner.run(&mine);
        // the recording ends whatever happened, so the stream runs work again
        let graph = rt.end_capture(self.device);
        let (outputs, graph) = (run?, graph?);
        let output_is_input: Vec<bool> = outputs
            .iter()
            .map(|o| mine.iter().any(|m| m.same_tensor(o)))
            .collect();
        // what a later recording may read in place: this one's outputs, and the captured
        // tensors it reads there (a forward hands its backward the weights it multiplied by)
        let stable = outputs
            .iter()
            .zip(&output_is_input)
            .filter(|(_, &input)| !input)
            .map(|(o, _)| o)
            .chain(
                mine.iter()
                    .enumerate()
                    .filter(|&(i, t)| self.is_static(i, t))
                    .map(|(_, t)| t),
            );
        register_stable(stable, self.id());
        Ok(Recording {
            graph,
            inputs: mine,
            in_place,
            outputs,
            output_is_input,
            handed_out: Vec::new(),
        })
    }

    /// Copies the call's other inputs into the recording's buffers; false when an input read
    /// in place is not what was recorded (a parameter replaced, another argument, another tensor
    /// where a recording's output was): the recording is stale, and each argument that differs
    /// is marked as varying.
    fn load_inputs(&self, rec: &Recording, inputs: &[Tensor], varies: &mut [bool]) -> Result<bool> {
        let mut stale = false;
        for (i, (t, mine)) in inputs.iter().zip(&rec.inputs).enumerate() {
            let same = match (self.is_static(i, t), rec.in_place[i]) {
                (true, _) => t.same_tensor(mine),
                (false, true) => t.shares_storage(mine) && t.layout() == mine.layout(),
                (false, false) => t.shape() == mine.shape() && t.dtype() == mine.dtype(),
            };
            if !same {
                stale = true;
                if let Some(v) = varies.get_mut(i) {
                    *v = true;
                }
            }
        }
        if stale {
            return Ok(false);
        }
        for (i, (t, mine)) in inputs.iter().zip(&rec.inputs).enumerate() {
            if rec.in_place[i] {
                continue;
            }
            super::pool::count(|s| {
                s.replay_copied_bytes += super::pool::nbytes(t.shape(), t.dtype())
            });
            if t.device() == self.device {
                mine.assign(t)?;
            } else {
                mine.assign(&t.to_device(self.device)?)?;
            }
        }
        Ok(true)
    }

    fn replay(&self, rec: &mut Recording) -> Result<Vec<Tensor>> {
        if rec.handed_out.iter().any(|w| w.upgrade().is_some()) {
            static WARN: Once = Once::new();
            WARN.call_once(|| {
                eprintln!(
                    "kiln: an output of a reduce-overhead (CUDA graph) call is still held while \
                     the graph runs again, which overwrites it in place; clone outputs you keep \
                     across calls (`t.clone_data()`), as with PyTorch's CUDA graphs"
                )
            });
        }
        rec.graph.replay()?;
        super::pool::count(|s| s.graph_replays += 1);
        let mut out = Vec::with_capacity(rec.outputs.len());
        rec.handed_out.clear();
        for (o, &is_input) in rec.outputs.iter().zip(&rec.output_is_input) {
            if is_input {
                // an in-place update hands back the input itself (the caller skips its copy)
                out.push(o.clone());
            } else {
                let h = o.detach();
                rec.handed_out.push(h.downgrade());
                out.push(h);
            }
        }
        Ok(out)
    }
}

impl CudaGraphed {
    /// This wrapper's identity among the recordings of the process.
    fn id(&self) -> usize {
        self as *const CudaGraphed as usize
    }
}

/// Tensors the process's recordings write or read at the same addresses at every replay — their
/// outputs and the captured tensors they read in place — held weakly (a dropped recording's go
/// with it), with the recording they belong to.
fn stable_tensors() -> &'static Mutex<Vec<(usize, WeakTensor)>> {
    static STABLE: Mutex<Vec<(usize, WeakTensor)>> = Mutex::new(Vec::new());
    &STABLE
}

/// Notes `tensors` as recording `owner`'s stable tensors, in place of those it had.
fn register_stable<'a>(tensors: impl Iterator<Item = &'a Tensor>, owner: usize) {
    let mut all = stable_tensors().lock().unwrap_or_else(|e| e.into_inner());
    // a graph recorded anew, or dropped, no longer writes its old outputs
    all.retain(|(o, w)| *o != owner && w.upgrade().is_some());
    all.extend(tensors.map(|t| (owner, t.downgrade())));
}

/// Whether `t` lies in a stable tensor of a live recording other than `owner`'s (one that
/// reads its own outputs must copy them: the replay writes them while reading).
fn recorded_elsewhere(t: &Tensor, owner: usize) -> bool {
    stable_of(t, |o| o != owner)
}

/// Whether `t` lies in a stable tensor of `owner`'s recording (an output of its last one).
fn recorded_by(t: &Tensor, owner: usize) -> bool {
    stable_of(t, |o| o == owner)
}

fn stable_of(t: &Tensor, owned: impl Fn(usize) -> bool) -> bool {
    let all = stable_tensors().lock().unwrap_or_else(|e| e.into_inner());
    all.iter()
        .any(|(o, w)| owned(*o) && w.upgrade().is_some_and(|r| r.shares_storage(t)))
}

/// A new device buffer holding `t`'s values.
fn copy_to_device(t: &Tensor, device: Device) -> Result<Tensor> {
    let buf = Tensor::empty_on(t.shape(), t.dtype(), device)?;
    match t.device() == device {
        true => buf.assign(t)?,
        false => buf.assign(&t.to_device(device)?)?,
    }
    Ok(buf)
}

impl CompiledGraph for CudaGraphed {
    fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        no_grad(|| {
            let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
            let Calls { state, varies } = &mut *calls;
            if let State::Recorded(rec) = state {
                if self.load_inputs(rec, inputs, varies)? {
                    return self.replay(rec);
                }
                *state = State::Warm(Vec::new()); // stale: record again
            }
            match state {
                State::Fresh => {
                    *state = State::Warm(inputs.iter().map(Tensor::downgrade).collect());
                    drop(calls);
                    return self.inner.run(inputs);
                }
                State::Off => {
                    drop(calls);
                    return self.inner.run(inputs);
                }
                State::Warm(before) => Self::note_varying(varies, before, inputs),
                State::Recorded(_) => {}
            }
            match self.record(inputs, varies) {
                Ok(mut rec) => {
                    let out = self.replay(&mut rec);
                    *state = State::Recorded(rec);
                    out
                }
                Err(e) => {
                    static WARN: Once = Once::new();
                    WARN.call_once(|| {
                        eprintln!(
                            "kiln: a compiled graph could not be recorded as a CUDA graph \
                             ({e}); it runs without one"
                        )
                    });
                    *state = State::Off;
                    drop(calls);
                    self.inner.run(inputs)
                }
            }
        })
    }

    fn run_with_rng(&self, inputs: &[Tensor], rng: (u64, u64)) -> Result<Vec<Tensor>> {
        self.inner.run_with_rng(inputs, rng)
    }
}
