// Hopper's weight gradient of a channels-last convolution, for `conv_wgmma_wgrad.rs`: f32
// operands, TF32 tensor cores. Per tap (r, s) it is a GEMM over the output's pixels,
//
//   dw[k][r][s][c] = sum_m X_rs(c, m) dY(k, m)     m = (n, p, q)
//   X_rs(c, m) = x[n, p*sh - ph + r*dh, q*sw - pw + s*dw, c]   dY(k, m) = dy[n, p, q, k]
//
// with M = 128 input channels a block (two consumer warpgroups of 64), N = BN output channels,
// and the sum over m in steps of WG_BK = 32 pixels. The tensor memory accelerator copies both
// operands as the forward's does (`conv_wgmma.cu`): x's windows for the block's tap by the im2col
// map, dy's rows as 2-d boxes; both land as [32 pixels][32 channels] boxes in 128-byte swizzled
// rows. But both run along their channels, and TF32 wgmma reads only k-major (here: pixel-major)
// operands from shared memory, so
// - A (X) comes from registers: each consumer loads its fragments from x's boxes with the
//   addresses transposed;
// - B (dY) is transposed by the consumers into a pixel-major, 128-byte swizzled copy (two of
//   them, so the next step's transposition runs while this step's MMA reads the other), then
//   `fence.proxy.async` makes the generic proxy's writes visible to the MMA.
// A stage goes back to the producer as soon as its A fragments are in registers and its dy is
// transposed: the MMA reads neither.
//
// The grid: (input-channel blocks, output-channel blocks, taps x splits): the sum over m is split
// into `splits` chunks of g.chunk pixels (a multiple of WG_BK, so a box never crosses two), each
// block writing its partial dw into its split's slice of `out` (one split: out is dw itself),
// which `conv_split_sum` then adds in a fixed order. Boxes of channels wholly past C or K are not
// copied: rows and columns of the accumulators they would feed are not written out.

struct WgradGeo {
    int c, k;         // input and output channels
    int r, s;         // filter height, width
    int p, q;         // output height, width
    int sh, sw, ph, pw, dh, dw;
    int m;            // N * P * Q
    int chunk;        // pixels a split sums over, a multiple of WG_BK
    int splits;
};

// The MMA of one k step of 8 over a tile BN wide, A from registers (generated: its accumulator
// list depends on BN).
template <int BN>
__device__ __forceinline__ void wgmma_tile_ra(float* d, const unsigned* a, unsigned long long b);

#define WG_BM 128
#define WG_BK 32

#define CONV_WGRAD_KERNEL(NAME, BN, STAGES)                                                     \
    extern "C" __global__ void __launch_bounds__(384, 1)                                        \
    NAME(const __grid_constant__ TensorMap xmap, const __grid_constant__ TensorMap dymap,       \
         float* __restrict__ out, WgradGeo g) {                                                 \
        conv_wgmma_wgrad<BN, STAGES>(&xmap, &dymap, out, g);                                    \
    }

// Element (row, col) of a [32][32] box swizzled by 128 bytes: 16-byte chunk col / 4 of row `row`
// lands at chunk (col / 4) ^ (row % 8).
__device__ __forceinline__ int swizzled(int row, int col) {
    return row * 32 + ((((col >> 2) ^ (row & 7))) << 2) + (col & 3);
}

