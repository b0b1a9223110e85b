// Multi-tensor fused Adam / AdamW: one launch updates a list of tensors.
//
// Launcher contract (deepshard/kernels/adam.py builds it):
//   table      int64 device array describing n tensors, laid out as
//                [0,n)     param pointers (T*)       [n,2n)  grad pointers (const T*)
//                [2n,3n)   exp_avg pointers (float*) [3n,4n) exp_avg_sq pointers (float*)
//                [4n,5n)   element counts            [5n,6n] chunk prefix: tensor i owns the
//              global chunks [prefix[i], prefix[i+1]); prefix[n] is the total chunk count.
//   chunk      elements per chunk (the same value the prefix was computed with).
//   grid       any size: blocks stride over the global chunks (grid-stride), so the launcher
//              may cap it; each chunk is processed by exactly one block, no atomics.
//   scalars    lr, beta1, beta2, eps, weight_decay, and the bias corrections
//              bc1 = 1 - beta1^step and bc2_sqrt = sqrt(1 - beta2^step) (1 and 1 when off);
//              decoupled != 0 is AdamW (p *= 1 - lr*wd), 0 is Adam with L2 (g += wd*p).
// Params and grads are T (float, __half, __nv_bfloat16); moments are always fp32 and all
// arithmetic is fp32, the result rounded to T once per step. The formulas are torch's:
//   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  p -= lr/bc1 * m / (sqrt(v)/bc2_sqrt + eps)
#include "common.cuh"

template <typename T>
__global__ void adam_step(const long long* __restrict__ table, int n, long long chunk,
                          float lr, float beta1, float beta2, float eps, float weight_decay,
                          float bc1, float bc2_sqrt, int decoupled) {
    const long long* sizes = table + 4 * n;
    const long long* prefix = table + 5 * n;
    const long long total = prefix[n];
    const float step_size = lr / bc1;
    const float decay = decoupled ? 1.0f - lr * weight_decay : 1.0f;
    const float l2 = decoupled ? 0.0f : weight_decay;

    for (long long c = blockIdx.x; c < total; c += gridDim.x) {
        const int t = owner_of(prefix, n, c);
        T* p = reinterpret_cast<T*>(table[t]);
        const T* g = reinterpret_cast<const T*>(table[n + t]);
        float* m = reinterpret_cast<float*>(table[2 * n + t]);
        float* v = reinterpret_cast<float*>(table[3 * n + t]);
        const long long begin = (c - prefix[t]) * chunk;
        const long long end = min(begin + chunk, sizes[t]);
        for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
            float pi = to_f(p[i]);
            float gi = to_f(g[i]) + l2 * pi;
            float mi = beta1 * m[i] + (1.0f - beta1) * gi;
            float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
            m[i] = mi;
            v[i] = vi;
            pi = pi * decay - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
            p[i] = from_f<T>(pi);
        }
    }
}

#ifdef DEEPSHARD_INSTANTIATE
// For `nvcc --ptx` in the tests: CuPy instantiates these through name_expressions.
#define ADAM_ARGS const long long*, int, long long, float, float, float, float, float, float, \
                  float, int
template __global__ void adam_step<float>(ADAM_ARGS);
template __global__ void adam_step<__half>(ADAM_ARGS);
template __global__ void adam_step<__nv_bfloat16>(ADAM_ARGS);
#endif
