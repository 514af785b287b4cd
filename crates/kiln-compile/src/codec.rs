//! A compact binary form of graphs and of what compilers keep on disk beside them (the compiled
//! graph cache, `disk_cache.rs`): integers as LEB128 varints, floats by their bits, strings and
//! lists length-first. Decoding never panics: a truncated or damaged record reads as `None`.

use kiln_core::prim::{
    Activation, ArgReduceOp, BinaryOp, ConvEpilogue, ConvParams, Epilogue, Prim, RandDist,
    ReduceOp, UnaryOp,
};
use kiln_core::{DType, Device};

use crate::graph::{Graph, Node, Op};

/// Bytes being written.
#[derive(Default)]
pub struct Writer {
    pub bytes: Vec<u8>,
}

impl Writer {
    pub fn u64(&mut self, mut v: u64) {
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                self.bytes.push(b);
                return;
            }
            self.bytes.push(b | 0x80);
        }
    }
    pub fn usize(&mut self, v: usize) {
        self.u64(v as u64);
    }
    pub fn i64(&mut self, v: i64) {
        // zigzag: small magnitudes of either sign stay short
        self.u64(((v << 1) ^ (v >> 63)) as u64);
    }
    pub fn u32(&mut self, v: u32) {
        self.u64(v as u64);
    }
    pub fn bool(&mut self, v: bool) {
        self.bytes.push(v as u8);
    }
    pub fn f64(&mut self, v: f64) {
        self.bytes.extend_from_slice(&v.to_bits().to_le_bytes());
    }
    pub fn str(&mut self, s: &str) {
        self.usize(s.len());
        self.bytes.extend_from_slice(s.as_bytes());
    }
    pub fn usizes(&mut self, v: &[usize]) {
        self.usize(v.len());
        for &x in v {
            self.usize(x);
        }
    }
    pub fn i64s(&mut self, v: &[i64]) {
        self.usize(v.len());
        for &x in v {
            self.i64(x);
        }
    }
}

/// Bytes being read; every getter is `None` past the end or on a value out of range.
pub struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, at: 0 }
    }
    /// Whether every byte was read.
    pub fn done(&self) -> bool {
        self.at == self.bytes.len()
    }
    fn byte(&mut self) -> Option<u8> {
        let b = *self.bytes.get(self.at)?;
        self.at += 1;
        Some(b)
    }
    pub fn u64(&mut self) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            v |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Some(v);
            }
        }
        None
    }
    pub fn usize(&mut self) -> Option<usize> {
        usize::try_from(self.u64()?).ok()
    }
    /// A count of elements to follow: at most the bytes left (every element takes at least one), so a damaged
    /// length cannot ask for a huge allocation.
    pub fn count(&mut self) -> Option<usize> {
        self.usize().filter(|&n| n <= self.bytes.len() - self.at)
    }
    pub fn i64(&mut self) -> Option<i64> {
        let z = self.u64()?;
        Some(((z >> 1) as i64) ^ -((z & 1) as i64))
    }
    pub fn u32(&mut self) -> Option<u32> {
        u32::try_from(self.u64()?).ok()
    }
    pub fn bool(&mut self) -> Option<bool> {
        match self.byte()? {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }
    pub fn f64(&mut self) -> Option<f64> {
        let b = self.bytes.get(self.at..self.at + 8)?;
        self.at += 8;
        Some(f64::from_bits(u64::from_le_bytes(b.try_into().ok()?)))
    }
    pub fn str(&mut self) -> Option<String> {
        let n = self.count()?;
        let s = std::str::from_utf8(&self.bytes[self.at..self.at + n]).ok()?;
        self.at += n;
        Some(s.to_string())
    }
    pub fn usizes(&mut self) -> Option<Vec<usize>> {
        let n = self.count()?;
        (0..n).map(|_| self.usize()).collect()
    }
    pub fn i64s(&mut self) -> Option<Vec<i64>> {
        let n = self.count()?;
        (0..n).map(|_| self.i64()).collect()
    }
}

/// Whether random seeds are written: a cache key leaves them out (they are run-time values, as
/// in `Graph::structure_key`), a stored graph keeps them.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Seeds {
    Keep,
    Zero,
}

