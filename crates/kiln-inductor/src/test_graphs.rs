//! Graph builders for this crate's unit tests: f32 nodes on the GPU (`push`, `input`, `binary`)
//! or on the CPU (`cpu::*`), appended to a graph being built by hand.

use kiln_compile::graph::{Graph, Node, NodeId, Op};
use kiln_core::prim::{BinaryOp, Prim, ReduceOp, UnaryOp};
use kiln_core::{DType, Device};

/// An f32 node on `device`, appended to `g`.
pub(crate) fn push_on(
    g: &mut Graph,
    device: Device,
    op: Op,
    args: Vec<NodeId>,
    shape: &[usize],
) -> NodeId {
    g.push(Node {
        op,
        args,
        shape: shape.to_vec(),
        dtype: DType::F32,
        grad_enabled: false,
        requires_grad: false,
        device,
    })
}

/// The next graph input, on `device`.
pub(crate) fn input_on(g: &mut Graph, device: Device, shape: &[usize]) -> NodeId {
    g.push_input(shape, DType::F32, device, false)
}

pub(crate) fn push(g: &mut Graph, op: Op, args: Vec<NodeId>, shape: &[usize]) -> NodeId {
    push_on(g, Device::Cuda(0), op, args, shape)
}

pub(crate) fn input(g: &mut Graph, shape: &[usize]) -> NodeId {
    input_on(g, Device::Cuda(0), shape)
}

/// `a op b`, of `a`'s shape.
pub(crate) fn binary(g: &mut Graph, op: BinaryOp, a: NodeId, b: NodeId) -> NodeId {
    let shape = g.nodes[a].shape.clone();
    let device = g.nodes[a].device;
    push_on(g, device, Op::Prim(Prim::Binary(op)), vec![a, b], &shape)
}

/// `op(a)`, of `a`'s shape and device.
pub(crate) fn unary(g: &mut Graph, op: UnaryOp, a: NodeId) -> NodeId {
    let shape = g.nodes[a].shape.clone();
    let device = g.nodes[a].device;
    push_on(g, device, Op::Prim(Prim::Unary(op)), vec![a], &shape)
}

/// The sum of `a` over `dims` (kept, as size 1), on `a`'s device.
pub(crate) fn sum(g: &mut Graph, a: NodeId, dims: &[usize]) -> NodeId {
    let mut shape = g.nodes[a].shape.clone();
    for &d in dims {
        shape[d] = 1;
    }
    let device = g.nodes[a].device;
    let op = Op::Prim(Prim::Reduce {
        op: ReduceOp::Sum,
        dims: dims.to_vec(),
    });
    push_on(g, device, op, vec![a], &shape)
}

/// `a` broadcast to `shape`, on `a`'s device.
pub(crate) fn expand(g: &mut Graph, a: NodeId, shape: &[usize]) -> NodeId {
    let device = g.nodes[a].device;
    push_on(
        g,
        device,
        Op::Prim(Prim::Expand(shape.to_vec())),
        vec![a],
        shape,
    )
}

/// `a[start..end]` along `dim`, on `a`'s device.
pub(crate) fn slice(g: &mut Graph, a: NodeId, dim: usize, start: usize, end: usize) -> NodeId {
    let mut shape = g.nodes[a].shape.clone();
    shape[dim] = end - start;
    let device = g.nodes[a].device;
    let op = Op::Prim(Prim::Slice {
        dim,
        start,
        end,
        step: 1,
    });
    push_on(g, device, op, vec![a], &shape)
}

/// The kernels `t` plans for `g`, each with the number of values it writes.
pub(crate) fn kernels<T: crate::backend::Target>(t: &T, g: &Graph) -> Vec<(T::Kernel, usize)> {
    crate::backend::plan_graph(t, g)
        .into_iter()
        .filter_map(|p| match p {
            crate::backend::Planned::Kernel { kernel, outs } => Some((kernel, outs.len())),
            crate::backend::Planned::Extern { .. } => None,
        })
        .collect()
}

/// Adam's shape on `device`: per parameter shape, a step count bumped in place (a scalar kernel),
/// then the parameter updated in place reading the new count (`p - grad * count`). Inputs: a
/// scalar one, then per shape its count, parameter and gradient.
pub(crate) fn counted_updates(g: &mut Graph, device: Device, shapes: &[&[usize]]) {
    let one = input_on(g, device, &[]);
    for &shape in shapes {
        let (step_index, p_index) = (g.num_inputs, g.num_inputs + 1);
        let step = input_on(g, device, &[]);
        let p = input_on(g, device, shape);
        let grad = input_on(g, device, shape);
        let bumped = binary(g, BinaryOp::Add, step, one);
        g.mutated_inputs.push((g.outputs.len(), step_index));
        g.outputs.push(bumped);
        let wide = push_on(
            g,
            device,
            Op::Prim(Prim::Expand(shape.to_vec())),
            vec![bumped],
            shape,
        );
        let scaled = binary(g, BinaryOp::Mul, grad, wide);
        let new = binary(g, BinaryOp::Sub, p, scaled);
        g.mutated_inputs.push((g.outputs.len(), p_index));
        g.outputs.push(new);
    }
}

