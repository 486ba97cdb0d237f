// Adam / AdamW, multi-tensor: one launch updates every tensor of a bucket.
//
// Per element, in exactly the float32 operation order of bf16opt/backends/reference.py
// (each line one IEEE-rounded operation, docs/numerics.md; the loader compiles with
// --fmad=false, IEEE division and square root, no flush-to-zero):
//
//   g = decode(grad) * inv_grad_scale;  if maximize: g = -g
//       (grad stored like the param, or float32 with the kFloat32Grad flag bit;
//        inv_grad_scale = 1 / GradScaler's scale, 1.0 without one: GradReader)
//   w0 = w = master value (the master policy's read)
//   if l2: t = w * weight_decay;  g = g + t
//   w = w * decay
//   m = decode(exp_avg) * beta1;  t = g * one_minus_beta1;  m = m + t
//   v = decode(exp_avg_sq) * beta2;  t = g * one_minus_beta2;  t = t * g;  v = v + t
//   v_hat = amsgrad ? max(decode(max_exp_avg_sq), v) : v
//   d = sqrt(v_hat);  d = d * inv_sqrt_bias_correction2;  d = d + eps
//   u = m / d;  u = u * step_size;  w = w - u
//   store m, v (, v_hat) in their storage types (streams EXP_AVG, EXP_AVG_SQ,
//   MAX_EXP_AVG_SQ when stochastic); the master policy's write(w0, w) (stream WEIGHTS)
//   telemetry (TRACK): u != 0 with the stored master unchanged; m, v != 0 stored as 0
//
// Template parameters: storage type of param (and of grad, unless kFloat32Grad; Stochastic<...> when the
// param is a stochastically rounded master), master policy (NoMaster, Master<S>,
// Kahan<C>, Remainder), exp_avg, exp_avg_sq (and max_exp_avg_sq) storage types; flags
// AMSGRAD (an extra array) and TRACK (telemetry).  maximize and L2 are run-time flags
// (kernel argument ``flags``): a uniform branch of one or two instructions per element
// in a memory-bound kernel, which keeps the instantiations (and NVRTC's compile time)
// four times fewer.
#include "storage.cuh"
#include "multi_tensor.cuh"
#include "q8.cuh"

namespace bf16opt {

// Roles of the chunk table, in bf16opt/algorithms.py's ADAM.roles order.  The
// companion is the master policy's array: master copy, compensation or remainder.
enum AdamRole {
  kAdamParam = 0,
  kAdamGrad = 1,
  kAdamCompanion = 2,
  kAdamExpAvg = 3,
  kAdamExpAvgSq = 4,
  kAdamMaxExpAvgSq = 5,
  kAdamRoles = 6
};

// Bits of the kernel argument ``flags``: bit k is ADAM.runtime_flags[k].
enum AdamFlag { kAdamMaximize = 1, kAdamL2 = 2 };

struct AdamCoefficients {
  bool maximize, l2, float32_grad;
  float beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, inv_sqrt_bias_correction2,
      eps, weight_decay, decay, inv_grad_scale;

  // adam_scalars (bf16opt/adam.py) at ``step``, the lr read now
  __device__ __forceinline__ AdamCoefficients at_step(const LiveStep& live, i64 step) const {
    AdamCoefficients out = *this;
    const double lr = live.learning_rate();
    out.step_size = live.step_size(lr, step);
    out.inv_sqrt_bias_correction2 = live.inv_sqrt_bias_correction2(step);
    out.decay = live.decay(lr);
    return out;
  }
};

// One tensor's Adam update (the Update interface of update_chunks, multi_tensor.cuh).
template <class P, class M, class EA, class EAS, bool AMSGRAD, bool TRACK>
struct AdamUpdate {
  static constexpr int kRoles = kAdamRoles;
  static constexpr int kVec = VectorWidth<min_bytes(
      min_bytes(min_bytes(P::kBytes, EA::kBytes), EAS::kBytes), M::kCompanion ? M::kBytes : 16)>::value;
  static constexpr bool kStochastic = P::kStochastic || EA::kStochastic || EAS::kStochastic;
  static constexpr bool kTrack = TRACK;

  const void* grad;
  void* param;
  void* companion;
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;  // 0 without AMSGRAD

  __device__ __forceinline__ AdamUpdate(const ChunkTable<kRoles>& tab, int tensor)
      : grad(tab.pointer(kAdamGrad, tensor)),
        param(tab.pointer(kAdamParam, tensor)),
        companion(tab.pointer(kAdamCompanion, tensor)),
        exp_avg(tab.pointer(kAdamExpAvg, tensor)),
        exp_avg_sq(tab.pointer(kAdamExpAvgSq, tensor)),
        max_exp_avg_sq(tab.pointer(kAdamMaxExpAvgSq, tensor)) {}

