//! CUDA events on a device's stream: mark a point in the queued work, wait for it, or time the
//! device between two marks (`torch.cuda.Event(enable_timing=True)`).

use cudarc::driver::{result, sys};
use kiln_core::{Device, Result};

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

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is live and not used after this
        let _ = unsafe { result::event::destroy(self.ev) };
    }
}
