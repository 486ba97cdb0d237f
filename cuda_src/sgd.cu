// SGD with momentum (torch.optim.SGD's math), multi-tensor: one launch updates every
// tensor of a bucket.
//
// Per element, in exactly the float32 operation order of bf16opt/backends/reference.py's
// sgd (each line one IEEE-rounded operation, docs/numerics.md):
//
//   g = decode(grad) * inv_grad_scale;  if maximize: g = -g
//       (grad stored like the param, or float32 with the kFloat32Grad flag bit;
//        inv_grad_scale = 1 / GradScaler's scale, 1.0 without one: GradReader)
//   w0 = w = master value (the master policy's read)
//   if l2: t = w * weight_decay;  g = g + t
//   if MOMENTUM:
//     if first: b = g
//     else:     b = decode(momentum_buffer) * momentum;  t = g * one_minus_dampening;  b = b + t
//     if nesterov: t = b * momentum;  g = g + t
//     else:        g = b
//     store b (stream EXP_AVG when stochastic)
//   u = g * lr;  w = w - u
//   the master policy's write(w0, w) (stream WEIGHTS)
//   telemetry (TRACK): u != 0 with the stored master unchanged; b != 0 stored as 0
//
// Template parameters: storage type of param (and of grad, unless kFloat32Grad), master policy (NoMaster,
// Master<S>, Kahan<C>, Remainder), momentum_buffer storage type (Fp32, and unused,
// without MOMENTUM); flags MOMENTUM (the buffer exists; its pointer is 0 otherwise and
// never touched) and TRACK (telemetry).  maximize, L2, nesterov and first are run-time
// flags (as in adam.cu).  first is the buffer's first step, where torch clones the
// gradient into it: the buffer is written but not read.
#include "storage.cuh"
#include "multi_tensor.cuh"
#include "q8.cuh"

namespace bf16opt {

// Roles of the chunk table, in bf16opt/algorithms.py's SGD.roles order.
enum SgdRole { kSgdParam = 0, kSgdGrad = 1, kSgdCompanion = 2, kSgdMomentumBuffer = 3, kSgdRoles = 4 };

// Bits of the kernel argument ``flags``: bit k is SGD.runtime_flags[k].
enum SgdFlag { kSgdMaximize = 1, kSgdL2 = 2, kSgdNesterov = 4, kSgdFirst = 8 };

struct SgdCoefficients {
  bool maximize, l2, nesterov, first, float32_grad;
  float momentum, one_minus_dampening, lr, weight_decay, inv_grad_scale;

  // sgd_scalars (bf16opt/sgd.py), the lr read now
  __device__ __forceinline__ SgdCoefficients at_step(const LiveStep& live, i64) const {
    SgdCoefficients out = *this;
    out.lr = __double2float_rn(live.learning_rate());
    return out;
  }
};

// One tensor's SGD update (the Update interface of update_chunks, multi_tensor.cuh).
template <class P, class M, class EA, bool MOMENTUM, bool TRACK>
struct SgdUpdate {
  static constexpr int kRoles = kSgdRoles;
  static constexpr int kVec = VectorWidth<min_bytes(
      min_bytes(P::kBytes, MOMENTUM ? EA::kBytes : 16), M::kCompanion ? M::kBytes : 16)>::value;
  static constexpr bool kStochastic = P::kStochastic || (MOMENTUM && EA::kStochastic);
  static constexpr bool kTrack = TRACK;

  const void* grad;
  void* param;
  void* companion;
  void* momentum_buffer;  // 0 without MOMENTUM

  __device__ __forceinline__ SgdUpdate(const ChunkTable<kRoles>& tab, int tensor)
      : grad(tab.pointer(kSgdGrad, tensor)),
        param(tab.pointer(kSgdParam, tensor)),
        companion(tab.pointer(kSgdCompanion, tensor)),
        momentum_buffer(tab.pointer(kSgdMomentumBuffer, tensor)) {}

