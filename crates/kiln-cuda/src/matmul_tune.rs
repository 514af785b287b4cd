//! max-autotune's GEMMs: `[B,M,K] x [B,K,N]` with the fastest of cuBLAS's default GEMM and the
//! algorithms cuBLASLt's heuristics offer for the shape (up to `CANDIDATES`), each timed on the
//! call's own operands the first time a shape is seen, with the L2 cache emptied before each run
//! (`event::time_cold`: in a model a GEMM's weights arrive from memory, not from the last run). The choice is kept for the process and written to disk
//! (`cache_root()/gemm/<key>.txt`, keyed by the shape, the operands' layouts, the dtype,
//! the math mode, the device model and the cuBLASLt version, with a checksum, atomically), so a
//! later process runs it without timing. A choice read from disk is checked by cuBLASLt
//! (`cublasLtMatmulAlgoCheck`) before it is used; one it refuses, or a damaged file, is timed
//! again. While the device records a CUDA graph nothing can be timed: a shape not timed in the
//! current cache scope takes a choice timed in another scope of the process, else cuBLAS's default
//! algorithm (`matmul::matmul`), as eager execution does.
//!
//! The algorithms compute the same sums in different orders, so a tuned GEMM agrees with eager
//! execution to rounding, not bit for bit (PyTorch's max-autotune likewise picks among GEMM
//! implementations by time).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublaslt::{result as lt, sys as ltsys};
use kiln_core::shape::Layout;
use kiln_core::{DType, Error, Result};

use crate::buffer::CudaBuffer;
use crate::device::CudaDevice;
use crate::matmul::{allow_tf32, gemm, operand};
use crate::matmul_lt::{launch, lt_handle, set_desc, Descs, Epilogue, Stored, WORKSPACE};

/// Algorithms asked of cuBLASLt's heuristics and timed per shape.
const CANDIDATES: usize = 8;
/// Timed runs per algorithm, after one untimed run.
const REPS: usize = 5;

const OP: &str = "matmul (max-autotune)";

static TIMED: AtomicUsize = AtomicUsize::new(0);
static DISK_HITS: AtomicUsize = AtomicUsize::new(0);

/// GEMM shapes this process timed algorithms for (max-autotune).
pub fn gemms_tuned() -> usize {
    TIMED.load(Ordering::Relaxed)
}

/// GEMM shapes whose algorithm this process read from the disk cache instead of timing.
pub fn gemm_tune_disk_hits() -> usize {
    DISK_HITS.load(Ordering::Relaxed)
}

/// What a choice is for: the device, the element type and math mode, the sizes, and how each
/// operand's matrices lie in memory (transposed?, leading dimension, batch stride).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    /// The fresh-cache scope (`kiln_core::cache::scope_id`): a cold compile measured in one
    /// finds no choice of the process's made outside it.
    scope: u64,
    ordinal: usize,
    dtype: DType,
    tf32: bool,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: (bool, i32, i64),
    b: (bool, i32, i64),
    /// What the GEMM applies before writing (a compiled graph's `Prim::MatmulEpilogue`).
    epilogue: Epilogue,
}

/// A cuBLASLt algorithm and the workspace it asked for, or (`algo: None`) cuBLAS's own GEMM as
/// eager execution runs it, which is timed among the candidates, so tuning never picks something
/// slower than the default.
#[derive(Clone, Copy)]
struct Choice {
    algo: Option<ltsys::cublasLtMatmulAlgo_t>,
    workspace: usize,
}

/// A shape's tuned GEMM: the choice and the cuBLASLt descriptors it runs with, built once, so a
/// call of a known shape only launches (a compiled graph runs its GEMMs on every call).
struct Tuned {
    choice: Choice,
    descs: Descs,
}

fn table() -> &'static Mutex<HashMap<Key, Arc<Tuned>>> {
    static TABLE: OnceLock<Mutex<HashMap<Key, Arc<Tuned>>>> = OnceLock::new();
    TABLE.get_or_init(Default::default)
}

/// The shape's tuned GEMM in the current cache scope; while the device records (nothing can be
/// timed then), one timed in another scope of the process (a cold compile measured in a fresh
/// one) serves too.
fn lookup(key: &Key, recording: bool) -> Option<Arc<Tuned>> {
    let t = table().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(tuned) = t.get(key) {
        return Some(tuned.clone());
    }
    if !recording {
        return None;
    }
    let same_but_scope = |k: &Key| {
        Key {
            scope: key.scope,
            ..*k
        } == *key
    };
    t.iter()
        .find(|(k, _)| same_but_scope(k))
        .map(|(_, v)| v.clone())
}

fn lt_err(dev: usize, what: &str, e: impl std::fmt::Debug) -> Error {
    crate::matmul_lt::lt_error(OP, dev, what, e)
}