const UNARY: [UnaryOp; 14] = [
    UnaryOp::Neg,
    UnaryOp::Abs,
    UnaryOp::Exp,
    UnaryOp::Log,
    UnaryOp::Log1p,
    UnaryOp::Sqrt,
    UnaryOp::Sin,
    UnaryOp::Cos,
    UnaryOp::Tanh,
    UnaryOp::Erf,
    UnaryOp::Floor,
    UnaryOp::Sign,
    UnaryOp::Recip,
    UnaryOp::Not,
];

const BINARY: [BinaryOp; 15] = [
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Div,
    BinaryOp::Pow,
    BinaryOp::Max,
    BinaryOp::Min,
    BinaryOp::Eq,
    BinaryOp::Ne,
    BinaryOp::Lt,
    BinaryOp::Le,
    BinaryOp::Gt,
    BinaryOp::Ge,
    BinaryOp::And,
    BinaryOp::Or,
];

const REDUCE: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::SumSqDev,
];

/// The index of `v` in `table` (the op tables list every variant in declaration order, so
/// their encoding is `op as usize`; a test checks both).
fn index_of<T: PartialEq>(table: &[T], v: &T) -> usize {
    table.iter().position(|t| t == v).unwrap_or(usize::MAX)
}

fn from_table<T: Copy>(table: &[T], r: &mut Reader) -> Option<T> {
    table.get(r.usize()?).copied()
}

pub fn dtype(w: &mut Writer, d: DType) {
    w.usize(index_of(&DType::ALL, &d));
}

pub fn read_dtype(r: &mut Reader) -> Option<DType> {
    from_table(&DType::ALL, r)
}

pub fn device(w: &mut Writer, d: Device) {
    match d {
        Device::Cpu => w.u64(0),
        Device::Cuda(i) => w.u64(1 + i as u64),
    }
}

fn read_device(r: &mut Reader) -> Option<Device> {
    Some(match r.usize()? {
        0 => Device::Cpu,
        i => Device::Cuda(i - 1),
    })
}

fn conv(w: &mut Writer, p: &ConvParams) {
    w.usizes(&p.stride);
    w.usizes(&p.padding);
    w.usizes(&p.dilation);
    w.usize(p.groups);
    w.bool(p.channels_last);
}

fn pair(r: &mut Reader) -> Option<[usize; 2]> {
    r.usizes()?.try_into().ok()
}

fn read_conv(r: &mut Reader) -> Option<ConvParams> {
    Some(ConvParams {
        stride: pair(r)?,
        padding: pair(r)?,
        dilation: pair(r)?,
        groups: r.usize()?,
        channels_last: r.bool()?,
    })
}

/// Writes a prim: a tag, then its attributes.
pub fn prim(w: &mut Writer, p: &Prim, seeds: Seeds) {
    match p {
        Prim::Unary(u) => {
            w.u64(0);
            w.usize(*u as usize);
        }
        Prim::Binary(b) => {
            w.u64(1);
            w.usize(*b as usize);
        }
        Prim::Where => w.u64(2),
        Prim::Cast(d) => {
            w.u64(3);
            dtype(w, *d);
        }
        Prim::Reduce { op, dims } => {
            w.u64(4);
            w.usize(*op as usize);
            w.usizes(dims);
        }
        Prim::ArgReduce { op, dim } => {
            w.u64(5);
            w.bool(*op == ArgReduceOp::ArgMin);
            w.usize(*dim);
        }
        Prim::Reshape(s) => {
            w.u64(6);
            w.usizes(s);
        }
        Prim::Permute(s) => {
            w.u64(7);
            w.usizes(s);
        }
        Prim::Expand(s) => {
            w.u64(8);
            w.usizes(s);
        }
        Prim::Slice {
            dim,
            start,
            end,
            step,
        } => {
            w.u64(9);
            for v in [dim, start, end, step] {
                w.usize(*v);
            }
        }
        Prim::Pad { pads, value } => {
            w.u64(10);
            w.usize(pads.len());
            for (a, b) in pads {
                w.usize(*a);
                w.usize(*b);
            }
            w.f64(*value);
        }
        Prim::Cat { dim } => {
            w.u64(11);
            w.usize(*dim);
        }
        Prim::Contiguous => w.u64(12),
        Prim::Full {
            shape,
            value,
            dtype: d,
        } => {
            w.u64(13);
            w.usizes(shape);
            w.f64(*value);
            dtype(w, *d);
        }
        Prim::Iota { n, dtype: d } => {
            w.u64(14);
            w.usize(*n);
            dtype(w, *d);
        }
        Prim::Rand {
            shape,
            dtype: d,
            dist,
            seed,
            offset,
        } => {
            w.u64(15);
            w.usizes(shape);
            dtype(w, *d);
            w.bool(*dist == RandDist::Normal);
            w.u64(if seeds == Seeds::Keep { *seed } else { 0 });
            w.u64(*offset);
        }
        Prim::Gather { dim } => {
            w.u64(16);
            w.usize(*dim);
        }
        Prim::ScatterAdd { dim } => {
            w.u64(17);
            w.usize(*dim);
        }
        Prim::Matmul => w.u64(18),
        Prim::Conv2d(p) => {
            w.u64(19);
            conv(w, p);
        }
        Prim::Conv2dGradInput {
            params,
            input_shape,
        } => {
            w.u64(20);
            conv(w, params);
            w.usizes(input_shape);
        }
        Prim::Conv2dGradWeight {
            params,
            weight_shape,
        } => {
            w.u64(21);
            conv(w, params);
            w.usizes(weight_shape);
        }
        Prim::MatmulEpilogue(e) => {
            w.u64(22);
            w.bool(e.bias);
            activation(w, e.act);
        }
        Prim::Conv2dEpilogue { params, epilogue } => {
            w.u64(23);
            conv(w, params);
            w.bool(epilogue.scale);
            w.bool(epilogue.shift);
            w.bool(epilogue.residual);
            activation(w, epilogue.act);
        }
    }
}

