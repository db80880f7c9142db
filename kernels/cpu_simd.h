/* Float vectors for lmq's CPU kernels (GCC/Clang vector extensions) and the reductions they share.
 *
 *   v16, i16, vselect, hsum, vexp   16 lanes whatever the target (64 bytes: one register with AVX-512,
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

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int i16 __attribute__((vector_size(64)));

static inline v16 vselect(i16 mask, v16 a, v16 b) {   /* mask ? a : b, lane by lane */
    return (v16)(((i16)a & mask) | ((i16)b & ~mask));
}

/* The sum of the 16 lanes, always in the same order. */
static inline float hsum(v16 a) {
    a += __builtin_shuffle(a, (i16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    a += __builtin_shuffle(a, (i16){4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15});
    a += __builtin_shuffle(a, (i16){2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
    a += __builtin_shuffle(a, (i16){1, 0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15});
    return a[0];
}

/* exp(x) for x <= 0, 16 lanes: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 polynomial
 * (Cephes' expf: relative error ~2e-7); x < -87 gives 0. */
static inline v16 vexp(v16 x) {
    const v16 lo = (v16){0} - 87.0f;
    x = vselect(x >= lo, x, lo);
    v16 t = x * 1.44269504088896341f + 0.5f;
    i16 n = __builtin_convertvector(t, i16);
    n -= (i16)(__builtin_convertvector(n, v16) > t) & 1;           /* floor */
    v16 nf = __builtin_convertvector(n, v16);
    v16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v16 p = (v16){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    v16 scale = (v16)((n + 127) << 23);
    return (v16)((i16)(p * scale) & (x > lo));
}

#endif
