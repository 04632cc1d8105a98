// MD_HOST_DEVICE marks the few small functions that host code and the CUDA kernels share (bf16
// rounding, the random-weight generator), so that the device computes them with the host's very
// code: `__host__ __device__ inline` under nvcc, plain `inline` for the host compiler (which is
// also how the CUDA simulation builds the kernels).
#pragma once

#if defined(__CUDACC__)
#define MD_HOST_DEVICE __host__ __device__ inline
#else
#define MD_HOST_DEVICE inline
#endif