/// `out = a @ b` for f32, f16 or bf16 operands with the algorithm timed fastest for the shape
/// (timed now when it has not been). Other dtypes and empty products run `matmul::matmul`, a
/// shape first seen while the device records cuBLAS's default GEMM.
pub(crate) fn matmul_tuned(
    dev: &Arc<CudaDevice>,
    (a, la): (&CudaBuffer, &Layout),
    (b, lb): (&CudaBuffer, &Layout),
    out: &CudaBuffer,
) -> Result<()> {
    let (batch, m, k, n) = (la.shape[0], la.shape[1], la.shape[2], lb.shape[2]);
    let dims_fit = [batch, m, n, k].iter().all(|&x| x <= i32::MAX as usize);
    if !matches!(a.dtype, DType::F32 | DType::F16 | DType::BF16)
        || batch * m * n * k == 0
        || !dims_fit
    {
        return crate::matmul::matmul(dev, (a, la), (b, lb), out);
    }
    let ma = operand(dev, a, la)?;
    let mb = operand(dev, b, lb)?;
    // cuBLAS's default GEMM of the same matrices (a strided operand is not copied again)
    let plain = || gemm(dev, a.dtype, (batch, m, n, k), (&ma, &mb), out);
    tuned_gemm(
        dev,
        (&ma, &mb),
        (Epilogue::None, 0),
        out,
        [batch, m, n, k],
        Some(&plain),
    )?;
    Ok(())
}

/// `Prim::MatmulEpilogue` (`[1, M, K] x [1, K, N] (+ [N])`) with the cuBLASLt algorithm timed
/// fastest for it among those its heuristics offer with the epilogue (cuBLAS's default GEMM
/// has none, so it is no candidate); its operands of `[m, k, n]` as
/// `matmul_lt::epilogue_dims` gave them. `false`, with nothing run, for what
/// `matmul_lt::execute` takes instead: a shape first seen while the device records, an empty
/// product.
pub(crate) fn matmul_epilogue_tuned(
    dev: &Arc<CudaDevice>,
    ops: &[(&CudaBuffer, &Layout)],
    [m, k, n]: [usize; 3],
    e: kiln_core::prim::Epilogue,
    out: &CudaBuffer,
) -> Result<bool> {
    if m * n == 0 {
        return Ok(false);
    }
    let ((a, la), (b, lb)) = (ops[0], ops[1]);
    let (bias, _bias_copy) =
        crate::matmul_lt::bias_address(dev, ops.get(2).copied().filter(|_| e.bias))?;
    let ma = operand(dev, a, la)?;
    let mb = operand(dev, b, lb)?;
    let epilogue = Epilogue::of(e);
    tuned_gemm(dev, (&ma, &mb), (epilogue, bias), out, [1, m, n, k], None)
}

/// `out = epilogue(a @ b)` with the shape's tuned choice (tuned now when there is none);
/// `plain`, cuBLAS's default GEMM, is a candidate when given (no epilogue) and what runs for a
/// shape first seen while the device records. `false` when nothing ran: no choice while
/// recording and no `plain`.
fn tuned_gemm(
    dev: &Arc<CudaDevice>,
    (ma, mb): (&crate::matmul::Mat, &crate::matmul::Mat),
    (epilogue, bias): (Epilogue, u64),
    out: &CudaBuffer,
    [batch, m, n, k]: [usize; 4],
    plain: Option<&dyn Fn() -> Result<()>>,
) -> Result<bool> {
    let key = Key {
        scope: kiln_core::cache::scope_id(),
        ordinal: dev.ordinal,
        dtype: out.dtype,
        tf32: out.dtype == DType::F32 && allow_tf32(),
        batch,
        m,
        n,
        k,
        a: (ma.trans, ma.ld, ma.batch_stride),
        b: (mb.trans, mb.ld, mb.batch_stride),
        epilogue,
    };
    // cuBLASLt's A is `b` and its B is `a` (row-major C = A B is column-major Cᵀ = Bᵀ Aᵀ)
    let ptrs = [mb.ptr, ma.ptr, out.ptr];
    let untuned = || match plain {
        Some(p) => p().map(|()| true),
        None => Ok(false),
    };
    let recording = dev.recorder.load(Ordering::Acquire) != 0;
    let tuned = match lookup(&key, recording) {
        Some(t) => t,
        None if recording => return untuned(),
        None => tune(dev, &key, ptrs, bias, plain)?,
    };
    let Some(algo) = &tuned.choice.algo else {
        return untuned();
    };
    let (_lock, handle) = lt_handle(dev)?;
    let err = |x| lt_err(dev.ordinal, "matmul", x);
    set_bias(&tuned.descs, epilogue, bias).map_err(err)?;
    // SAFETY: the pointers address live buffers of the sizes the key's layouts describe
    unsafe {
        launch(
            dev,
            handle,
            &tuned.descs,
            ptrs,
            algo,
            tuned.choice.workspace,
            err,
        )
    }?;
    Ok(true)
}

