//! The generated convolutions' modules (`conv_igemm.rs`'s mma.sync kernels, `conv_wgmma.rs`'s and
//! `conv_wgmma_wgrad.rs`'s Hopper kernels): each kernel is one NVRTC translation unit, built into
//! the disk cache once (the first build of a family starts its siblings' builds on threads of
//! their own) and loaded once per device and cache scope, so a launch costs one map lookup. Also
//! the weight gradients' fixed-order split sum, which both families' modules carry.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;

use kiln_core::{Error, Result};

use crate::buffer::CudaBuffer;
use crate::device::CudaDevice;

/// A weight gradient's partial sums added in a fixed order (`conv_split_sum`), appended to the
/// modules of both families' weight gradients.
pub(crate) const SPLIT_SUM: &str = include_str!("kernels/conv_split_sum.cu");

/// Adds the `splits` partial sums of `total` values each in `parts` into `out`, in the splits'
/// order, by `conv_split_sum` (`split_sum`, loaded from a weight gradient's module). The buffer
/// can go back to the pool once this returns: the pool orders its reuse on the stream.
pub(crate) fn sum_splits(
    dev: &CudaDevice,
    split_sum: sys::CUfunction,
    parts: &CudaBuffer,
    out: u64,
    total: usize,
    splits: usize,
) -> Result<()> {
    let (mut src, mut dst) = (parts.ptr, out);
    let (mut total_i, mut splits) = (total as i32, splits as i32);
    let mut params: [*mut c_void; 4] = [
        (&mut src as *mut u64).cast(),
        (&mut dst as *mut u64).cast(),
        (&mut total_i as *mut i32).cast(),
        (&mut splits as *mut i32).cast(),
    ];
    dev.launch(split_sum, total.div_ceil(256) as u32, 256, 0, &mut params)
}

/// One kernel of a family of generated convolutions.
pub(crate) trait ConvKernel: Copy + PartialEq + Send + 'static {
    /// The family's name, unique among families.
    const FAMILY: &'static str;
    /// What tells this kernel from its siblings, as a number (looked up at every launch, so no
    /// text is built for it).
    fn code(&self) -> u32;
    /// The kernel's entry point.
    fn name(&self) -> String;
    /// The module's whole text.
    fn source(&self) -> String;
    /// Dynamic shared memory a block takes.
    fn shared_bytes(&self) -> usize;
    /// Threads a block has.
    fn threads(&self) -> u32;
    /// Another entry point of the module the launch needs (`conv_split_sum`), if any.
    fn helper(&self) -> Option<&'static str>;
    /// The family's kernels `dev` can run: built together.
    fn siblings(dev: &CudaDevice) -> Vec<Self>;
}

/// A kernel per cache scope (a cold-compile measurement builds its own), device, family and code.
type Key = (u64, usize, &'static str, u32);
/// An NVRTC build of one kernel into the disk cache, run once by whichever thread asks first.
type Build = Arc<OnceLock<std::result::Result<(), String>>>;

/// Builds under way or done in this process.
static BUILDS: Mutex<Option<HashMap<Key, Build>>> = Mutex::new(None);
/// Kernels loaded.
static LOADED: Mutex<Option<HashMap<Key, Loaded>>> = Mutex::new(None);

/// A kernel loaded on a device.
#[derive(Clone, Copy)]
pub(crate) struct Loaded {
    pub(crate) kernel: sys::CUfunction,
    /// The module's helper (`ConvKernel::helper`), null without one.
    pub(crate) helper: sys::CUfunction,
    /// Blocks of the kernel one multiprocessor holds at once, by its registers and shared
    /// memory (a persistent grid's size per multiprocessor).
    pub(crate) resident: usize,
}

// SAFETY: CUDA functions are handles valid on any thread of the process while their module
// stays loaded (modules stay loaded for the process)
unsafe impl Send for Loaded {}

fn key<K: ConvKernel>(dev: &CudaDevice, spec: K) -> Key {
    (
        kiln_core::cache::scope_id(),
        dev.ordinal,
        K::FAMILY,
        spec.code(),
    )
}

/// `spec`'s kernel, loaded once per device and cache scope (a map lookup after the first call).
pub(crate) fn load<K: ConvKernel>(dev: &Arc<CudaDevice>, spec: K) -> Result<Loaded> {
    let key = key(dev, spec);
    if let Some(&loaded) = LOADED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .get(&key)
    {
        return Ok(loaded);
    }
    let err = |msg: String| Error::arg("conv2d", format!("generating {}: {msg}", spec.name()));
    built(dev, spec).map_err(err)?;
    // from the disk cache, where the build left it
    let mut names = vec![spec.name()];
    names.extend(spec.helper().map(str::to_string));
    let fs = crate::nvrtc::module_kernels(dev, &spec.source(), &names)?;
    let cu = |what: &'static str| move |e| crate::device::cu_err(what, dev.ordinal, e);
    use sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX;
    // SAFETY: a loaded function of the bound context (`module_kernels` bound it); the kernels'
    // sizes are within the opt-in limit of the devices their families run on
    unsafe {
        cudarc::driver::result::function::set_function_attribute(
            fs[0],
            MAX,
            spec.shared_bytes() as i32,
        )
    }
    .map_err(cu("cuFuncSetAttribute"))?;
    let mut resident = 0;
    // SAFETY: as above; an out-parameter
    unsafe {
        sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
            &mut resident,
            fs[0],
            spec.threads() as i32,
            spec.shared_bytes(),
        )
    }
    .result()
    .map_err(cu("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
    let loaded = Loaded {
        kernel: fs[0],
        helper: fs.get(1).copied().unwrap_or(std::ptr::null_mut()),
        resident: resident.max(1) as usize,
    };
    LOADED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(key, loaded);
    Ok(loaded)
}

/// Waits until `spec`'s kernel is in the disk cache, building it if no thread has. A kernel
/// that has to be built starts the builds of its family's other kernels not on disk, each on a
/// thread of its own: a model's convolutions want several, and built one after another at their
/// first calls they would add up their times (0.2-1.3 s each). Those threads only run NVRTC and
/// write files; no CUDA call, which a CUDA graph's capture elsewhere in the process could refuse.
fn built<K: ConvKernel>(dev: &Arc<CudaDevice>, spec: K) -> std::result::Result<(), String> {
    // the build of `spec`, and whether this call made its slot
    let slot = |spec: K| -> (Build, bool) {
        let mut builds = BUILDS.lock().unwrap_or_else(|e| e.into_inner());
        match builds
            .get_or_insert_with(HashMap::new)
            .entry(key(dev, spec))
        {
            Entry::Occupied(e) => (e.get().clone(), false),
            Entry::Vacant(e) => (e.insert(Build::default()).clone(), true),
        }
    };
    let build = |dev: &CudaDevice, spec: K, b: &Build| {
        b.get_or_init(|| {
            crate::nvrtc::build(dev, &spec.name(), &spec.source()).map_err(|e| e.to_string())
        })
        .clone()
    };
    let (mine, first) = slot(spec);
    if first && !crate::nvrtc::on_disk(dev, &spec.source()) {
        for other in K::siblings(dev).into_iter().filter(|s| *s != spec) {
            let (b, first) = slot(other);
            if first && !crate::nvrtc::on_disk(dev, &other.source()) {
                let dev = dev.clone();
                std::thread::spawn(move || build(&dev, other, &b));
            }
        }
    }
    build(dev, spec, &mine)
}
