//! kiln-core's `DeviceRuntime` for CUDA: maps each prim to a generated kernel, cuBLAS, or the host
//! path, on the operands' device.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use kiln_core::device::{
    BuiltUnits, ConvUse, DeviceBuffer, DeviceGraph, DeviceKernel, DeviceRuntime, Route,
};
use kiln_core::prim::{OutMeta, Prim, ReduceOp};
use kiln_core::shape::Layout;
use kiln_core::storage::CpuStorage;
use kiln_core::{DType, Device, Error, Result, Tensor};

use crate::buffer::CudaBuffer;
use crate::device::CudaDevice;
use crate::generated::GeneratedKernel;
use crate::kernels::elementwise::{self as ew, Scalars};
use crate::kernels::{argreduce, index, movement, reduce, MAX_RANK};

pub(crate) struct CudaRuntime;

pub(crate) fn ordinal(op: &'static str, device: Device) -> Result<usize> {
    match device {
        Device::Cuda(n) => Ok(n),
        Device::Cpu => Err(Error::Device {
            op,
            lhs: device,
            rhs: Device::Cuda(0),
            msg: "the CUDA runtime was handed a CPU device".into(),
        }),
    }
}

fn cuda_buf<'a>(op: &'static str, b: &'a Arc<dyn DeviceBuffer>) -> Result<&'a CudaBuffer> {
    b.as_any()
        .downcast_ref::<CudaBuffer>()
        .ok_or_else(|| Error::Device {
            op,
            lhs: b.device(),
            rhs: b.device(),
            msg: "buffer was not allocated by kiln's CUDA runtime".into(),
        })
}

pub(crate) fn operand<'a>(op: &'static str, t: &'a Tensor) -> Result<(&'a CudaBuffer, &'a Layout)> {
    let b = t.device_buffer().ok_or_else(|| Error::Device {
        op,
        lhs: t.device(),
        rhs: Device::Cuda(0),
        msg: format!("operand of shape {:?} is not on a CUDA device", t.shape()),
    })?;
    Ok((cuda_buf(op, b)?, t.layout()))
}

/// An epilogue prim computed as the ops it stands for (`kiln_core::ops::epilogue`), on the
/// device, where the library has no fused call for it; the result's buffer as the prim's output
/// (its own when it is the tensor, contiguous from its start; else a contiguous copy's).
fn epilogue_as_ops(prim: &Prim, inputs: &[&Tensor]) -> Result<Arc<dyn DeviceBuffer>> {
    as_ops(prim, || kiln_core::ops::epilogue::as_ops(prim, inputs))
}

/// `prim`'s value computed by other prims (`ops`), as a contiguous device buffer.
fn as_ops(prim: &Prim, ops: impl FnOnce() -> Result<Tensor>) -> Result<Arc<dyn DeviceBuffer>> {
    let t = kiln_core::no_grad(ops)?;
    let t = match t.is_contiguous() && t.layout().offset == 0 {
        true => t,
        false => kiln_core::dispatch::apply(Prim::Contiguous, &[&t])?,
    };
    t.device_buffer().cloned().ok_or_else(|| Error::Device {
        op: prim.name(),
        lhs: t.device(),
        rhs: t.device(),
        msg: "the epilogue's ops gave no device buffer".into(),
    })
}

/// `(Σx, Σx²)` in f64 over `dims` of device tensor `x`, into tensors of the `kept` shape: each
/// one fused sum of x's widened values (`reduce::launch_f64_sum`), where the prims would first
/// write x in f64 and its square (the same values added in the same order).
fn f64_moment_sums(
    dev: &Arc<CudaDevice>,
    x: &Tensor,
    dims: &[usize],
    kept: &[usize],
) -> Result<(Tensor, Tensor)> {
    let (b, l) = operand("reduce_sumsqdev", x)?;
    let sum = |term| -> Result<Tensor> {
        let out = dev.alloc(kept.iter().product(), DType::F64)?;
        reduce::launch_f64_sum(dev, term, dims, b, l, &out)?;
        Ok(Tensor::from_device_buffer(
            Arc::new(out),
            Layout::contiguous(kept),
        ))
    };
    Ok((sum(reduce::Term::Value)?, sum(reduce::Term::Square)?))
}