/// Points `descs` at the bias a call adds (under the cuBLASLt handle's mutex: the descriptors
/// are shared by every call of their key).
fn set_bias(
    descs: &Descs,
    epilogue: Epilogue,
    bias: u64,
) -> std::result::Result<(), lt::CublasError> {
    use ltsys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER;
    match epilogue.has_bias() {
        true => set_desc(descs.matmul, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias),
        false => Ok(()),
    }
}

/// The shape's choice read from disk, or timed on the call's operands (and written), kept in
/// the table with its descriptors.
fn tune(
    dev: &Arc<CudaDevice>,
    key: &Key,
    ptrs: [u64; 3],
    bias: u64,
    plain: Option<&dyn Fn() -> Result<()>>,
) -> Result<Arc<Tuned>> {
    let descs = descriptors(dev.ordinal, key)?;
    let choice = {
        let (_lock, handle) = lt_handle(dev)?;
        set_bias(&descs, key.epilogue, bias).map_err(|x| lt_err(dev.ordinal, "bias", x))?;
        let gemm = Gemm {
            dev,
            handle,
            descs: &descs,
            ptrs,
            plain,
        };
        match gemm.read_choice(key) {
            Some(c) => {
                DISK_HITS.fetch_add(1, Ordering::Relaxed);
                c
            }
            None => {
                let c = gemm.fastest()?;
                TIMED.fetch_add(1, Ordering::Relaxed);
                write_choice(dev, key, &c);
                c
            }
        }
    };
    let tuned = Arc::new(Tuned { choice, descs });
    table()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(*key, tuned.clone());
    Ok(tuned)
}

/// The cuBLASLt descriptors of `key`'s GEMM: its math, each operand's stored matrix (before its
/// transpose, column-major) with its batch stride, and a preference for the workspace allowed.
fn descriptors(o: usize, key: &Key) -> Result<Descs> {
    let ((a_trans, a_ld, a_stride), (b_trans, b_ld, b_stride)) = (key.a, key.b);
    let (m, n, k) = (key.m as u64, key.n as u64, key.k as u64);
    // each stored matrix as (rows, cols) column-major, before its transpose
    let stored = |trans: bool, (rows, cols): (u64, u64), ld: i64, batch_stride: i64| {
        let (rows, cols) = match trans {
            true => (cols, rows),
            false => (rows, cols),
        };
        Stored {
            rows,
            cols,
            ld,
            batch_stride,
        }
    };
    // cuBLASLt's first operand is `b`
    crate::matmul_lt::descriptors(
        o,
        (key.dtype, key.tf32),
        key.epilogue,
        [b_trans, a_trans],
        [
            stored(b_trans, (n, k), b_ld as i64, b_stride),
            stored(a_trans, (k, m), a_ld as i64, a_stride),
            stored(false, (n, m), n as i64, (key.m * key.n) as i64),
        ],
        key.batch,
    )
}

/// A GEMM being tuned: the device's cuBLASLt handle (its mutex held by the caller), the shape's
/// descriptors and the call's operands.
struct Gemm<'a> {
    dev: &'a Arc<CudaDevice>,
    handle: ltsys::cublasLtHandle_t,
    descs: &'a Descs,
    /// cuBLASLt's A, B and D (the call's `b`, `a` and output).
    ptrs: [u64; 3],
    /// cuBLAS's default GEMM of the same operands (`Choice::algo` `None`), where it computes
    /// the same (no epilogue).
    plain: Option<&'a dyn Fn() -> Result<()>>,
}