fn activation(w: &mut Writer, a: Activation) {
    w.u64(match a {
        Activation::None => 0,
        Activation::Relu => 1,
        Activation::GeluTanh => 2,
    });
}

fn read_activation(r: &mut Reader) -> Option<Activation> {
    Some(match r.u64()? {
        0 => Activation::None,
        1 => Activation::Relu,
        2 => Activation::GeluTanh,
        _ => return None,
    })
}

pub fn read_prim(r: &mut Reader) -> Option<Prim> {
    let four = |r: &mut Reader| -> Option<[usize; 4]> { r.usizes()?.try_into().ok() };
    Some(match r.u64()? {
        0 => Prim::Unary(from_table(&UNARY, r)?),
        1 => Prim::Binary(from_table(&BINARY, r)?),
        2 => Prim::Where,
        3 => Prim::Cast(read_dtype(r)?),
        4 => Prim::Reduce {
            op: from_table(&REDUCE, r)?,
            dims: r.usizes()?,
        },
        5 => Prim::ArgReduce {
            op: match r.bool()? {
                true => ArgReduceOp::ArgMin,
                false => ArgReduceOp::ArgMax,
            },
            dim: r.usize()?,
        },
        6 => Prim::Reshape(r.usizes()?),
        7 => Prim::Permute(r.usizes()?),
        8 => Prim::Expand(r.usizes()?),
        9 => Prim::Slice {
            dim: r.usize()?,
            start: r.usize()?,
            end: r.usize()?,
            step: r.usize()?,
        },
        10 => {
            let n = r.count()?;
            let pads = (0..n)
                .map(|_| Some((r.usize()?, r.usize()?)))
                .collect::<Option<Vec<_>>>()?;
            Prim::Pad {
                pads,
                value: r.f64()?,
            }
        }
        11 => Prim::Cat { dim: r.usize()? },
        12 => Prim::Contiguous,
        13 => Prim::Full {
            shape: r.usizes()?,
            value: r.f64()?,
            dtype: read_dtype(r)?,
        },
        14 => Prim::Iota {
            n: r.usize()?,
            dtype: read_dtype(r)?,
        },
        15 => Prim::Rand {
            shape: r.usizes()?,
            dtype: read_dtype(r)?,
            dist: match r.bool()? {
                true => RandDist::Normal,
                false => RandDist::Uniform,
            },
            seed: r.u64()?,
            offset: r.u64()?,
        },
        16 => Prim::Gather { dim: r.usize()? },
        17 => Prim::ScatterAdd { dim: r.usize()? },
        18 => Prim::Matmul,
        19 => Prim::Conv2d(read_conv(r)?),
        20 => Prim::Conv2dGradInput {
            params: read_conv(r)?,
            input_shape: four(r)?,
        },
        21 => Prim::Conv2dGradWeight {
            params: read_conv(r)?,
            weight_shape: four(r)?,
        },
        22 => Prim::MatmulEpilogue(Epilogue {
            bias: r.bool()?,
            act: read_activation(r)?,
        }),
        23 => Prim::Conv2dEpilogue {
            params: read_conv(r)?,
            epilogue: ConvEpilogue {
                scale: r.bool()?,
                shift: r.bool()?,
                residual: r.bool()?,
                act: read_activation(r)?,
            },
        },
        _ => return None,
    })
}

