//! Where a tensor lives, and the hook through which a device runtime plugs into the core.
//!
//! CUDA is detected, never assumed (DESIGN.md invariant 6), and the core knows nothing of CUDA (layers
//! point downward): a higher crate (kiln-cuda) implements [`DeviceRuntime`] and registers it with
//! [`register_runtime`]. `dispatch::apply` hands every prim whose operands live on a device to that
//! runtime; view prims (permute, expand, slice, reshape of a viewable layout) never reach it, the core
//! re-lays them over the same buffer as it does on the CPU.

use std::any::Any;
use std::sync::{Arc, RwLock};

use crate::prim::{OutMeta, Prim};
use crate::shape::Layout;
use crate::storage::CpuStorage;
use crate::{DType, Error, Result, Tensor};

/// A convolution of a compiled function, as `DeviceRuntime::generated_convs` weighs it: the
/// prim, its operands' shapes and dtypes, and how many times the function runs it.
#[derive(Clone, Debug)]
pub struct ConvUse {
    pub prim: Prim,
    pub operands: Vec<(Vec<usize>, DType)>,
    pub count: usize,
}

impl ConvUse {
    /// Its operands' shapes, in order.
    pub fn shapes(&self) -> Vec<&[usize]> {
        self.operands.iter().map(|(s, _)| s.as_slice()).collect()
    }

    /// Its operands' dtypes, in order.
    pub fn dtypes(&self) -> Vec<DType> {
        self.operands.iter().map(|&(_, d)| d).collect()
    }

    /// Zeros of its operands' shapes and dtypes on `device`: what a warm-up or a timing runs it
    /// on.
    pub fn zeros_on(&self, device: Device) -> Result<Vec<Tensor>> {
        self.operands
            .iter()
            .map(|(shape, dtype)| Tensor::zeros_on(shape, *dtype, device))
            .collect()
    }
}

/// How a compiled graph's extern step asks its runtime to run a prim
/// (`DeviceRuntime::execute_routed`, `prepare`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// As eager execution runs it (`execute`).
    Eager,
    /// As max-autotune's steps run their GEMMs and convolutions: the runtime may time its
    /// implementations of the prim at a shape's first call and keep the fastest (kiln-cuda:
    /// cuBLAS's and cuBLASLt's GEMM algorithms, cuDNN's engines, kiln's generated
    /// convolutions). The result may then differ from `execute`'s by rounding.
    Tuned,
    /// A convolution of a compiled function that chose the runtime's own generated kernels
    /// (`DeviceRuntime::generated_convs`).
    Generated,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// A buffer of elements in a device's memory, owned by the runtime that allocated it. The core only
/// shares it between views and asks the runtime to read or write it; freeing happens on drop (the
/// runtime's caching allocator takes the memory back).
pub trait DeviceBuffer: Send + Sync + Any {
    fn device(&self) -> Device;
    fn dtype(&self) -> DType;
    /// Capacity in elements.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device address of element 0: generated kernels take it as an argument, and the
    /// compiler compares address ranges to decide whether a write in place is safe.
    fn address(&self) -> u64;
    /// For the owning runtime to recover its own buffer type.
    fn as_any(&self) -> &dyn Any;
}

/// Work recorded from a device's stream (`DeviceRuntime::begin_capture`), replayed as one
/// launch: CUDA graphs. Buffers allocated while recording belong to it while it lives (a replay
/// writes them again).
pub trait DeviceGraph: Send + Sync {
    /// Queues the recorded work again, on the same buffers.
    fn replay(&self) -> Result<()>;
}

/// Most parameters one generated kernel launch takes, eight bytes each: 4 KiB of arguments, what
/// every CUDA driver accepts. The compiler's horizontal kernels are packed up to it.
pub const MAX_KERNEL_PARAMS: usize = 512;

