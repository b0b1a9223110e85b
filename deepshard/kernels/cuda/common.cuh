// Shared by every kernel source: element types and their fp32 conversions.
// Kernels are templated on T in {float, __half, __nv_bfloat16}; they load with to_f, compute
// in fp32, and store with from_f<T> (round to nearest even).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) {
    return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// Multi-tensor launches: the tensor owning global chunk c is the last i with prefix[i] <= c
// (binary search over the launch's chunk prefix; n, the tensors per launch, is small).
__device__ __forceinline__ int owner_of(const long long* prefix, int n, long long c) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (prefix[mid] <= c) lo = mid; else hi = mid - 1;
    }
    return lo;
}
