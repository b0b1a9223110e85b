// Multi-tensor fused LAMB with DeepSpeed FusedLamb's update, in three launches per group:
//   lamb_update<T>  moments, u = m/(sqrt(v)+eps) + wd*p into an fp32 scratch, and per-chunk
//                   partial sums of p^2 and u^2 (a block reduction; no atomics);
//   lamb_ratio      one block per tensor: sums its chunks' partials, writes the trust ratio
//                   r = clamp(||p||/||u||, min_coeff, max_coeff), or 1 when a norm is 0;
//   lamb_apply<T>   p -= step_size * r * u.
//
// Launcher contract (deepshard/kernels/lamb.py builds it):
//   table     int64 device array for n tensors: [0,n) param (T*), [n,2n) grad (const T*),
//             [2n,3n) exp_avg (float*), [3n,4n) exp_avg_sq (float*), [4n,5n) scratch u
//             (float*, same element count as the param), [5n,6n) element counts,
//             [6n,7n] chunk prefix (tensor i owns global chunks [prefix[i], prefix[i+1])).
//   partials  float[2 * total_chunks]: (sum p^2, sum u^2) of each global chunk.
//   ratio     float[n].
//   grad_divisor  pointer to one fp32 on the device (gradient clipping; 1 when off), so
//             clipping needs no host synchronisation.
//   block     THREADS (a multiple of 32, at most 1024); grid any size (grid-stride).
// Moments are fp32, arithmetic is fp32, bias correction is folded into step_size by the host:
// step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t), or lr without bias correction.
#include "common.cuh"

// Sum of x over the block, valid in thread 0. Every thread of the block must call it;
// `shared` holds one float per warp and is reused, hence the leading barrier.
__device__ __forceinline__ float block_sum(float x, float* shared) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) shared[warp] = x;
    __syncthreads();
    x = threadIdx.x < blockDim.x / 32 ? shared[threadIdx.x] : 0.0f;
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
    return x;
}

template <typename T>
__global__ void lamb_update(const long long* __restrict__ table, int n, long long chunk,
                            float* __restrict__ partials, const float* __restrict__ grad_divisor,
                            float beta1, float beta2, float eps, float weight_decay,
                            int eps_inside_sqrt) {
    __shared__ float shared[32];
    const long long* sizes = table + 5 * n;
    const long long* prefix = table + 6 * n;
    const long long total = prefix[n];
    const float scale = 1.0f / *grad_divisor;

    for (long long c = blockIdx.x; c < total; c += gridDim.x) {
        const int t = owner_of(prefix, n, c);
        const T* p = reinterpret_cast<const T*>(table[t]);
        const T* g = reinterpret_cast<const T*>(table[n + t]);
        float* m = reinterpret_cast<float*>(table[2 * n + t]);
        float* v = reinterpret_cast<float*>(table[3 * n + t]);
        float* u = reinterpret_cast<float*>(table[4 * n + t]);
        const long long begin = (c - prefix[t]) * chunk;
        const long long end = min(begin + chunk, sizes[t]);
        float pp = 0.0f, uu = 0.0f;
        for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
            const float pi = to_f(p[i]);
            const float gi = to_f(g[i]) * scale;
            const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
            const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
            m[i] = mi;
            v[i] = vi;
            const float denom = eps_inside_sqrt ? sqrtf(vi + eps) : sqrtf(vi) + eps;
            const float ui = mi / denom + weight_decay * pi;
            u[i] = ui;
            pp += pi * pi;
            uu += ui * ui;
        }
        pp = block_sum(pp, shared);
        uu = block_sum(uu, shared);
        if (threadIdx.x == 0) {
            partials[2 * c] = pp;
            partials[2 * c + 1] = uu;
        }
    }
}

// grid = n (one block per tensor).
__global__ void lamb_ratio(const long long* __restrict__ table, int n,
                           const float* __restrict__ partials, float* __restrict__ ratio,
                           float min_coeff, float max_coeff) {
    __shared__ float shared[32];
    const long long* prefix = table + 6 * n;
    const int t = blockIdx.x;
    float pp = 0.0f, uu = 0.0f;
    for (long long c = prefix[t] + threadIdx.x; c < prefix[t + 1]; c += blockDim.x) {
        pp += partials[2 * c];
        uu += partials[2 * c + 1];
    }
    pp = block_sum(pp, shared);
    uu = block_sum(uu, shared);
    if (threadIdx.x == 0) {
        const float w_norm = sqrtf(pp), u_norm = sqrtf(uu);
        float r = 1.0f;
        if (w_norm != 0.0f && u_norm != 0.0f)
            r = fmaxf(fminf(w_norm / u_norm, max_coeff), min_coeff);
        ratio[t] = r;
    }
}

template <typename T>
__global__ void lamb_apply(const long long* __restrict__ table, int n, long long chunk,
                           const float* __restrict__ ratio, float step_size) {
    const long long* sizes = table + 5 * n;
    const long long* prefix = table + 6 * n;
    const long long total = prefix[n];
    for (long long c = blockIdx.x; c < total; c += gridDim.x) {
        const int t = owner_of(prefix, n, c);
        T* p = reinterpret_cast<T*>(table[t]);
        const float* u = reinterpret_cast<const float*>(table[4 * n + t]);
        const float coef = step_size * ratio[t];
        const long long begin = (c - prefix[t]) * chunk;
        const long long end = min(begin + chunk, sizes[t]);
        for (long long i = begin + threadIdx.x; i < end; i += blockDim.x)
            p[i] = from_f<T>(to_f(p[i]) - coef * u[i]);
    }
}

#ifdef DEEPSHARD_INSTANTIATE
// For `nvcc --ptx` in the tests: CuPy instantiates these through name_expressions.
#define UPDATE_ARGS const long long*, int, long long, float*, const float*, float, float, \
                    float, float, int
#define APPLY_ARGS const long long*, int, long long, const float*, float
template __global__ void lamb_update<float>(UPDATE_ARGS);
template __global__ void lamb_update<__half>(UPDATE_ARGS);
template __global__ void lamb_update<__nv_bfloat16>(UPDATE_ARGS);
template __global__ void lamb_apply<float>(APPLY_ARGS);
template __global__ void lamb_apply<__half>(APPLY_ARGS);
template __global__ void lamb_apply<__nv_bfloat16>(APPLY_ARGS);
#endif