impl CudaRuntime {
    /// `prim` on `device`, its GEMMs and convolutions as max-autotune's (`matmul_tune.rs`,
    /// `conv_graph.rs`'s timed plans) when `route` is `Tuned`, its convolutions on kiln's kernels
    /// when it is `Generated` (`conv::run`).
    fn run(
        &self,
        device: Device,
        prim: &Prim,
        inputs: &[&Tensor],
        meta: &OutMeta,
        route: Route,
    ) -> Result<Arc<dyn DeviceBuffer>> {
        let tuned = route == Route::Tuned;
        let name = prim.name();
        let dev = CudaDevice::get(ordinal(name, device)?)?;
        let n: usize = meta.shape.iter().product();
        let rank_ok = meta.shape.len() <= MAX_RANK && inputs.iter().all(|t| t.rank() <= MAX_RANK);
        // a CPU scalar this runtime took by value (`takes_host_scalar`): in the launch's arguments
        let host = inputs.iter().position(|t| t.device() == Device::Cpu);
        let by_value = match host {
            Some(j) => Scalars {
                value: inputs[j].host_scalar_f64()?,
                operand: Some((j, inputs[j].dtype())),
                ..Scalars::default()
            },
            None => Scalars::default(),
        };
        let ops = inputs
            .iter()
            .enumerate()
            .filter(|&(j, _)| Some(j) != host)
            .map(|(_, t)| operand(name, t))
            .collect::<Result<Vec<_>>>()?;
        let out_layout = Layout::contiguous(&meta.shape);
        let elementwise = |op: ew::Op, scalars: Scalars| -> Result<Arc<dyn DeviceBuffer>> {
            let out = dev.alloc(n, meta.dtype)?;
            ew::launch(&dev, &op, &ops, &out, &out_layout, scalars)?;
            Ok(Arc::new(out))
        };
        let dt = |i: usize| inputs[i].dtype();
        match prim {
            _ if !rank_ok => crate::fallback::run(&dev, prim, inputs),
            Prim::Unary(op) => elementwise(ew::Op::Unary(*op, dt(0)), Scalars::default()),
            Prim::Binary(op) => elementwise(ew::Op::Binary(*op, dt(0)), by_value),
            Prim::Where => elementwise(ew::Op::Where, by_value),
            Prim::Cast(_) | Prim::Contiguous => elementwise(ew::Op::Identity, Scalars::default()),
            Prim::Reshape(_) => {
                // not viewable: a contiguous copy in the input's own shape, re-laid by dispatch
                let (b, l) = ops[0];
                Ok(Arc::new(ew::copy_strided(&dev, b, l)?))
            }
            Prim::Full { value, .. } => elementwise(
                ew::Op::Full,
                Scalars {
                    value: *value,
                    ..Scalars::default()
                },
            ),
            Prim::Iota { .. } => elementwise(ew::Op::Iota, Scalars::default()),
            Prim::Rand {
                dist, seed, offset, ..
            } => elementwise(
                ew::Op::Rand(*dist),
                Scalars {
                    seed: *seed,
                    offset: *offset,
                    ..Scalars::default()
                },
            ),
            Prim::Reduce {
                op: ReduceOp::SumSqDev,
                dims,
            } => as_ops(prim, || {
                kiln_core::ops::reduce::sum_sq_dev_with(inputs[0], dims, |x| {
                    f64_moment_sums(&dev, x, dims, &meta.shape)
                })
            }),
            Prim::Reduce { op, dims } => {
                let out = dev.alloc(n, meta.dtype)?;
                let (b, l) = ops[0];
                reduce::launch(&dev, *op, dims, b, l, &out)?;
                Ok(Arc::new(out))
            }
            Prim::ArgReduce { op, dim } => {
                let out = dev.alloc(n, meta.dtype)?;
                let (b, l) = ops[0];
                argreduce::launch(&dev, *op, *dim, b, l, &out)?;
                Ok(Arc::new(out))
            }
            Prim::Pad { pads, value } => {
                let out = dev.alloc(n, meta.dtype)?;
                movement::pad(&dev, ops[0], pads, *value, &out, &meta.shape)?;
                Ok(Arc::new(out))
            }
            Prim::Cat { dim } => {
                let out = dev.alloc(n, meta.dtype)?;
                movement::cat(&dev, &ops, *dim, &out, &meta.shape)?;
                Ok(Arc::new(out))
            }
            Prim::Gather { dim } => {
                let out = dev.alloc(n, meta.dtype)?;
                index::gather(&dev, ops[0], ops[1], *dim, &out)?;
                Ok(Arc::new(out))
            }
            Prim::ScatterAdd { dim }
                if index::scatter_supported(meta.dtype)
                    && inputs[1].shape() == inputs[2].shape() =>
            {
                let out = dev.alloc(n, meta.dtype)?;
                index::scatter_add(&dev, ops[0], ops[1], ops[2], *dim, &out)?;
                Ok(Arc::new(out))
            }
            Prim::Conv2d(_) | Prim::Conv2dGradInput { .. } | Prim::Conv2dGradWeight { .. } => {
                match crate::conv::run(&dev, prim, inputs, meta, route)? {
                    Some(out) => Ok(out),
                    None => crate::fallback::run(&dev, prim, inputs),
                }
            }
            Prim::Conv2dEpilogue { .. } => match crate::conv::run(&dev, prim, inputs, meta, route)?
            {
                Some(out) => Ok(out),
                None => epilogue_as_ops(prim, inputs),
            },
            Prim::MatmulEpilogue(e) => {
                let Some(dims) = crate::matmul_lt::epilogue_dims(&ops) else {
                    return epilogue_as_ops(prim, inputs);
                };
                let out = dev.alloc(n, meta.dtype)?;
                let tuned_ran =
                    tuned && crate::matmul_tune::matmul_epilogue_tuned(&dev, &ops, dims, *e, &out)?;
                if !tuned_ran {
                    crate::matmul_lt::execute(&dev, &ops, dims, *e, &out)?;
                }
                crate::matmul_lt::count_epilogue_gemm();
                Ok(Arc::new(out))
            }
            Prim::Matmul if meta.dtype.is_float() => {
                let out = dev.alloc(n, meta.dtype)?;
                match tuned {
                    true => crate::matmul_tune::matmul_tuned(&dev, ops[0], ops[1], &out)?,
                    false => crate::matmul::matmul(&dev, ops[0], ops[1], &out)?,
                }
                Ok(Arc::new(out))
            }
            _ => crate::fallback::run(&dev, prim, inputs),
        }
    }
}

