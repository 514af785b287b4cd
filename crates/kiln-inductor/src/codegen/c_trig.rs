//! Pointwise kernels that compute the sine or cosine of f32 values, on the CPU. Their innermost
//! loop runs in blocks of `BLOCK` elements. Each block is computed with the inline sine and
//! cosine of `runtime/trig.rs`, which GCC vectorizes and which share one reduction between
//! `sin(x)` and `cos(x)`. The same loop notes whether an operand was beyond their range
//! (`kiln_far`: magnitude 2^20 or more, or infinite). Such a block is computed again with
//! `kiln_sinf`/`kiln_cosf`, the C library's functions (libmvec's where `runtime/cc.rs` finds
//! it), which are right for every float. The check is a compare and an or per element.
//!
//! The second pass reads the block's inputs again and rewrites its outputs, so a kernel that
//! writes an input in place (reads it through its output) keeps the C library's functions: by
//! then its inputs are overwritten. Reductions, row and sibling kernels call the C library's
//! functions too: only the pointwise loop is blocked.
//!
//! `sin(x) + cos(x)` on a Sapphire Rapids core (GCC 13, 256-bit vectors), 2^16 floats in cache:
//! 0.45 ns per element, where libmvec's calls took 0.87 to 1.0 ns. On 16 cores over 2^26 floats
//! the kernel now takes the time of a generated `x + 1` (5.9 ms, memory-bound), where it took
//! 8.0 to 8.6 ms.

/// Elements per block: few enough that a block's operands are still in L1 when a second pass
/// reads them, enough that the check and the loop's set-up are a small part of a block.
pub(super) const BLOCK: usize = 1024;

/// In a kernel's text where it calls the inline functions: `runtime/cc.rs` then defines them in
/// its translation unit.
pub(crate) const MARK: &str = "kiln_far(";

/// The text inside a pointwise kernel's loops, the innermost of them (variable `v`, extent `n`)
/// stepping by `BLOCK`, when its `body` computes the sine or cosine of the f32 values `args` and
/// the kernel writes no input in place (`in_place`); `None` otherwise.
pub(super) fn blocks(
    (v, n): (usize, usize),
    body: &str,
    stores: &str,
    args: &[String],
    in_place: bool,
) -> Option<String> {
    if args.is_empty() || in_place {
        return None;
    }
    // `ir/lower.rs` writes f32 sines and cosines as these calls (f64 ones as `kiln_sin(`...)
    let fast = body
        .replace("kiln_sinf(", "kiln_fast_sinf(")
        .replace("kiln_cosf(", "kiln_fast_cosf(");
    let far: Vec<String> = args.iter().map(|a| format!("{MARK}{a})")).collect();
    let i = format!("i{v}");
    let each = format!("  for (int64_t {i} = {i}_lo; {i} < {i}_hi; {i}++)\n");
    Some(format!(
        "  {{\n  const int64_t {i}_lo = {i}, {i}_hi = {i} + {BLOCK} < {n} ? {i} + {BLOCK} : {n};\n  \
         int far = 0;\n{each}  {{\n{fast}    far |= {};\n{stores}  }}\n  if (far)\n{each}  {{\n{body}\
         {stores}  }}\n  }}\n",
        far.join(" | ")
    ))
}

#[cfg(test)]
mod tests {
    use kiln_core::{DType, Result, Tensor};

    use super::{BLOCK, MARK};
    use crate::test_graphs::{planned_kernels, C_TARGET as TARGET};

    /// The sine and cosine of `x`, compiled by the `kiln` backend.
    fn compiled(x: &Tensor) -> Result<Vec<Tensor>> {
        crate::register();
        let f = kiln_compile::compile_fn(
            |a: &[Tensor]| Ok(vec![a[0].sin()?, a[0].cos()?]),
            kiln_compile::CompileOptions::default(),
        )?;
        let args = std::slice::from_ref(x);
        // the first call traces (computing eagerly); the second runs the kernels
        kiln_core::no_grad(|| f.call(args))?;
        kiln_core::no_grad(|| f.call(args))
    }

    /// Only a pointwise loop over f32 sines or cosines is blocked: an f64 one, a reduction over
    /// sines and a kernel without them keep their text.
    #[test]
    fn only_pointwise_f32_sines_and_cosines_are_blocked() -> Result<()> {
        let x = Tensor::randn(&[3, 5000], DType::F32)?;
        let sincos = |a: &[Tensor]| Ok(vec![a[0].sin()?.add(&a[0].cos()?)?]);
        let k = planned_kernels(&TARGET, sincos, std::slice::from_ref(&x))?;
        assert_eq!(k.len(), 1);
        let src = &k[0].0.source;
        // one argument checked for both, the innermost loop stepping by blocks
        assert_eq!(src.matches(MARK).count(), 1, "{src}");
        assert!(src.contains(&format!("i1 += {BLOCK})")), "{src}");
        assert!(
            src.contains("kiln_fast_sinf(") && src.contains("kiln_sinf("),
            "{src}"
        );
        for f in [
            |a: &[Tensor]| Ok(vec![a[0].exp()?.mul(2.0)?]),
            |a: &[Tensor]| Ok(vec![a[0].sin()?.sum(&[1], false)?]),
            |a: &[Tensor]| Ok(vec![a[0].to_dtype(DType::F64)?.sin()?]),
        ] {
            for (k, _) in planned_kernels(&TARGET, f, std::slice::from_ref(&x))? {
                assert!(!k.source.contains(MARK), "{}", k.source);
                assert!(!k.source.contains(&format!("+= {BLOCK})")), "{}", k.source);
            }
        }
        Ok(())
    }

