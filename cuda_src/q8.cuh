// q8 moments (bf16opt/storage.py's "q8"): 8-bit codes in blocks of 256 elements of the flattened
// param, each block a row of 260 bytes (256 codes, then its float32 scale, little-endian).
//
// The element math of every algorithm stays as it is: a q8 storage type Q8<SIGNED, SR> is
// float32 to the update (decode and encode as Fp32), and update_q8_chunks hands the update
// float32 scratch in place of the q8 arrays: a warp takes a block of 256 elements, each lane
// decodes its 8 codes into its scratch, runs the update over its elements, then the warp
// quantizes the new values (q8_quantize_lane): the scale is the block's largest finite
// magnitude (the lanes' maxima combined by __shfl_xor_sync), y = x / scale, the code of the
// nearest map value (an 8-step binary search over the boundaries) or, stochastically, of one
// of the two values around y, and the non-finite code for a non-finite element.  No shared memory;
// the CPU emulation runs these kernels' warps in lockstep (emulate_launch_warps).  Rows of
// the chunk table start on blocks (the chunk size is a multiple of 256).
#pragma once

#include "storage.cuh"
#include "multi_tensor.cuh"
#include "q8_maps.cuh"

namespace bf16opt {

inline constexpr int kQ8Block = 256;
inline constexpr int kQ8Row = 260;
inline constexpr int kQ8Lane = kQ8Block / 32;  // a lane's elements of a block: a warp takes one block

// A q8 moment as the element update sees it: float32 scratch (the Fp32 codec).
template <bool SIGNED, bool SR>
struct Q8 {
  static constexpr bool kStochastic = SR;  // (the streams' keys are needed when it rounds stochastically)
  static constexpr bool kSigned = SIGNED;
  typedef u32 bits_t;
  static constexpr int kBytes = 4;
  static __device__ __forceinline__ float decode(bits_t bits) { return Fp32::decode(bits); }
  static __device__ __forceinline__ bits_t encode(float x, const EncodeContext& context) {
    return Fp32::encode(x, context);
  }
};

template <class S>
struct IsSignedQ8 {
  static constexpr bool value = false;
};

template <bool SIGNED, bool SR>
struct IsSignedQ8<Q8<SIGNED, SR>> {
  static constexpr bool value = SIGNED;
};

template <class S>
struct IsQ8 {
  static constexpr bool value = false;
};

template <bool SIGNED, bool SR>
struct IsQ8<Q8<SIGNED, SR>> {
  static constexpr bool value = true;
};

// #{k: table[k] < y} (STRICT) or <= y over the table's first 255 entries.
template <bool STRICT>
__device__ __forceinline__ int q8_count_below(const u32* table, float y) {
  int index = 0;
#pragma unroll
  for (int step = 128; step >= 1; step >>= 1) {
    const float probe = __uint_as_float(table[index + step - 1]);
    index += (STRICT ? probe < y : probe <= y) ? step : 0;
  }
  return index;
}

template <bool SIGNED>
__device__ __forceinline__ float q8_decoded(int code, float scale) {
  const u32* values = SIGNED ? kQ8SignedValues : kQ8UnsignedValues;
  return __uint_as_float(values[SIGNED ? (code + 127) & 255 : code]) * scale;
}

__device__ __forceinline__ float q8_row_scale(const unsigned char* row) {
  return __uint_as_float(static_cast<u32>(row[256]) | (static_cast<u32>(row[257]) << 8) |
                         (static_cast<u32>(row[258]) << 16) | (static_cast<u32>(row[259]) << 24));
}

// This lane's codes of a block decoded: out[j] = element kQ8Lane * lane + j, for j < count.
template <bool SIGNED>
__device__ __forceinline__ void q8_decode_lane(const unsigned char* row, int lane, int count, float* out) {
  const float scale = q8_row_scale(row);
#pragma unroll
  for (int j = 0; j < kQ8Lane; ++j) {
    if (j < count) out[j] = q8_decoded<SIGNED>(row[kQ8Lane * lane + j], scale);
  }
}

// The block's scale: the largest finite magnitude of its values, each lane's, then the warp's by
// five exchanges (a maximum in any order is the sequential one: no NaN takes part).  A
// non-finite value counts as the least float32, so that its code decodes as inf, not inf * 0.
// Every lane of the warp calls it.
__device__ __forceinline__ float q8_block_scale(const float* values, int count) {
  float scale = 0.0f;
#pragma unroll
  for (int j = 0; j < kQ8Lane; ++j) {
    const float magnitude = fabsf(values[j]);
    const float counted = magnitude < __uint_as_float(0x7F800000u) ? magnitude : __uint_as_float(1u);
    if (j < count && counted > scale) scale = counted;
  }
#pragma unroll
  for (int offset = 16; offset >= 1; offset >>= 1) {
    const float other = __shfl_xor_sync(0xFFFFFFFFu, scale, offset);
    scale = other > scale ? other : scale;
  }
  return scale;
}

// The code of x in a block of scale ``scale``: the nearest map value's (an 8-step binary search
// over the boundaries) or, stochastically, one of the two around x / scale; NaN's for a
// non-finite x.  ``underflow``: x is non-zero and finite and its code decodes to zero.
template <bool SIGNED, bool SR>
__device__ __forceinline__ int q8_code(float x, float scale, const EncodeContext& context, bool& underflow) {
  const u32* table = SIGNED ? kQ8SignedValues : kQ8UnsignedValues;
  const u32* bounds = SIGNED ? kQ8SignedBounds : kQ8UnsignedBounds;
  const float y = scale > 0.0f ? x / scale : 0.0f;
  int index;
  if constexpr (SR) {
    int lo = q8_count_below<false>(table, y) - 1;
    lo = lo > 0 ? lo : 0;
    const bool top = lo >= 254;
    const int low = top ? lo - 1 : lo;
    const float below = __uint_as_float(table[low]);
    const float fraction = (y - below) / (__uint_as_float(table[low + 1]) - below);
    const bool up = static_cast<float>(context.random() >> 16) < fraction * 65536.0f;
    index = top ? lo : lo + (up ? 1 : 0);
  } else {
    index = q8_count_below<true>(bounds, y);
  }
  const bool finite = fabsf(x) < __uint_as_float(0x7F800000u);
  underflow = x != 0.0f && finite && __uint_as_float(table[index]) * scale == 0.0f;
  const int code = SIGNED ? (index - 127) & 255 : index;
  return finite ? code : (SIGNED ? 0x80 : 0xFF);
}

// Quantize this lane's values[0..count) (elements first..first+count of the tensor) into the
// block's row; lane 0 writes the scale.  Returns the lane's underflows.  Every lane calls it.
template <bool SIGNED, bool SR>
__device__ __forceinline__ u32 q8_quantize_lane(const float* values, int count, unsigned char* row, int lane,
                                                const Streams& streams, int buffer, i64 first) {
  const float scale = q8_block_scale(values, count);
  if (lane == 0) {
    const u32 bits = __float_as_uint(scale);
    row[256] = static_cast<unsigned char>(bits & 0xFFu);
    row[257] = static_cast<unsigned char>((bits >> 8) & 0xFFu);
    row[258] = static_cast<unsigned char>((bits >> 16) & 0xFFu);
    row[259] = static_cast<unsigned char>(bits >> 24);
  }
  u32 underflows = 0;
#pragma unroll
  for (int j = 0; j < kQ8Lane; ++j) {
    if (j < count) {
      bool underflow;
      row[kQ8Lane * lane + j] = static_cast<unsigned char>(
          q8_code<SIGNED, SR>(values[j], scale, streams.at(buffer, first + j), underflow));
      underflows += underflow ? 1u : 0u;
    }
  }
  return underflows;
}

// One state array of an update, for update_q8_chunks: its chunk-table role, storage type,
// random buffer (its row of cpu_src/roles.py's STATE_ROLES) and telemetry column (-1: none);
// its map is S's (Q8<signed, ...>, from the same row).  Off unless S is q8.
template <int ROLE, class S, int BUFFER, int COLUMN, bool PRESENT = true>
struct Q8Slot {
  static constexpr bool kOn = PRESENT && IsQ8<S>::value;
  static constexpr bool kStochastic = S::kStochastic;
  static constexpr int kRole = ROLE;
  static constexpr int kBuffer = BUFFER;
  static constexpr int kColumn = COLUMN;
  static constexpr bool kSigned = kOn ? IsSignedQ8<S>::value : false;
};

struct NoQ8Slot {
  static constexpr bool kOn = false;
  static constexpr bool kStochastic = false;
  static constexpr int kRole = 0;
  static constexpr int kBuffer = 0;
  static constexpr int kColumn = -1;
  static constexpr bool kSigned = false;
};

// A lane's part of a q8 slot's block (elements first..first+count): its codes decoded into
// ``scratch``, which the update then addresses in place of the q8 array.
template <class Slot, int R>
__device__ __forceinline__ void q8_slot_load(i64 (&local)[R], const ChunkTable<R>& tab, int tensor, i64 block,
                                             int lane, int count, i64 first, float* scratch) {
  if constexpr (Slot::kOn) {
    const unsigned char* row = static_cast<const unsigned char*>(tab.pointer(Slot::kRole, tensor)) +
                               (block / kQ8Block) * kQ8Row;
    q8_decode_lane<Slot::kSigned>(row, lane, count, scratch);
    // the update addresses element i at base + 4 i: the scratch, shifted to the lane's first element
    local[Slot::kRole] = static_cast<i64>(reinterpret_cast<u64>(scratch) - static_cast<u64>(first) * 4u);
  }
}

template <class Slot, int R, class T>
__device__ __forceinline__ void q8_slot_store(const ChunkTable<R>& tab, int tensor, i64 block, int lane, int count,
                                              i64 first, const float* scratch, const Streams& streams, T& tally) {
  if constexpr (Slot::kOn) {
    unsigned char* row = static_cast<unsigned char*>(tab.pointer(Slot::kRole, tensor)) + (block / kQ8Block) * kQ8Row;
    const u32 under = q8_quantize_lane<Slot::kSigned, Slot::kStochastic>(scratch, count, row, lane, streams,
                                                                          Slot::kBuffer, first);
    if constexpr (Slot::kColumn >= 0) tally.add(Slot::kColumn, under);
  }
}

// The chunk loop of a kernel with q8 states (update_chunks' counterpart): each warp takes whole
// blocks of a chunk, lane l the block's elements 8 l .. 8 l + 7 (with 16-byte accesses where the
// other arrays allow, as update_chunks' vector path), so a warp reads and writes each array of
// the block in one contiguous stretch and keeps the block's float32 values in its lanes.  The
// launch has whole warps (cupy.prepare_launch).  S0..S2: the update's state slots.
template <class Update, class S0, class S1, class S2, bool LIVE, class Coefficients>
__device__ __forceinline__ void update_q8_chunks(const i64* table, int n_tensors, i64 n_chunks, int chunk_size,
                                                 u64 seed, i64 step, u64* counts, const Coefficients& coefficients,
                                                 const LiveStep& live) {
  constexpr int R = Update::kRoles;
  constexpr int kVec = Update::kVec;
  static_assert(kQ8Lane % kVec == 0, "a lane's elements are whole vector steps");
  const ChunkTable<R> tab{table, n_tensors};
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const i64 stride = static_cast<i64>(blockDim.x >> 5) * kQ8Block;
  for_each_chunk_at_step<LIVE>(tab, n_chunks, chunk_size, step, coefficients, live,
                         [&](int tensor, i64 start, i64 count, i64 tensor_step, const Coefficients& c) {
    const Streams streams = make_streams<Update::kStochastic>(seed, tensor_step, tab.index(tensor),
                                                                tab.first_element(tensor));
    Tally<Update::kTrack> tally;
    alignas(16) float scratch0[kQ8Lane];
    alignas(16) float scratch1[kQ8Lane];
    alignas(16) float scratch2[kQ8Lane];
    i64 local[R];
    for (int r = 0; r < R; ++r) local[r] = table[r * n_tensors + tensor];
    for (i64 block = start + (threadIdx.x >> 5) * static_cast<i64>(kQ8Block); block < start + count;
         block += stride) {
      const i64 left = start + count - block;
      const int ahead = (left < kQ8Block ? static_cast<int>(left) : kQ8Block) - kQ8Lane * lane;
      const int mine = ahead < 0 ? 0 : (ahead > kQ8Lane ? kQ8Lane : ahead);  // (a block's tail: fewer)
      const i64 first = block + kQ8Lane * lane;
      q8_slot_load<S0>(local, tab, tensor, block, lane, mine, first, scratch0);
      q8_slot_load<S1>(local, tab, tensor, block, lane, mine, first, scratch1);
      q8_slot_load<S2>(local, tab, tensor, block, lane, mine, first, scratch2);
      const Update up(ChunkTable<R>{local, 1}, 0);
      if (mine == kQ8Lane && up.vector_ok(first, c)) {
#pragma unroll
        for (int k = 0; k < kQ8Lane; k += kVec) up.template run<kVec, true>(first + k, streams, c, tally);
      } else {
        for (int j = 0; j < mine; ++j) up.template run<1, false>(first + j, streams, c, tally);
      }
      q8_slot_store<S0>(tab, tensor, block, lane, mine, first, scratch0, streams, tally);
      q8_slot_store<S1>(tab, tensor, block, lane, mine, first, scratch1, streams, tally);
      q8_slot_store<S2>(tab, tensor, block, lane, mine, first, scratch2, streams, tally);
    }
    tally.flush(counts, tensor);
  });
}

}  // namespace bf16opt
