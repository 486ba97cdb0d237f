// q8 moments (bf16opt/storage.py's "q8"): 8-bit codes in blocks of 256 elements of the flattened
// param, each block a row of 260 bytes (256 codes, then its float32 scale, little-endian).
//
// The element math of every algorithm stays as it is: a q8 storage type Q8<SIGNED, SR> is
// float32 to the update (decode and encode as Fp32), and update_q8_chunks hands the update
// float32 scratch arrays in place of the q8 arrays: per block of 256 elements one thread
// decodes the q8 states' codes into its scratch, runs the update over the block's elements
// in order, then quantizes the new values (quantize_block): the scale is the largest finite
// magnitude, y = x / scale, the code of the nearest map value (an 8-step binary search over
// the boundaries) or, stochastically, of one of the two values around y, and the NaN code for
// a non-finite element.  One thread per block: no shared memory, no warp intrinsics, so the
// CPU emulation runs it as it is.  Rows of the chunk table start on blocks (the chunk size is
// a multiple of 256).
#pragma once

#include "storage.cuh"
#include "multi_tensor.cuh"
#include "q8_maps.cuh"

namespace bf16opt {

inline constexpr int kQ8Block = 256;
inline constexpr int kQ8Row = 260;

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
__device__ __forceinline__ void q8_decode_block(const unsigned char* row, int count, float* out) {
  const u32* values = SIGNED ? kQ8SignedValues : kQ8UnsignedValues;
  const float scale = __uint_as_float(static_cast<u32>(row[256]) | (static_cast<u32>(row[257]) << 8) |
                                      (static_cast<u32>(row[258]) << 16) | (static_cast<u32>(row[259]) << 24));
  for (int j = 0; j < count; ++j) {
    const int code = row[j];
    const int index = SIGNED ? (code + 127) & 255 : code;
    out[j] = __uint_as_float(values[index]) * scale;
  }
}

// Quantize values[0..count) into the block's row; returns the underflows (non-zero finite
// values stored as zero).  ``first``: the block's first element's index in its tensor.
template <bool SIGNED, bool SR>
__device__ __forceinline__ u32 q8_quantize_block(const float* values, int count, unsigned char* row,
                                                 const Streams& streams, int buffer, i64 first) {
  const u32* table = SIGNED ? kQ8SignedValues : kQ8UnsignedValues;
  const u32* bounds = SIGNED ? kQ8SignedBounds : kQ8UnsignedBounds;
  float scale = 0.0f;
  for (int j = 0; j < count; ++j) {
    const float magnitude = fabsf(values[j]);
    if (magnitude < __uint_as_float(0x7F800000u) && magnitude > scale) scale = magnitude;
  }
  const u32 bits = __float_as_uint(scale);
  row[256] = static_cast<unsigned char>(bits & 0xFFu);
  row[257] = static_cast<unsigned char>((bits >> 8) & 0xFFu);
  row[258] = static_cast<unsigned char>((bits >> 16) & 0xFFu);
  row[259] = static_cast<unsigned char>(bits >> 24);
  u32 underflows = 0;
  for (int j = 0; j < count; ++j) {
    const float x = values[j];
    const float y = scale > 0.0f ? x / scale : 0.0f;
    int index;
    if constexpr (SR) {
      int lo = q8_count_below<false>(table, y) - 1;
      lo = lo > 0 ? lo : 0;
      const bool top = lo >= 254;
      const int low = top ? lo - 1 : lo;
      const float below = __uint_as_float(table[low]);
      const float fraction = (y - below) / (__uint_as_float(table[low + 1]) - below);
      const u32 word = streams.at(buffer, first + j).random();
      const bool up = static_cast<float>(word >> 16) < fraction * 65536.0f;
      index = top ? lo : lo + (up ? 1 : 0);
    } else {
      index = q8_count_below<true>(bounds, y);
    }
    const bool finite = fabsf(x) < __uint_as_float(0x7F800000u);
    const int code = SIGNED ? (index - 127) & 255 : index;
    row[j] = static_cast<unsigned char>(finite ? code : (SIGNED ? 0x80 : 0xFF));
    underflows += (x != 0.0f && finite && __uint_as_float(table[index]) * scale == 0.0f) ? 1u : 0u;
  }
  return underflows;
}

// One state array of an update, for update_q8_chunks: its chunk-table role, storage type,
// random buffer (storage.EXP_AVG...) and telemetry column (-1: none).  Off unless S is q8.
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

template <class Slot, int R>
__device__ __forceinline__ void q8_slot_load(i64 (&local)[R], const ChunkTable<R>& tab, int tensor, i64 block,
                                             int count, float* scratch) {
  if constexpr (Slot::kOn) {
    const unsigned char* row = static_cast<const unsigned char*>(tab.pointer(Slot::kRole, tensor)) +
                               (block / kQ8Block) * kQ8Row;
    q8_decode_block<Slot::kSigned>(row, count, scratch);
    // the update addresses element i at base + 4 i: the scratch, shifted to the block's first element
    local[Slot::kRole] = static_cast<i64>(reinterpret_cast<u64>(scratch) - static_cast<u64>(block) * 4u);
  }
}

template <class Slot, int R, class T>
__device__ __forceinline__ void q8_slot_store(const ChunkTable<R>& tab, int tensor, i64 block, int count,
                                              const float* scratch, const Streams& streams, T& tally) {
  if constexpr (Slot::kOn) {
    unsigned char* row = static_cast<unsigned char*>(tab.pointer(Slot::kRole, tensor)) + (block / kQ8Block) * kQ8Row;
    const u32 under = q8_quantize_block<Slot::kSigned, Slot::kStochastic>(scratch, count, row, streams,
                                                                           Slot::kBuffer, block);
    if constexpr (Slot::kColumn >= 0) tally.add(Slot::kColumn, under);
  }
}

// The chunk loop of a kernel with q8 states (update_chunks' counterpart): each thread takes
// whole blocks of a chunk, in order of its index.  S0..S2: the update's state slots.
template <class Update, class S0, class S1, class S2, bool LIVE, class Coefficients>
__device__ __forceinline__ void update_q8_chunks(const i64* table, int n_tensors, i64 n_chunks, int chunk_size,
                                                 u64 seed, i64 step, u64* counts, const Coefficients& coefficients,
                                                 const LiveStep& live) {
  constexpr int R = Update::kRoles;
  const ChunkTable<R> tab{table, n_tensors};
  for_each_chunk_at_step<LIVE>(tab, n_chunks, chunk_size, step, coefficients, live,
                         [&](int tensor, i64 start, i64 count, i64 tensor_step, const Coefficients& c) {
    const Streams streams = make_streams<Update::kStochastic>(seed, tensor_step, tab.index(tensor),
                                                                tab.first_element(tensor));
    Tally<Update::kTrack> tally;
    float scratch0[kQ8Block], scratch1[kQ8Block], scratch2[kQ8Block];
    i64 local[R];
    for (int r = 0; r < R; ++r) local[r] = table[r * n_tensors + tensor];
    const i64 stride = static_cast<i64>(blockDim.x) * kQ8Block;
    for (i64 block = start + threadIdx.x * static_cast<i64>(kQ8Block); block < start + count; block += stride) {
      const i64 left = start + count - block;
      const int n = left < kQ8Block ? static_cast<int>(left) : kQ8Block;
      q8_slot_load<S0>(local, tab, tensor, block, n, scratch0);
      q8_slot_load<S1>(local, tab, tensor, block, n, scratch1);
      q8_slot_load<S2>(local, tab, tensor, block, n, scratch2);
      const Update up(ChunkTable<R>{local, 1}, 0);
      for (i64 i = block; i < block + n; ++i) up.template run<1, false>(i, streams, c, tally);
      q8_slot_store<S0>(tab, tensor, block, n, scratch0, streams, tally);
      q8_slot_store<S1>(tab, tensor, block, n, scratch1, streams, tally);
      q8_slot_store<S2>(tab, tensor, block, n, scratch2, streams, tally);
    }
    tally.flush(counts, tensor);
  });
}

}  // namespace bf16opt
