//! Horizontal fusion on the CPU: independent kernels (`horizontal.rs` decides which: none reads
//! what another writes, none overwrites what another reads) as one C function with one OpenMP
//! parallel region. A kernel on its own opens a region per call, and each region is a fork and
//! a join of the thread team (with `OMP_WAIT_POLICY=PASSIVE`, which `runtime/cc.rs` sets, a
//! wake-up of sleeping threads): an optimizer step over many parameters, or a backward graph's
//! many small independent loops, paid that once per kernel.
//!
//! Inside the region each member's loop nest is what it is on its own, with only the sharing of
//! its outer loops changed:
//! - a member large enough to run on several threads alone (`Member::parallel`) shares its outer
//!   loops among the team with `#pragma omp for schedule(static) nowait`. No barrier after it:
//!   the members are independent, and the region's closing barrier orders them before whatever
//!   follows the launch;
//! - a smaller member runs on one thread under `#pragma omp single nowait`: the first thread
//!   free takes it (they come after the shared loops, so the threads that finish their static
//!   chunks first pick up the small members).
//!
//! A launch whose members together have fewer than `PARALLEL_THRESHOLD` iterations opens no
//! region at all: its members run one after another on the calling thread, as they did alone.
//!
//! Every element is computed by the same expression as in the member's own kernel, and every
//! reduction row by one thread in the member's order (the work-shared loops are the kept dims,
//! never the reduced ones): results are bitwise those of the kernels run one by one.
//!
//! Declined (`Kernel::member` is `None`): a chunked sum (`c.rs` `chunked_sum`), whose chunks run
//! in a parallel region of its own followed by a serial sum of the partials. Sharing it would need
//! its partials allocated outside the region and summed after the region's barrier; it is at
//! least `SUM_CHUNKED_FROM` elements long, enough work to amortize its own fork and join. Also
//! none under a size context (`backend.rs`): a size-generic kernel rewrites the literals of
//! member functions named by the hash of their static text.

use std::fmt::Write;

use super::c::{blocked_loops, Kernel, PARALLEL_THRESHOLD};
use crate::backend::Side;

/// How a loop nest's outer loops are shared among OpenMP threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Threads {
    /// All on the calling thread.
    One,
    /// In a parallel region of their own (`parallel for`): a kernel on its own.
    Region,
    /// Work-shared inside an enclosing region, with no barrier after (`for nowait`).
    Shared,
}

/// A C kernel's loop nest in parts, so that it can be written as a kernel of its own or as a
/// member function of a horizontal kernel.
#[derive(Debug)]
pub(crate) struct Member {
    /// Each argument's C element type and name: the inputs (read only), then the outputs.
    pub(crate) args: Vec<(&'static str, String)>,
    /// How many of `args` are inputs.
    pub(crate) inputs: usize,
    /// The values the same at every element, computed before the loops.
    pub(crate) pre: String,
    /// The loops OpenMP may share: (variable, extent), outermost first.
    pub(crate) outer: Vec<(usize, usize)>,
    /// Elements per iteration of the innermost of `outer` (`codegen/c_trig.rs`'s blocks; else 1).
    pub(crate) block: usize,
    /// The text inside `outer`: the body, or a reduction's inner loops.
    pub(crate) inner: String,
    /// Whether the kernel on its own runs `outer` on several threads.
    pub(crate) parallel: bool,
    /// Iterations of the whole nest.
    pub(crate) elements: usize,
}

impl Member {
    /// The argument pointers, read from `args` from `input_at` (inputs) and `output_at`
    /// (outputs) on.
    pub(crate) fn declare(&self, out: &mut String, input_at: usize, output_at: usize) {
        let (ins, outs) = self.args.split_at(self.inputs);
        for (p, (t, name)) in ins.iter().enumerate() {
            let at = input_at + p;
            let _ = writeln!(
                out,
                "  const {t} *restrict {name} = (const {t} *)args[{at}];"
            );
        }
        for (j, (t, name)) in outs.iter().enumerate() {
            let at = output_at + j;
            let _ = writeln!(out, "  {t} *restrict {name} = ({t} *)args[{at}];");
        }
    }

