// CPU emulation of the CUDA subset the bf16opt kernels use, for g++ (tests only).
//
// The kernel sources in cuda_src/ are compiled unchanged after this header:
// __global__/__device__ become plain inline functions, blockIdx/threadIdx/blockDim/
// gridDim are globals that the generated launch wrappers set while looping over every
// block and thread of the grid (as fibers for kernels whose warps exchange values, at the
// end of this file), and the bit-cast intrinsics go through memcpy.
// Compile with -ffp-contract=off (no -ffast-math), so every float operation is one
// IEEE-rounded operation as with NVRTC's --fmad=false, and -fno-strict-aliasing (the
// kernels reinterpret arrays as 16-byte packs, as CUDA code does); emulator.py's CXXFLAGS.
#pragma once

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

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

// Warp-synchronous kernels (those that exchange values between the lanes of a warp with
// __shfl_xor_sync: the q8 kernels) run each block's threads as fibers: every thread runs
// until its next exchange, posts its value and yields; once every thread of the block has
// posted (or finished), each resumes and reads its partner's value.  Two buffers by round
// keep a fast lane's next post from overwriting a value a slower lane has yet to read.
namespace emulation {

struct Fiber {
  ucontext_t context;
  unsigned round = 0;
  bool done = false;
};

inline ucontext_t scheduler;
inline Fiber* fibers = nullptr;  // the running block's (nullptr: no fibers)
inline unsigned current = 0;
inline unsigned* exchange[2] = {nullptr, nullptr};  // a value per thread, by round parity
inline void (*fiber_body)(void*) = nullptr;
inline void* fiber_kernel = nullptr;

template <class Kernel>
void call_kernel(void* kernel) { (*static_cast<Kernel*>(kernel))(); }

inline void fiber_entry() {
  fiber_body(fiber_kernel);
  fibers[current].done = true;  // (returns to the scheduler through uc_link)
}

[[noreturn]] inline void fail(const char* why) {
  fprintf(stderr, "CUDA emulation: %s\n", why);
  abort();
}

// After a pass: the lanes of each warp are all done, or all waiting at the same exchange.
inline void check_warps(unsigned block) {
  for (unsigned w = 0; w < block; w += 32) {
    const unsigned end = w + 32 < block ? w + 32 : block;
    for (unsigned t = w + 1; t < end; ++t) {
      if (fibers[t].done != fibers[w].done || fibers[t].round != fibers[w].round)
        fail("the lanes of a warp diverged at __shfl_xor_sync");
    }
  }
}

}  // namespace emulation

// Run ``kernel()`` once per (block, thread) of a 1-D launch, each block's threads as fibers.
template <class Kernel>
inline void emulate_launch_warps(unsigned int grid, unsigned int block, Kernel kernel) {
  using namespace emulation;
  if (block % 32 != 0) fail("a warp-synchronous kernel needs whole warps (blockDim.x % 32 == 0)");
  constexpr size_t kStack = 256 * 1024;
  Fiber* pool = new Fiber[block];
  char* stacks = static_cast<char*>(malloc(kStack * block));
  exchange[0] = static_cast<unsigned*>(calloc(block, sizeof(unsigned)));
  exchange[1] = static_cast<unsigned*>(calloc(block, sizeof(unsigned)));
  fibers = pool;
  fiber_body = call_kernel<Kernel>;
  fiber_kernel = &kernel;
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned int b = 0; b < grid; ++b) {
    blockIdx.x = b;
    for (unsigned int t = 0; t < block; ++t) {
      pool[t] = Fiber();
      getcontext(&pool[t].context);
      pool[t].context.uc_stack.ss_sp = stacks + kStack * t;
      pool[t].context.uc_stack.ss_size = kStack;
      pool[t].context.uc_link = &scheduler;
      makecontext(&pool[t].context, fiber_entry, 0);
    }
    for (bool running = true; running;) {
      running = false;
      for (unsigned int t = 0; t < block; ++t) {
        if (pool[t].done) continue;
        current = t;
        threadIdx.x = t;
        swapcontext(&scheduler, &pool[t].context);
        running = true;
      }
      check_warps(block);
    }
  }
  fibers = nullptr;
  free(exchange[0]);
  free(exchange[1]);
  free(stacks);
  delete[] pool;
}

// The value ``value`` of lane (this lane ^ lane_mask) of this warp (every lane must call it).
inline unsigned int __shfl_xor_sync(unsigned int, unsigned int value, int lane_mask) {
  using namespace emulation;
  if (fibers == nullptr) fail("__shfl_xor_sync outside a warp-synchronous launch (emulate_launch_warps)");
  Fiber& me = fibers[current];
  const unsigned thread = current;
  const unsigned slot = me.round & 1u;
  exchange[slot][thread] = value;
  ++me.round;
  swapcontext(&me.context, &scheduler);
  threadIdx.x = thread;
  return exchange[slot][(thread & ~31u) | ((thread & 31u) ^ static_cast<unsigned>(lane_mask))];
}

inline float __shfl_xor_sync(unsigned int mask, float value, int lane_mask) {
  return __uint_as_float(__shfl_xor_sync(mask, __float_as_uint(value), lane_mask));
}