/// When a reduction on a GPU is split in two passes: a few output elements over long rows
/// (batch norm's per-channel sums, a full sum) would give the device a few dozen blocks of
/// megabytes each, so each row is cut into chunks reduced side by side, then the chunks' partial
/// results are reduced in order. One policy for the eager kernels (kiln-cuda) and the generated
/// ones (kiln-inductor's `split_reduction.rs`), which each choose their chunks within it.
#[derive(Clone, Copy, Debug)]
pub struct ReduceSplit {
    /// Reductions with fewer output elements than this are split...
    pub few_rows: usize,
    /// ...when each output element reduces at least this many input elements.
    pub long_row: usize,
    /// Chunks are at least this long (shorter ones would spend more on the partials than they
    /// save).
    pub min_chunk: usize,
}

impl ReduceSplit {
    /// For a GPU of `sm_count` multiprocessors: split when the rows cannot give every
    /// multiprocessor two blocks.
    pub fn for_gpu(sm_count: u32) -> ReduceSplit {
        ReduceSplit {
            few_rows: 2 * sm_count.max(1) as usize,
            long_row: 1 << 16,
            min_chunk: 4096,
        }
    }

    /// The most chunks per row for `rows` output elements over `red` input elements each, or
    /// `None` when such a reduction is left whole: about `2 · few_rows` blocks in all (four per
    /// multiprocessor), no chunk shorter than `min_chunk`.
    pub fn most_chunks(&self, rows: usize, red: usize) -> Option<usize> {
        if rows == 0 || rows >= self.few_rows || red < self.long_row {
            return None;
        }
        Some((2 * self.few_rows).div_ceil(rows).min(red / self.min_chunk))
    }
}

/// A compiled generated kernel, loaded on its device (`DeviceRuntime::load_kernels`).
pub trait DeviceKernel: Send + Sync {
    /// Queues the kernel on its device's stream: `grid` blocks of `block` threads, each block
    /// with `shared` bytes of dynamic shared memory (at most the runtime's
    /// `shared_memory_per_block`), and `params` the kernel's arguments in order, each eight bytes
    /// (device addresses and 64-bit integers).
    fn launch(&self, grid: [u32; 3], block: u32, shared: u32, params: &[u64]) -> Result<()>;
}

/// Per unit, its kernels where they were loaded without compiling (`load_built_units`).
pub type BuiltUnits = Vec<Option<Vec<Arc<dyn DeviceKernel>>>>;

