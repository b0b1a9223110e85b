// Scaled masked softmax along the last dimension: y = softmax(scale * x + mask), optionally
// with the causal (upper-triangle) mask; backward dx = scale * y * (dy - sum(dy * y)).
//
// Launch contract (deepshard/kernels/softmax.py computes it and checks the layouts):
//   scaled_masked_softmax_fwd<T>, scaled_masked_softmax_bwd<T>:
//     grid (rows), block (threads), threads a multiple of 32 and <= 1024; one block per row,
//     reductions by warp shuffles + 64 floats of static shared memory.
// Preconditions: x, y, dy, dx row-major contiguous [rows, cols]; x finite.
//   mask: nullptr, or contiguous [rows / mask_group, cols] of float, additive (0 or -inf / large
//   negative); row r uses mask row r / mask_group (mask_group = rows for one shared mask row,
//   H * Q for a [B, 1, 1, K] padding mask of [B, H, Q, K] scores, 1 for a full mask).
//   causal_q > 0: rows are [..., causal_q, cols] and row r masks columns c > r % causal_q
//   (top-left aligned like torch's scaled_dot_product_attention(is_causal=True)).
// A fully masked row (every logit -inf) gives y = 0, not NaN, and so dx = 0.
// T in {float, __half, __nv_bfloat16}; all math in fp32.

#include "common.cuh"

namespace {

// (max, sum of exp(z - max)) pairs; a -inf max means "nothing seen" and carries sum 0,
// which keeps exp(-inf - -inf) = NaN out of every combination.
__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
    const float top = fmaxf(m, m2);
    if (top == -INFINITY) return;  // both empty
    s = s * expf(m - top) + s2 * expf(m2 - top);
    m = top;
}

// Adds one logit to a thread's running (max, sum): one exp per element.
__device__ __forceinline__ void push(float& m, float& s, float z) {
    if (z > m) {
        s = s * expf(m - z) + 1.0f;  // m = -inf: exp(-inf) = 0, s restarts at 1
        m = z;
    } else if (z != -INFINITY) {
        s += expf(z - m);
    }
}

__device__ __forceinline__ void block_max_sum(float& m, float& s, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int offset = 16; offset > 0; offset >>= 1) {
        combine(m, s, __shfl_xor_sync(0xffffffffu, m, offset),
                __shfl_xor_sync(0xffffffffu, s, offset));
    }
    if (lane == 0) { scratch[warp] = m; scratch[32 + warp] = s; }
    __syncthreads();
    m = lane < warps ? scratch[lane] : -INFINITY;
    s = lane < warps ? scratch[32 + lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) {
        combine(m, s, __shfl_xor_sync(0xffffffffu, m, offset),
                __shfl_xor_sync(0xffffffffu, s, offset));
    }
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

}  // namespace

template <typename T>
__global__ void scaled_masked_softmax_fwd(const T* __restrict__ x, const float* __restrict__ mask,
                                          T* __restrict__ y, int cols, int mask_group,
                                          int causal_q, float scale) {
    __shared__ float scratch[64];
    const size_t row = blockIdx.x;
    const T* xr = x + row * cols;
    const float* mr = mask ? mask + (row / mask_group) * cols : nullptr;
    T* yr = y + row * cols;
    // Columns >= limit are causally masked.
    const int limit = causal_q > 0 ? (int)(row % causal_q) + 1 : cols;

    float m = -INFINITY, s = 0.0f;  // online softmax: one read of x for both statistics
    for (int c = threadIdx.x; c < limit && c < cols; c += blockDim.x) {
        const float z = scale * to_f(xr[c]) + (mr ? to_f(mr[c]) : 0.0f);
        push(m, s, z);
    }
    block_max_sum(m, s, scratch);
    const float inv = m == -INFINITY ? 0.0f : 1.0f / s;

    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float p = 0.0f;
        if (c < limit && inv != 0.0f) {
            p = expf(scale * to_f(xr[c]) + (mr ? to_f(mr[c]) : 0.0f) - m) * inv;
        }
        yr[c] = from_f<T>(p);
    }
}

template <typename T>
__global__ void scaled_masked_softmax_bwd(const T* __restrict__ dy, const T* __restrict__ y,
                                          T* __restrict__ dx, int cols, float scale) {
    __shared__ float scratch[64];
    const size_t row = blockIdx.x;
    const T* dyr = dy + row * cols;
    const T* yr = y + row * cols;
    T* dxr = dx + row * cols;

    float dot = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dot += to_f(dyr[c]) * to_f(yr[c]);
    dot = block_sum(dot, scratch);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        dxr[c] = from_f<T>(scale * to_f(yr[c]) * (to_f(dyr[c]) - dot));
    }
}

#ifdef DEEPSHARD_INSTANTIATE
// Every instantiation the loader names, so `nvcc -DDEEPSHARD_INSTANTIATE` checks them all.
#define DEEPSHARD_SM(T)                                                                        \
    template __global__ void scaled_masked_softmax_fwd<T>(const T*, const float*, T*, int, int,    \
                                                          int, float);                         \
    template __global__ void scaled_masked_softmax_bwd<T>(const T*, const T*, T*, int, float);
DEEPSHARD_SM(float)
DEEPSHARD_SM(__half)
DEEPSHARD_SM(__nv_bfloat16)
#undef DEEPSHARD_SM
#endif
