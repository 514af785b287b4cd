//! `Tensor`: a shared handle to a layout over a storage, plus autograd metadata.
//! Cloning a `Tensor` clones the handle (like a Python reference), never the data.

use std::panic::Location;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, RwLockReadGuard};

use crate::autograd::{GradEdge, Node};
use crate::device::PendingBuffer;
use crate::intercept::Deferred;
use crate::prim::Prim;
use crate::shape::Layout;
use crate::storage::{CpuStorage, Storage, StorageElement};
use crate::{DType, Device, Error, Result};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub(crate) struct TensorImpl {
    pub(crate) id: u64,
    pub(crate) layout: Layout,
    pub(crate) dtype: DType,
    pub(crate) device: Device,
    pub(crate) storage: Storage,
    pub(crate) requires_grad: AtomicBool,
    pub(crate) grad: Mutex<Option<Tensor>>,
    pub(crate) grad_fn: OnceLock<GradEdge>,
    /// Set while the values are not computed yet (a traced tensor); see `intercept.rs`.
    pub(crate) deferred: Mutex<Option<Arc<dyn Deferred>>>,
}

#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<TensorImpl>);

impl Tensor {
    pub(crate) fn from_parts(
        storage: Storage,
        layout: Layout,
        dtype: DType,
        grad_fn: Option<GradEdge>,
    ) -> Tensor {
        Tensor::from_parts_deferred(storage, layout, dtype, grad_fn, None)
    }

    /// `from_parts` with the producer of a deferred tensor's values, set as it is made (not
    /// through its lock afterwards: a trace makes one per recorded prim).
    fn from_parts_deferred(
        storage: Storage,
        layout: Layout,
        dtype: DType,
        grad_fn: Option<GradEdge>,
        deferred: Option<Arc<dyn Deferred>>,
    ) -> Tensor {
        Tensor(Arc::new(TensorImpl {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            layout,
            dtype,
            device: storage.device(),
            storage,
            requires_grad: AtomicBool::new(grad_fn.is_some()),
            grad: Mutex::new(None),
            grad_fn: grad_fn.map(OnceLock::from).unwrap_or_default(),
            deferred: Mutex::new(deferred),
        }))
    }

    /// A contiguous tensor owning `storage`.
    pub fn from_storage(storage: CpuStorage, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if storage.len() != n {
            return Err(Error::shape(
                "from_storage",
                format!(
                    "{} elements cannot fill shape {shape:?} ({n} elements)",
                    storage.len()
                ),
            ));
        }
        let dtype = storage.dtype();
        Ok(Tensor::from_parts(
            Storage::cpu(storage),
            Layout::contiguous(shape),
            dtype,
            None,
        ))
    }