/// What a device runtime provides. All work is queued in order on the device's stream; the methods
/// that hand values to the host (`download`) wait for that work first, so a user who reads a value
/// (`to_vec`, `item`, printing) always sees the result of every op queued before.
pub trait DeviceRuntime: Send + Sync + 'static {
    /// For messages: "cuda".
    fn name(&self) -> &'static str;
    /// Copies host values onto `device` (contiguous, `data.len()` elements).
    fn upload(&self, device: Device, data: &CpuStorage) -> Result<Arc<dyn DeviceBuffer>>;
    /// The elements `layout` addresses in `buf`, in row-major order, as a contiguous host buffer.
    fn download(&self, buf: &Arc<dyn DeviceBuffer>, layout: &Layout) -> Result<CpuStorage>;
    /// Runs a (non-view) prim whose operands all live on `device` (none for creation prims; one
    /// CPU scalar where `takes_host_scalar` said so) and returns a fresh contiguous buffer of
    /// `meta`'s shape and dtype. `Prim::infer` has checked the operands.
    fn execute(
        &self,
        device: Device,
        prim: &Prim,
        inputs: &[&Tensor],
        meta: &OutMeta,
    ) -> Result<Arc<dyn DeviceBuffer>>;
    /// Whether `execute` takes `operand` of `prim` where it is: a CPU tensor that reads one
    /// element (a Rust number, a CPU scalar) whose value then rides in the launch's arguments,
    /// as PyTorch's wrapped numbers do, instead of a device buffer allocated and filled for it.
    /// Dispatch keeps at most one operand of a call on the host, and only where this says yes;
    /// every other CPU operand is copied onto the device first (the default: all of them).
    fn takes_host_scalar(&self, device: Device, prim: &Prim, operand: &Tensor) -> bool {
        let _ = (device, prim, operand);
        false
    }
    /// `execute` as a compiled graph's extern step asks for it (`Route`): tuned, as max-autotune
    /// runs its GEMMs and convolutions, or a convolution on the runtime's generated kernels.
    /// The default runs it as `execute` does.
    fn execute_routed(
        &self,
        device: Device,
        prim: &Prim,
        inputs: &[&Tensor],
        meta: &OutMeta,
        route: Route,
    ) -> Result<Arc<dyn DeviceBuffer>> {
        let _ = route;
        self.execute(device, prim, inputs, meta)
    }
    /// Readies `prim` on `device` for operands of `shapes` and `dtypes` without running it, as
    /// `execute_routed` will run it by `route`: loads what its first execution would. `true`
    /// when that is all a first execution would load (kiln-cuda: a convolution on kiln's
    /// generated kernels, whose module it loads), so a warm-up need not run it; `false` (the
    /// default) when only running it readies it (cuDNN loads its engines' kernels at their first
    /// launch).
    fn prepare(
        &self,
        device: Device,
        prim: &Prim,
        shapes: &[&[usize]],
        dtypes: &[DType],
        route: Route,
    ) -> Result<bool> {
        let _ = (device, prim, shapes, dtypes, route);
        Ok(false)
    }
    /// Whether a compiled function whose convolutions are `convs` runs them on the runtime's
    /// own generated kernels (`Route::Generated`) rather than as `execute` does (the default:
    /// `false`). kiln-cuda decides once per function, timing them if need be, and remembers it
    /// on disk.
    fn generated_convs(&self, device: Device, convs: &[&ConvUse]) -> Result<bool> {
        let _ = (device, convs);
        Ok(false)
    }
    /// Writes `src`'s elements into the positions `dst` addresses (same device, shape, dtype).
    fn assign(&self, dst: &Tensor, src: &Tensor) -> Result<()>;
    /// `assign` for each pair, all on `device`'s runtime, shapes and dtypes already matched
    /// (`Tensor::assign_many`). Runtimes copy many small tensors in a few launches where they can.
    fn assign_many(&self, pairs: &[(&Tensor, &Tensor)]) -> Result<()> {
        pairs.iter().try_for_each(|(d, s)| self.assign(d, s))
    }
    /// Waits for all work queued on `device`.
    fn synchronize(&self, device: Device) -> Result<()>;
    /// An uninitialized buffer of `len` elements (a generated kernel's output).
    fn empty(&self, device: Device, dtype: DType, len: usize) -> Result<Arc<dyn DeviceBuffer>>;
    /// Compiles generated source (one translation unit; the runtime caches by its text) and
    /// loads the kernels named `names` from it, in that order.
    fn load_kernels(
        &self,
        device: Device,
        source: &str,
        names: &[String],
    ) -> Result<Vec<Arc<dyn DeviceKernel>>>;
    /// `load_kernels` for each unit (source, kernel names) whose machine code is already built
    /// (loaded, or in the disk cache), `None` for each that would have to be compiled first. A
    /// warm start's units are loaded this way (kiln-cuda reads the cubins on a few threads and
    /// loads them on the calling one: CUDA's driver loads one module at a time, and more
    /// threads only wait for it), and only the misses go to compiler threads. The default:
    /// all `None`.
    fn load_built_units(
        &self,
        device: Device,
        units: &[(String, Vec<String>)],
    ) -> Result<BuiltUnits> {
        let _ = device;
        Ok(vec![None; units.len()])
    }
    /// An id of `source`'s built machine code on `device` by which `prefetch_units` loads it in
    /// another process, without the source (kiln-cuda: the source's hash and its cubin's key);
    /// `None` where the runtime keeps none.
    fn unit_id(&self, device: Device, source: &str) -> Option<String> {
        let _ = (device, source);
        None
    }
    /// Loads the units `ids` names (each with its kernel names, ids from `unit_id`), so that a
    /// later `load_built_units` of their sources finds them loaded: a warm start loads its units
    /// while the user's code is still being traced. Best effort: an id whose machine code is
    /// not on disk is skipped. The default: nothing.
    fn prefetch_units(&self, device: Device, ids: &[(String, Vec<String>)]) -> Result<()> {
        let _ = (device, ids);
        Ok(())
    }
    /// The multiprocessor count of `device` (generated kernels size their grids by it).
    fn multiprocessors(&self, device: Device) -> Result<u32>;
    /// The most dynamic shared memory, in bytes, one block of a generated kernel may be launched
    /// with on `device` (CUDA's opt-in limit: 227 KiB on Hopper). 48 KiB, which every CUDA
    /// device gives without opting in, where the runtime does not say.
    fn shared_memory_per_block(&self, device: Device) -> Result<u32> {
        let _ = device;
        Ok(48 * 1024)
    }
    /// Device time of `f`'s queued work: `f` runs once to warm up, then `reps` times, each between
    /// two device events (kiln-cuda empties the L2 cache before each, so a run reads its inputs
    /// from memory as it would in a model); the milliseconds per run. What max-autotune times
    /// candidate kernels with.
    /// Waits for the device. Runtimes without timing say "not supported" (the compiler then
    /// keeps its default kernels).
    fn time_launches(
        &self,
        device: Device,
        f: &mut dyn FnMut() -> Result<()>,
        reps: usize,
    ) -> Result<f64> {
        let _ = (f, reps);
        Err(Error::unsupported(
            "time_launches",
            format!("{device}'s runtime cannot time queued work"),
        ))
    }
    /// What tells `device`'s model apart for tuned choices kept on disk (name and architecture);
    /// `None` where the runtime cannot say.
    fn device_key(&self, device: Device) -> Option<String> {
        let _ = device;
        None
    }
    /// Starts recording the work queued on `device` instead of running it. Nothing may read
    /// values back to the host until `end_capture`.
    fn begin_capture(&self, device: Device) -> Result<()> {
        Err(Error::unsupported(
            "begin_capture",
            format!("{device}'s runtime cannot record work for replay"),
        ))
    }
    /// Ends the recording begun by `begin_capture`: the work, ready to replay. On `Err` nothing
    /// was recorded (and the stream runs work again).
    fn end_capture(&self, device: Device) -> Result<Arc<dyn DeviceGraph>> {
        Err(Error::unsupported(
            "end_capture",
            format!("{device}'s runtime cannot record work for replay"),
        ))
    }
}

