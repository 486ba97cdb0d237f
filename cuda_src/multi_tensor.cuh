// Multi-tensor launch machinery: one launch updates every tensor of a bucket.
//
// update_chunks (the end of this file) is the one chunk loop of every kernel; an
// algorithm's .cu file holds only its math (an Update struct) and a thin __global__.
//
// The chunk table is one int64 array in device memory, built on the host by
// bf16opt.backends.cupy.build_launch_plan (pure Python/numpy; the CPU emulation tests
// use the same function).  For n tensors and R roles (arrays per element, e.g.
// param, grad, master, exp_avg, ...):
//
//   table[r * n + t]        data pointer of role r of tensor t (0 when unused)
//   table[R * n + t]        number of elements of tensor t
//   table[(R + 1) * n + t]  tensor t's stream id (names its random streams)
//   table[(R + 2) * n + t]  index of tensor t's first chunk; entry n is the total
//   table[(R + 3) * n + 1 + t]  global element index of tensor t's first element (a
//                           DTensor shard's offset in the whole param; random streams only)
//   table[(R + 4) * n + 1 + t]  live kernels only (LIVE): address of tensor t's step counter
//                           (float64, in device memory)
//
// Chunk c covers elements [k * chunk_size, min((k + 1) * chunk_size, size)) of the
// tensor t whose chunk range holds c (k = c - first chunk of t).  Blocks walk the
// chunks grid-stride; threads of a block share a chunk.  A chunk runs the vector
// path when every array it touches is 16-byte aligned at the chunk's start: each
// thread then moves kVec elements per array with 16-byte (or 8-byte) loads and
// stores; the chunk's last size % kVec elements and every chunk of a misaligned
// tensor take the scalar path.  No shared memory, no warp intrinsics, no
// synchronisation: every element is read and written by exactly one thread.
//
// Precision telemetry (a TRACK kernel): each thread counts its hits per chunk in
// registers and adds them to counts[3 * t + column] (unsigned 64-bit) with one
// atomicAdd per non-zero counter at the end of the chunk; Tally<false> is empty, so
// untracked kernels carry no counting code.  Columns are the algorithm's counters
// (bf16opt/algorithms.py): swallowed updates, then one underflow count per moment.
#pragma once

#include "storage.cuh"

namespace bf16opt {

template <int R>
struct ChunkTable {
  const i64* table;
  int n_tensors;

  __device__ __forceinline__ void* pointer(int role, int tensor) const {
    return reinterpret_cast<void*>(static_cast<u64>(table[role * n_tensors + tensor]));
  }
  __device__ __forceinline__ i64 size(int tensor) const { return table[R * n_tensors + tensor]; }
  __device__ __forceinline__ i64 index(int tensor) const { return table[(R + 1) * n_tensors + tensor]; }
  __device__ __forceinline__ i64 first_chunk(int tensor) const {
    return table[(R + 2) * n_tensors + tensor];
  }
  __device__ __forceinline__ i64 first_element(int tensor) const {
    return table[(R + 3) * n_tensors + 1 + tensor];
  }
  __device__ __forceinline__ const double* counter(int tensor) const {
    return reinterpret_cast<const double*>(static_cast<u64>(table[(R + 4) * n_tensors + 1 + tensor]));
  }
  // The last tensor whose first chunk is <= chunk (tensors without chunks are skipped).
  __device__ __forceinline__ int tensor_of_chunk(i64 chunk) const {
    int lo = 0;
    int hi = n_tensors - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (first_chunk(mid) <= chunk) lo = mid; else hi = mid - 1;
    }
    return lo;
  }
};

// The CPU emulation (tests/cuda_emulation/emulation.h) defines this to count vector
// accesses at addresses the kernel wrongly took for aligned: x86 forgives them, a GPU faults.
#ifndef BF16OPT_CHECK_ALIGNED
#define BF16OPT_CHECK_ALIGNED(pointer, bytes)
#endif

// kVec elements of one array, moved with 16-byte (or, for 4 x 16-bit, 8-byte) accesses.
template <class T, int N>
struct alignas((sizeof(T) * N) < 16 ? (sizeof(T) * N) : 16) Pack {
  T v[N];
};

