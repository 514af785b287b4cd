//! CUDA events on a device's stream: mark a point in the queued work, wait for it, or time the
//! device between two marks (`torch.cuda.Event(enable_timing=True)`).

use std::sync::Arc;

use cudarc::driver::{result, sys};
use kiln_core::{DType, Device, Result};

use crate::device::{cu_err, CudaDevice};

pub struct Event {
    ev: sys::CUevent,
    ordinal: usize,
}

// SAFETY: an event handle is a process-wide driver object; the driver calls on it are thread-safe
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    /// Records an event after everything queued so far on `device`.
    pub fn record(device: Device) -> Result<Event> {
        let dev = CudaDevice::get(crate::runtime::ordinal("event", device)?)?;
        dev.bind()?;
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(|e| cu_err("cuEventCreate", dev.ordinal, e))?;
        let event = Event {
            ev,
            ordinal: dev.ordinal,
        };
        // SAFETY: both handles are live
        unsafe { result::event::record(ev, dev.stream) }
            .map_err(|e| cu_err("cuEventRecord", dev.ordinal, e))?;
        Ok(event)
    }

    /// Waits until the work before the event has run.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: the event is live
        unsafe { result::event::synchronize(self.ev) }
            .map_err(|e| cu_err("cuEventSynchronize", self.ordinal, e))
    }

    /// Device milliseconds from `self` to `later` (waits for `later`).
    pub fn elapsed_ms(&self, later: &Event) -> Result<f32> {
        later.synchronize()?;
        // SAFETY: both events are live and recorded
        unsafe { result::event::elapsed(self.ev, later.ev) }
            .map_err(|e| cu_err("cuEventElapsedTime", self.ordinal, e))
    }
}

/// Mean device milliseconds of `run` over `reps` runs, each started with the L2 cache holding none
/// of its operands (twice the cache's bytes of a scratch buffer zeroed first, outside the timed
/// span), as Triton's `do_bench` times candidates. Timed back to back, a GEMM's weights or a
/// kernel's inputs stay in L2 from one run to the next, which in a model they are not: a
/// batch-1 BERT layer's GEMMs read 2-9 MB of weights each, cold, and back to back the algorithms
/// that stream weights best lose to those that reuse them from cache.
pub(crate) fn time_cold(
    dev: &Arc<CudaDevice>,
    reps: usize,
    run: &mut dyn FnMut() -> Result<()>,
) -> Result<f32> {
    let device = Device::Cuda(dev.ordinal);
    let bytes = (2 * dev.l2_bytes).max(1 << 20);
    let scratch = dev.alloc(bytes, DType::U8)?;
    // every run queued before the host waits once, at the end
    let mut marks = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        dev.bind()?;
        // SAFETY: the scratch buffer is live and `bytes` long
        unsafe { result::memset_d8_async(scratch.ptr, 0, bytes, dev.stream) }
            .map_err(|e| cu_err("cuMemsetD8Async", dev.ordinal, e))?;
        let start = Event::record(device)?;
        run()?;
        marks.push((start, Event::record(device)?));
    }
    let mut total = 0.0;
    for (start, end) in &marks {
        total += start.elapsed_ms(end)?;
    }
    Ok(total / marks.len() as f32)
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is live and not used after this
        let _ = unsafe { result::event::destroy(self.ev) };
    }
}