/// Writes a whole graph: every node (op, operands, shape, dtype, grad mode, requires_grad,
/// device), then inputs, outputs, random span, in-place updates and static inputs.
pub fn graph(w: &mut Writer, g: &Graph, seeds: Seeds) {
    w.usize(g.nodes.len());
    for n in &g.nodes {
        match &n.op {
            Op::Input(i) => {
                w.u64(0);
                w.usize(*i);
            }
            Op::Prim(p) => {
                w.u64(1);
                prim(w, p, seeds);
            }
        }
        w.usizes(&n.args);
        w.usizes(&n.shape);
        dtype(w, n.dtype);
        w.bool(n.grad_enabled);
        w.bool(n.requires_grad);
        device(w, n.device);
    }
    w.usize(g.num_inputs);
    w.usizes(&g.outputs);
    w.u64(g.rng_span);
    w.usize(g.mutated_inputs.len());
    for (k, i) in &g.mutated_inputs {
        w.usize(*k);
        w.usize(*i);
    }
    w.usize(g.static_inputs.len());
    for &s in &g.static_inputs {
        w.bool(s);
    }
}

/// Reads a graph `graph` wrote; `None` where the bytes are not one, or where an operand, output
/// or input index is out of range (a graph that would make a compiler index out of bounds).
pub fn read_graph(r: &mut Reader) -> Option<Graph> {
    let n = r.count()?;
    let mut nodes = Vec::with_capacity(n);
    for id in 0..n {
        let op = match r.u64()? {
            0 => Op::Input(r.usize()?),
            1 => Op::Prim(read_prim(r)?),
            _ => return None,
        };
        let args = r.usizes()?;
        if args.iter().any(|&a| a >= id) {
            return None;
        }
        nodes.push(Node {
            op,
            args,
            shape: r.usizes()?,
            dtype: read_dtype(r)?,
            grad_enabled: r.bool()?,
            requires_grad: r.bool()?,
            device: read_device(r)?,
        });
    }
    let num_inputs = r.usize()?;
    let outputs = r.usizes()?;
    let rng_span = r.u64()?;
    let m = r.count()?;
    let mutated_inputs = (0..m)
        .map(|_| Some((r.usize()?, r.usize()?)))
        .collect::<Option<Vec<_>>>()?;
    let s = r.count()?;
    let static_inputs = (0..s).map(|_| r.bool()).collect::<Option<Vec<_>>>()?;
    let inputs_ok = nodes
        .iter()
        .all(|n| !matches!(n.op, Op::Input(i) if i >= num_inputs));
    if !inputs_ok || outputs.iter().any(|&o| o >= n) {
        return None;
    }
    Some(Graph {
        nodes,
        num_inputs,
        outputs,
        rng_span,
        mutated_inputs,
        static_inputs,
    })
}