template <class T, int N>
__device__ __forceinline__ void load_pack(const void* base, i64 index, T (&out)[N]) {
  BF16OPT_CHECK_ALIGNED(static_cast<const T*>(base) + index, alignof(Pack<T, N>));
  const Pack<T, N> p = *reinterpret_cast<const Pack<T, N>*>(static_cast<const T*>(base) + index);
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = p.v[k];
}

template <class T, int N>
__device__ __forceinline__ void store_pack(void* base, i64 index, const T (&in)[N]) {
  BF16OPT_CHECK_ALIGNED(static_cast<T*>(base) + index, alignof(Pack<T, N>));
  Pack<T, N> p;
#pragma unroll
  for (int k = 0; k < N; ++k) p.v[k] = in[k];
  *reinterpret_cast<Pack<T, N>*>(static_cast<T*>(base) + index) = p;
}

// Scalar access, for tails and misaligned tensors (N == 1 is the same shape).
template <class T, int N>
__device__ __forceinline__ void load_scalar(const void* base, i64 index, T (&out)[N]) {
  out[0] = static_cast<const T*>(base)[index];
}

template <class T, int N>
__device__ __forceinline__ void store_scalar(void* base, i64 index, const T (&in)[N]) {
  static_cast<T*>(base)[index] = in[0];
}

// Packed (VEC) or scalar access, chosen at compile time.
template <bool VEC, class T, int N>
__device__ __forceinline__ void load_bits(const void* base, i64 index, T (&out)[N]) {
  if constexpr (VEC) load_pack(base, index, out); else load_scalar(base, index, out);
}

template <bool VEC, class T, int N>
__device__ __forceinline__ void store_bits(void* base, i64 index, const T (&in)[N]) {
  if constexpr (VEC) store_pack(base, index, in); else store_scalar(base, index, in);
}

__device__ __forceinline__ bool aligned16(const void* base, int bytes, i64 index) {
  return ((static_cast<u64>(reinterpret_cast<u64>(base)) + static_cast<u64>(index * bytes)) & 15u) == 0;
}

// Bits of the kernels' ``flags`` argument shared by every algorithm, above their own
// (bf16opt/algorithms.py's FLOAT32_GRAD_BIT).  kFloat32Grad: the grads are float32 while
// the param is bfloat16/float16 (gradients accumulated in float32).  A run-time bit like
// maximize: a template parameter would double every instantiation for one load.
enum SharedFlag { kFloat32Grad = 1 << 15, kLiveLrDouble = 1 << 13 };

// Live steps (capturable=True; the kernels' LIVE instantiations): the step and the learning
// rate are read from device memory when the kernel runs, so a CUDA graph replays the right step.  Each tensor's step is
// its counter's value (advanced before the launch); its scalars are the host's
// (adam_scalars & co.), computed here in the same float64 operations, each IEEE-rounded as on
// the host, then rounded to float32 once.  Adam's bias corrections come from a host-filled
// table (1 - beta1**k, float32(1 / sqrt(1 - beta2**k)), by the host's pow) whose last row
// holds for every later step: a device pow is not the host's.  GradScaler's loss scale and inf
// flag, when given, are read here too: the grads are read times float32(1 / scale), and a
// non-zero flag skips the step (amp_arguments, bf16opt/amp.py).
struct LiveStep {
  const void* lr;       // the group's lr tensor (float32, or float64 with kLiveLrDouble); nullptr: lr_value
  bool lr_double;
  double lr_value;
  double decay_rate;    // decoupled weight decay: decay = 1 - lr * decay_rate (0: none)
  const double* bias;   // Adam: bias_rows rows of (1 - beta1**k, float32(1 / sqrt(1 - beta2**k)))
  i64 bias_rows;
  const float* grad_scale;  // GradScaler's loss scale (nullptr: the launch's inv_grad_scale)
  const float* found_inf;   // GradScaler's inf flag (nullptr: never skips)