    /// `torch.tensor(data).reshape(shape)`.
    pub fn from_vec<T: StorageElement>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        Tensor::from_storage(T::wrap(data), shape)
    }

    pub fn from_slice<T: StorageElement>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        Tensor::from_vec(data.to_vec(), shape)
    }

    /// A 0-dim tensor.
    pub fn scalar<T: StorageElement>(v: T) -> Tensor {
        Tensor::from_parts(
            Storage::cpu(T::wrap(vec![v])),
            Layout::contiguous(&[]),
            T::DTYPE,
            None,
        )
    }

    /// A unique id for this handle's tensor (not its storage). Views get new ids.
    pub fn id(&self) -> u64 {
        self.0.id
    }
    pub fn shape(&self) -> &[usize] {
        &self.0.layout.shape
    }
    pub fn dims(&self) -> &[usize] {
        self.shape()
    }
    pub fn strides(&self) -> &[usize] {
        &self.0.layout.strides
    }
    pub fn offset(&self) -> usize {
        self.0.layout.offset
    }
    pub fn layout(&self) -> &Layout {
        &self.0.layout
    }
    pub fn rank(&self) -> usize {
        self.0.layout.rank()
    }
    pub fn numel(&self) -> usize {
        self.0.layout.numel()
    }
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }
    pub fn device(&self) -> Device {
        self.0.device
    }
    pub fn is_contiguous(&self) -> bool {
        self.0.layout.is_contiguous()
    }
    /// Size of one dim, with negative indexing.
    pub fn size(&self, dim: isize) -> Result<usize> {
        let d = crate::shape::norm_dim("size", dim, self.rank())?;
        Ok(self.shape().get(d).copied().unwrap_or(1))
    }
    /// True when both handles view the same storage buffer.
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        self.0.storage.key() == other.0.storage.key()
    }
    /// The host buffer of a CPU tensor, locked for reading. Only CPU code calls this: dispatch sends
    /// device operands to their runtime, and every value reader in this file copies a device tensor to
    /// the host first; a device tensor that slipped through reads as an empty buffer.
    pub(crate) fn storage(&self) -> RwLockReadGuard<'_, CpuStorage> {
        static NO_HOST_BUFFER: RwLock<CpuStorage> = RwLock::new(CpuStorage::F32(Vec::new()));
        let lock = match &self.0.storage {
            Storage::Cpu(lock) => &**lock,
            Storage::Device(_) => {
                debug_assert!(
                    false,
                    "host storage of a {} tensor requested",
                    self.device()
                );
                &NO_HOST_BUFFER
            }
        };
        // A poisoned lock means a kernel panicked mid-write; the data is still the best we have.
        lock.read().unwrap_or_else(|e| e.into_inner())
    }
    /// The device buffer of a tensor on a device (`None` on the CPU, and for a traced tensor not
    /// computed yet), for device runtimes.
    pub fn device_buffer(&self) -> Option<&Arc<dyn crate::device::DeviceBuffer>> {
        match &self.0.storage {
            Storage::Device(b) => match b.as_any().downcast_ref::<PendingBuffer>() {
                Some(p) => p.filled.get(),
                None => Some(b),
            },
            Storage::Cpu(_) => None,
        }
    }
    /// A tensor over `buf` with `layout` (a device runtime's results; views use `dispatch`).
    pub fn from_device_buffer(buf: Arc<dyn crate::device::DeviceBuffer>, layout: Layout) -> Tensor {
        let dtype = buf.dtype();
        Tensor::from_parts(Storage::Device(buf), layout, dtype, None)
    }
    fn is_on_device(&self) -> bool {
        !matches!(self.0.storage, Storage::Cpu(_))
    }

    // ---- autograd metadata ----

    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad.load(Ordering::Relaxed)
    }
    /// `requires_grad_()`: marks a leaf as a parameter to differentiate against.
    pub fn set_requires_grad(&self, on: bool) -> Result<&Tensor> {
        if self.0.grad_fn.get().is_some() && !on {
            return Err(Error::Autograd(
                "requires_grad can only be turned off on leaf tensors; use detach()".into(),
            ));
        }
        if on && !self.dtype().is_float() {
            return Err(Error::Autograd(format!(
                "only floating-point tensors can require gradients, got {}",
                self.dtype()
            )));
        }
        self.0.requires_grad.store(on, Ordering::Relaxed);
        Ok(self)
    }
    /// Builder form of `set_requires_grad(true)`.
    pub fn with_grad(self) -> Result<Tensor> {
        self.set_requires_grad(true)?;
        Ok(self)
    }
    pub fn is_leaf(&self) -> bool {
        self.0.grad_fn.get().is_none()
    }
    pub(crate) fn grad_fn(&self) -> Option<&GradEdge> {
        self.0.grad_fn.get()
    }
    /// A new handle on the same values whose gradient flows to output `index` of `node`.
    pub(crate) fn with_grad_fn(&self, node: Arc<Node>, index: usize) -> Tensor {
        Tensor::from_parts(
            self.0.storage.clone(),
            self.0.layout.clone(),
            self.0.dtype,
            Some(GradEdge { node, index }),
        )
    }
    /// Gives a fresh (traced) tensor its autograd history in place.
    pub(crate) fn attach_grad_fn(&self, node: Arc<Node>, index: usize) {
        if self.0.grad_fn.set(GradEdge { node, index }).is_ok() {
            self.0.requires_grad.store(true, Ordering::Relaxed);
        }
    }
    /// The accumulated gradient of a leaf, if `backward` has reached it.
    pub fn grad(&self) -> Option<Tensor> {
        let g = self
            .0
            .grad
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let (Some(g), Some(i)) = (&g, crate::intercept::current()) {
            // a tracer must re-read `.grad` on every call, not keep this handle
            i.grad_read(self, g);
        }
        g
    }
    pub fn set_grad(&self, g: Option<Tensor>) {
        *self.0.grad.lock().unwrap_or_else(|e| e.into_inner()) = g;
    }
    pub fn zero_grad(&self) {
        self.set_grad(None);
    }
    /// A handle to the same data, cut from the autograd graph.
    pub fn detach(&self) -> Tensor {
        if self.is_deferred() || crate::intercept::current().is_some() {
            // traced code: record an identity under no_grad, so the graph carries the detach (a
            // new untracked handle would be taken for a constant and replayed stale)
            let id = crate::no_grad(|| {
                crate::dispatch::apply(crate::prim::Prim::Reshape(self.shape().to_vec()), &[self])
            });
            if let Ok(t) = id {
                return t;
            }
        }
        Tensor::from_parts(
            self.0.storage.clone(),
            self.0.layout.clone(),
            self.0.dtype,
            None,
        )
    }

    // ---- reading values ----

    /// All elements in row-major order, converted to `T`.
    #[track_caller]
    pub fn to_vec<T: StorageElement>(&self) -> Result<Vec<T>> {
        self.ready("to_vec", Location::caller())?;
        if self.is_on_device() {
            return self.to_device(Device::Cpu)?.to_vec();
        }
        let t = if self.dtype() == T::DTYPE {
            self.clone()
        } else {
            self.to_dtype(T::DTYPE)?
        };
        let s = t.storage();
        let data = T::view(&s)
            .ok_or_else(|| Error::dtype("to_vec", t.dtype(), "internal storage mismatch"))?;
        let mut out = Vec::with_capacity(t.numel());
        t.layout().for_each_offset(|o| out.push(data[o]));
        Ok(out)
    }
    /// Elements as f64, whatever the dtype (for tests and printing).
    #[track_caller]
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        self.ready("to_vec", Location::caller())?;
        if self.is_on_device() {
            return self.to_device(Device::Cpu)?.to_vec_f64();
        }
        let s = self.storage();
        let mut out = Vec::with_capacity(self.numel());
        self.layout().for_each_offset(|o| out.push(s.get_f64(o)));
        Ok(out)
    }
    /// Whether this is a CPU tensor whose elements are all one element of its storage (a 0-dim
    /// tensor, possibly expanded with zero strides, to an empty shape too).
    pub(crate) fn reads_one_host_element(&self) -> bool {
        let l = self.layout();
        let single = l
            .shape
            .iter()
            .zip(&l.strides)
            .all(|(&d, &s)| d <= 1 || s == 0);
        single && !self.is_on_device() && l.offset < self.storage().len()
    }
    /// The element of a CPU tensor that reads a single one (a 0-dim tensor, possibly expanded
    /// with zero strides, to an empty shape too), as f64, without copying: how a device runtime
    /// reads a scalar operand it takes by value (`DeviceRuntime::takes_host_scalar`).
    pub fn host_scalar_f64(&self) -> Result<f64> {
        let l = self.layout();
        if !self.reads_one_host_element() || self.is_deferred() {
            return Err(Error::shape(
                "host_scalar",
                format!(
                    "a CPU tensor reading one element, got shape {:?} strides {:?} on {}",
                    l.shape,
                    l.strides,
                    self.device()
                ),
            ));
        }
        Ok(self.storage().get_f64(l.offset))
    }
    /// The value of a one-element tensor.
    #[track_caller]
    pub fn item<T: StorageElement>(&self) -> Result<T> {
        if self.numel() != 1 {
            return Err(Error::shape(
                "item",
                format!(
                    "only one-element tensors can be converted to a scalar, got shape {:?}",
                    self.shape()
                ),
            ));
        }
        self.ready("item", Location::caller())?;
        Ok(self.to_vec::<T>()?[0])
    }

    /// Copies `src`'s values into this tensor's storage in place (PyTorch's `copy_` under `no_grad`).
    /// The tensor keeps its identity, so compiled graphs that read it as an input see the new values.
    /// While a tracer is installed the write is recorded (an input mutation of the graph).
    #[track_caller]
    pub fn assign(&self, src: &Tensor) -> Result<()> {
        if src.shape() != self.shape() {
            return Err(Error::shape(
                "assign",
                format!(
                    "cannot copy a tensor of shape {:?} into one of shape {:?}",
                    src.shape(),
                    self.shape()
                ),
            ));
        }
        let src = if src.dtype() == self.dtype() {
            src.clone()
        } else {
            src.to_dtype(self.dtype())?
        };
        if let Some(i) = crate::intercept::current() {
            if let Some(r) = i.assign(self, &src) {
                return r;
            }
        }
        let at = Location::caller();
        src.ready("assign", at)?;
        self.ready("assign", at)?;
        if self.is_on_device() || src.is_on_device() {
            return self.assign_across(&src);
        }
        if self.is_contiguous() && src.is_contiguous() && !self.shares_storage(&src) {
            // the common case (optimizer and running-stat updates): one memcpy, no staging copy
            let (n, from, to) = (self.numel(), src.offset(), self.offset());
            if n == 0 {
                return Ok(()); // an empty view may carry an offset past its buffer
            }
            let values = src.storage();
            let mut dst = self.host_write();
            crate::cpu::copy_range(&mut dst, to, &values, from, n);
            return Ok(());
        }
        let values = crate::cpu::materialize(&src);
        let mut dst = self.host_write();
        crate::cpu::write_strided(&mut dst, self.layout(), &values);
        Ok(())
    }

    /// `dst.assign(src)` for every pair (PyTorch's `torch._foreach_copy_`): what a multi-tensor
    /// optimizer writes back into its parameters. Every pair's shapes are checked, and its source
    /// converted to the destination's dtype and device, before any is written, so a bad pair is
    /// an `Err` that leaves all destinations as they were. The pairs on one device go to its
    /// runtime together, which copies the contiguous ones in a few launches instead of one each.
    #[track_caller]
    pub fn assign_many(pairs: &[(&Tensor, &Tensor)]) -> Result<()> {
        for (k, (dst, src)) in pairs.iter().enumerate() {
            if src.shape() != dst.shape() {
                return Err(Error::shape(
                    "assign_many",
                    format!(
                        "pair {k}: cannot copy a tensor of shape {:?} into one of shape {:?}",
                        src.shape(),
                        dst.shape()
                    ),
                ));
            }
        }
        if crate::intercept::current().is_some() {
            // a tracer records each write (input mutations of its graph); forcing the traced
            // values here would break its graph
            return pairs.iter().try_for_each(|(dst, src)| dst.assign(src));
        }
        let at = Location::caller();
        // each source in its destination's dtype and on its device, before anything is written
        let mut srcs = Vec::with_capacity(pairs.len());
        for (dst, src) in pairs {
            src.ready("assign_many", at)?;
            dst.ready("assign_many", at)?;
            let mut s = (*src).clone();
            if s.dtype() != dst.dtype() {
                s = s.to_dtype(dst.dtype())?;
            }
            if s.device() != dst.device() {
                s = s.to_device(dst.device())?;
            }
            srcs.push(s);
        }
        let mut by_device: Vec<(Device, Vec<(&Tensor, &Tensor)>)> = Vec::new();
        for ((dst, _), src) in pairs.iter().zip(&srcs) {
            if !dst.is_on_device() {
                dst.assign(src)?;
                continue;
            }
            match by_device.iter_mut().find(|(d, _)| *d == dst.device()) {
                Some((_, v)) => v.push((dst, src)),
                None => by_device.push((dst.device(), vec![(dst, src)])),
            }
        }
        for (device, group) in by_device {
            crate::device::runtime_for("assign_many", device)?.assign_many(&group)?;
        }
        Ok(())
    }

    /// The host buffer of a CPU tensor, locked for writing (callers checked the device).
    fn host_write(&self) -> std::sync::RwLockWriteGuard<'_, CpuStorage> {
        static NO_HOST_BUFFER: RwLock<CpuStorage> = RwLock::new(CpuStorage::F32(Vec::new()));
        match &self.0.storage {
            Storage::Cpu(lock) => lock.write(),
            Storage::Device(_) => NO_HOST_BUFFER.write(),
        }
        .unwrap_or_else(|e| e.into_inner())
    }

    /// `assign` where either side lives on a device: the source moves to the destination's device
    /// (a copy), then the destination's runtime writes it in place.
    fn assign_across(&self, src: &Tensor) -> Result<()> {
        let src = if src.device() == self.device() {
            src.clone()
        } else {
            src.to_device(self.device())?
        };
        if !self.is_on_device() {
            // a device source, now downloaded: an ordinary host write
            let values = crate::cpu::materialize(&src);
            let mut dst = self.host_write();
            crate::cpu::write_strided(&mut dst, self.layout(), &values);
            return Ok(());
        }
        crate::device::runtime_for("assign", self.device())?.assign(self, &src)
    }

    // ---- deferred values (see intercept.rs) ----

    /// A tensor on `device` whose values will be produced later by `source` (a traced tensor).
    pub fn deferred(
        shape: &[usize],
        dtype: DType,
        device: Device,
        source: Arc<dyn Deferred>,
    ) -> Tensor {
        let storage = match device {
            Device::Cpu => Storage::cpu(CpuStorage::full(dtype, 0, 0.0)),
            device => Storage::Device(Arc::new(PendingBuffer {
                device,
                dtype,
                len: shape.iter().product(),
                filled: OnceLock::new(),
            })),
        };
        Tensor::from_parts_deferred(
            storage,
            Layout::contiguous(shape),
            dtype,
            None,
            Some(source),
        )
    }
    pub fn is_deferred(&self) -> bool {
        self.0
            .deferred
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
    /// Forces a deferred tensor's values (a graph break while tracing); a no-op on ordinary tensors.
    pub fn ready(&self, why: &'static str, at: &'static Location<'static>) -> Result<()> {
        let source = self
            .0
            .deferred
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match source {
            Some(s) => s.force(self, why, at),
            None => crate::intercept::before_read(self, why, at),
        }
    }
    /// Gives a deferred tensor its values (and autograd history) from a computed `value` of the same
    /// shape and dtype. Called by the `Deferred` producer.
    pub fn fill_deferred(&self, value: &Tensor) -> Result<()> {
        if value.shape() != self.shape() || value.dtype() != self.dtype() {
            return Err(Error::shape(
                "fill_deferred",
                format!(
                    "value {:?} {} does not match deferred tensor {:?} {}",
                    value.shape(),
                    value.dtype(),
                    self.shape(),
                    self.dtype()
                ),
            ));
        }
        if value.device() != self.device() {
            return Err(Error::Device {
                op: "fill_deferred",
                lhs: self.device(),
                rhs: value.device(),
                msg: "a traced value was computed on another device than it was traced on".into(),
            });
        }
        match &self.0.storage {
            Storage::Cpu(_) => {
                let data = crate::cpu::materialize(value);
                *self.host_write() = data;
            }
            Storage::Device(pending) => {
                let Some(pending) = pending.as_any().downcast_ref::<PendingBuffer>() else {
                    return Err(Error::arg("fill_deferred", "device tensor is not deferred"));
                };
                let buf = device_contiguous(value)?;
                // a second fill (never made by the tracer) keeps the first value
                let _ = pending.filled.set(buf);
            }
        }
        if let Some(f) = value.grad_fn() {
            let _ = self.0.grad_fn.set(f.clone());
            self.0.requires_grad.store(true, Ordering::Relaxed);
        } else if value.requires_grad() {
            self.0.requires_grad.store(true, Ordering::Relaxed);
        }
        *self.0.deferred.lock().unwrap_or_else(|e| e.into_inner()) = None;
        Ok(())
    }

    /// `tensor.to(device)`: the same values on `device` (this handle when already there). Reading a
    /// device tensor back waits for the ops queued before (the runtime's `download` synchronizes).
    /// The copy is a new leaf: gradients do not flow across it yet.
    #[track_caller]
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        self.ready("to", Location::caller())?;
        let host = match self.device_buffer() {
            Some(buf) => {
                let rt = crate::device::runtime_for("to", self.device())?;
                let data = rt.download(buf, self.layout())?;
                Tensor::from_parts(
                    Storage::cpu(data),
                    Layout::contiguous(self.shape()),
                    self.dtype(),
                    None,
                )
            }
            None => self.clone(),
        };
        if device == Device::Cpu {
            return Ok(host);
        }
        let rt = crate::device::runtime_for("to", device)?;
        let data = crate::cpu::materialize(&host);
        let buf = rt.upload(device, &data)?;
        Ok(Tensor::from_device_buffer(
            buf,
            Layout::contiguous(self.shape()),
        ))
    }
    /// `torch.empty(shape, device=...)`: a contiguous tensor on `device` whose values are
    /// unspecified, for a producer that writes every element (a generated kernel).
    pub fn empty_on(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        if device == Device::Cpu {
            return Tensor::empty(shape, dtype);
        }
        let n = shape.iter().product();
        let buf = crate::device::runtime_for("empty", device)?.empty(device, dtype, n)?;
        Ok(Tensor::from_device_buffer(buf, Layout::contiguous(shape)))
    }
    /// `tensor.to(device)` (PyTorch's name; `to_device` is the same).
    #[track_caller]
    pub fn to(&self, device: Device) -> Result<Tensor> {
        self.to_device(device)
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor(shape={:?}, dtype={}, device={})",
            self.shape(),
            self.dtype(),
            self.device()
        )
    }
}

/// The buffer of a device tensor's elements laid out contiguously from element 0: its own buffer
/// when it already is, else a copy made by its runtime (not through `dispatch`, so no interceptor
/// sees it).
fn device_contiguous(t: &Tensor) -> Result<Arc<dyn crate::device::DeviceBuffer>> {
    let buf = t.device_buffer().ok_or_else(|| {
        Error::arg(
            "fill_deferred",
            "a device value has no buffer (a traced value not computed)",
        )
    })?;
    if t.is_contiguous() && t.offset() == 0 {
        return Ok(buf.clone());
    }
    let meta = crate::prim::OutMeta {
        shape: t.shape().to_vec(),
        dtype: t.dtype(),
    };
    crate::device::runtime_for("fill_deferred", t.device())?.execute(
        t.device(),
        &Prim::Contiguous,
        &[t],
        &meta,
    )
}
