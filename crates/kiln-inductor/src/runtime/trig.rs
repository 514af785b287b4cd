//! Single-precision sine and cosine as inline C, for the loops of pointwise kernels
//! (`codegen/c_trig.rs` says which loops call them, and how arguments beyond their range are
//! handled).
//!
//! glibc's vector variants (`cc.rs` `VECTOR_MATH`) are calls the compiler cannot see into: a
//! kernel computing `sin(x) + cos(x)` reduces the same argument twice, and libmvec's AVX2 variant
//! is what GCC calls on a CPU it tunes for 256-bit vectors (Sapphire Rapids), however wide its
//! registers. These are plain C the vectorizer inlines at any width, and `sin(x)` and `cos(x)` of
//! one operand share their reduction and both polynomials (the quadrant only picks and signs).
//!
//! The argument is reduced to `r = x - k·π/2`, `|r| <= π/4`, and `sin(r)` and `cos(r)` are
//! polynomials in float (Chebyshev fits on that interval). With FMA, `k·π/2` is subtracted in three
//! float parts (Cody and Waite): the first product and difference are exact, the other two are
//! rounded once each. Without FMA the reduction is in double, `π/2` split so that the first
//! product (of at most 25 + 20 bits) and difference are exact. The quadrant is read from the
//! bits of `x·2/π` rounded by adding 1.5·2^23 (1.5·2^52 in double): no float-to-int conversion,
//! which C leaves undefined for NaN. NaN and infinity give NaN.
//!
//! Accuracy, checked exhaustively on every float of magnitude below 2^20 against glibc's double
//! `sin` and `cos` (with GCC 12, vectorized for AVX-512 and for SSE4.2, which has no FMA): within
//! 1.81 ulp of the exact result with FMA (1.67 for sine), 1.50 without;
//! at most 1.62e-7 relative from glibc's `sinf` and `cosf`, which eager kernels call. From 2^20
//! up the three-part reduction loses bits (7.5 ulp at 2^21, none left at 2^22), so `kiln_far`
//! sends such arguments to the C library.

/// The definitions, added to a translation unit after the C library's (`cc.rs`) when one of its
/// kernels calls them.
pub(crate) const FAST_TRIG: &str = "\
#define KILN_FAST_TRIG_MAX 0x1p20f
/* Whether x is beyond the reduction below: its block is computed by kiln_sinf/kiln_cosf. */
static inline int kiln_far(float x) { return fabsf(x) >= KILN_FAST_TRIG_MAX; }
#ifdef __FP_FAST_FMAF
#define KILN_FMAF(a, b, c) __builtin_fmaf(a, b, c)
/* x - k*pi/2 for k the integer nearest x*2/pi, whose low bits go to q */
static inline float kiln_reduce(float x, uint32_t *q)
{
  const float m = KILN_FMAF(x, 0x1.45f306p-1f, 0x1.8p23f), k = m - 0x1.8p23f;
  __builtin_memcpy(q, &m, 4);
  const float r = KILN_FMAF(k, -0x1.921fb6p0f, x);
  return KILN_FMAF(k, 0x1.ee59dap-50f, KILN_FMAF(k, 0x1.777a5cp-25f, r));
}
#else
#define KILN_FMAF(a, b, c) ((a) * (b) + (c))
/* the same in double, pi/2 in two parts: the first has 25 bits, so that its product with k
   (below 2^20) and the difference are exact */
static inline float kiln_reduce(float x, uint32_t *q)
{
  const double d = x, m = d * 0x1.45f306dc9c883p-1 + 0x1.8p52, k = m - 0x1.8p52;
  uint64_t u;
  __builtin_memcpy(&u, &m, 8);
  *q = (uint32_t)u;
  return (float)((d - k * 0x1.921fb5p0) - k * 0x1.110b4611a6263p-26);
}
#endif
/* sin(r) and cos(r) for |r| <= pi/4, r2 = r*r */
static inline float kiln_sin_poly(float r, float r2)
{
  const float p = KILN_FMAF(r2, KILN_FMAF(r2, -0x1.9ac9bp-13f, 0x1.110c28p-7f), -0x1.555552p-3f);
  return KILN_FMAF(r * r2, p, r);
}
static inline float kiln_cos_poly(float r2)
{
  const float p = KILN_FMAF(r2, KILN_FMAF(r2, 0x1.9a6f2cp-16f, -0x1.6c0e08p-10f), 0x1.55554cp-5f);
  return KILN_FMAF(r2, KILN_FMAF(r2, p, -0x1p-1f), 1.0f);
}
/* sin(x) (cos = 0) or cos(x) (cos = 1), which after inlining share everything but the last
   line. Both reduce |x|: sin is odd and cos even, exactly, and sin(-0) is -0. Both polynomials
   are computed and one is picked with integer masks (the cosine's for odd q, negated for q & 2;
   cos(x) is sin(x) a quadrant on): with a branch the compiler sinks the unused one into it, and
   without masked vector moves (AVX2, SSE) it does not if-convert float arithmetic on one side
   only (-ftrapping-math), so the loop would not vectorize. */
static inline float kiln_trig(float x, int cos)
{
  uint32_t q, bits;
  __builtin_memcpy(&bits, &x, 4);
  const float r = kiln_reduce(fabsf(x), &q), r2 = r * r;
  const float s = kiln_sin_poly(r, r2), c = kiln_cos_poly(r2);
  uint32_t su, cu;
  __builtin_memcpy(&su, &s, 4);
  __builtin_memcpy(&cu, &c, 4);
  const uint32_t q30 = q << 30, q31 = q << 31;
  const uint32_t swap = (su ^ cu) & (uint32_t)((int32_t)q31 >> 31);
  const uint32_t u = cos ? (cu ^ swap) ^ ((q30 ^ q31) & 0x80000000u)
                         : (su ^ swap) ^ ((q30 ^ bits) & 0x80000000u);
  float v;
  __builtin_memcpy(&v, &u, 4);
  return v;
}
static inline float kiln_fast_sinf(float x) { return kiln_trig(x, 0); }
static inline float kiln_fast_cosf(float x) { return kiln_trig(x, 1); }

";