    /// The values computed once, then the loops.
    pub(crate) fn nest(&self, out: &mut String, threads: Threads) {
        out.push_str(&self.pre);
        blocked_loops(out, &self.outer, threads, self.block);
        out.push_str(&self.inner);
    }

    /// Whether this member's loops are work-shared in a horizontal kernel's region (else one
    /// thread runs it whole).
    fn shares_loops(&self) -> bool {
        self.parallel && !self.outer.is_empty()
    }
}

/// The block size and parameter count `horizontal.rs` weighs: a C function takes any number
/// of arguments and has no block size, so every shareable kernel fits beside every other.
pub(crate) fn side_by_side(k: &Kernel) -> Option<Side> {
    k.member.as_ref().map(|m| Side {
        block: 0,
        params: m.args.len(),
        shared: 0,
    })
}

/// One C function running `kernels` (independent, as `horizontal.rs` plans them): its
/// arguments are every member's inputs in member order, then every member's outputs (the order
/// `horizontal.rs` lists the launch's outputs in). `None` if a member cannot share a region.
///
/// Each member's nest is a `static` function of its own arguments (`member_fn`), called with
/// its slice of the launch's: members of one text — an optimizer's updates of parameters of one
/// shape — are one function, compiled once, as they were one kernel before.
pub(crate) fn horizontal(kernels: &[&Kernel]) -> Option<Kernel> {
    let members: Vec<&Member> = kernels
        .iter()
        .map(|k| k.member.as_deref())
        .collect::<Option<_>>()?;
    let inputs: usize = members.iter().map(|m| m.inputs).sum();
    let elements = members
        .iter()
        .fold(0usize, |n, m| n.saturating_add(m.elements));
    let region = elements >= PARALLEL_THRESHOLD;
    let mut fns: Vec<(String, String)> = Vec::new();
    let (mut shared, mut single) = (String::new(), String::new());
    let (mut input_at, mut output_at) = (0, inputs);
    for m in &members {
        let outputs = m.args.len() - m.inputs;
        let args: Vec<String> = (input_at..input_at + m.inputs)
            .chain(output_at..output_at + outputs)
            .map(|a| format!("args[{a}]"))
            .collect();
        input_at += m.inputs;
        output_at += outputs;
        let (text, threads) = match (region, m.shares_loops()) {
            (true, true) => (&mut shared, Threads::Shared),
            (true, false) => {
                single.push_str("  #pragma omp single nowait\n");
                (&mut single, Threads::One)
            }
            (false, _) => (&mut single, Threads::One),
        };
        let f = member_fn(&mut fns, m, threads);
        let _ = writeln!(text, "  {{ void *a[] = {{{}}}; {f}(a); }}", args.join(", "));
    }
    let body = match region {
        true => format!("  #pragma omp parallel\n  {{\n{shared}{single}  }}\n"),
        false => single,
    };
    let defs: String = fns.into_iter().map(|f| f.1).collect();
    let hash = xxhash_rust::xxh3::xxh3_64(format!("{defs}{body}").as_bytes());
    let name = format!("k_{hash:016x}");
    Some(Kernel {
        source: format!("{defs}void {name}(void **args) {{\n{body}}}\n"),
        name,
        inputs: kernels
            .iter()
            .flat_map(|k| k.inputs.iter().copied())
            .collect(),
        member: None,
    })
}

/// The name of `m`'s nest as a `static void m_<hash>(void **args)` (its inputs, then its
/// outputs), with its outer loops shared as `threads` says; its definition added to `fns`
/// (name, text) unless there. Named by the hash of its text and defined under a guard of that
/// name, so that a translation unit holding several kernels that run it (horizontal kernels, and
/// the single-threaded kernel of the same nest: `c.rs` `finish_outputs`) defines it once, and
/// `noinline` so that the C compiler also compiles it once, not once per caller.
pub(crate) fn member_fn(fns: &mut Vec<(String, String)>, m: &Member, threads: Threads) -> String {
    let mut text = String::new();
    m.declare(&mut text, 0, m.inputs);
    m.nest(&mut text, threads);
    let hash = xxhash_rust::xxh3::xxh3_64(text.as_bytes());
    let name = format!("m_{hash:016x}");
    if !fns.iter().any(|f| f.0 == name) {
        let guard = format!("KILN_{}", name.to_uppercase());
        let def = format!(
            "#ifndef {guard}\n#define {guard}\n__attribute__((noinline)) static void {name}(void \
             **args) {{\n{text}}}\n#endif\n"
        );
        fns.push((name.clone(), def));
    }
    name
}

#[cfg(test)]
mod tests {
    use kiln_compile::graph::{Graph, NodeId, Op};
    use kiln_core::prim::{BinaryOp, Prim, ReduceOp};