  __device__ __forceinline__ bool skips() const { return found_inf != nullptr && *found_inf != 0.0f; }
  __device__ __forceinline__ float inv_grad_scale(float given) const {
    return grad_scale == nullptr ? given : __double2float_rn(__ddiv_rn(1.0, static_cast<double>(*grad_scale)));
  }

  __device__ __forceinline__ double learning_rate() const {
    if (lr == nullptr) return lr_value;
    return lr_double ? *static_cast<const double*>(lr) : static_cast<double>(*static_cast<const float*>(lr));
  }
  __device__ __forceinline__ i64 row(i64 step) const { return step < bias_rows ? step : bias_rows - 1; }
  __device__ __forceinline__ float step_size(double lr_now, i64 step) const {
    return __double2float_rn(__ddiv_rn(lr_now, bias[2 * row(step)]));
  }
  __device__ __forceinline__ float inv_sqrt_bias_correction2(i64 step) const {
    return static_cast<float>(bias[2 * row(step) + 1]);
  }
  __device__ __forceinline__ float decay(double lr_now) const {
    return __double2float_rn(__dsub_rn(1.0, __dmul_rn(lr_now, decay_rate)));
  }
};

#define BF16OPT_LIVE_PARAMETERS                                                                  \
  const void *live_lr, double lr_value, double decay_rate, const double *bias, i64 bias_rows, \
      const float *grad_scale, const float *found_inf
#define BF16OPT_LIVE_STEP \
  LiveStep{live_lr, (flags & kLiveLrDouble) != 0, lr_value, decay_rate, bias, bias_rows, grad_scale, found_inf}

// The coefficients of a live step at ``step`` (the launch's, with those computed from it).
template <class Coefficients>
__device__ __forceinline__ Coefficients live_coefficients(const Coefficients& c, const LiveStep& live, i64 step) {
  Coefficients out = c.at_step(live, step);
  out.inv_grad_scale = live.inv_grad_scale(c.inv_grad_scale);
  return out;
}

// The gradient as the update reads it: its decoded float32 value times the inverse loss
// scale (1.0 without GradScaler), in the grad's own format: the param's storage type P,
// or float32 (``float32_grad``; never rounded to P).
template <class P>
struct GradReader {
  bool float32_grad;
  float inv_grad_scale;

  __device__ __forceinline__ int bytes() const { return float32_grad ? 4 : P::kBytes; }

  template <bool VEC, int N>
  __device__ __forceinline__ void load(const void* grad, i64 index, float (&g)[N]) const {
    if (P::kBytes != 4 && float32_grad) {
      u32 bits[N];
      load_bits<VEC>(grad, index, bits);
#pragma unroll
      for (int k = 0; k < N; ++k) g[k] = __uint_as_float(bits[k]) * inv_grad_scale;
    } else {
      typename P::bits_t bits[N];
      load_bits<VEC>(grad, index, bits);
#pragma unroll
      for (int k = 0; k < N; ++k) g[k] = P::decode(bits[k]) * inv_grad_scale;
    }
  }
};

// Elements per vector step: 16 bytes of the narrowest array.
template <int MinBytes>
struct VectorWidth {
  static constexpr int value = 16 / MinBytes;
};

// (host too: it sizes the vector step in static constexpr members)
__host__ __device__ constexpr int min_bytes(int a, int b) { return a < b ? a : b; }

// Per-thread telemetry counters of one chunk (see the top of this file).
template <bool TRACK>
struct Tally {
  __device__ __forceinline__ void count(int, bool) {}
  __device__ __forceinline__ void add(int, u32) {}
  __device__ __forceinline__ void flush(u64*, int) {}
};

template <>
struct Tally<true> {
  static constexpr int kColumns = 3;  // the widest algorithm's (Adam's) counters
  u32 hits[kColumns] = {0u, 0u, 0u};  // a chunk has fewer than 2^31 elements
  __device__ __forceinline__ void count(int column, bool hit) { hits[column] += hit ? 1u : 0u; }
  __device__ __forceinline__ void add(int column, u32 n) { hits[column] += n; }
  __device__ __forceinline__ void flush(u64* counts, int tensor) {
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      if (hits[c] != 0u) atomicAdd(counts + kColumns * tensor + c, static_cast<u64>(hits[c]));
    }
  }
};

