/* Float vectors for lmq's CPU kernels (GCC/Clang vector extensions) and the reductions they share.
 *
 *   v16, hsum                       16 lanes whatever the target (64 bytes: one register with AVX-512,
 *                                   two with AVX2, four with SSE/NEON; the compiler splits them)
 *   vf, LMQ_VL, LMQ_VREGS           the target's own vector: LMQ_VL float lanes, one register each, and
 *                                   how many such registers it has, chosen at compile time from the
 *                                   target macros (-march): AVX-512F 16 lanes x 32, AVX/AVX2 8 x 16,
 *                                   AArch64 NEON 4 x 32, anything else (SSE2, ...) 4 x 16.
 *
 * A kernel whose register blocking must fit the target (the small-M GEMM) is written over vf; the v16 code
 * keeps its meaning on every target but spills on one with fewer or narrower registers.
 */
#ifndef LMQ_CPU_SIMD_H
#define LMQ_CPU_SIMD_H

#if defined(__SSE__) || defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#if defined(__AVX512F__)
#define LMQ_VL 16
#define LMQ_VREGS 32
#elif defined(__AVX__)
#define LMQ_VL 8
#define LMQ_VREGS 16
#elif defined(__aarch64__)
#define LMQ_VL 4
#define LMQ_VREGS 32
#else
#define LMQ_VL 4
#define LMQ_VREGS 16
#endif

typedef float vf __attribute__((vector_size(4 * LMQ_VL), aligned(4)));

/* *p in every lane: one broadcast load (`(vf){0} + x` is an add the compiler must keep, since 0 + -0 is +0,
 * and on AVX2 the zero it holds took the register the GEMM's 4 x 3 block needs: an accumulator spilled) */
static inline vf vf_splat(const float *p) {
#if defined(__AVX512F__) && LMQ_VL == 16
    return (vf)_mm512_set1_ps(*p);
#elif defined(__AVX__) && LMQ_VL == 8
    return (vf)_mm256_broadcast_ss(p);
#elif defined(__aarch64__) && LMQ_VL == 4
    return (vf)vld1q_dup_f32(p);
#elif defined(__SSE__) && LMQ_VL == 4
    return (vf)_mm_load1_ps(p);
#else
    vf v;
    for (int i = 0; i < LMQ_VL; i++) v[i] = *p;
    return v;
#endif
}

/* a * b + c with one rounding where the target has FMA (else a multiply and an add, never contracted there).
 * Written out, not left to -ffp-contract: GCC left one instance of `block` (1 row x 1 vector: the tail
 * columns of a width that is not a whole number of register blocks) uncontracted on AVX2, so such a column
 * of a row alone got other bits than in a batch. Used wherever a result must not depend on the blocking. */
static inline vf fma_vf(vf a, vf b, vf c) {
#if defined(__AVX512F__) && LMQ_VL == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && LMQ_VL == 8
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__aarch64__) && LMQ_VL == 4
    return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
    return a * b + c;
#endif
}

typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* v16 code is split by the compiler into the target's registers, but GCC does not split every operation:
 * on AVX2/SSE/NEON a 16-lane comparison or shuffle becomes 16 scalar ones. hsum, vexp_vf and silu (ops.c)
 * therefore work on the target's own vectors (vf), part by part, with the same operations in the same order
 * on every lane: the same bits as a 16-lane evaluation. */
#define LMQ_PARTS (16 / LMQ_VL)
typedef int vfi __attribute__((vector_size(4 * LMQ_VL)));

/* The lanes of x and y (lanes VL.. 2 VL - 1 are y's) picked by constant indices: GCC's __builtin_shuffle takes
 * them as a vector, Clang's __builtin_shufflevector (GCC 12+ has it too) as arguments. */
#if defined(__clang__)
#define LMQ_SHUFFLE(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define LMQ_SHUFFLE(x, y, ...) __builtin_shuffle(x, y, (vfi){__VA_ARGS__})
#endif

/* The sum of a native vector's lanes in a fixed order: lane i + lane i + VL/2, then + the lane VL/4 further,
 * ..., then lane 0 + lane 1 (log2(VL) shuffles and adds). */
static inline float lanes_total(vf a) {
#if LMQ_VL == 16
    a += LMQ_SHUFFLE(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    a += LMQ_SHUFFLE(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    a += LMQ_SHUFFLE(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
#elif LMQ_VL == 8
    a += LMQ_SHUFFLE(a, a, 4, 5, 6, 7, 0, 1, 2, 3);
    a += LMQ_SHUFFLE(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
#else
    a += LMQ_SHUFFLE(a, a, 2, 3, 0, 1);
#endif
    return a[0] + a[1];
}

/* The sum of the 16 lanes, always in the same order: lane i + lane i+8, then + the lane 4 further, 2
 * further, 1 further (the sum of lane 0): the target's vectors added part by part down to one, then
 * lanes_total's tree. */
static inline float hsum(v16 a) {
#if LMQ_VL == 16
    return lanes_total((vf)a);
#else
    vf p[LMQ_PARTS];
    __builtin_memcpy(p, &a, sizeof(a));
#if LMQ_VL == 8
    return lanes_total(p[0] + p[1]);                                      /* lanes i and i + 8 */
#else
    return lanes_total((p[0] + p[2]) + (p[1] + p[3]));                    /* i + 8, then i + 4 */
#endif
#endif
}

/* exp(x) for x <= 0, lane by lane: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 polynomial
 * (Cephes' expf: relative error ~2e-7); x < -87 gives 0. One native vector. */
static inline vf vexp_vf(vf x) {
    const vf lo = (vf){0} - 87.0f;
    const vfi keep = x >= lo;
    x = (vf)(((vfi)x & keep) | ((vfi)lo & ~keep));
    vf t = x * 1.44269504088896341f + 0.5f;
    vfi n = __builtin_convertvector(t, vfi);
    n -= (vfi)(__builtin_convertvector(n, vf) > t) & 1;           /* floor */
    vf nf = __builtin_convertvector(n, vf);
    vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vf scale = (vf)((n + 127) << 23);
    return (vf)((vfi)(p * scale) & (x > lo));
}

#endif
