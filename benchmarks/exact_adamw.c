/* AdamW over float32 params and states, written by hand in C: the benchmark's answer to
 * "is DeepSpeedCPUAdam's lead over bf16opt's fp32-state step the numerics, or the code?"
 * (cpu_step.py --same-arrays; not part of bf16opt).
 *
 * Both kernels do exactly the work of compute_limit.py's fp32-params Adam kernel, and give its
 * bits: every float32 operation rounded on its own (built with -ffp-contract=off: no fused
 * multiply-add), an IEEE square root and division, and every stored value's NaN made canonical
 * (0x7FC00000) as bf16opt's storage spec requires.  They differ only in how the loop is written:
 *
 *   exact_avx2:       8 lanes, one vector per array per iteration (what LLVM builds from
 *                     bf16opt's Numba loop on these CPUs);
 *   exact_avx512_x8:  16 lanes, eight vectors per array per iteration, all loads first (the
 *                     structure of DeepSpeed's Step_AVX<8>).
 *
 * n must be a multiple of 128 (the benchmark's sizes are powers of two).  scalars: beta1, beta2,
 * 1 - beta1, 1 - beta2, step size, 1 / sqrt(bias correction 2), eps, 1 - lr * weight decay. */
#include <immintrin.h>
#include <omp.h>

#define CANONICAL 0x7FC00000

/* the kernels' thread count (the benchmark gives them Numba's) */
void exact_threads(int threads) { omp_set_num_threads(threads); }

__attribute__((target("avx2")))
void exact_avx2(float *p, const float *g, float *m, float *v, const float *s, long n)
{
    const __m256 b1 = _mm256_set1_ps(s[0]), b2 = _mm256_set1_ps(s[1]), ob1 = _mm256_set1_ps(s[2]);
    const __m256 ob2 = _mm256_set1_ps(s[3]), step = _mm256_set1_ps(s[4]), ibc = _mm256_set1_ps(s[5]);
    const __m256 eps = _mm256_set1_ps(s[6]), decay = _mm256_set1_ps(s[7]);
    const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(CANONICAL));
#define CANON256(x) _mm256_blendv_ps((x), nan, _mm256_cmp_ps((x), (x), _CMP_UNORD_Q))
#pragma omp parallel for schedule(static)
    for (long i = 0; i < n; i += 8) {
        __m256 grad = _mm256_loadu_ps(g + i);
        __m256 w = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
        __m256 a = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(m + i), b1), _mm256_mul_ps(grad, ob1));
        __m256 b = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(v + i), b2),
                                 _mm256_mul_ps(_mm256_mul_ps(grad, grad), ob2));
        __m256 d = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(b), ibc), eps);
        __m256 w1 = _mm256_sub_ps(w, _mm256_mul_ps(_mm256_div_ps(a, d), step));
        _mm256_storeu_ps(p + i, CANON256(w1));
        _mm256_storeu_ps(m + i, CANON256(a));
        _mm256_storeu_ps(v + i, CANON256(b));
    }
}

#define SPAN 8

__attribute__((target("avx512f")))
void exact_avx512_x8(float *p, const float *g, float *m, float *v, const float *s, long n)
{
    const __m512 b1 = _mm512_set1_ps(s[0]), b2 = _mm512_set1_ps(s[1]), ob1 = _mm512_set1_ps(s[2]);
    const __m512 ob2 = _mm512_set1_ps(s[3]), step = _mm512_set1_ps(s[4]), ibc = _mm512_set1_ps(s[5]);
    const __m512 eps = _mm512_set1_ps(s[6]), decay = _mm512_set1_ps(s[7]);
    const __m512 nan = _mm512_castsi512_ps(_mm512_set1_epi32(CANONICAL));
#define CANON512(x) _mm512_mask_blend_ps(_mm512_cmp_ps_mask((x), (x), _CMP_UNORD_Q), (x), nan)
#pragma omp parallel for schedule(static)
    for (long i = 0; i < n; i += 16 * SPAN) {
        __m512 G[SPAN], P[SPAN], M[SPAN], V[SPAN];
        for (int k = 0; k < SPAN; k++) {
            G[k] = _mm512_loadu_ps(g + i + 16 * k);
            P[k] = _mm512_loadu_ps(p + i + 16 * k);
            M[k] = _mm512_loadu_ps(m + i + 16 * k);
            V[k] = _mm512_loadu_ps(v + i + 16 * k);
        }
        for (int k = 0; k < SPAN; k++) {
            __m512 w = _mm512_mul_ps(P[k], decay);
            __m512 a = _mm512_add_ps(_mm512_mul_ps(M[k], b1), _mm512_mul_ps(G[k], ob1));
            __m512 b = _mm512_add_ps(_mm512_mul_ps(V[k], b2), _mm512_mul_ps(_mm512_mul_ps(G[k], G[k]), ob2));
            __m512 d = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(b), ibc), eps);
            P[k] = CANON512(_mm512_sub_ps(w, _mm512_mul_ps(_mm512_div_ps(a, d), step)));
            M[k] = CANON512(a);
            V[k] = CANON512(b);
        }
        for (int k = 0; k < SPAN; k++) {
            _mm512_storeu_ps(p + i + 16 * k, P[k]);
            _mm512_storeu_ps(m + i + 16 * k, M[k]);
            _mm512_storeu_ps(v + i + 16 * k, V[k]);
        }
    }
}