    /// Independent loops over sines and cosines in one parallel region (`c_horizontal.rs`):
    /// each member's innermost loop is work-shared by blocks, and the results are right.
    #[test]
    fn horizontal_members_keep_their_blocks() -> Result<()> {
        let (x, y) = (
            Tensor::randn(&[40000], DType::F32)?,
            Tensor::randn(&[40, 1000], DType::F32)?,
        );
        let f = |a: &[Tensor]| Ok(vec![a[0].sin()?, a[1].mul(100.0)?.cos()?]);
        let k = planned_kernels(&TARGET, f, &[x.clone(), y.clone()])?;
        assert_eq!(k.len(), 1, "one horizontal kernel");
        let src = &k[0].0.source;
        assert_eq!(src.matches("#pragma omp for ").count(), 2, "{src}");
        assert_eq!(src.matches(&format!("+= {BLOCK})")).count(), 2, "{src}");
        crate::register();
        let c = kiln_compile::compile_fn(f, kiln_compile::CompileOptions::default())?;
        let args = [x, y];
        kiln_core::no_grad(|| c.call(&args))?;
        let got = kiln_core::no_grad(|| c.call(&args))?;
        for (g, w) in got.iter().zip(f(&args)?) {
            for (p, q) in g.to_vec::<f32>()?.iter().zip(w.to_vec::<f32>()?) {
                assert!(
                    (p - q).abs() <= 1e-6 * p.abs().max(q.abs()),
                    "{p:e} vs {q:e}"
                );
            }
        }
        Ok(())
    }

    /// Compiled sines and cosines against the C library's (what eager kernels compute), within
    /// compile_ops' tolerance for them (1e-6 relative), signed zeros and NaN exactly: blocks of
    /// arguments in range, one with the special values in range, one with those and every kind
    /// of argument beyond it (computed again by the C library), and a short last block with them
    /// too. Several threads share the blocks.
    #[test]
    fn sines_and_cosines_match_the_c_library() -> Result<()> {
        let n = 40 * BLOCK + 100;
        let mut state = 0x2545f4914f6cdd1du64;
        let mut xs: Vec<f32> = (0..n)
            .map(|i| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                // alternate blocks: |x| <= 1e4, and up to the inline functions' bound (2^20)
                match (i / BLOCK) % 2 {
                    0 => u * 1e4,
                    _ => u * 1048575.0,
                }
            })
            .collect();
        let in_range = [
            0.0,
            -0.0,
            1e-40,
            -1e-45,
            f32::MIN_POSITIVE,
            f32::NAN,
            std::f32::consts::FRAC_PI_2,
            -std::f32::consts::PI,
            1048575.9,
            -1048575.9,
        ];
        let beyond = [
            f32::INFINITY,
            f32::NEG_INFINITY,
            1048576.0,
            -1e6,
            1e20,
            -3.4e38,
            f32::MAX,
        ];
        let specials = in_range.iter().chain(&beyond);
        for (k, &v) in in_range.iter().enumerate() {
            xs[3 * BLOCK + 11 * k] = v;
        }
        for (k, &v) in specials.enumerate() {
            xs[6 * BLOCK + 7 * k] = v;
            xs[n - 1 - k] = v;
        }
        let out = compiled(&Tensor::from_slice(&xs, &[n])?)?;
        let (sin, cos) = (out[0].to_vec::<f32>()?, out[1].to_vec::<f32>()?);
        for (i, &x) in xs.iter().enumerate() {
            for (got, want, what) in [(sin[i], x.sin(), "sin"), (cos[i], x.cos(), "cos")] {
                let ok = match (want.is_nan(), want == 0.0) {
                    (true, _) => got.is_nan(),
                    (false, true) => got.to_bits() == want.to_bits(),
                    (false, false) => {
                        let diff = (got as f64 - want as f64).abs();
                        got.is_finite() && diff <= 1e-6 * (got.abs().max(want.abs()) as f64)
                    }
                };
                assert!(
                    ok,
                    "{what}({x:e}) = {want:e}, compiled {got:e} (element {i})"
                );
            }
        }
        Ok(())
    }
}