/// The buffer of a traced (deferred) tensor on a device: it has no memory until the compiled
/// graph computes the value, which `Tensor::fill_deferred` puts here. Until then it reads as
/// empty; the tensor is deferred, so nothing reads it before it is filled.
pub(crate) struct PendingBuffer {
    pub(crate) device: Device,
    pub(crate) dtype: DType,
    pub(crate) len: usize,
    pub(crate) filled: std::sync::OnceLock<Arc<dyn DeviceBuffer>>,
}

impl DeviceBuffer for PendingBuffer {
    fn device(&self) -> Device {
        self.device
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn len(&self) -> usize {
        self.len
    }
    fn address(&self) -> u64 {
        self.filled.get().map_or(0, |b| b.address())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

static RUNTIME: RwLock<Option<Arc<dyn DeviceRuntime>>> = RwLock::new(None);

/// Installs the runtime that executes prims on non-CPU devices (kiln-cuda calls this from `init`).
/// A later registration replaces an earlier one.
pub fn register_runtime(rt: Arc<dyn DeviceRuntime>) {
    *RUNTIME.write().unwrap_or_else(|e| e.into_inner()) = Some(rt);
}

/// The runtime for `device`, or an error that says how to get one.
pub fn runtime_for(op: &'static str, device: Device) -> Result<Arc<dyn DeviceRuntime>> {
    RUNTIME
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .ok_or_else(|| Error::Device {
            op,
            lhs: Device::Cpu,
            rhs: device,
            msg: format!(
                "no runtime for {device} is registered: depend on the kiln-cuda crate and call \
                 kiln_cuda::init() (or kiln::cuda::init() through the facade) before using it"
            ),
        })
}

/// `torch.cuda.synchronize(device)`: waits for every op queued on `device`. A no-op on the CPU.
pub fn synchronize(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        d => runtime_for("synchronize", d)?.synchronize(d),
    }
}
