// Storage formats of bf16opt's CUDA kernels: decode to float32, encode from float32.
//
// Same functions, same bits as bf16opt/storage.py (the specification):
//   * decode: bfloat16/float16 -> float32 is exact; float32 is taken as is.
//   * encode to bfloat16: round to nearest, ties to even, on the integer bits.
//   * encode to float16: IEEE round to nearest, ties to even, subnormals kept,
//     overflow to +-inf; done on the integer bits too, so the result does not depend
//     on the device's conversion instructions or on flush-to-zero settings.
//   * NaN is stored as the canonical quiet NaN of each format (float32 0x7FC00000,
//     bfloat16 0x7FC0, float16 0x7E00) whatever its sign or payload.
//
// A storage type is a tag struct with
//   bits_t                      the raw element type in memory (the kernel never
//                               touches __nv_bfloat16/__half, only integer bits)
//   kBytes                      sizeof(bits_t)
//   kStochastic                 whether encode() draws random bits
//   decode(bits_t) -> float
//   encode(float, const EncodeContext&) -> bits_t
// Round to nearest: Fp32, Bf16, Fp16.  Stochastic rounding: Stochastic<Bf16>,
// Stochastic<Fp16>, whose encode() hashes the EncodeContext (the element's random
// stream, see "Random streams").  How the master weight is held (the param itself, a
// float32 copy, param + Kahan compensation, bf16 param + int16 remainder) is a master
// policy (see "Master policies"); kernels only talk to these two interfaces.
//
// Portable CUDA only: bit casts go through __float_as_uint/__uint_as_float, which
// the CPU emulation (tests/cuda_emulation/emulation.h) provides via memcpy.
#pragma once

