// Run on the GPU machine: nvcc -O3 -arch=sm_90 --fmad=false tools/adam_member.cu -o /tmp/adam_member && /tmp/adam_member
// Adam update member as kiln generates it (10 x 1M f32), three ways to get the step scalars:
// 0: each thread computes pow(0.9, step) etc. in double (as generated), 1: thread 0 of each block
// computes them into shared memory, 2: precomputed scalars read from memory.
#include <cstdio>
#include <cuda_runtime.h>
template <typename T> struct alignas(4 * sizeof(T)) kiln_v4 { T v[4]; };
#define N 1048576
#define P 10
template <int MODE>
__device__ __noinline__ void member(const float *__restrict__ b0, const double *__restrict__ b1, const double *__restrict__ b2, const float *__restrict__ pre, float *__restrict__ out0, float *__restrict__ out1, float *__restrict__ out2, long long kbid, long long knblk) {
  float t17, t23;
  if (MODE == 0) {
    const double t11 = b1[0]; const double t12 = b2[0];
    const double t13 = pow(0.9, t12); const double t14 = 1.0 - t13; const double t15 = t11 / t14;
    t17 = (float)(-t15);
    const double t20 = pow(0.999, t12); const double t21 = 1.0 - t20; t23 = (float)sqrt(t21);
  } else if (MODE == 1) {
    __shared__ float s[2];
    if (threadIdx.x == 0) {
      const double t11 = b1[0]; const double t12 = b2[0];
      const double t13 = pow(0.9, t12); const double t14 = 1.0 - t13; const double t15 = t11 / t14;
      s[0] = (float)(-t15);
      const double t20 = pow(0.999, t12); const double t21 = 1.0 - t20; s[1] = (float)sqrt(t21);
    }
    __syncthreads();
    t17 = s[0]; t23 = s[1];
  } else {
    t17 = pre[0]; t23 = pre[1];
  }
  const int stride = knblk * blockDim.x;
  int e0 = kbid * blockDim.x + threadIdx.x;
  for (int q = e0; q < N / 4; q += stride) {
    const kiln_v4<float> out0_v = ((const kiln_v4<float> *)out0)[q];
    const kiln_v4<float> b0_v = ((const kiln_v4<float> *)b0)[q];
    const kiln_v4<float> out1_v = ((const kiln_v4<float> *)out1)[q];
    const kiln_v4<float> out2_v = ((const kiln_v4<float> *)out2)[q];
    kiln_v4<float> o0, o1, o2;
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const float t0 = out0_v.v[k], t1 = b0_v.v[k];
      const float t4 = t0 + (t1 - t0) * 0.1f;
      const float t9 = out1_v.v[k] * 0.999f + t1 * t1 * 0.001f;
      const float t26 = (t4 * t17) / (sqrtf(t9) / t23 + 1e-8f);
      o0.v[k] = t4; o1.v[k] = t9; o2.v[k] = out2_v.v[k] + t26;
    }
    ((kiln_v4<float> *)out0)[q] = o0; ((kiln_v4<float> *)out1)[q] = o1; ((kiln_v4<float> *)out2)[q] = o2;
  }
}
struct Args { const float *g[P]; float *m[P], *v[P], *p[P]; };
template <int MODE>
__global__ void __launch_bounds__(256) k(Args a, const double *lr, const double *step, const float *pre, int per) {
  int m = blockIdx.x / per;
  member<MODE>(a.g[m], lr, step, pre, a.m[m], a.v[m], a.p[m], blockIdx.x % per, per);
}
int main() {
  Args a; float *buf; cudaMalloc(&buf, sizeof(float) * N * 4 * P); cudaMemset(buf, 0, sizeof(float) * N * 4 * P);
  for (int i = 0; i < P; i++) { a.g[i] = buf + (4 * i) * N; a.m[i] = buf + (4 * i + 1) * N; a.v[i] = buf + (4 * i + 2) * N; a.p[i] = buf + (4 * i + 3) * N; }
  double h[2] = {1e-3, 5.0}; double *d; cudaMalloc(&d, 16); cudaMemcpy(d, h, 16, cudaMemcpyHostToDevice);
  float hp[2] = {1e-3f, 0.5f}; float *pre; cudaMalloc(&pre, 8); cudaMemcpy(pre, hp, 8, cudaMemcpyHostToDevice);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int per : {1024, 512, 256, 128}) {
    for (int mode = 0; mode < 3; mode++) {
      auto launch = [&]() {
        if (mode == 0) k<0><<<per * P, 256>>>(a, d, d + 1, pre, per);
        if (mode == 1) k<1><<<per * P, 256>>>(a, d, d + 1, pre, per);
        if (mode == 2) k<2><<<per * P, 256>>>(a, d, d + 1, pre, per);
      };
      for (int i = 0; i < 20; i++) launch();
      cudaEventRecord(e0);
      for (int i = 0; i < 200; i++) launch();
      cudaEventRecord(e1); cudaEventSynchronize(e1);
      float ms; cudaEventElapsedTime(&ms, e0, e1);
      double us = ms * 1000 / 200;
      printf("blocks/member %4d mode %d: %.2f us  %.2f TB/s\n", per, mode, us, 28.0 * N * P / us / 1e6);
    }
  }
  // a device-to-device copy moving the same bytes (read + written), the floor's reference
  size_t bytes = sizeof(float) * N * P * 7 / 2;
  float *src, *dst; cudaMalloc(&src, bytes); cudaMalloc(&dst, bytes);
  for (int i = 0; i < 5; i++) cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(e0);
  for (int i = 0; i < 50; i++) cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(e1); cudaEventSynchronize(e1);
  float ms; cudaEventElapsedTime(&ms, e0, e1);
  printf("copy of %zu bytes: %.2f us, %.2f TB/s (read + written)\n", bytes, ms * 1000 / 50, 2.0 * bytes / (ms * 1000 / 50) / 1e6);
  return 0;
}