impl DeviceRuntime for CudaRuntime {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn upload(&self, device: Device, data: &CpuStorage) -> Result<Arc<dyn DeviceBuffer>> {
        let dev = CudaDevice::get(ordinal("to", device)?)?;
        Ok(Arc::new(dev.upload(data)?))
    }

    fn download(&self, buf: &Arc<dyn DeviceBuffer>, layout: &Layout) -> Result<CpuStorage> {
        let b = cuda_buf("to", buf)?;
        b.dev.download(b, layout)
    }

    fn execute(
        &self,
        device: Device,
        prim: &Prim,
        inputs: &[&Tensor],
        meta: &OutMeta,
    ) -> Result<Arc<dyn DeviceBuffer>> {
        self.run(device, prim, inputs, meta, Route::Eager)
    }

    /// A binary op's or `where`'s scalar operand, while no CUDA graph records on the device (a
    /// recorded launch would keep this call's value; the copy keeps its buffer's). Values an f64
    /// holds exactly: every dtype's, but int64's beyond 2^53.
    fn takes_host_scalar(&self, device: Device, prim: &Prim, operand: &Tensor) -> bool {
        if !matches!(prim, Prim::Binary(_) | Prim::Where) || operand.rank() > MAX_RANK {
            return false;
        }
        let exact = match operand.host_scalar_f64() {
            Ok(v) => operand.dtype() != DType::I64 || v.abs() < (1u64 << 53) as f64,
            Err(_) => false,
        };
        // last: the device's allocator lock
        exact
            && ordinal("cuda", device)
                .and_then(CudaDevice::get)
                .is_ok_and(|dev| dev.pool().capturing.is_none())
    }