namespace bf16opt {

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

// ---------------------------------------------------------------- random streams
// Stochastic rounding's random bits (bf16opt/storage.py): a counter-based hash, so
// every backend, launch shape and thread count draws the same bits.  Buffers pair up into
// streams (buffer b in stream b >> 1), one hash per stream and element for both:
//   key = stream_key(seed, step, tensor index, stream)       once per tensor and stream
//   r   = fmix32(key ^ (element index * 0x9E3779B9 mod 2^32))  per element
//   u   = r & 0xFFFF0000 (even buffer) or r << 16 (odd)       the buffer's 16 bits, on top
// inline, not static: NVRTC salts the PTX names of internal-linkage globals (process
// id and more), so the same compile would not give the same bytes twice.
inline constexpr u32 kGolden = 0x9E3779B9u;

// Buffer numbers (storage.WEIGHTS, EXP_AVG, EXP_AVG_SQ, MAX_EXP_AVG_SQ) and streams per tensor.
// Which buffer each state rounds with is its row of cpu_src/roles.py's STATE_ROLES; a kernel's
// streams.at(kBuffer, i) and Q8Slot<..., kBuffer, ...> follow it (tests/test_algorithms.py).
enum Buffer { kWeights = 0, kExpAvg = 1, kExpAvgSq = 2, kMaxExpAvgSq = 3, kBuffers = 4 };
enum { kStreams = 2 };

// MurmurHash3's 32-bit finaliser (unsigned arithmetic wraps modulo 2^32).
__device__ __forceinline__ u32 fmix32(u32 h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// storage.stream_key: the words (seed low, seed high ^ step high, step, tensor index, stream),
// each folded in as k = fmix32((k ^ word) + golden).
__device__ __forceinline__ u32 stream_key(u64 seed, i64 step, i64 tensor_index, u32 stream) {
  // the step's high word shares the seed's slot: unchanged keys below 2^32 steps, and no
  // two steps of one run share a key
  const u32 words[5] = {static_cast<u32>(seed),
                        static_cast<u32>(seed >> 32) ^ static_cast<u32>(static_cast<u64>(step) >> 32),
                        static_cast<u32>(step), static_cast<u32>(tensor_index), stream};
  u32 key = 0;
#pragma unroll
  for (int w = 0; w < 5; ++w) key = fmix32((key ^ words[w]) + kGolden);
  return key;
}

// What an encode may hash: the element's random stream.  Round to nearest ignores it
// (and the compiler drops it); the two buffers of a stream hash the same key and index,
// which the compiler computes once.
struct EncodeContext {
  u32 key;    // stream_key of the element's tensor and stream
  u32 index;  // row-major element index, modulo 2^32
  bool odd;   // the stream's odd buffer: the hash's lower half
  // storage.buffer_bits: the buffer's 16 random bits as the upper half of the word
  __device__ __forceinline__ u32 random() const {
    const u32 r = fmix32(key ^ (index * kGolden));
    return odd ? r << 16 : r & 0xFFFF0000u;
  }
};

// The streams of one tensor in one step.  Kernels without stochastic storage never
// compute the keys (kNeeded = false).
struct Streams {
  u32 key[kStreams];
  i64 first;  // global index of the tensor's element 0 (a shard's offset in its param)
  __device__ __forceinline__ EncodeContext at(int buffer, i64 index) const {
    return EncodeContext{key[buffer >> 1], static_cast<u32>(index + first), (buffer & 1) != 0};
  }
};

template <bool kNeeded>
__device__ __forceinline__ Streams make_streams(u64 seed, i64 step, i64 tensor_index, i64 first = 0) {
  Streams s{{0u, 0u}, first};
  if constexpr (kNeeded) {
#pragma unroll
    for (int k = 0; k < kStreams; ++k) s.key[k] = stream_key(seed, step, tensor_index, static_cast<u32>(k));
  }
  return s;
}

__device__ __forceinline__ bool is_nan_bits32(u32 bits) {
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

// ---------------------------------------------------------------- float32
struct Fp32 {
  static constexpr bool kStochastic = false;
  typedef u32 bits_t;
  static constexpr int kBytes = 4;
  static constexpr u32 kCanonicalNaN = 0x7FC00000u;

  static __device__ __forceinline__ float decode(bits_t bits) { return __uint_as_float(bits); }

  static __device__ __forceinline__ bits_t encode(float x, const EncodeContext&) {
    const u32 bits = __float_as_uint(x);
    return is_nan_bits32(bits) ? kCanonicalNaN : bits;
  }
};

// ---------------------------------------------------------------- bfloat16
struct Bf16 {
  static constexpr bool kStochastic = false;
  typedef u16 bits_t;
  static constexpr int kBytes = 2;
  static constexpr u16 kCanonicalNaN = 0x7FC0u;

  static __device__ __forceinline__ float decode(bits_t bits) {
    return __uint_as_float(static_cast<u32>(bits) << 16);
  }

  // Round to nearest even on the integer bits.  No overflow of the 32-bit sum:
  // the largest non-NaN pattern is 0xFF800000 (-inf).  Finite values past the
  // largest bfloat16 round to inf, as in IEEE.
  static __device__ __forceinline__ bits_t encode(float x, const EncodeContext&) {
    const u32 bits = __float_as_uint(x);
    if (is_nan_bits32(bits)) return kCanonicalNaN;
    const u32 lsb = (bits >> 16) & 1u;
    return static_cast<bits_t>((bits + 0x7FFFu + lsb) >> 16);
  }
};

// ---------------------------------------------------------------- float16
struct Fp16 {
  static constexpr bool kStochastic = false;
  typedef u16 bits_t;
  static constexpr int kBytes = 2;
  static constexpr u16 kCanonicalNaN = 0x7E00u;

  static __device__ __forceinline__ float decode(bits_t h) {
    const u32 sign = static_cast<u32>(h & 0x8000u) << 16;
    const u32 exponent = (h >> 10) & 0x1Fu;
    const u32 mantissa = h & 0x3FFu;
    if (exponent == 0x1Fu) return __uint_as_float(sign | 0x7F800000u | (mantissa << 13));
    if (exponent != 0) return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
    // zero or subnormal: mantissa * 2^-24, exact in float32 (the integer converts
    // exactly, the power-of-two scale keeps it a normal float32); no loop, no branch
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
    return __uint_as_float(sign | __float_as_uint(magnitude));
  }

  static __device__ __forceinline__ bits_t encode(float x, const EncodeContext&) {
    const u32 bits = __float_as_uint(x);
    const u32 sign = (bits >> 16) & 0x8000u;
    const u32 a = bits & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return kCanonicalNaN;
    if (a >= 0x477FF000u) return static_cast<bits_t>(sign | 0x7C00u);  // >= 65520: inf
    if (a >= 0x38800000u) {  // normal float16 (>= 2^-14)
      const u32 t = a - 0x38000000u;  // rebias exponent 127 -> 15
      u32 h = t >> 13;
      const u32 rest = t & 0x1FFFu;
      h += (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ? 1u : 0u;  // carries into exponent
      return static_cast<bits_t>(sign | h);
    }
    if (a <= 0x33000000u) return static_cast<bits_t>(sign);  // <= 2^-25: ties to even zero
    // subnormal float16: units of 2^-24
    const u32 shift = 126u - (a >> 23);  // 14..24
    const u32 m = (a & 0x7FFFFFu) | 0x800000u;
    u32 h = m >> shift;
    const u32 rest = m & ((1u << shift) - 1u);
    const u32 half = 1u << (shift - 1u);
    h += (rest > half || (rest == half && (h & 1u))) ? 1u : 0u;  // may become the smallest normal
    return static_cast<bits_t>(sign | h);
  }
};

// ---------------------------------------------------------------- stochastic rounding
// Stochastic<S>: S's format, encoded with stochastic rounding (storage.encode_stochastic):
// the magnitude rounds up with probability equal to the dropped fraction.  inf stays
// inf, NaN becomes the canonical NaN, as with round to nearest.
template <class S>
struct Stochastic;

template <>
struct Stochastic<Bf16> : Bf16 {
  static constexpr bool kStochastic = true;

  // bits(x) + (u >> 16), upper 16 bits.  No wrap-around: the largest finite pattern
  // plus 0xFFFF stays below 2^32 (and may round up to inf, as the reference does).
  static __device__ __forceinline__ bits_t encode(float x, const EncodeContext& ctx) {
    // hashed before any branch: the two buffers of a stream then share one hash (the
    // compiler merges the same operations on the same key and index, not in sibling branches)
    const u32 r = ctx.random();
    const u32 bits = __float_as_uint(x);
    if (is_nan_bits32(bits)) return kCanonicalNaN;
    if ((bits & 0x7FFFFFFFu) == 0x7F800000u) return static_cast<bits_t>(bits >> 16);
    return static_cast<bits_t>((bits + (r >> 16)) >> 16);
  }
};

template <>
struct Stochastic<Fp16> : Fp16 {
  static constexpr bool kStochastic = true;

  static __device__ __forceinline__ bits_t encode(float x, const EncodeContext& ctx) {
    const u32 r = ctx.random();  // (before any branch, as Stochastic<Bf16>'s)
    const u32 bits = __float_as_uint(x);
    const u32 sign = (bits >> 16) & 0x8000u;
    const u32 a = bits & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return kCanonicalNaN;
    if (a == 0x7F800000u) return static_cast<bits_t>(sign | 0x7C00u);
    if (a >= 0x38800000u) {
      // |x| >= 2^-14: (bits(|x|) + (u >> 19)) with the low 13 bits cleared is a float16
      // value (exact), or >= 2^16, which float16 holds as inf.
      const u32 up = (a + (r >> 19)) & 0xFFFFE000u;
      if (up >= 0x47800000u) return static_cast<bits_t>(sign | 0x7C00u);
      return static_cast<bits_t>(sign | ((up - 0x38000000u) >> 13));  // rebias 127 -> 15
    }
    // float16's subnormal grid (step 2^-24): y = |x| * 2^24, n = floor(y), round up when
    // float(u >> 8) < (y - n) * 2^24 (16 random bits).  Every float operation here is exact.
    const float y = __uint_as_float(a) * 16777216.0f;
    const float n = floorf(y);
    const bool round_up = static_cast<float>(r >> 8) < (y - n) * 16777216.0f;
    // n + round_up units of 2^-24 (1024 units: the smallest normal, 0x0400)
    return static_cast<bits_t>(sign | (static_cast<u32>(n) + (round_up ? 1u : 0u)));
  }
};

// ---------------------------------------------------------------- master policies
// How the master weight of one element is held, read and written.  A policy owns the
// param array (P, the param's storage type) and at most one companion array:
//
//   kReadsParam                 whether read() needs the param's bits
//   kCompanion                  whether there is a companion array
//   bits_t, kBytes              the companion's element type (a placeholder when none)
//   read<P>(p, c) -> float      the master value w0 before the step
//   write<P>(w0, w, p, c, ctx) -> bool
//                               store the updated master w into p (and c); returns
//                               whether the stored master kept its bits (telemetry's
//                               "swallowed update"; compiled away when not tracked).
//                               ctx is the WEIGHTS stream for a stochastic P.
//
//   NoMaster          the param is the master: p = encode(w) (stochastic if P is)
//   Master<S>         a master copy in S: c = encode(w), p = encode(w) (nearest); read
//                     is decode(c), or decode(p) where p != encode(decode(c)) (p edited)
//   Kahan<C>          16-bit param plus a compensation buffer in C (reference.py):
//                       y = w - w0;  y = y + decode(c);  s = w0 + y;  p = encode(s)
//                       t = decode(p) - w0;  c = encode(y - t)
//   Remainder         bfloat16 param + int16 remainder = exact float32 master
//                     (storage.split_remainder / join_remainder)
struct NoMaster {
  static constexpr bool kReadsParam = true;
  static constexpr bool kCompanion = false;
  typedef u16 bits_t;  // unused; keeps register arrays well-formed
  static constexpr int kBytes = 2;

  template <class P>
  static __device__ __forceinline__ float read(const typename P::bits_t& p, const bits_t&) {
    return P::decode(p);
  }
  template <class P>
  static __device__ __forceinline__ bool write(float, float w, typename P::bits_t& p, bits_t&,
                                               const EncodeContext& ctx) {
    const typename P::bits_t old = p;
    p = P::encode(w, ctx);
    return p == old;
  }
};

template <class S>
struct Master {
  static constexpr bool kReadsParam = true;
  static constexpr bool kCompanion = true;
  typedef typename S::bits_t bits_t;
  static constexpr int kBytes = S::kBytes;

  // the copy, or the param's value where the param's bits are not the copy's encoding (round
  // to nearest, as write() stores it): a param edited since the step wrote it (storage.join_copy)
  template <class P>
  static __device__ __forceinline__ float read(const typename P::bits_t& p, const bits_t& c) {
    static_assert(!P::kStochastic, "a param written from a master copy is rounded to nearest");
    const float master = S::decode(c);
    return P::encode(master, EncodeContext{0u, 0u, false}) == p ? master : P::decode(p);
  }
  // unchanged: the new copy is the encoding of the master the update started from (w0: an
  // edited param's value, not the stale copy)
  template <class P>
  static __device__ __forceinline__ bool write(float w0, float w, typename P::bits_t& p, bits_t& c,
                                               const EncodeContext& ctx) {
    c = S::encode(w, ctx);
    p = P::encode(w, ctx);
    return c == S::encode(w0, ctx);
  }
};

template <class C>
struct Kahan {
  static constexpr bool kReadsParam = true;
  static constexpr bool kCompanion = true;
  typedef typename C::bits_t bits_t;
  static constexpr int kBytes = C::kBytes;

  template <class P>
  static __device__ __forceinline__ float read(const typename P::bits_t& p, const bits_t&) {
    return P::decode(p);
  }
  template <class P>
  static __device__ __forceinline__ bool write(float w0, float w, typename P::bits_t& p, bits_t& c,
                                               const EncodeContext& ctx) {
    float y = w - w0;
    y = y + C::decode(c);
    const float s = w0 + y;
    const typename P::bits_t old = p;
    p = P::encode(s, ctx);
    const float t = P::decode(p) - w0;
    c = C::encode(y - t, ctx);
    return p == old;
  }
};

struct Remainder {
  static constexpr bool kReadsParam = true;
  static constexpr bool kCompanion = true;
  typedef u16 bits_t;  // int16 remainder, as raw bits
  static constexpr int kBytes = 2;

  // M = ((param - (remainder < 0)) << 16) | remainder; the param alone where M is NaN but the
  // param is not (a param edited to +-0 or +-inf beside its old remainder)
  template <class P>
  static __device__ __forceinline__ float read(const typename P::bits_t& p, const bits_t& c) {
    static_assert(sizeof(typename P::bits_t) == 2, "the remainder completes a bfloat16 param");
    const u32 upper = (static_cast<u32>(p) - (static_cast<u32>(c) >> 15)) & 0xFFFFu;
    const u32 joined = (upper << 16) | static_cast<u32>(c);
    const u32 alone = static_cast<u32>(p) << 16;
    const bool stray = (joined & 0x7FFFFFFFu) > 0x7F800000u && (alone & 0x7FFFFFFFu) <= 0x7F800000u;
    return __uint_as_float(stray ? alone : joined);
  }
  // param = (M + 0x8000) >> 16 (nearest, ties away from zero), remainder = M & 0xFFFF,
  // M the canonical float32 bits (no wrap-around: the largest non-NaN pattern is -inf).
  template <class P>
  static __device__ __forceinline__ bool write(float, float w, typename P::bits_t& p, bits_t& c,
                                               const EncodeContext& ctx) {
    const u32 bits = Fp32::encode(w, ctx);
    const typename P::bits_t old_p = p;
    const bits_t old_c = c;
    p = static_cast<typename P::bits_t>((bits + 0x8000u) >> 16);
    c = static_cast<bits_t>(bits & 0xFFFFu);
    return p == old_p && c == old_c;
  }
};

// ---------------------------------------------------------------- float helpers
// max(a, b) = a if (a > b or a is NaN) else b (reference.py): one answer for +-0 ties
// (b) and NaN.  Written with comparisons, never fmaxf (which drops NaN).
__device__ __forceinline__ float max_or_nan(float a, float b) {
  return (a > b || a != a) ? a : b;
}

// sign(c): +1, -1, +0 for +-0, NaN for NaN (c + 0.0 turns -0 into +0 and keeps NaN).
__device__ __forceinline__ float sign_of(float c) {
  return c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c + 0.0f);
}

}  // namespace bf16opt