// Walk every chunk of the table: body(tensor, start, count) per chunk, on every thread
// of the block that owns it.
template <int R, class Body>
__device__ __forceinline__ void for_each_chunk(const ChunkTable<R>& tab, i64 n_chunks, int chunk_size,
                                               Body body) {
  for (i64 chunk = blockIdx.x; chunk < n_chunks; chunk += gridDim.x) {
    const int tensor = tab.tensor_of_chunk(chunk);
    const i64 start = (chunk - tab.first_chunk(tensor)) * static_cast<i64>(chunk_size);
    const i64 left = tab.size(tensor) - start;
    const i64 count = left < chunk_size ? left : static_cast<i64>(chunk_size);
    body(tensor, start, count);
  }
}

// for_each_chunk with each chunk's step and coefficients: body(tensor, start, count, step, c).
// The launch's, or in a live kernel (LIVE, its own instantiation) its tensor's counter and the
// coefficients computed from it (nothing at all when GradScaler's flag skips the step).  The
// live loop is not compiled into the other kernels: its computed coefficients take registers
// the launch's scalars do not, and a kernel has the registers of its widest path.
template <bool LIVE, int R, class Coefficients, class Body>
__device__ __forceinline__ void for_each_chunk_at_step(const ChunkTable<R>& tab, i64 n_chunks, int chunk_size,
                                                       i64 step, const Coefficients& c, const LiveStep& live,
                                                       Body body) {
  if constexpr (!LIVE) {
    for_each_chunk(tab, n_chunks, chunk_size, [&](int tensor, i64 start, i64 count) {
      body(tensor, start, count, step, c);
    });
  } else if (!live.skips()) {
    for_each_chunk(tab, n_chunks, chunk_size, [&](int tensor, i64 start, i64 count) {
      const i64 tensor_step = static_cast<i64>(*tab.counter(tensor));
      body(tensor, start, count, tensor_step, live_coefficients(c, live, tensor_step));
    });
  }
}

// The chunk loop of every kernel.  Update is one algorithm's math on one tensor:
//   kRoles, kVec, kStochastic, kTrack   chunk-table roles, vector width, whether any
//                                       storage rounds stochastically, telemetry
//   Update(const ChunkTable<kRoles>&, int tensor)    the tensor's arrays
//   vector_ok(start, c)                 every array it touches 16-byte aligned at start
//   run<N, VEC>(index, streams, c, tally)
//                                       N elements from index: N == kVec with packed
//                                       accesses (VEC) or N == 1
// Per chunk, the threads of the block stride over its vector steps, then over the
// elements the vector path left (all of them when a pointer is misaligned).
template <class Update, bool LIVE, class Coefficients>
__device__ __forceinline__ void update_chunks(const i64* table, int n_tensors, i64 n_chunks,
                                              int chunk_size, u64 seed, i64 step, u64* counts,
                                              const Coefficients& coefficients, const LiveStep& live) {
  constexpr int kVec = Update::kVec;
  const ChunkTable<Update::kRoles> tab{table, n_tensors};
  for_each_chunk_at_step<LIVE>(tab, n_chunks, chunk_size, step, coefficients, live,
                         [&](int tensor, i64 start, i64 count, i64 tensor_step, const Coefficients& c) {
    const Update up(tab, tensor);
    const Streams streams = make_streams<Update::kStochastic>(seed, tensor_step, tab.index(tensor),
                                                                 tab.first_element(tensor));
    Tally<Update::kTrack> tally;
    const i64 stride = blockDim.x;
    i64 scalar_from = 0;
    if (up.vector_ok(start, c)) {
      const i64 vector_end = start + (count / kVec) * kVec;
      for (i64 i = start + threadIdx.x * static_cast<i64>(kVec); i < vector_end; i += stride * kVec)
        up.template run<kVec, true>(i, streams, c, tally);
      scalar_from = vector_end - start;
    }
    for (i64 i = start + scalar_from + threadIdx.x; i < start + count; i += stride)
      up.template run<1, false>(i, streams, c, tally);
    tally.flush(counts, tensor);
  });
}

}  // namespace bf16opt