  __device__ __forceinline__ bool vector_ok(i64 start, const AdamCoefficients& c) const {
    const GradReader<P> grads{c.float32_grad, c.inv_grad_scale};
    bool ok = aligned16(grad, grads.bytes(), start) && aligned16(param, P::kBytes, start) &&
              aligned16(exp_avg, EA::kBytes, start) && aligned16(exp_avg_sq, EAS::kBytes, start);
    if (M::kCompanion) ok = ok && aligned16(companion, M::kBytes, start);
    if (AMSGRAD) ok = ok && aligned16(max_exp_avg_sq, EAS::kBytes, start);
    return ok;
  }

  // N elements from ``index`` on: N == kVec with VEC (packed accesses) or N == 1.
  template <int N, bool VEC>
  __device__ __forceinline__ void run(i64 index, const Streams& streams, const AdamCoefficients& c,
                                      Tally<TRACK>& tally) const {
    float g_values[N];
    typename P::bits_t p_bits[N];
    typename M::bits_t c_bits[N];
    typename EA::bits_t m_bits[N];
    typename EAS::bits_t v_bits[N], vmax_bits[N];
    GradReader<P>{c.float32_grad, c.inv_grad_scale}.template load<VEC>(grad, index, g_values);
    if constexpr (M::kReadsParam) load_bits<VEC>(param, index, p_bits);
    if constexpr (M::kCompanion) load_bits<VEC>(companion, index, c_bits);
    load_bits<VEC>(exp_avg, index, m_bits);
    load_bits<VEC>(exp_avg_sq, index, v_bits);
    if constexpr (AMSGRAD) load_bits<VEC>(max_exp_avg_sq, index, vmax_bits);
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
      w = w * c.decay;
      float m = EA::decode(m_bits[k]) * c.beta1;
      t = g * c.one_minus_beta1;
      m = m + t;
      float v = EAS::decode(v_bits[k]) * c.beta2;
      t = g * c.one_minus_beta2;
      t = t * g;
      v = v + t;
      float v_hat = v;
      if constexpr (AMSGRAD) {
        v_hat = max_or_nan(EAS::decode(vmax_bits[k]), v);
        vmax_bits[k] = EAS::encode(v_hat, streams.at(kMaxExpAvgSq, i));
      }
      float d = sqrtf(v_hat);
      d = d * c.inv_sqrt_bias_correction2;
      d = d + c.eps;
      float u = m / d;
      u = u * c.step_size;
      w = w - u;
      m_bits[k] = EA::encode(m, streams.at(kExpAvg, i));
      v_bits[k] = EAS::encode(v, streams.at(kExpAvgSq, i));
      const bool kept = M::template write<P>(w0, w, p_bits[k], c_bits[k], streams.at(kWeights, i));
      tally.count(0, u != 0.0f && kept);
      tally.count(1, m != 0.0f && EA::decode(m_bits[k]) == 0.0f);
      tally.count(2, v != 0.0f && EAS::decode(v_bits[k]) == 0.0f);
    }
    store_bits<VEC>(exp_avg, index, m_bits);
    store_bits<VEC>(exp_avg_sq, index, v_bits);
    if constexpr (AMSGRAD) store_bits<VEC>(max_exp_avg_sq, index, vmax_bits);
    if constexpr (M::kCompanion) store_bits<VEC>(companion, index, c_bits);
    store_bits<VEC>(param, index, p_bits);
  }
};

template <class P, class M, class EA, class EAS, bool AMSGRAD, bool TRACK, bool LIVE = false>
__global__ void adam_kernel(const i64* table, int n_tensors, i64 n_chunks, int chunk_size, u64 seed,
                            i64 step, u64* counts, int flags, BF16OPT_LIVE_PARAMETERS, float beta1, float beta2,
                            float one_minus_beta1, float one_minus_beta2, float step_size,
                            float inv_sqrt_bias_correction2, float eps, float weight_decay,
                            float decay, float inv_grad_scale) {
  const AdamCoefficients c{(flags & kAdamMaximize) != 0, (flags & kAdamL2) != 0,
                           (flags & kFloat32Grad) != 0, beta1, beta2, one_minus_beta1,
                           one_minus_beta2, step_size, inv_sqrt_bias_correction2, eps,
                           weight_decay, decay, inv_grad_scale};
  const LiveStep live = BF16OPT_LIVE_STEP;
  typedef AdamUpdate<P, M, EA, EAS, AMSGRAD, TRACK> Update;
  if constexpr (IsQ8<EA>::value || IsQ8<EAS>::value) {  // q8 moments: block by block (q8.cuh)
    update_q8_chunks<Update, Q8Slot<kAdamExpAvg, EA, kExpAvg, 1>, Q8Slot<kAdamExpAvgSq, EAS, kExpAvgSq, 2>,
                     Q8Slot<kAdamMaxExpAvgSq, EAS, kMaxExpAvgSq, -1, AMSGRAD>, LIVE>(table, n_tensors, n_chunks,
                                                                            chunk_size, seed, step, counts, c,
                                                                            live);
  } else {
    update_chunks<Update, LIVE>(table, n_tensors, n_chunks, chunk_size, seed, step, counts, c, live);
  }
}

}  // namespace bf16opt