// dy's [32 m][BN k] boxes at `dyt` into bt[k][m] (BN rows of 32 pixels, 128-byte swizzled: the
// MMA's k-major B), by the 8 consumer warps, then fenced so the MMA (the async proxy) sees the
// writes after the next barrier. A warp moves 4 channels of 8 pixels a step (lane bits: k % 4,
// then m % 4, then m / 4 % 2): its reads hit 32 banks, its writes 16.
template <int BN>
__device__ __forceinline__ void transpose_dy(const float* dyt, float* bt, int consumer_warp,
                                             int lane) {
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
        const int q = i * 8 + consumer_warp;
        const int m = (q & 3) * 8 + (lane >> 4) * 4 + ((lane >> 2) & 3);
        const int k = (q >> 2) * 4 + (lane & 3);
        bt[swizzled(k, m)] = dyt[(k >> 5) * 32 * 32 + swizzled(m, k & 31)];
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

template <int BN, int STAGES>
__device__ __forceinline__ void conv_wgmma_wgrad(const TensorMap* xmap, const TensorMap* dymap,
                                                 float* __restrict__ out, const WgradGeo& g) {
    constexpr int BOX = 32 * 32, A_BOXES = WG_BM / 32, B_BOXES = BN / 32;
    constexpr int A_FLOATS = A_BOXES * BOX, B_FLOATS = B_BOXES * BOX;
    extern __shared__ unsigned char raw[];
    // the 128-byte swizzle repeats every 1024 bytes: boxes start on that boundary
    float* sa = (float*)(((unsigned long long)raw + 1023) & ~1023ull);
    float* sdy = sa + STAGES * A_FLOATS;
    float* sbt = sdy + STAGES * B_FLOATS;  // two transposed copies of dy, [BN][WG_BK] each
    unsigned long long* full = (unsigned long long*)(sbt + 2 * B_FLOATS);
    unsigned long long* empty = full + STAGES;
    const int group = threadIdx.x / 128, t = threadIdx.x % 128;
    const int c0 = blockIdx.x * WG_BM, k0 = blockIdx.y * BN;
    const int tap = blockIdx.z / g.splits, split = blockIdx.z % g.splits;
    const int r = tap / g.s, s = tap % g.s;
    const int mbeg = split * g.chunk, mend = min(g.m, mbeg + g.chunk);
    const int ktiles = mend > mbeg ? (mend - mbeg + WG_BK - 1) / WG_BK : 0;
    // boxes holding some channel of x or dy
    const int a_boxes = min(A_BOXES, (g.c - c0 + 31) / 32);
    const int b_boxes = min(B_BOXES, (g.k - k0 + 31) / 32);
    pipeline_init(full, empty, STAGES);
    if (group == 0) {
        if (t != 0) return;
        for (int kt = 0; kt < ktiles; ++kt) {
            const int st = kt % STAGES, round = kt / STAGES;
            if (round > 0) barrier_wait(&empty[st], (round - 1) & 1);
            const int m0 = mbeg + kt * WG_BK;
            // the first pixel's window corner; the walk goes on from there, image to image
            const int q0 = m0 % g.q, p0 = (m0 / g.q) % g.p, img = m0 / (g.q * g.p);
            const int w0 = q0 * g.sw - g.pw, h0 = p0 * g.sh - g.ph;
            barrier_expect(&full[st], (a_boxes + b_boxes) * BOX * 4);
            for (int b = 0; b < a_boxes; ++b)
                copy_im2col(sa + st * A_FLOATS + b * BOX, xmap, &full[st], c0 + 32 * b, w0, h0,
                            img, (unsigned short)(s * g.dw), (unsigned short)(r * g.dh));
            for (int b = 0; b < b_boxes; ++b)
                copy_box_2d(sdy + st * B_FLOATS + b * BOX, dymap, &full[st], k0 + 32 * b, m0);
        }
        return;
    }
    const int half = group - 1, warp = t / 32, lane = t % 32;
    const int consumer_warp = half * 4 + warp;  // 0..7
    float d[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
    unsigned a[WG_BK / 8][4];
    // each step's dy is transposed during the MMA of the step before (into the other copy), and
    // each step's MMA is waited for within its step: an MMA in flight across the loop's back edge
    // would have ptxas serialize the MMAs (its C7515), the zeroed accumulators defined on the
    // loop's other way in
    if (ktiles > 0) {
        barrier_wait(&full[0], 0);
        transpose_dy<BN>(sdy, sbt, consumer_warp, lane);
    }
    for (int kt = 0; kt < ktiles; ++kt) {
        const int st = kt % STAGES;
        // A's fragments (the m64n?k8 TF32 layout: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4),
        // a3 (g + 8, t + 4) of the warp's 16 rows, g = lane / 4, t = lane % 4) from x's boxes,
        // rows c, columns m
        const float* xt = sa + st * A_FLOATS;
#pragma unroll
        for (int kk = 0; kk < WG_BK / 8; ++kk) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int c = half * 64 + warp * 16 + (lane >> 2) + 8 * (i & 1);
                const int m = kk * 8 + (lane & 3) + 4 * (i >> 1);
                a[kk][i] = __float_as_uint(xt[(c >> 5) * BOX + swizzled(m, c & 31)]);
            }
        }
        // every consumer's transposition of this step is written and its last MMA done
        asm volatile("bar.sync 1, 256;" ::: "memory");
        // the stage is in registers and transposed: back to the producer
        if (t == 0) barrier_arrive(&empty[st]);
        const float* bt = sbt + (kt & 1) * B_FLOATS;
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int kk = 0; kk < WG_BK / 8; ++kk) wgmma_tile_ra<BN>(d, a[kk], operand(bt + kk * 8));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        // the next step's dy into the other copy, last read by the MMA before this one, which
        // every consumer waited for before this step's barrier
        if (kt + 1 < ktiles) {
            const int next = (kt + 1) % STAGES;
            barrier_wait(&full[next], ((kt + 1) / STAGES) & 1);
            transpose_dy<BN>(sdy + next * B_FLOATS, sbt + ((kt + 1) & 1) * B_FLOATS,
                             consumer_warp, lane);
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    }
    // the accumulators: rows c (warp w: 16w + lane / 4, + 8), columns k (8j + 2 (lane % 4),
    // + 1), in registers 4j + 2 * (second row) + {0, 1}; dw is [k][r][s][c]
    float* o = out + (size_t)split * g.k * g.r * g.s * g.c;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = c0 + half * 64 + warp * 16 + (lane >> 2) + 8 * h;
#pragma unroll
            for (int v = 0; v < 2; ++v) {
                const int k = k0 + 8 * j + 2 * (lane & 3) + v;
                if (c < g.c && k < g.k)
                    o[(((size_t)k * g.r + r) * g.s + s) * g.c + c] = d[4 * j + 2 * h + v];
            }
        }
    }
}
