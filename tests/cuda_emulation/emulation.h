// CPU emulation of the CUDA subset the bf16opt kernels use, for g++ (tests only).
//
// The kernel sources in cuda_src/ are compiled unchanged after this header:
// __global__/__device__ become plain inline functions, blockIdx/threadIdx/blockDim/
// gridDim are globals that the generated launch wrappers set while looping over every
// block and thread of the grid, and the bit-cast intrinsics go through memcpy.
// Compile with -ffp-contract=off (no -ffast-math), so every float operation is one
// IEEE-rounded operation as with NVRTC's --fmad=false, and -fno-strict-aliasing (the
// kernels reinterpret arrays as 16-byte packs, as CUDA code does); emulator.py's CXXFLAGS.
#pragma once

#include <math.h>
#include <string.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __constant__
#define __restrict__ __restrict

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};

// One emulated thread at a time: the wrappers loop over the grid sequentially.
inline dim3 gridDim, blockDim, blockIdx, threadIdx;

inline unsigned int __float_as_uint(float x) {
  unsigned int u;
  memcpy(&u, &x, sizeof u);
  return u;
}

inline float __uint_as_float(unsigned int u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

inline int __float_as_int(float x) {
  int i;
  memcpy(&i, &x, sizeof i);
  return i;
}

inline float __int_as_float(int i) {
  float x;
  memcpy(&x, &i, sizeof x);
  return x;
}

// float64 arithmetic, one IEEE rounding each (SSE2 double, no contraction), and the
// round-to-nearest-even conversion to float32 (the default rounding mode).
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline float __double2float_rn(double x) { return static_cast<float>(x); }

// Vector (Pack) accesses at addresses not aligned to the pack: the x86 CPU would carry them
// out, a GPU would fault, so the emulator reads this count after every launch.
inline unsigned long long misaligned_vector_accesses = 0;
#define BF16OPT_CHECK_ALIGNED(pointer, bytes) \
  (void)(reinterpret_cast<unsigned long long>(pointer) % (bytes) == 0 || ++misaligned_vector_accesses)

// The emulated threads run one at a time, so a plain add is atomic here.
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  const unsigned long long old = *address;
  *address = old + value;
  return old;
}

// Run ``kernel()`` once per (block, thread) of a 1-D launch.
template <class Kernel>
inline void emulate_launch(unsigned int grid, unsigned int block, Kernel kernel) {
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned int b = 0; b < grid; ++b) {
    for (unsigned int t = 0; t < block; ++t) {
      blockIdx.x = b;
      threadIdx.x = t;
      kernel();
    }
  }
}