    use crate::backend::{plan_graph, Planned, C};
    use crate::codegen::c::Kernel;
    use crate::runtime::plan::Alloc;
    use crate::test_graphs::binary;
    use crate::test_graphs::cpu::{input, push};

    /// The kernels of `g` planned for the CPU, with or without horizontal fusion.
    fn kernels(g: &Graph, horizontal: bool) -> Vec<(Kernel, Vec<(NodeId, Alloc)>)> {
        let c = C {
            inline_matmul: false,
            horizontal,
        };
        plan_graph(&c, g)
            .into_iter()
            .filter_map(|p| match p {
                Planned::Kernel { kernel, outs } => Some((kernel, outs)),
                Planned::Extern { .. } => None,
            })
            .collect()
    }

    fn count(k: &Kernel, pragma: &str) -> usize {
        k.source.matches(pragma).count()
    }

    fn sum(g: &mut Graph, x: NodeId, dims: Vec<usize>, shape: &[usize]) -> NodeId {
        let op = Op::Prim(Prim::Reduce {
            op: ReduceOp::Sum,
            dims,
        });
        push(g, op, vec![x], shape)
    }

    /// Independent values of different shapes (so no two are one grouped loop): three large
    /// pointwise products, a large row sum, a small product and a scalar one. One function, one
    /// parallel region: the large members' loops work-shared without barriers, the small ones
    /// each on one thread.
    #[test]
    fn independent_kernels_share_one_parallel_region() {
        let mut g = Graph::default();
        for shape in [&[256usize, 256][..], &[300, 200], &[64, 1024], &[10], &[]] {
            let a = input(&mut g, shape);
            let b = input(&mut g, shape);
            let y = binary(&mut g, BinaryOp::Mul, a, b);
            g.outputs.push(y);
        }
        let x = input(&mut g, &[64, 1024]);
        let rows = sum(&mut g, x, vec![1], &[64]);
        g.outputs.push(rows);
        let alone = kernels(&g, false);
        assert_eq!(
            alone.len(),
            6,
            "one kernel per value without horizontal fusion"
        );
        let regions: usize = alone.iter().map(|k| count(&k.0, "parallel for")).sum();
        assert_eq!(regions, 4, "each large kernel opens its own region");
        let fused = kernels(&g, true);
        assert_eq!(fused.len(), 1, "one launch");
        let (k, outs) = &fused[0];
        assert_eq!(outs.len(), 6);
        assert_eq!(count(k, "#pragma omp parallel\n"), 1, "{}", k.source);
        assert_eq!(count(k, "parallel for"), 0, "{}", k.source);
        assert_eq!(count(k, "#pragma omp for "), 4, "{}", k.source);
        assert_eq!(count(k, "schedule(static) nowait"), 4, "{}", k.source);
        assert_eq!(count(k, "#pragma omp single nowait"), 2, "{}", k.source);
        // every member's inputs, then every member's outputs
        assert_eq!(k.inputs.len(), 11);
        assert_eq!(count(k, "args[16]"), 1, "{}", k.source);
    }

    /// Members that together are too small for threads run one after another on the calling
    /// thread, as they did as kernels of their own.
    #[test]
    fn small_members_open_no_region() {
        let mut g = Graph::default();
        for shape in [&[32usize, 32][..], &[100], &[7, 3]] {
            let a = input(&mut g, shape);
            let y = binary(&mut g, BinaryOp::Add, a, a);
            g.outputs.push(y);
        }
        let fused = kernels(&g, true);
        assert_eq!(fused.len(), 1);
        assert!(
            !fused[0].0.source.contains("#pragma omp"),
            "{}",
            fused[0].0.source
        );
    }