    fn prepare(
        &self,
        device: Device,
        prim: &Prim,
        shapes: &[&[usize]],
        dtypes: &[DType],
        route: Route,
    ) -> Result<bool> {
        let dev = CudaDevice::get(ordinal("cuda", device)?)?;
        crate::conv::prepare(&dev, prim, shapes, dtypes, route)
    }

    fn generated_convs(&self, device: Device, convs: &[&ConvUse]) -> Result<bool> {
        let dev = CudaDevice::get(ordinal("conv2d", device)?)?;
        crate::conv_choice::function_choice(&dev, convs)
    }

    fn execute_routed(
        &self,
        device: Device,
        prim: &Prim,
        inputs: &[&Tensor],
        meta: &OutMeta,
        route: Route,
    ) -> Result<Arc<dyn DeviceBuffer>> {
        self.run(device, prim, inputs, meta, route)
    }

    fn assign(&self, dst: &Tensor, src: &Tensor) -> Result<()> {
        let (db, dl) = operand("assign", dst)?;
        let (sb, sl) = operand("assign", src)?;
        let dev = db.dev.clone();
        if dl.rank() > MAX_RANK {
            return Err(Error::unsupported(
                "assign",
                format!("CUDA tensors of rank {} (at most {MAX_RANK})", dl.rank()),
            ));
        }
        if dst.shares_storage(src) {
            // the source may overlap the destination: read it all before writing
            let tmp = ew::copy_strided(&dev, sb, sl)?;
            let tl = Layout::contiguous(&sl.shape);
            return ew::launch(
                &dev,
                &ew::Op::Identity,
                &[(&tmp, &tl)],
                db,
                dl,
                Scalars::default(),
            );
        }
        ew::launch(
            &dev,
            &ew::Op::Identity,
            &[(sb, sl)],
            db,
            dl,
            Scalars::default(),
        )
    }

    fn assign_many(&self, pairs: &[(&Tensor, &Tensor)]) -> Result<()> {
        let mut table: Vec<movement::RowCopy> = Vec::new();
        let mut table_of: Option<(Arc<CudaDevice>, DType)> = None;
        let mut rest: Vec<(&Tensor, &Tensor)> = Vec::new();
        let (mut writes, mut reads) = (Vec::new(), Vec::new());
        for &(dst, src) in pairs {
            let (db, dl) = operand("assign_many", dst)?;
            let (sb, sl) = operand("assign_many", src)?;
            if dl.numel() == 0 {
                continue;
            }
            writes.push(movement::bytes_touched(db, dl));
            reads.push(movement::bytes_touched(sb, sl));
            let fits = dl.is_contiguous()
                && sl.is_contiguous()
                && db.dtype == sb.dtype
                && table_of
                    .as_ref()
                    .map_or(true, |(d, t)| Arc::ptr_eq(d, &db.dev) && *t == db.dtype);
            if !fits {
                rest.push((dst, src));
                continue;
            }
            table_of.get_or_insert_with(|| (db.dev.clone(), db.dtype));
            table.push(movement::RowCopy {
                dst: db.at(dl.offset),
                src: sb.at(sl.offset),
                width: dl.numel() as i64,
            });
        }
        // one launch only where the pairs read as if written one after another
        if !movement::copies_commute(writes, &reads) {
            return pairs.iter().try_for_each(|(d, s)| self.assign(d, s));
        }
        if let Some((dev, dtype)) = table_of {
            movement::copy_rows(&dev, &table, movement::Rows::ONE, dtype.size_in_bytes())?;
        }
        rest.iter().try_for_each(|(d, s)| self.assign(d, s))
    }

