// Channels-last convolutions as implicit GEMMs on tensor cores (TF32 mma.sync m16n8k8), for
// `conv_igemm.rs`. One template computes C[m][n] = sum_k A(m, k) B(k, n) where A and B are gathers
// from the convolution's tensors, never materialized (the operand structs below):
//
//   forward      FwdA, FwdB      m = (n, p, q)  n = out channel  k = (r, s, c)  A: x,  B: w
//   data grad    DgradA, DgradB  m = (n, h, w)  n = in channel   k = (r, s, k)  A: dy, B: w
//   weight grad  WgradA, WgradB  m = (r, s, c)  n = out channel  k = (n, p, q)  A: x,  B: dy
//
// x is [N, H, W, C], w is [K, R, S, C], y (and dy) [N, P, Q, K], all contiguous. The weight
// gradient's output dw[k][r][s][c] is C transposed (`transposed` below); its sum over N*P*Q is
// split across blocks (blockIdx.z), each writing a partial C that `conv_split_sum` adds up in a
// fixed order (no atomics: the same inputs give the same bits).
//
// Each operand is copied tile by tile (BK = 16 values of k) into shared memory asynchronously
// (`cp.async`), STAGES tiles in flight: the next tiles' copies run while the tensor cores work on
// the current one. Values are rounded to TF32 as the fragments are read. An operand whose
// memory runs along k (x in the forward) is kept k-major in shared memory ([rows][BK + 4]); one
// whose memory runs along its rows (w in the data gradient) row-major ([BK][rows + 8]): either
// way its four-wide copies and the fragments' reads are free of bank conflicts. VEC = 4 copies
// four neighbours at once (C and K multiples of 4, operands 16-byte aligned), VEC = 1 one value
// at a time.

struct ConvGeo {
    int n, h, w, c;   // input, NHWC
    int k, r, s;      // filter, KRSC
    int p, q;         // output height, width
    int sh, sw, ph, pw, dh, dw;
    int gm, gn, gk;   // the GEMM's sizes
    int tiles_per_split;  // k tiles each blockIdx.z sums
    int chunked;      // the forward and data gradient's k order (`tap_channel`)
};

#define BK 16