    /// A long single sum is summed in chunks in a parallel region of its own: it is not a
    /// member, and a pointwise kernel beside it keeps its own launch.
    #[test]
    fn chunked_sums_keep_their_own_region() {
        let mut g = Graph::default();
        let x = input(&mut g, &[1 << 16]);
        let total = sum(&mut g, x, vec![0], &[]);
        let a = input(&mut g, &[256, 256]);
        let y = binary(&mut g, BinaryOp::Mul, a, a);
        g.outputs = vec![total, y];
        let fused = kernels(&g, true);
        assert_eq!(fused.len(), 2);
        assert!(fused.iter().all(|k| count(&k.0, "parallel for") == 1));
    }

    /// Adam's shape on the CPU: each parameter's step count bumped in place (a scalar kernel),
    /// then the parameter updated in place reading the new count. Without horizontal fusion a
    /// launch each (ten); with it, the counts in one launch and the updates in another, the
    /// large updates' loops in one region. Members of one text (the counts; the updates of the
    /// two parameters of one shape) call one function.
    #[test]
    fn an_optimizer_step_is_two_launches() {
        let mut g = Graph::default();
        let shapes: [&[usize]; 5] = [&[256, 256], &[300, 200], &[256, 256], &[10], &[5, 5, 5]];
        crate::test_graphs::counted_updates(&mut g, kiln_core::Device::Cpu, &shapes);
        assert_eq!(kernels(&g, false).len(), 10);
        let fused = kernels(&g, true);
        let sizes: Vec<usize> = fused.iter().map(|k| k.1.len()).collect();
        assert_eq!(sizes, vec![5, 5]);
        assert!(fused
            .iter()
            .flat_map(|k| &k.1)
            .all(|o| matches!(o.1, Alloc::InPlace(_))));
        // five scalars: too little work for threads; one function called five times
        let counts = &fused[0].0;
        assert!(!counts.source.contains("#pragma omp"), "{}", counts.source);
        assert_eq!(count(counts, "static void m_"), 1, "{}", counts.source);
        assert_eq!(count(counts, "(a); }"), 5, "{}", counts.source);
        let update = &fused[1].0;
        assert_eq!(count(update, "#pragma omp parallel\n"), 1);
        assert_eq!(count(update, "static void m_"), 4, "{}", update.source);
        assert_eq!(count(update, "#pragma omp for "), 2, "{}", update.source);
        assert_eq!(count(update, "#pragma omp single nowait"), 2);
        assert_eq!(count(update, "(a); }"), 5);
    }

    /// Two horizontal kernels calling one member function, built in one translation unit (the
    /// guard defines it once), and run: each member reads and writes its own arguments.
    #[test]
    fn kernels_sharing_a_member_build_together_and_run() -> kiln_core::Result<()> {
        let Some(tc) = crate::runtime::cc::toolchain() else {
            eprintln!("SKIPPED: no C compiler");
            return Ok(());
        };
        let mut g = Graph::default();
        for (shape, op) in [
            (10, BinaryOp::Add),
            (12, BinaryOp::Mul),
            (14, BinaryOp::Sub),
        ] {
            let x = input(&mut g, &[shape]);
            let y = binary(&mut g, op, x, x);
            g.outputs.push(y);
        }
        let alone = kernels(&g, false);
        let [(add, _), (mul, _), (sub, _)] = &alone[..] else {
            panic!("three kernels planned, got {}", alone.len());
        };
        let first = super::horizontal(&[add, mul]).expect("members of a horizontal kernel");
        let second = super::horizontal(&[add, sub]).expect("members of a horizontal kernel");
        let fns = crate::runtime::cc::load(tc, &[(&first).into(), (&second).into()])?;
        let xs: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let zs: Vec<f32> = (0..14).map(|i| i as f32 + 0.5).collect();
        let (mut ys, mut ws) = (vec![0f32; 10], vec![1f32; 14]);
        let args = [xs.as_ptr(), zs.as_ptr(), ys.as_mut_ptr(), ws.as_mut_ptr()]
            .map(|p| p as *mut std::ffi::c_void);
        // SAFETY: the second kernel reads a [10] and a [14] f32 buffer and writes a [10] and a
        // [14] one, in that argument order; all four are alive and distinct
        unsafe { fns[1](args.as_ptr()) };
        assert_eq!(ys, xs.iter().map(|x| x + x).collect::<Vec<_>>());
        assert_eq!(ws, vec![0f32; 14]);
        Ok(())
    }
}
