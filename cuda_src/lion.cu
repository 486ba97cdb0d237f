// Lion (Chen et al. 2023), multi-tensor: one launch updates every tensor of a bucket.
//
// Per element, in exactly the float32 operation order of bf16opt/backends/reference.py
// (each line one IEEE-rounded operation, docs/numerics.md):
//
//   g = decode(grad) * inv_grad_scale;  if maximize: g = -g
//       (grad stored like the param, or float32 with the kFloat32Grad flag bit;
//        inv_grad_scale = 1 / GradScaler's scale, 1.0 without one: GradReader)
//   w0 = master value (the master policy's read);  w = w0 * decay
//   c = decode(exp_avg) * beta1;  t = g * one_minus_beta1;  c = c + t
//   s = sign(c)                           (+1, -1, +0 for +-0, NaN for NaN)
//   u = s * lr;  w = w - u
//   m = decode(exp_avg) * beta2;  t = g * one_minus_beta2;  m = m + t
//   store m (stream EXP_AVG when stochastic); the master policy's write(w0, w)
//   telemetry (TRACK): u != 0 with the stored master unchanged; m != 0 stored as 0
//
// Template parameters: storage type of param (and of grad, unless kFloat32Grad), master policy (NoMaster,
// Master<S>, Kahan<C>, Remainder), exp_avg storage type; flag TRACK (telemetry).
// maximize is a run-time flag (kernel argument ``flags``, as in adam.cu).
#include "storage.cuh"
#include "multi_tensor.cuh"
#include "q8.cuh"

namespace bf16opt {

// Roles of the chunk table, in bf16opt/algorithms.py's LION.roles order.
enum LionRole { kLionParam = 0, kLionGrad = 1, kLionCompanion = 2, kLionExpAvg = 3, kLionRoles = 4 };

// Bits of the kernel argument ``flags``: bit k is LION.runtime_flags[k].
enum LionFlag { kLionMaximize = 1 };

struct LionCoefficients {
  bool maximize, float32_grad;
  float beta1, beta2, one_minus_beta1, one_minus_beta2, lr, decay, inv_grad_scale;

  // lion_scalars (bf16opt/lion.py), the lr read now
  __device__ __forceinline__ LionCoefficients at_step(const LiveStep& live, i64) const {
    LionCoefficients out = *this;
    const double lr_now = live.learning_rate();
    out.lr = __double2float_rn(lr_now);
    out.decay = live.decay(lr_now);
    return out;
  }
};

// One tensor's Lion update (the Update interface of update_chunks, multi_tensor.cuh).
template <class P, class M, class EA, bool TRACK>
struct LionUpdate {
  static constexpr int kRoles = kLionRoles;
  static constexpr int kVec =
      VectorWidth<min_bytes(min_bytes(P::kBytes, EA::kBytes), M::kCompanion ? M::kBytes : 16)>::value;
  static constexpr bool kStochastic = P::kStochastic || EA::kStochastic;
  static constexpr bool kTrack = TRACK;

  const void* grad;
  void* param;
  void* companion;
  void* exp_avg;

  __device__ __forceinline__ LionUpdate(const ChunkTable<kRoles>& tab, int tensor)
      : grad(tab.pointer(kLionGrad, tensor)),
        param(tab.pointer(kLionParam, tensor)),
        companion(tab.pointer(kLionCompanion, tensor)),
        exp_avg(tab.pointer(kLionExpAvg, tensor)) {}

  __device__ __forceinline__ bool vector_ok(i64 start, const LionCoefficients& c) const {
    const GradReader<P> grads{c.float32_grad, c.inv_grad_scale};
    bool ok = aligned16(grad, grads.bytes(), start) && aligned16(param, P::kBytes, start) &&
              aligned16(exp_avg, EA::kBytes, start);
    if (M::kCompanion) ok = ok && aligned16(companion, M::kBytes, start);
    return ok;
  }

  template <int N, bool VEC>
  __device__ __forceinline__ void run(i64 index, const Streams& streams, const LionCoefficients& c,
                                      Tally<TRACK>& tally) const {
    float g_values[N];
    typename P::bits_t p_bits[N];
    typename M::bits_t c_bits[N];
    typename EA::bits_t m_bits[N];
    GradReader<P>{c.float32_grad, c.inv_grad_scale}.template load<VEC>(grad, index, g_values);
    if constexpr (M::kReadsParam) load_bits<VEC>(param, index, p_bits);
    if constexpr (M::kCompanion) load_bits<VEC>(companion, index, c_bits);
    load_bits<VEC>(exp_avg, index, m_bits);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const i64 i = index + k;
      float g = g_values[k];
      if (c.maximize) g = -g;
      const float w0 = M::template read<P>(p_bits[k], c_bits[k]);
      float w = w0 * c.decay;
      const float m_old = EA::decode(m_bits[k]);
      float interp = m_old * c.beta1;
      float t = g * c.one_minus_beta1;
      interp = interp + t;
      const float s = sign_of(interp);
      const float u = s * c.lr;
      w = w - u;
      float m = m_old * c.beta2;
      t = g * c.one_minus_beta2;
      m = m + t;
      m_bits[k] = EA::encode(m, streams.at(kExpAvg, i));
      const bool kept = M::template write<P>(w0, w, p_bits[k], c_bits[k], streams.at(kWeights, i));
      tally.count(0, u != 0.0f && kept);
      tally.count(1, m != 0.0f && EA::decode(m_bits[k]) == 0.0f);
    }
    store_bits<VEC>(exp_avg, index, m_bits);
    if constexpr (M::kCompanion) store_bits<VEC>(companion, index, c_bits);
    store_bits<VEC>(param, index, p_bits);
  }
};

template <class P, class M, class EA, bool TRACK, bool LIVE = false>
__global__ void lion_kernel(const i64* table, int n_tensors, i64 n_chunks, int chunk_size, u64 seed,
                            i64 step, u64* counts, int flags, BF16OPT_LIVE_PARAMETERS, float beta1, float beta2,
                            float one_minus_beta1, float one_minus_beta2, float lr, float decay,
                            float inv_grad_scale) {
  const LionCoefficients c{(flags & kLionMaximize) != 0, (flags & kFloat32Grad) != 0, beta1, beta2,
                           one_minus_beta1, one_minus_beta2, lr, decay, inv_grad_scale};
  const LiveStep live = BF16OPT_LIVE_STEP;
  typedef LionUpdate<P, M, EA, TRACK> Update;
  if constexpr (IsQ8<EA>::value) {  // a q8 moment: block by block (q8.cuh)
    update_q8_chunks<Update, Q8Slot<kLionExpAvg, EA, kExpAvg, 1>, NoQ8Slot, NoQ8Slot, LIVE>(
        table, n_tensors, n_chunks, chunk_size, seed, step, counts, c, live);
  } else {
    update_chunks<Update, LIVE>(table, n_tensors, n_chunks, chunk_size, seed, step, counts, c, live);
  }
}

}  // namespace bf16opt