__device__ __forceinline__ unsigned to_tf32(float x) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void mma_tf32(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The tap (r * S + s) and channel of a forward or data-gradient k, over `ch` channels. Chunked
// (channels a multiple of BK, more than one tap): k = (channel block, tap, channel in block), so
// that one block of BK channels goes through every tap in consecutive tiles, whose windows of the
// input overlap: A's copies of the later taps find the rows in L1. Else k = (tap, channel).
__device__ __forceinline__ void tap_channel(const ConvGeo& g, int kk, int ch, int& tap, int& c) {
    if (g.chunked) {
        const int blk = kk / BK, taps = g.r * g.s;
        tap = blk % taps;
        c = (blk / taps) * BK + kk % BK;
    } else {
        tap = kk / ch;
        c = kk % ch;
    }
}

// An operand: `row` precomputes what a GEMM row (m for A, n for B) fixes and `kdec` what a k fixes
// (w = 0: k lies past the GEMM's); `at` gives the offset of element (row, k) in the tensor, or -1
// where the gather reads padding or lies outside the GEMM. A thread's k is the same for all its
// rows in a tile, so its decomposition (the divisions) is done once per tile, not per row.
// KMAJOR: whether consecutive k of one row are consecutive in memory (else consecutive rows are).

struct FwdA {  // x[n, p*sh - ph + r*dh, q*sw - pw + s*dw, c]
    static constexpr bool KMAJOR = true;
    static __device__ __forceinline__ int4 row(const ConvGeo& g, int m) {
        if (m >= g.gm) return make_int4(-1, 0, 0, 0);
        int q = m % g.q, t = m / g.q;
        int p = t % g.p, n = t / g.p;
        return make_int4(n * g.h * g.w * g.c, p * g.sh - g.ph, q * g.sw - g.pw, 0);
    }
    static __device__ __forceinline__ int4 kdec(const ConvGeo& g, int kk) {
        int rs, c;
        tap_channel(g, kk, g.c, rs, c);
        int r = rs / g.s, s = rs - r * g.s;
        return make_int4(c, r * g.dh, s * g.dw, kk < g.gk);
    }
    static __device__ __forceinline__ int at(const ConvGeo& g, int4 i, int4 d) {
        int h = i.y + d.y, w = i.z + d.z;
        if (i.x < 0 || !d.w || h < 0 || h >= g.h || w < 0 || w >= g.w) return -1;
        return i.x + (h * g.w + w) * g.c + d.x;
    }
};

struct FwdB {  // w[n][tap][c]
    static constexpr bool KMAJOR = true;
    static __device__ __forceinline__ int4 row(const ConvGeo& g, int n) {
        return make_int4(n < g.gn ? n * g.gk : -1, 0, 0, 0);
    }
    static __device__ __forceinline__ int4 kdec(const ConvGeo& g, int kk) {
        int rs, c;
        tap_channel(g, kk, g.c, rs, c);
        return make_int4(rs * g.c + c, 0, 0, kk < g.gk);
    }
    static __device__ __forceinline__ int at(const ConvGeo&, int4 i, int4 d) {
        return (i.x < 0 || !d.w) ? -1 : i.x + d.x;
    }
};

struct DgradA {  // dy[n, (h + ph - r*dh) / sh, (w + pw - s*dw) / sw, k] where the division is exact
    static constexpr bool KMAJOR = true;
    static __device__ __forceinline__ int4 row(const ConvGeo& g, int m) {
        if (m >= g.gm) return make_int4(-1, 0, 0, 0);
        int w = m % g.w, t = m / g.w;
        int h = t % g.h, n = t / g.h;
        return make_int4(n * g.p * g.q * g.k, h + g.ph, w + g.pw, 0);
    }
    static __device__ __forceinline__ int4 kdec(const ConvGeo& g, int kk) {
        int rs, k;
        tap_channel(g, kk, g.k, rs, k);
        int r = rs / g.s, s = rs - r * g.s;
        return make_int4(k, r * g.dh, s * g.dw, kk < g.gk);
    }
    static __device__ __forceinline__ int at(const ConvGeo& g, int4 i, int4 d) {
        int hp = i.y - d.y, wq = i.z - d.z;
        if (i.x < 0 || !d.w || hp < 0 || wq < 0) return -1;
        int p = hp, q = wq;
        if (g.sh > 1) {
            if (hp % g.sh) return -1;
            p = hp / g.sh;
        }
        if (g.sw > 1) {
            if (wq % g.sw) return -1;
            q = wq / g.sw;
        }
        if (p >= g.p || q >= g.q) return -1;
        return i.x + (p * g.q + q) * g.k + d.x;
    }
};

struct DgradB {  // w[k][r][s][c], rows c
    static constexpr bool KMAJOR = false;
    static __device__ __forceinline__ int4 row(const ConvGeo& g, int c) {
        return make_int4(c < g.gn ? c : -1, 0, 0, 0);
    }
    static __device__ __forceinline__ int4 kdec(const ConvGeo& g, int kk) {
        int rs, k;
        tap_channel(g, kk, g.k, rs, k);
        return make_int4((k * g.r * g.s + rs) * g.c, 0, 0, kk < g.gk);
    }
    static __device__ __forceinline__ int at(const ConvGeo&, int4 i, int4 d) {
        return (i.x < 0 || !d.w) ? -1 : d.x + i.x;
    }
};

struct WgradA {  // x[n, p*sh - ph + r*dh, q*sw - pw + s*dw, c], rows (r, s, c), k = (n, p, q)
    static constexpr bool KMAJOR = false;
    static __device__ __forceinline__ int4 row(const ConvGeo& g, int m) {
        if (m >= g.gm) return make_int4(-1, 0, 0, 0);
        int c = m % g.c, rs = m / g.c;
        int r = rs / g.s, s = rs - r * g.s;
        return make_int4(c, r * g.dh - g.ph, s * g.dw - g.pw, 0);
    }
    static __device__ __forceinline__ int4 kdec(const ConvGeo& g, int j) {
        int q = j % g.q, t = j / g.q;
        int p = t % g.p, n = t / g.p;
        return make_int4(n * g.h * g.w * g.c, p * g.sh, q * g.sw, j < g.gk);
    }
    static __device__ __forceinline__ int at(const ConvGeo& g, int4 i, int4 d) {
        int h = d.y + i.y, w = d.z + i.z;
        if (i.x < 0 || !d.w || h < 0 || h >= g.h || w < 0 || w >= g.w) return -1;
        return d.x + (h * g.w + w) * g.c + i.x;
    }
};

struct WgradB {  // dy[j][k], rows k
    static constexpr bool KMAJOR = false;
    static __device__ __forceinline__ int4 row(const ConvGeo& g, int k) {
        return make_int4(k < g.gn ? k : -1, 0, 0, 0);
    }
    static __device__ __forceinline__ int4 kdec(const ConvGeo& g, int j) {
        return make_int4(j * g.k, 0, 0, j < g.gk);
    }
    static __device__ __forceinline__ int at(const ConvGeo&, int4 i, int4 d) {
        return (i.x < 0 || !d.w) ? -1 : d.x + i.x;
    }
};

// Shared-memory words of one buffer of an operand with ROWS rows.
template <bool KMAJOR, int ROWS>
struct Smem {
    static constexpr int STRIDE = KMAJOR ? BK + 4 : ROWS + 8;
    static constexpr int WORDS = KMAJOR ? ROWS * STRIDE : BK * STRIDE;
    static __device__ __forceinline__ int index(int row, int k) {
        return KMAJOR ? row * STRIDE + k : k * STRIDE + row;
    }
};

// Asynchronous copies into shared memory (sm_80 and later): 16 or 4 bytes, zero-filled where the
// gather reads padding, so no register holds a tile on its way; through L1 (.ca), where a
// convolution's taps find the input rows an earlier tap read.
__device__ __forceinline__ unsigned shared_address(const unsigned* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void copy16(unsigned* dst, const float* src, bool valid) {
    unsigned d = shared_address(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(d), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy4(unsigned* dst, const float* src, bool valid) {
    unsigned d = shared_address(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(d), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void copies_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// One thread's share of an operand's tiles: PASSES groups of four values, each four neighbours
// in memory (along k for a k-major operand, along rows otherwise).
template <class OP, int ROWS, int THREADS, int VEC>
struct Loader {
    static constexpr int PASSES = ROWS * BK / 4 / THREADS;
    static constexpr int INFOS = OP::KMAJOR ? PASSES : (VEC == 4 ? 1 : 4);
    using S = Smem<OP::KMAJOR, ROWS>;
    int4 info[INFOS];
    int row_local, k_local;  // the first group's row and k within the tile

    __device__ __forceinline__ void init(const ConvGeo& g, int t, int row0) {
        if constexpr (OP::KMAJOR) {
            row_local = t / (BK / 4);
            k_local = (t % (BK / 4)) * 4;
#pragma unroll
            for (int i = 0; i < PASSES; ++i)
                info[i] = OP::row(g, row0 + row_local + i * (THREADS / (BK / 4)));
        } else {
            row_local = (t % (ROWS / 4)) * 4;
            k_local = t / (ROWS / 4);
#pragma unroll
            for (int j = 0; j < INFOS; ++j) info[j] = OP::row(g, row0 + row_local + j);
        }
    }

    // Starts the copies of the tile at k0 into `s`.
    __device__ __forceinline__ void load(const ConvGeo& g, const float* __restrict__ src, int k0,
                                         unsigned* s) {
        if constexpr (OP::KMAJOR) {
            // one k (or four) for all of this thread's rows
            int4 d[VEC == 4 ? 1 : 4];
#pragma unroll
            for (int j = 0; j < (VEC == 4 ? 1 : 4); ++j) d[j] = OP::kdec(g, k0 + k_local + j);
#pragma unroll
            for (int i = 0; i < PASSES; ++i) {
                unsigned* dst = s + S::index(row_local + i * (THREADS / (BK / 4)), k_local);
                if constexpr (VEC == 4) {
                    int o = OP::at(g, info[i], d[0]);
                    copy16(dst, src + (o < 0 ? 0 : o), o >= 0);
                } else {
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        int o = OP::at(g, info[i], d[j]);
                        copy4(dst + j, src + (o < 0 ? 0 : o), o >= 0);
                    }
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < PASSES; ++i) {
                const int kl = k_local + i * (THREADS / (ROWS / 4));
                int4 d = OP::kdec(g, k0 + kl);
                unsigned* dst = s + S::index(row_local, kl);
                if constexpr (VEC == 4) {
                    int o = OP::at(g, info[0], d);
                    copy16(dst, src + (o < 0 ? 0 : o), o >= 0);
                } else {
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        int o = OP::at(g, info[j % INFOS], d);
                        copy4(dst + j, src + (o < 0 ? 0 : o), o >= 0);
                    }
                }
            }
        }
    }
};

// Tiles in flight: while the tensor cores work on one, the copies of the next STAGES - 1 run.
#define STAGES 4

template <class OA, class OB, int VEC, int BM, int BN, int WM, int WN>
__device__ __forceinline__ void conv_gemm(const ConvGeo& g, const float* __restrict__ a_src,
                                          const float* __restrict__ b_src,
                                          float* __restrict__ out, bool transposed) {
    constexpr int THREADS = WM * WN * 32;
    constexpr int TM = BM / WM, TN = BN / WN;
    constexpr int MT = TM / 16, NT = TN / 8;
    using SA = Smem<OA::KMAJOR, BM>;
    using SB = Smem<OB::KMAJOR, BN>;
    // STAGES buffers of A, then STAGES of B (`Spec::shared_bytes` in conv_igemm.rs)
    extern __shared__ __align__(16) unsigned smem[];
    unsigned* sa = smem;
    unsigned* sb = smem + STAGES * SA::WORDS;

    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int wm = warp % WM, wn = warp / WM;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int ktiles = (g.gk + BK - 1) / BK;
    const int kt0 = blockIdx.z * g.tiles_per_split;
    const int kt1 = min(ktiles, kt0 + g.tiles_per_split);

    Loader<OA, BM, THREADS, VEC> la;
    Loader<OB, BN, THREADS, VEC> lb;
    la.init(g, t, m0);
    lb.init(g, t, n0);

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    // the first STAGES - 1 tiles; a group is committed for every stage, empty or not, so
    // that waiting for "all but the newest STAGES - 2" always means the tile needed next
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (kt0 + st < kt1) {
            la.load(g, a_src, (kt0 + st) * BK, sa + st * SA::WORDS);
            lb.load(g, b_src, (kt0 + st) * BK, sb + st * SB::WORDS);
        }
        copies_commit();
    }
    for (int kt = kt0; kt < kt1; ++kt) {
        copies_wait<STAGES - 2>();
        __syncthreads();
        // the buffer refilled now was read in the previous iteration, which every thread has
        // finished (the barrier above)
        const int next = kt + STAGES - 1;
        if (next < kt1) {
            const int st = (next - kt0) % STAGES;
            la.load(g, a_src, next * BK, sa + st * SA::WORDS);
            lb.load(g, b_src, next * BK, sb + st * SB::WORDS);
        }
        copies_commit();
        const int cur = (kt - kt0) % STAGES;
        const unsigned* A = sa + cur * SA::WORDS;
        const unsigned* B = sb + cur * SB::WORDS;
#pragma unroll
        for (int ks = 0; ks < BK; ks += 8) {
            const int kc = ks + (lane & 3);
            unsigned af[MT][4], bf[NT][2];
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const int r = wm * TM + i * 16 + (lane >> 2);
                af[i][0] = to_tf32(__uint_as_float(A[SA::index(r, kc)]));
                af[i][1] = to_tf32(__uint_as_float(A[SA::index(r + 8, kc)]));
                af[i][2] = to_tf32(__uint_as_float(A[SA::index(r, kc + 4)]));
                af[i][3] = to_tf32(__uint_as_float(A[SA::index(r + 8, kc + 4)]));
            }
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int n = wn * TN + j * 8 + (lane >> 2);
                bf[j][0] = to_tf32(__uint_as_float(B[SB::index(n, kc)]));
                bf[j][1] = to_tf32(__uint_as_float(B[SB::index(n, kc + 4)]));
            }
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j) mma_tf32(acc[i][j], af[i], bf[j]);
        }
    }
    copies_wait<0>();

    // C fragment: c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1)
    float* o = out + (long long)blockIdx.z * g.gm * g.gn;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int r = m0 + wm * TM + i * 16 + (lane >> 2);
            const int c = n0 + wn * TN + j * 8 + 2 * (lane & 3);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int rr = r + (e >> 1) * 8, cc = c + (e & 1);
                if (rr < g.gm && cc < g.gn) {
                    const long long idx = transposed ? (long long)cc * g.gm + rr
                                                     : (long long)rr * g.gn + cc;
                    o[idx] = acc[i][j][e];
                }
            }
        }
    }
}

#define CONV_KERNEL(NAME, OA, OB, VEC, BM, BN, WM, WN, T)                                   \
    extern "C" __global__ void __launch_bounds__(WM * WN * 32, 2)                              \
    NAME(ConvGeo g, const float* __restrict__ a, const float* __restrict__ b,               \
         float* __restrict__ out) {                                                         \
        conv_gemm<OA, OB, VEC, BM, BN, WM, WN>(g, a, b, out, T);                            \
    }

// The kernels: `conv_igemm.rs` appends one CONV_KERNEL line per module (NVRTC builds only the
// ones a process uses, each on its own thread).
