//! CUDA graphs: the work queued on a device's stream recorded once (stream capture) and replayed
//! with one launch, for `Mode::ReduceOverhead`. Blocks the allocator hands out while recording
//! belong to the graph (`alloc.rs`): a replay writes them again, so they are not reused by other
//! work while the graph lives.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{result, sys};
use kiln_core::device::DeviceGraph;
use kiln_core::{Device, Error, Result};

use crate::device::{cu_err, CudaDevice};

static NEXT_GRAPH: AtomicU64 = AtomicU64::new(1);

/// Starts recording `dev`'s stream (relaxed mode: allocating device memory while recording is
/// allowed, the allocator marks those blocks as the graph's). Until `end`, other threads' work
/// on the device is refused (`CudaDevice::recorder`).
pub(crate) fn begin(dev: &Arc<CudaDevice>) -> Result<()> {
    dev.bind()?;
    let mut pool = dev.pool();
    if pool.capturing.is_some() {
        return Err(Error::Device {
            op: "begin_capture",
            lhs: Device::Cuda(dev.ordinal),
            rhs: Device::Cuda(dev.ordinal),
            msg: "a graph is already being recorded on this device".into(),
        });
    }
    // SAFETY: the stream lives for the process
    unsafe {
        result::stream::begin_capture(
            dev.stream,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        )
    }
    .map_err(|e| cu_err("cuStreamBeginCapture", dev.ordinal, e))?;
    pool.capturing = Some(NEXT_GRAPH.fetch_add(1, Ordering::Relaxed));
    dev.recorder
        .store(crate::device::thread_token(), Ordering::Release);
    Ok(())
}

/// Ends the recording and instantiates it.
pub(crate) fn end(dev: &Arc<CudaDevice>) -> Result<Arc<dyn DeviceGraph>> {
    dev.bind()?;
    let id = dev.pool().capturing.take();
    // SAFETY: the stream is being captured (begin succeeded)
    let ended = unsafe { result::stream::end_capture(dev.stream) };
    // the stream records no more: other threads may queue work again
    dev.recorder.store(0, Ordering::Release);
    let Some(id) = id else {
        return Err(Error::Device {
            op: "end_capture",
            lhs: Device::Cuda(dev.ordinal),
            rhs: Device::Cuda(dev.ordinal),
            msg: "no graph is being recorded on this device".into(),
        });
    };
    let graph = match ended {
        Ok(g) => g,
        Err(e) => {
            dev.pool().release_graph(id);
            return Err(cu_err("cuStreamEndCapture", dev.ordinal, e));
        }
    };
    // SAFETY: `graph` was just captured; it is destroyed once instantiated
    let exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
    unsafe {
        let _ = result::graph::destroy(graph);
    }
    match exec {
        Ok(exec) => Ok(Arc::new(CudaGraph {
            exec,
            dev: dev.clone(),
            id,
        })),
        Err(e) => {
            dev.pool().release_graph(id);
            Err(cu_err("cuGraphInstantiate", dev.ordinal, e))
        }
    }
}

struct CudaGraph {
    exec: sys::CUgraphExec,
    dev: Arc<CudaDevice>,
    id: u64,
}

// SAFETY: a graph exec is a driver handle; launches bind the device's context and go to its
// stream, in order with every other launch there.
unsafe impl Send for CudaGraph {}
unsafe impl Sync for CudaGraph {}

impl DeviceGraph for CudaGraph {
    fn replay(&self) -> Result<()> {
        self.dev.bind()?;
        // SAFETY: the exec is alive; its buffers are owned by it (see `alloc.rs`) or by the
        // tensors its owner keeps
        unsafe { result::graph::launch(self.exec, self.dev.stream) }
            .map_err(|e| cu_err("cuGraphLaunch", self.dev.ordinal, e))
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // a replay may still be queued: wait before its blocks are handed out again
        let _ = self.dev.synchronize();
        // SAFETY: no replay is queued any more
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
        }
        self.dev.pool().release_graph(self.id);
    }
}
