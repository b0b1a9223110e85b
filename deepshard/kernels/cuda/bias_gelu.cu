// Fused bias + GeLU: y = gelu(x + bias), bias broadcast along the last dimension; backward
// gives dx = dy * gelu'(x + bias) and dbias = sum over rows of dx.
// TANH selects the tanh approximation (F.gelu(approximate="tanh")), else the exact erf form.
//
// Launch contract (deepshard/kernels/bias_gelu.py computes it):
//   bias_gelu_fwd<T, TANH>: 1-D grid-stride loop over n = rows * cols elements; any grid/block.
//   bias_gelu_bwd<T, TANH>:
//     grid (ceil(cols / blockDim.x), parts), block (threads); thread (col, block y) writes dx for
//     rows y, y + parts, ... of its column and partial_dbias[y * cols + col] (float).
//   bias_gelu_dbias_final<T>: grid (ceil(cols / threads)), block (threads); sums `parts`
//     partial rows per column into dbias. Two kernels instead of atomics: deterministic.
// Preconditions: x, dy, y, dx row-major contiguous [rows, cols]; bias, dbias [cols];
//   T in {float, __half, __nv_bfloat16}; all math in fp32 (x + bias is not rounded to T).

#include "common.cuh"

namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kInvSqrt2 = 0.7071067811865476f;     // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.3989422804014327f;   // 1 / sqrt(2 pi)
constexpr float kCubic = 0.044715f;

template <bool TANH> __device__ __forceinline__ float gelu(float u) {
    if (TANH) return 0.5f * u * (1.0f + tanhf(kSqrt2OverPi * (u + kCubic * u * u * u)));
    return 0.5f * u * (1.0f + erff(u * kInvSqrt2));
}

template <bool TANH> __device__ __forceinline__ float gelu_grad(float u) {
    if (TANH) {
        const float t = tanhf(kSqrt2OverPi * (u + kCubic * u * u * u));
        return 0.5f * (1.0f + t)
               + 0.5f * u * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kCubic * u * u);
    }
    return 0.5f * (1.0f + erff(u * kInvSqrt2)) + u * kInvSqrt2Pi * expf(-0.5f * u * u);
}

}  // namespace

template <typename T, bool TANH>
__global__ void bias_gelu_fwd(const T* __restrict__ x, const T* __restrict__ bias,
                              T* __restrict__ y, size_t n, int cols) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = from_f<T>(gelu<TANH>(to_f(x[i]) + to_f(bias[i % cols])));
    }
}

template <typename T, bool TANH>
__global__ void bias_gelu_bwd(const T* __restrict__ dy, const T* __restrict__ x,
                              const T* __restrict__ bias, T* __restrict__ dx,
                              float* __restrict__ partial_dbias, int rows, int cols) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols) return;
    const float b = to_f(bias[col]);
    float db = 0.0f;
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        const size_t i = (size_t)row * cols + col;
        const T g = from_f<T>(to_f(dy[i]) * gelu_grad<TANH>(to_f(x[i]) + b));
        dx[i] = g;
        db += to_f(g);  // dbias = sum of the dx as stored, like autograd's sum over rows
    }
    partial_dbias[(size_t)blockIdx.y * cols + col] = db;
}

template <typename T>
__global__ void bias_gelu_dbias_final(const float* __restrict__ partial_dbias,
                                      T* __restrict__ dbias, int parts, int cols) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols) return;
    float db = 0.0f;
    for (int p = 0; p < parts; ++p) db += partial_dbias[(size_t)p * cols + col];
    dbias[col] = from_f<T>(db);
}

#ifdef DEEPSHARD_INSTANTIATE
// Every instantiation the loader names, so `nvcc -DDEEPSHARD_INSTANTIATE` checks them all.
#define DEEPSHARD_BG(T, TANH)                                                                  \
    template __global__ void bias_gelu_fwd<T, TANH>(const T*, const T*, T*, size_t, int);      \
    template __global__ void bias_gelu_bwd<T, TANH>(const T*, const T*, const T*, T*, float*,  \
                                                    int, int);
#define DEEPSHARD_BG_TYPE(T)                                                                   \
    DEEPSHARD_BG(T, true)                                                                      \
    DEEPSHARD_BG(T, false)                                                                     \
    template __global__ void bias_gelu_dbias_final<T>(const float*, T*, int, int);
DEEPSHARD_BG_TYPE(float)
DEEPSHARD_BG_TYPE(__half)
DEEPSHARD_BG_TYPE(__nv_bfloat16)
#undef DEEPSHARD_BG_TYPE
#undef DEEPSHARD_BG
#endif