    fn synchronize(&self, device: Device) -> Result<()> {
        CudaDevice::get(ordinal("synchronize", device)?)?.synchronize()
    }

    fn empty(&self, device: Device, dtype: DType, len: usize) -> Result<Arc<dyn DeviceBuffer>> {
        let dev = CudaDevice::get(ordinal("empty", device)?)?;
        Ok(Arc::new(dev.alloc(len, dtype)?))
    }

    fn load_kernels(
        &self,
        device: Device,
        source: &str,
        names: &[String],
    ) -> Result<Vec<Arc<dyn DeviceKernel>>> {
        let dev = CudaDevice::get(ordinal("compiled kernels", device)?)?;
        let fs = crate::nvrtc::module_kernels(&dev, source, names)?;
        Ok(generated_kernels(&dev, fs, names))
    }

    fn unit_id(&self, device: Device, source: &str) -> Option<String> {
        let dev = CudaDevice::get(ordinal("unit_id", device).ok()?).ok()?;
        Some(crate::nvrtc::unit_id(&dev, source))
    }

    fn prefetch_units(&self, device: Device, ids: &[(String, Vec<String>)]) -> Result<()> {
        let dev = CudaDevice::get(ordinal("prefetch_units", device)?)?;
        crate::nvrtc::prefetch_units(&dev, ids)
    }

    fn load_built_units(
        &self,
        device: Device,
        units: &[(String, Vec<String>)],
    ) -> Result<BuiltUnits> {
        let dev = CudaDevice::get(ordinal("compiled kernels", device)?)?;
        let built = crate::nvrtc::built_units(&dev, units)?;
        Ok(built
            .into_iter()
            .zip(units)
            .map(|(fs, (_, names))| fs.map(|fs| generated_kernels(&dev, fs, names)))
            .collect())
    }

    fn multiprocessors(&self, device: Device) -> Result<u32> {
        Ok(CudaDevice::get(ordinal("multiprocessors", device)?)?.sm_count)
    }

    fn shared_memory_per_block(&self, device: Device) -> Result<u32> {
        Ok(CudaDevice::get(ordinal("shared_memory_per_block", device)?)?.shared_per_block)
    }

    fn time_launches(
        &self,
        device: Device,
        f: &mut dyn FnMut() -> Result<()>,
        reps: usize,
    ) -> Result<f64> {
        // the first run pays for first-touch costs (module load, cache misses of the TLB)
        f()?;
        let dev = CudaDevice::get(ordinal("time_launches", device)?)?;
        Ok(f64::from(crate::event::time_cold(&dev, reps, f)?))
    }

    fn device_key(&self, device: Device) -> Option<String> {
        let dev = CudaDevice::get(ordinal("device_key", device).ok()?).ok()?;
        Some(format!("{} {} {}sm", dev.name, dev.arch, dev.sm_count))
    }

    fn begin_capture(&self, device: Device) -> Result<()> {
        crate::capture::begin(&CudaDevice::get(ordinal("begin_capture", device)?)?)
    }

    fn end_capture(&self, device: Device) -> Result<Arc<dyn DeviceGraph>> {
        crate::capture::end(&CudaDevice::get(ordinal("end_capture", device)?)?)
    }
}

/// Generated kernels over loaded functions, one per name.
fn generated_kernels(
    dev: &Arc<CudaDevice>,
    fs: Vec<cudarc::driver::sys::CUfunction>,
    names: &[String],
) -> Vec<Arc<dyn DeviceKernel>> {
    fs.into_iter()
        .zip(names)
        .map(|(f, name)| {
            Arc::new(GeneratedKernel {
                f,
                dev: dev.clone(),
                name: name.clone(),
                shared_opt_in: AtomicU32::new(0),
            }) as Arc<dyn DeviceKernel>
        })
        .collect()
}