  __device__ __forceinline__ bool vector_ok(i64 start, const SgdCoefficients& c) const {
    const GradReader<P> grads{c.float32_grad, c.inv_grad_scale};
    bool ok = aligned16(grad, grads.bytes(), start) && aligned16(param, P::kBytes, start);
    if constexpr (M::kCompanion) ok = ok && aligned16(companion, M::kBytes, start);
    if constexpr (MOMENTUM) ok = ok && aligned16(momentum_buffer, EA::kBytes, start);
    return ok;
  }

  // N elements from ``index`` on: N == kVec with VEC (packed accesses) or N == 1.
  template <int N, bool VEC>
  __device__ __forceinline__ void run(i64 index, const Streams& streams, const SgdCoefficients& c,
                                      Tally<TRACK>& tally) const {
    float g_values[N];
    typename P::bits_t p_bits[N];
    typename M::bits_t c_bits[N];
    typename EA::bits_t b_bits[N];
    GradReader<P>{c.float32_grad, c.inv_grad_scale}.template load<VEC>(grad, index, g_values);
    if constexpr (M::kReadsParam) load_bits<VEC>(param, index, p_bits);
    if constexpr (M::kCompanion) load_bits<VEC>(companion, index, c_bits);
    if constexpr (MOMENTUM) {
      if (!c.first) load_bits<VEC>(momentum_buffer, index, b_bits);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const i64 i = index + k;
      float g = g_values[k];
      if (c.maximize) g = -g;
      const float w0 = M::template read<P>(p_bits[k], c_bits[k]);
      float w = w0;
      float t;
      if (c.l2) {
        t = w * c.weight_decay;
        g = g + t;
      }
      if constexpr (MOMENTUM) {
        float b;
        if (c.first) {
          b = g;
        } else {
          b = EA::decode(b_bits[k]) * c.momentum;
          t = g * c.one_minus_dampening;
          b = b + t;
        }
        if (c.nesterov) {
          t = b * c.momentum;
          g = g + t;
        } else {
          g = b;
        }
        b_bits[k] = EA::encode(b, streams.at(kExpAvg, i));
        tally.count(1, b != 0.0f && EA::decode(b_bits[k]) == 0.0f);
      }
      const float u = g * c.lr;
      w = w - u;
      const bool kept = M::template write<P>(w0, w, p_bits[k], c_bits[k], streams.at(kWeights, i));
      tally.count(0, u != 0.0f && kept);
    }
    if constexpr (MOMENTUM) store_bits<VEC>(momentum_buffer, index, b_bits);
    if constexpr (M::kCompanion) store_bits<VEC>(companion, index, c_bits);
    store_bits<VEC>(param, index, p_bits);
  }
};

template <class P, class M, class EA, bool MOMENTUM, bool TRACK, bool LIVE = false>
__global__ void sgd_kernel(const i64* table, int n_tensors, i64 n_chunks, int chunk_size, u64 seed,
                           i64 step, u64* counts, int flags, BF16OPT_LIVE_PARAMETERS, float momentum,
                           float one_minus_dampening, float lr, float weight_decay,
                           float inv_grad_scale) {
  const SgdCoefficients c{(flags & kSgdMaximize) != 0, (flags & kSgdL2) != 0,
                          (flags & kSgdNesterov) != 0, (flags & kSgdFirst) != 0,
                          (flags & kFloat32Grad) != 0, momentum, one_minus_dampening, lr,
                          weight_decay, inv_grad_scale};
  const LiveStep live = BF16OPT_LIVE_STEP;
  typedef SgdUpdate<P, M, EA, MOMENTUM, TRACK> Update;
  if constexpr (MOMENTUM && IsQ8<EA>::value) {  // a q8 momentum buffer: block by block (q8.cuh)
    update_q8_chunks<Update, Q8Slot<kSgdMomentumBuffer, EA, kExpAvg, 1>, NoQ8Slot, NoQ8Slot, LIVE>(
        table, n_tensors, n_chunks, chunk_size, seed, step, counts, c, live);
  } else {
    update_chunks<Update, LIVE>(table, n_tensors, n_chunks, chunk_size, seed, step, counts, c, live);
  }
}

}  // namespace bf16opt