/// The bytes of a graph, for a cache key (seeds left out) or to store (`Seeds::Keep`).
pub fn graph_bytes(g: &Graph, seeds: Seeds) -> Vec<u8> {
    let mut w = Writer {
        bytes: Vec::with_capacity(g.nodes.len() * 24),
    };
    graph(&mut w, g, seeds);
    w.bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_prim() -> Vec<Prim> {
        let cp = ConvParams {
            stride: [2, 1],
            padding: [3, 0],
            dilation: [1, 2],
            groups: 4,
            channels_last: true,
        };
        let mut v: Vec<Prim> = UNARY.iter().map(|&u| Prim::Unary(u)).collect();
        v.extend(BINARY.iter().map(|&b| Prim::Binary(b)));
        v.extend(REDUCE.iter().map(|&op| Prim::Reduce {
            op,
            dims: vec![0, 2],
        }));
        v.extend(DType::ALL.iter().map(|&d| Prim::Cast(d)));
        v.extend([
            Prim::Where,
            Prim::ArgReduce {
                op: ArgReduceOp::ArgMax,
                dim: 1,
            },
            Prim::ArgReduce {
                op: ArgReduceOp::ArgMin,
                dim: 0,
            },
            Prim::Reshape(vec![3, 0, 1]),
            Prim::Permute(vec![1, 0]),
            Prim::Expand(vec![5, 1 << 40]),
            Prim::Slice {
                dim: 1,
                start: 2,
                end: 9,
                step: 3,
            },
            Prim::Pad {
                pads: vec![(1, 2), (0, 0)],
                value: f64::NEG_INFINITY,
            },
            Prim::Cat { dim: 2 },
            Prim::Contiguous,
            Prim::Full {
                shape: vec![],
                value: -0.0,
                dtype: DType::BF16,
            },
            Prim::Iota {
                n: 7,
                dtype: DType::I64,
            },
            Prim::Rand {
                shape: vec![4, 4],
                dtype: DType::F32,
                dist: RandDist::Normal,
                seed: u64::MAX,
                offset: 12,
            },
            Prim::Rand {
                shape: vec![2],
                dtype: DType::F64,
                dist: RandDist::Uniform,
                seed: 3,
                offset: 0,
            },
            Prim::Gather { dim: 0 },
            Prim::ScatterAdd { dim: 1 },
            Prim::Matmul,
            Prim::Conv2d(cp),
            Prim::Conv2dGradInput {
                params: cp,
                input_shape: [1, 2, 3, 4],
            },
            Prim::Conv2dGradWeight {
                params: ConvParams {
                    channels_last: false,
                    ..cp
                },
                weight_shape: [4, 3, 2, 1],
            },
            Prim::MatmulEpilogue(Epilogue {
                bias: true,
                act: Activation::Relu,
            }),
            Prim::MatmulEpilogue(Epilogue {
                bias: false,
                act: Activation::None,
            }),
            Prim::MatmulEpilogue(Epilogue {
                bias: true,
                act: Activation::GeluTanh,
            }),
            Prim::Conv2dEpilogue {
                params: cp,
                epilogue: ConvEpilogue {
                    scale: true,
                    shift: false,
                    residual: true,
                    act: Activation::Relu,
                },
            },
            Prim::Conv2dEpilogue {
                params: ConvParams {
                    channels_last: false,
                    ..cp
                },
                epilogue: ConvEpilogue {
                    scale: false,
                    shift: true,
                    residual: false,
                    act: Activation::None,
                },
            },
        ]);
        v
    }

    /// Fails to compile when an op is added: add it to its table (in declaration order) too.
    #[test]
    fn the_op_tables_list_every_variant_in_order() {
        let unary = |u: UnaryOp| match u {
            UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Exp | UnaryOp::Log | UnaryOp::Log1p => (),
            UnaryOp::Sqrt | UnaryOp::Sin | UnaryOp::Cos | UnaryOp::Tanh | UnaryOp::Erf => (),
            UnaryOp::Floor | UnaryOp::Sign | UnaryOp::Recip | UnaryOp::Not => (),
        };
        let binary = |b: BinaryOp| match b {
            BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Div | BinaryOp::Pow => (),
            BinaryOp::Max | BinaryOp::Min | BinaryOp::Eq | BinaryOp::Ne | BinaryOp::Lt => (),
            BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge | BinaryOp::And | BinaryOp::Or => (),
        };
        let reduce = |r: ReduceOp| match r {
            ReduceOp::Sum | ReduceOp::Prod | ReduceOp::Max | ReduceOp::Min => (),
            ReduceOp::SumSqDev => (),
        };
        for (i, &u) in UNARY.iter().enumerate() {
            unary(u);
            assert_eq!(u as usize, i);
        }
        for (i, &b) in BINARY.iter().enumerate() {
            binary(b);
            assert_eq!(b as usize, i);
        }
        for (i, &r) in REDUCE.iter().enumerate() {
            reduce(r);
            assert_eq!(r as usize, i);
        }
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!(index_of(&DType::ALL, d), i);
        }
    }

    #[test]
    fn every_prim_reads_back_as_written() {
        for p in every_prim() {
            let mut w = Writer::default();
            prim(&mut w, &p, Seeds::Keep);
            let mut r = Reader::new(&w.bytes);
            assert_eq!(read_prim(&mut r).as_ref(), Some(&p), "{p:?}");
            assert!(r.done(), "{p:?}: bytes left over");
        }
    }

    #[test]
    fn integers_and_floats_round_trip_at_their_extremes() {
        let mut w = Writer::default();
        for v in [0u64, 1, 127, 128, u64::MAX] {
            w.u64(v);
        }
        for v in [0i64, -1, 1, i64::MIN, i64::MAX] {
            w.i64(v);
        }
        for v in [f64::NAN, -0.0, f64::INFINITY, 1e-310] {
            w.f64(v);
        }
        let mut r = Reader::new(&w.bytes);
        for v in [0u64, 1, 127, 128, u64::MAX] {
            assert_eq!(r.u64(), Some(v));
        }
        for v in [0i64, -1, 1, i64::MIN, i64::MAX] {
            assert_eq!(r.i64(), Some(v));
        }
        for v in [f64::NAN, -0.0, f64::INFINITY, 1e-310] {
            assert_eq!(r.f64().map(f64::to_bits), Some(v.to_bits()));
        }
        assert!(r.done());
    }

    fn sample_graph() -> Graph {
        let node = |op, args: Vec<usize>, shape: Vec<usize>| Node {
            op,
            args,
            shape,
            dtype: DType::F32,
            grad_enabled: true,
            requires_grad: false,
            device: Device::Cuda(1),
        };
        let mut g = Graph::default();
        let x = g.push(Node {
            requires_grad: true,
            ..node(Op::Input(0), vec![], vec![2, 3])
        });
        let y = g.push(node(Op::Input(1), vec![], vec![2, 3]));
        let r = g.push(node(
            Op::Prim(Prim::Rand {
                shape: vec![2, 3],
                dtype: DType::F32,
                dist: RandDist::Uniform,
                seed: 99,
                offset: 5,
            }),
            vec![],
            vec![2, 3],
        ));
        let s = g.push(node(
            Op::Prim(Prim::Binary(BinaryOp::Add)),
            vec![x, y],
            vec![2, 3],
        ));
        let t = g.push(Node {
            device: Device::Cpu,
            grad_enabled: false,
            ..node(
                Op::Prim(Prim::Binary(BinaryOp::Mul)),
                vec![s, r],
                vec![2, 3],
            )
        });
        g.num_inputs = 2;
        g.outputs = vec![t, s];
        g.rng_span = 6;
        g.mutated_inputs = vec![(1, 1)];
        g.static_inputs = vec![false, true];
        g
    }

    #[test]
    fn a_graph_reads_back_equal_and_a_key_ignores_seeds() {
        let g = sample_graph();
        let bytes = graph_bytes(&g, Seeds::Keep);
        let mut r = Reader::new(&bytes);
        assert_eq!(read_graph(&mut r), Some(g.clone()));
        assert!(r.done());
        let mut reseeded = g.clone();
        if let Op::Prim(Prim::Rand { seed, .. }) = &mut reseeded.nodes[2].op {
            *seed = 7;
        }
        assert_eq!(
            graph_bytes(&g, Seeds::Zero),
            graph_bytes(&reseeded, Seeds::Zero)
        );
        assert_ne!(
            graph_bytes(&g, Seeds::Keep),
            graph_bytes(&reseeded, Seeds::Keep)
        );
    }

    #[test]
    fn truncated_or_damaged_bytes_read_as_none_without_panicking() {
        let bytes = graph_bytes(&sample_graph(), Seeds::Keep);
        for cut in 0..bytes.len() {
            assert_eq!(
                read_graph(&mut Reader::new(&bytes[..cut])),
                None,
                "cut {cut}"
            );
        }
        // every single-byte change either fails to read or reads as some valid graph
        for at in 0..bytes.len() {
            let mut b = bytes.clone();
            b[at] ^= 0x5a;
            if let Some(g) = read_graph(&mut Reader::new(&b)) {
                assert!(g
                    .nodes
                    .iter()
                    .enumerate()
                    .all(|(i, n)| n.args.iter().all(|&a| a < i)));
            }
        }
    }
}
