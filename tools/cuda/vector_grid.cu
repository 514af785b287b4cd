// How many blocks a vector loop should launch (BENCHMARKS.md, "A thread per vector"): sin+cos and
// x + 1 over 2^26 floats, four elements a thread per step as kiln's vector loops take them, in
// grid-stride loops of several grids (32 waves of blocks per multiprocessor, the resident count
// and its multiples) and with a thread per vector.
// On the GPU machine: nvcc -O3 -arch=sm_90 -o /tmp/vector_grid tools/cuda/vector_grid.cu && /tmp/vector_grid
#include <cstdio>
#include <cuda_runtime.h>
struct __align__(16) v4 { float x, y, z, w; };
__global__ void sc(const float* __restrict__ a, float* __restrict__ s, long long n4) {
  long long stride = (long long)gridDim.x * blockDim.x;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n4; e += stride) {
    v4 x = ((const v4*)a)[e], so, co;
    sincosf(x.x, &so.x, &co.x); sincosf(x.y, &so.y, &co.y); sincosf(x.z, &so.z, &co.z); sincosf(x.w, &so.w, &co.w);
    so.x += co.x; so.y += co.y; so.z += co.z; so.w += co.w;
    ((v4*)s)[e] = so;
  }
}
__global__ void add(const float* __restrict__ a, float* __restrict__ s, long long n4) {
  long long stride = (long long)gridDim.x * blockDim.x;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n4; e += stride) {
    v4 x = ((const v4*)a)[e]; x.x += 1.f; x.y += 1.f; x.z += 1.f; x.w += 1.f; ((v4*)s)[e] = x;
  }
}
int main() {
  long long n = 1LL << 26, n4 = n / 4;
  float *a, *s; cudaMalloc(&a, n * 4); cudaMalloc(&s, n * 4);
  cudaMemset(a, 0x3f, n * 4);
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  const char* names[] = {"sm*32", "sm*active", "sm*active*2", "sm*active*4", "roundup32", "one-per-vector"};
  for (int which = 0; which < 2; which++) {
    int blocks[] = {128, 256, 512, 1024};
    for (int bi = 0; bi < 4; bi++) {
      int b = blocks[bi], active;
      const void* k = which == 0 ? (const void*)sc : (const void*)add;
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&active, k, b, 0);
      cudaFuncAttributes fa; cudaFuncGetAttributes(&fa, k);
      long long grids[] = {(long long)sms * 32, (long long)sms * active, (long long)sms * active * 2,
                           (long long)sms * active * 4, (long long)sms * ((32 + active - 1) / active) * active,
                           (n4 + b - 1) / b};
      for (int gi = 0; gi < 6; gi++) {
        long long g = grids[gi] < (n4 + b - 1) / b ? grids[gi] : (n4 + b - 1) / b;
        auto launch = [&] { if (which == 0) sc<<<g, b>>>(a, s, n4); else add<<<g, b>>>(a, s, n4); };
        for (int w = 0; w < 3; w++) launch();
        cudaEventRecord(e0);
        for (int r = 0; r < 50; r++) launch();
        cudaEventRecord(e1); cudaEventSynchronize(e1);
        float ms; cudaEventElapsedTime(&ms, e0, e1);
        printf("%s block %4d regs %d active %d grid %8lld (%s) %.1f us\n", which == 0 ? "sincos" : "add", b,
               fa.numRegs, active, g, names[gi], ms * 1000 / 50);
      }
    }
  }
}
