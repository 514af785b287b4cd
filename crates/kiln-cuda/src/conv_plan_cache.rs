//! cuDNN execution plans kept on disk, so a new process skips cuDNN's heuristics. Choosing a
//! plan by heuristics costs about 1.3 ms of host time per convolution shape on the H200 machine
//! (ResNet-18's inference: 11 shapes, 14.5 ms of a 33 ms warm start; its training step: 32
//! shapes, 25 ms); rebuilding a chosen plan from its JSON serialization (cuDNN's
//! `CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION`) skips that search.
//!
//! An entry lives under `<kiln cache>/cudnn/<key>.json` with a checksum beside it, written
//! atomically as the NVRTC cache's entries are (`nvrtc::store`). The key hashes everything the
//! plan was made for (`Spec`), the device and cuDNN's version. An entry that fails its checksum
//! or that cuDNN will not finalize is ignored and replaced by a plan made by heuristics.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::cudnn::sys as dsys;
use dsys::cudnnBackendAttributeName_t as A;
use dsys::cudnnBackendAttributeType_t as T;
use dsys::cudnnBackendDescriptorType_t as D;

use crate::conv_graph::{Desc, GraphPlan, Spec};

static DISK_HITS: AtomicUsize = AtomicUsize::new(0);

/// Convolution plans this process rebuilt from the disk cache instead of choosing them by
/// heuristics.
pub fn cudnn_plan_disk_hits() -> usize {
    DISK_HITS.load(Ordering::Relaxed)
}

/// Where `spec`'s plan for `device` (its name and architecture) is kept: the entry and its
/// checksum.
pub(crate) fn entry(spec: &Spec, device: &str) -> (PathBuf, PathBuf) {
    // SAFETY: a plain query of the loaded library
    let version = unsafe { dsys::cudnnGetVersion() };
    let key = crate::nvrtc::checksum(format!("{spec:?}|{device}|cudnn {version}").as_bytes());
    let dir = kiln_core::cache::cache_root().join("cudnn");
    (
        dir.join(format!("{key}.json")),
        dir.join(format!("{key}.json.xxh3")),
    )
}

/// The plan stored at `path`, rebuilt on `handle`; `None` when there is none, its checksum fails,
/// cuDNN refuses it, or it needs more workspace than `spec` allows.
pub(crate) fn load(
    handle: dsys::cudnnHandle_t,
    spec: &Spec,
    (path, sum_path): &(PathBuf, PathBuf),
) -> Option<GraphPlan> {
    let json = crate::nvrtc::read_verified(path, sum_path)?;
    let plan = Desc::new(D::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR).ok()?;
    plan.set(
        A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
        T::CUDNN_TYPE_HANDLE,
        &[handle],
    )
    .ok()?;
    plan.set(
        A::CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION,
        T::CUDNN_TYPE_CHAR,
        &json,
    )
    .ok()?;
    let plan = GraphPlan::rebuilt(plan.finalize().ok()?, spec)?;
    DISK_HITS.fetch_add(1, Ordering::Relaxed);
    Some(plan)
}

/// Stores `plan`'s serialization at `path`. A plan cuDNN cannot serialize, or a cache folder that
/// cannot be written, only costs the next process its heuristics.
pub(crate) fn store(plan: &GraphPlan, (path, sum_path): &(PathBuf, PathBuf)) {
    if let Some(json) = serialize(plan.descriptor()) {
        let _ = crate::nvrtc::store(path, sum_path, &json);
    }
}

/// A finalized plan's JSON text.
fn serialize(plan: &Desc) -> Option<Vec<u8>> {
    let json = |out: &mut [u8]| {
        plan.get(
            A::CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION,
            T::CUDNN_TYPE_CHAR,
            out,
        )
    };
    let len = json(&mut []).ok()?;
    if len == 0 {
        return None;
    }
    let mut buf = vec![0u8; len];
    let got = json(&mut buf).ok()?;
    buf.truncate(got.min(len));
    // the text ends at its NUL, if cuDNN counted one
    if let Some(end) = buf.iter().position(|&b| b == 0) {
        buf.truncate(end);
    }
    (!buf.is_empty()).then_some(buf)
}
