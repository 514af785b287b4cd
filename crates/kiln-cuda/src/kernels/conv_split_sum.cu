// A weight gradient's partial sums (`conv_igemm.cu`'s and `conv_wgmma_wgrad.cu`'s, each split
// of the sum over N*P*Q writing one), added in the order of the splits: the same inputs give the
// same bits, where atomics would not. Appended to both families' modules.
extern "C" __global__ void conv_split_sum(const float* __restrict__ parts, float* __restrict__ out,
                                          int total, int splits) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    float s = 0.f;
    for (int z = 0; z < splits; ++z) s += parts[(long long)z * total + i];
    out[i] = s;
}
