// LayerNorm over the last dimension: forward (y, mean, rstd) and backward (dx, dgamma, dbeta).
//
// Launch contract (deepshard/kernels/layer_norm.py computes it):
//   layer_norm_fwd<T>, layer_norm_bwd_dx<T>:
//     grid (rows), block (threads) with threads a multiple of 32 and <= 1024; one block per row,
//     block-wide reduction = warp shuffles + 32 floats of static shared memory.
//   layer_norm_bwd_params_partial<T>:
//     grid (ceil(cols / threads), parts), block (threads); block y sums rows y, y + parts, ...
//     for its columns into partial_dgamma/partial_dbeta[y * cols + col] (float, parts * cols).
//   layer_norm_bwd_params_final<T>:
//     grid (ceil(cols / threads)), block (threads); sums the `parts` partial rows per column.
//     Two kernels instead of atomics: deterministic, and no zero-initialised output needed.
// Preconditions: x, dy, y row-major contiguous [rows, cols]; gamma, beta, dgamma, dbeta [cols];
//   mean, rstd float [rows]; T in {float, __half, __nv_bfloat16}; all math in fp32.

#include "common.cuh"

namespace {

__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Sum over the whole block, returned to every thread. `scratch` holds 32 floats; the leading
// __syncthreads makes back-to-back calls with the same scratch safe.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

}  // namespace

template <typename T>
__global__ void layer_norm_fwd(const T* __restrict__ x, const T* __restrict__ gamma,
                               const T* __restrict__ beta, T* __restrict__ y,
                               float* __restrict__ mean_out, float* __restrict__ rstd_out,
                               int cols, float eps) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const T* xr = x + row * cols;
    T* yr = y + row * cols;

    float sum = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) sum += to_f(xr[c]);
    const float mean = block_sum(sum, scratch) / cols;

    // Two passes (the second re-reads the row from cache): no E[x^2] - E[x]^2 cancellation.
    float sq = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float d = to_f(xr[c]) - mean;
        sq += d * d;
    }
    const float rstd = rsqrtf(block_sum(sq, scratch) / cols + eps);

    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float n = (to_f(xr[c]) - mean) * rstd;
        yr[c] = from_f<T>(n * to_f(gamma[c]) + to_f(beta[c]));
    }
    if (threadIdx.x == 0) {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), with g = dy * gamma.
template <typename T>
__global__ void layer_norm_bwd_dx(const T* __restrict__ dy, const T* __restrict__ x,
                                  const T* __restrict__ gamma, const float* __restrict__ mean,
                                  const float* __restrict__ rstd, T* __restrict__ dx, int cols) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const T* dyr = dy + row * cols;
    const T* xr = x + row * cols;
    T* dxr = dx + row * cols;
    const float mu = mean[row], rs = rstd[row];

    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float g = to_f(dyr[c]) * to_f(gamma[c]);
        sum_g += g;
        sum_gx += g * (to_f(xr[c]) - mu) * rs;
    }
    const float mean_g = block_sum(sum_g, scratch) / cols;
    const float mean_gx = block_sum(sum_gx, scratch) / cols;

    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float g = to_f(dyr[c]) * to_f(gamma[c]);
        const float xhat = (to_f(xr[c]) - mu) * rs;
        dxr[c] = from_f<T>(rs * (g - mean_g - xhat * mean_gx));
    }
}

template <typename T>
__global__ void layer_norm_bwd_params_partial(const T* __restrict__ dy, const T* __restrict__ x,
                                              const float* __restrict__ mean,
                                              const float* __restrict__ rstd,
                                              float* __restrict__ partial_dgamma,
                                              float* __restrict__ partial_dbeta, int rows,
                                              int cols) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols) return;
    float dg = 0.0f, db = 0.0f;
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        const size_t i = (size_t)row * cols + col;
        const float d = to_f(dy[i]);
        dg += d * (to_f(x[i]) - mean[row]) * rstd[row];
        db += d;
    }
    partial_dgamma[(size_t)blockIdx.y * cols + col] = dg;
    partial_dbeta[(size_t)blockIdx.y * cols + col] = db;
}

template <typename T>
__global__ void layer_norm_bwd_params_final(const float* __restrict__ partial_dgamma,
                                            const float* __restrict__ partial_dbeta,
                                            T* __restrict__ dgamma, T* __restrict__ dbeta,
                                            int parts, int cols) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols) return;
    float dg = 0.0f, db = 0.0f;
    for (int p = 0; p < parts; ++p) {
        dg += partial_dgamma[(size_t)p * cols + col];
        db += partial_dbeta[(size_t)p * cols + col];
    }
    dgamma[col] = from_f<T>(dg);
    dbeta[col] = from_f<T>(db);
}

#ifdef DEEPSHARD_INSTANTIATE
// Every instantiation the loader names, so `nvcc -DDEEPSHARD_INSTANTIATE` checks them all.
#define DEEPSHARD_LN(T)                                                                        \
    template __global__ void layer_norm_fwd<T>(const T*, const T*, const T*, T*, float*,      \
                                               float*, int, float);                           \
    template __global__ void layer_norm_bwd_dx<T>(const T*, const T*, const T*, const float*, \
                                                  const float*, T*, int);                      \
    template __global__ void layer_norm_bwd_params_partial<T>(const T*, const T*, const float*, \
                                                              const float*, float*, float*,   \
                                                              int, int);                       \
    template __global__ void layer_norm_bwd_params_final<T>(const float*, const float*, T*, T*, \
                                                            int, int);
DEEPSHARD_LN(float)
DEEPSHARD_LN(__half)
DEEPSHARD_LN(__nv_bfloat16)
#undef DEEPSHARD_LN
#endif
