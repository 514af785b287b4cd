// Hopper's building blocks for the generated convolutions on compute capability 9.0
// (`conv_wgmma.cu`'s forward, `conv_wgmma_wgrad.cu`'s weight gradient; each module's text starts
// with this file): tensor maps, the tensor memory accelerator's copies, shared-memory barriers
// and the warpgroup MMA's view of a swizzled operand in shared memory.

// A tensor map as the driver encodes it (`cuTensorMapEncode*`): opaque, passed by value.
struct __align__(64) TensorMap {
    unsigned long long words[16];
};

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void barrier_init(unsigned long long* b, int arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(arrivals));
}

// A producer/consumer pipeline's barriers, set up by one thread before the whole block syncs:
// each of the `stages` `full` barriers waits for the producer's one arrival (and its copies'
// bytes), each `empty` one for both consumer warpgroups.
__device__ __forceinline__ void pipeline_init(unsigned long long* full, unsigned long long* empty,
                                              int stages) {
    if (threadIdx.x == 0) {
        for (int i = 0; i < stages; ++i) {
            barrier_init(&full[i], 1);
            barrier_init(&empty[i], 2);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
}

// The producer's arrival, announcing the bytes its copies will bring.
__device__ __forceinline__ void barrier_expect(unsigned long long* b, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 ::"r"(smem_addr(b)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void barrier_arrive(unsigned long long* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}

// Waits until the barrier's phase of this parity has completed.
__device__ __forceinline__ void barrier_wait(unsigned long long* b, int parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(smem_addr(b)), "r"(parity) : "memory");
}

// BM pixels' BK channels, the pixels the im2col map's walk reaches from (c, w, h, n), each read
// at (w + ow, h + oh): the tap's offsets.
__device__ __forceinline__ void copy_im2col(void* dst, const TensorMap* map,
                                            unsigned long long* bar, int c, int w, int h, int n,
                                            unsigned short ow, unsigned short oh) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2], {%7, %8};"
        ::"r"(smem_addr(dst)), "l"(map), "r"(smem_addr(bar)), "r"(c), "r"(w), "r"(h), "r"(n),
          "h"(ow), "h"(oh) : "memory");
}

__device__ __forceinline__ void copy_box(void* dst, const TensorMap* map, unsigned long long* bar,
                                         int c0, int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];"
        ::"r"(smem_addr(dst)), "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// A box of a 2-d tiled map at (c0, c1), innermost first.
__device__ __forceinline__ void copy_box_2d(void* dst, const TensorMap* map,
                                            unsigned long long* bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];"
        ::"r"(smem_addr(dst)), "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1) : "memory");
}

// The MMA's view of a k-major operand in shared memory swizzled by 128 bytes: rows of 128 bytes
// (BK values) in atoms of 8 rows, 1024 bytes apart (the stride field); the leading offset is
// unused for this layout (1 by convention); layout 1 = 128-byte swizzle. Stepping k by 8 values
// within the row adds 32 bytes to the start address: the swizzle applies to the final address.
__device__ __forceinline__ unsigned long long operand(const void* p) {
    const unsigned long long a = smem_addr(p);
    return ((a & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}