impl Gemm<'_> {
    /// The algorithms cuBLASLt's heuristics offer, best guess first.
    fn candidates(&self) -> Result<Vec<ltsys::cublasLtMatmulHeuristicResult_t>> {
        let l = &self.descs.layouts;
        // SAFETY: zeroed plain data, filled by cuBLASLt
        let mut results: Vec<ltsys::cublasLtMatmulHeuristicResult_t> =
            vec![unsafe { std::mem::zeroed() }; CANDIDATES];
        let mut count = 0;
        // SAFETY: live handle and descriptors; `results` holds CANDIDATES entries
        unsafe {
            ltsys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                self.descs.matmul,
                l[0],
                l[1],
                l[2],
                l[2],
                self.descs.pref,
                CANDIDATES as i32,
                results.as_mut_ptr(),
                &mut count,
            )
        }
        .result()
        .map_err(|x| lt_err(self.dev.ordinal, "heuristic", x))?;
        results.truncate(count.max(0) as usize);
        results.retain(|r| r.state == ltsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS);
        Ok(results)
    }

    /// Times each candidate on the call's operands (its output written each run) and returns the
    /// fastest.
    fn fastest(&self) -> Result<Choice> {
        let mut best: Option<(f32, Choice)> = None;
        let default = Choice {
            algo: None,
            workspace: 0,
        };
        // a shape cuBLASLt's heuristics refuse is left to the default
        let offered = self
            .candidates()
            .unwrap_or_default()
            .into_iter()
            .map(|r| Choice {
                algo: Some(r.algo),
                workspace: r.workspaceSize,
            });
        let default = self.plain.map(|_| default);
        for c in default.into_iter().chain(offered) {
            // an algorithm that fails to launch is skipped, not fatal
            if self.run(&c).is_err() {
                continue;
            }
            let ms = crate::event::time_cold(self.dev, REPS, &mut || self.run(&c))?;
            if best.as_ref().map_or(true, |(t, _)| ms < *t) {
                best = Some((ms, c));
            }
        }
        best.map(|(_, c)| c)
            .ok_or_else(|| lt_err(self.dev.ordinal, "heuristic", "no algorithm ran"))
    }

    /// `out = a @ b` with `c`'s algorithm, queued on the device's stream.
    fn run(&self, c: &Choice) -> Result<()> {
        let Some(algo) = &c.algo else {
            return match self.plain {
                Some(p) => p(),
                None => Err(lt_err(self.dev.ordinal, "matmul", "no default GEMM")),
            };
        };
        let err = |x| lt_err(self.dev.ordinal, "matmul", x);
        let (descs, ptrs) = (self.descs, self.ptrs);
        // SAFETY: the pointers address live buffers of the sizes the layouts describe
        unsafe { launch(self.dev, self.handle, descs, ptrs, algo, c.workspace, err) }
    }

    /// The choice kept on disk for `key`, if its checksum holds and cuBLASLt accepts it for these
    /// descriptors.
    fn read_choice(&self, key: &Key) -> Option<Choice> {
        let (path, sum_path) = entry(self.dev, key);
        let text = crate::nvrtc::read_verified(&path, &sum_path)?;
        let text = std::str::from_utf8(&text).ok()?;
        if text == "default" {
            self.plain?;
            return Some(Choice {
                algo: None,
                workspace: 0,
            });
        }
        let words: Vec<u64> = text
            .split_whitespace()
            .map(|w| u64::from_str_radix(w, 16).ok())
            .collect::<Option<_>>()?;
        let (data, workspace) = (words.get(..8)?, *words.get(8)? as usize);
        let mut algo = ltsys::cublasLtMatmulAlgo_t { data: [0; 8] };
        algo.data.copy_from_slice(data);
        let l = &self.descs.layouts;
        // SAFETY: zeroed plain data, filled by cuBLASLt
        let mut check: ltsys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: live handle and descriptors; `algo` came from this cuBLASLt version's output
        let ok = unsafe {
            ltsys::cublasLtMatmulAlgoCheck(
                self.handle,
                self.descs.matmul,
                l[0],
                l[1],
                l[2],
                l[2],
                &algo,
                &mut check,
            )
        };
        let fits = check.workspaceSize <= workspace && workspace <= WORKSPACE;
        (ok == ltsys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && fits).then_some(Choice {
            algo: Some(algo),
            workspace,
        })
    }
}

/// Writes `c` for `key`. A cache folder that cannot be written only costs the next process
/// its timing.
fn write_choice(dev: &CudaDevice, key: &Key, c: &Choice) {
    let (path, sum_path) = entry(dev, key);
    let text = match &c.algo {
        None => "default".to_string(),
        Some(algo) => {
            let mut words: Vec<String> = algo.data.iter().map(|w| format!("{w:016x}")).collect();
            words.push(format!("{:x}", c.workspace));
            words.join(" ")
        }
    };
    let _ = crate::nvrtc::store(&path, &sum_path, text.as_bytes());
}

/// Where `key`'s choice is kept, and its checksum: named by the key (the device's model in
/// place of its ordinal, no scope) and cuBLASLt's version.
fn entry(dev: &CudaDevice, key: &Key) -> (PathBuf, PathBuf) {
    // SAFETY: a plain query of the loaded library
    let version = unsafe { ltsys::cublasLtGetVersion() };
    let key = Key {
        scope: 0,
        ordinal: 0,
        ..*key
    };
    let name = crate::nvrtc::checksum(
        format!(
            "{key:?}|{} {} {}sm|cublasLt {version}",
            dev.name, dev.arch, dev.sm_count
        )
        .as_bytes(),
    );
    let dir = kiln_core::cache::cache_root().join("gemm");
    (
        dir.join(format!("{name}.txt")),
        dir.join(format!("{name}.txt.xxh3")),
    )
}
