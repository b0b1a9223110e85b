// 1-bit sign compression (1-bit Adam/LAMB style): pack x into sign bits plus one scale, and
// unpack to +-scale. Error feedback (x - unpack(pack(x))) is the caller's business.
//
// Bit layout: element i is bit (i % 8) of byte i / 8, least significant bit first
// (little-endian bit order, numpy.packbits(..., bitorder="little")); 1 means x >= 0 (so -0.0
// packs as 1 and NaN as 0). Padding bits of the last byte are 0.
// Scale: mean(|x|) over the whole tensor, fp32 (the L2-optimal scale for sign codes).
//
// Launch contract (deepshard/kernels/onebit.py computes it):
//   onebit_pack<T>: grid (parts), block (threads), threads a multiple of 32 and <= 1024. Each
//     warp packs groups of 32 elements with one __ballot_sync (lane j's sign is bit j of the
//     ballot, hence the bit order), so loops are warp-uniform; block b writes the sum of |x|
//     over its elements to partial_abs[b] (float, parts entries).
//   onebit_scale: grid (1), block (1024); scale[0] = sum(partial_abs) / n, summed in double.
//   onebit_unpack<T>: 1-D grid-stride loop over n; any grid/block.
// Preconditions: x, y contiguous with n elements; bits holds ceil(n / 8) bytes; n >= 1;
//   T in {float, __half, __nv_bfloat16}.

#include "common.cuh"

namespace {

template <typename A> __device__ __forceinline__ A block_sum(A v, A* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : A(0);
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

}  // namespace

template <typename T>
__global__ void onebit_pack(const T* __restrict__ x, unsigned char* __restrict__ bits,
                            float* __restrict__ partial_abs, size_t n) {
    __shared__ float scratch[32];
    const int lane = threadIdx.x & 31;
    const size_t nbytes = (n + 7) / 8;
    const size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const size_t warps = ((size_t)gridDim.x * blockDim.x) >> 5;
    float acc = 0.0f;
    for (size_t base = warp * 32; base < n; base += warps * 32) {  // base is warp-uniform
        const size_t i = base + lane;
        const float v = i < n ? to_f(x[i]) : 0.0f;
        const unsigned ballot = __ballot_sync(0xffffffffu, i < n && v >= 0.0f);
        acc += fabsf(v);
        const size_t byte = base / 8 + lane;
        if (lane < 4 && byte < nbytes) bits[byte] = (unsigned char)(ballot >> (8 * lane));
    }
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partial_abs[blockIdx.x] = acc;
}

__global__ void onebit_scale(const float* __restrict__ partial_abs, int parts,
                             float* __restrict__ scale, size_t n) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (int p = threadIdx.x; p < parts; p += blockDim.x) acc += partial_abs[p];
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) scale[0] = (float)(acc / (double)n);
}

template <typename T>
__global__ void onebit_unpack(const unsigned char* __restrict__ bits,
                              const float* __restrict__ scale, T* __restrict__ y, size_t n) {
    const float s = scale[0];
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = from_f<T>((bits[i >> 3] >> (i & 7)) & 1 ? s : -s);
    }
}

#ifdef DEEPSHARD_INSTANTIATE
// Every instantiation the loader names, so `nvcc -DDEEPSHARD_INSTANTIATE` checks them all.
#define DEEPSHARD_1BIT(T)                                                                      \
    template __global__ void onebit_pack<T>(const T*, unsigned char*, float*, size_t);         \
    template __global__ void onebit_unpack<T>(const unsigned char*, const float*, T*, size_t);
DEEPSHARD_1BIT(float)
DEEPSHARD_1BIT(__half)
DEEPSHARD_1BIT(__nv_bfloat16)
#undef DEEPSHARD_1BIT
#endif