/// The values each kernel planned for a GPU (2 multiprocessors) computes, in launch order.
pub(crate) fn cuda_kernel_outputs(g: &Graph) -> Vec<usize> {
    let planned = kernels(&crate::codegen::cuda::Cuda::new(2), g);
    planned.into_iter().map(|(_, outs)| outs).collect()
}

/// The same builders on the CPU.
pub(crate) mod cpu {
    use super::*;

    pub(crate) fn push(g: &mut Graph, op: Op, args: Vec<NodeId>, shape: &[usize]) -> NodeId {
        push_on(g, Device::Cpu, op, args, shape)
    }

    pub(crate) fn input(g: &mut Graph, shape: &[usize]) -> NodeId {
        input_on(g, Device::Cpu, shape)
    }
}

/// A backend that records the graphs it is given and runs them on the interpreter.
pub(crate) struct Capture(pub(crate) std::sync::Mutex<Vec<Graph>>);

impl kiln_compile::Backend for Capture {
    fn name(&self) -> &str {
        "capture"
    }
    fn compile(
        &self,
        graph: &Graph,
        _ctx: &kiln_compile::BackendContext,
    ) -> kiln_core::Result<std::sync::Arc<dyn kiln_compile::CompiledGraph>> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(graph.clone());
        Ok(std::sync::Arc::new(
            kiln_compile::backends::Interpreter::new(graph.clone()),
        ))
    }
}

/// The one graph `f` traces to on `args`, without autograd; an error when it traced to more
/// (a graph break) or none.
pub(crate) fn traced(
    f: impl Fn(&[kiln_core::Tensor]) -> kiln_core::Result<Vec<kiln_core::Tensor>>
        + Send
        + Sync
        + 'static,
    args: &[kiln_core::Tensor],
) -> kiln_core::Result<Graph> {
    let capture = std::sync::Arc::new(Capture(Default::default()));
    let compiled = kiln_compile::compile_fn(
        f,
        kiln_compile::CompileOptions::default().custom_backend(capture.clone()),
    )?;
    kiln_core::no_grad(|| compiled.call(args))?;
    let mut graphs = capture.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
    match graphs.len() {
        1 => Ok(graphs.remove(0)),
        n => Err(kiln_core::Error::arg(
            "traced",
            format!("the function compiled {n} graphs, expected one"),
        )),
    }
}

/// A backend that interprets each graph after a rewrite (a pass under test).
struct Rewriting(fn(&Graph) -> Graph);

impl kiln_compile::Backend for Rewriting {
    fn name(&self) -> &str {
        "rewriting_interpreter"
    }
    fn compile(
        &self,
        graph: &Graph,
        _ctx: &kiln_compile::BackendContext,
    ) -> kiln_core::Result<std::sync::Arc<dyn kiln_compile::CompiledGraph>> {
        Ok(std::sync::Arc::new(
            kiln_compile::backends::Interpreter::new((self.0)(graph)),
        ))
    }
}

/// The graph `f` traces to on `args`, rewritten by `rewrite`, after checking that the rewritten
/// graph, interpreted, computes what `f` computes eagerly, bit for bit (f32 outputs).
pub(crate) fn rewritten_bitwise(
    f: impl Fn(&[kiln_core::Tensor]) -> kiln_core::Result<Vec<kiln_core::Tensor>>
        + Send
        + Sync
        + Clone
        + 'static,
    args: &[kiln_core::Tensor],
    rewrite: fn(&Graph) -> Graph,
) -> kiln_core::Result<Graph> {
    let want = f(args)?;
    let compiled = kiln_compile::compile_fn(
        f.clone(),
        kiln_compile::CompileOptions::default()
            .custom_backend(std::sync::Arc::new(Rewriting(rewrite))),
    )?;
    let got = kiln_core::no_grad(|| compiled.call(args))?;
    assert_eq!(want.len(), got.len());
    for (w, o) in want.iter().zip(&got) {
        assert_eq!(w.shape(), o.shape());
        assert_eq!(w.to_vec::<f32>()?, o.to_vec::<f32>()?);
    }
    Ok(rewrite(&traced(f, args)?))
}

/// The kernels `t` plans for the graph `f` traces to on `args`, rewritten as the backend
/// rewrites it (`backend::prepare`), each with the number of values it writes.
pub(crate) fn planned_kernels<T: crate::backend::Target>(
    t: &T,
    f: impl Fn(&[kiln_core::Tensor]) -> kiln_core::Result<Vec<kiln_core::Tensor>>
        + Send
        + Sync
        + 'static,
    args: &[kiln_core::Tensor],
) -> kiln_core::Result<Vec<(T::Kernel, usize)>> {
    let mut g = traced(f, args)?;
    if !t.generates_sqdev() {
        g = crate::two_pass::two_pass(&g)?.unwrap_or(g);
    }
    Ok(kernels(t, &*crate::backend::prepare(&g)?))
}

/// The C target as the `kiln` backend makes it for a concrete graph (horizontal kernels on,
/// small matmuls left to gemm).
pub(crate) const C_TARGET: crate::backend::C = crate::backend::C {
    inline_matmul: false,
    horizontal: true,
};
