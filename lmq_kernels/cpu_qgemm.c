/* Quantized GEMMs for the CPU: y[M, N] (+)= x[M, K] @ W^T with int4 or int8 weights and x rounded to int8 per
 * group of 32 (W4A8 / W8A8, as llama.cpp multiplies Q4_1 / Q8_0 weights by Q8_1 / Q8_0 activations), for every
 * M (decode steps and prefills alike).
 *
 *   int4     w[n, k] = d[n, g] q[n, k] + m[n, g],  q in 0..15, g = k / 32 (GGUF's Q4_1 values)
 *   int8     w[n, k] = d[n, g] q[n, k],            q in -127..127 (GGUF's Q8_0 values)
 *   x        per row r and group g: a = max |x|, xs = a / 127, xq = round(x * (127 / a)) (to even; 0 where
 *            a = 0), s = xs * sum(xq)                                      (lmq_q8_rows)
 *   y[r, n]  = sum over g, in order, of  (float(sum_k q xq) * d) * xs  (then + m * s for int4)
 *
 * The dot products are integers (exact: at most 32 x 127 x 127 a group), so the order they are summed in does
 * not matter; the float part is the same roundings a group on every target (products kept out of FMAs): a
 * row's result does not depend on the batch, the blocking, the thread count or the instruction set, and
 * torch's emulation (cpu_quantized.py, `qgemm_torch`) gives the same bits.
 *
 * Weights are stored in panels of 16 outputs (cpu_quantized.py, `pack`), so that one 64-byte load holds 4 k
 * of 16 outputs (each output's 4 bytes in its 32-bit lane):
 *   int4   qp uint8 [P][K / 8][16][4]   byte (p, c, i, j): q[16 p + i, 8 c + j] | q[16 p + i, 8 c + 4 + j] << 4
 *          (two 4-k chunks a load: low and high nibbles); dp, mp float [P][K / 32][16]: d and m
 *   int8   qp int8 [P][K / 4][16][4]    byte (p, c, i, j): q[16 p + i, 4 c + j]
 *          dp float [P][K / 32][16]: d; wsum int32 [P][K / 32][16]: sum of the group's q
 * (P = ceil(N / 16); the padding is zeros). With AVX-512 VNNI one vpdpbusd multiplies a load by a broadcast of
 * 4 bytes of x and adds each output's 4 products to its lane (unsigned x signed bytes: int4's levels are the
 * unsigned side; for int8, x offset to unsigned, less 128 wsum); AVX2 does the same with vpmaddubsw +
 * vpmaddwd on 8 outputs a register (int8 with vpsignb: |x| times q with x's sign), or AVX-VNNI's vpdpbusd.
 * A panel is loaded once for a block of RB rows. Why: the float kernels they replace (x float32, the weight
 * de-quantized in registers) spent ~4 instructions of de-quantization and an FMA per weight and row; an 8-row
 * int4 step was FMA-bound at ~3x a one-row step (issue #15; benchmarks/RESULTS.md).
 */
#include <omp.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define GROUP 32
#define PW 16                 /* outputs a panel */
#define SERIAL_BELOW (1L << 17)   /* products (rows x weights) fewer than this run on one thread */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QPATH 512
#define X_UNSIGNED8 1         /* int8 weights: x offset to unsigned (see lmq_q8_rows) */
#elif defined(__AVX2__)
#define QPATH 256
#define X_UNSIGNED8 0
#else
#define QPATH 0
#define X_UNSIGNED8 0
#endif

#ifndef LMQ_QGEMM_RB
#if QPATH == 512
#define LMQ_QGEMM_RB 8        /* 4 and 12-16 measured 4-20% slower at 8-64 rows (Zen 4) */
#else
#define LMQ_QGEMM_RB 4
#endif
#endif
#define RB LMQ_QGEMM_RB       /* rows a block: a panel's group is loaded (and unpacked) once for them */

/* a value the compiler must round as it is (a product kept out of an FMA with the add that follows) */
#if defined(__x86_64__) || defined(__i386__)
#if defined(__AVX512F__)
#define KEEP(v) __asm__("" : "+v"(v))
#else
#define KEEP(v) __asm__("" : "+x"(v))
#endif
#elif defined(__aarch64__)
#define KEEP(v) __asm__("" : "+w"(v))
#else
#define KEEP(v) __asm__("" : "+g"(v))
#endif

typedef int unaligned_int __attribute__((aligned(1), may_alias));

/* One group of 32: its largest magnitude, and its values times `id` rounded to even, clamped, summed. The
 * vector paths do the scalar path's arithmetic lane by lane (max is exact; cvtps rounds to even as
 * nearbyint does under the default rounding mode). */
static inline float group_amax(const float *x) {
#if defined(__AVX512F__)
    const __m512 a = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x)), _mm512_abs_ps(_mm512_loadu_ps(x + 16)));
    return _mm512_reduce_max_ps(a);
#else
    float a = 0.0f;
    for (int i = 0; i < GROUP; i++) {
        const float v = __builtin_fabsf(x[i]);
        a = v > a ? v : a;
    }
    return a;
#endif
}

static inline int group_round(const float *x, float id, signed char *q) {
#if defined(__AVX512F__)
    const __m512 scale = _mm512_set1_ps(id);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i r0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), scale));
    __m512i r1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), scale));
    r0 = _mm512_min_epi32(_mm512_max_epi32(r0, lo), hi);
    r1 = _mm512_min_epi32(_mm512_max_epi32(r1, lo), hi);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(r0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(r1));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));
#else
    int sum = 0;
    for (int i = 0; i < GROUP; i++) {
        float v = __builtin_nearbyintf(x[i] * id);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q[i] = (signed char)v;
        sum += q[i];
    }
    return sum;
#endif
}

/* x [M, K] (row stride ldx) -> xq int8 [M, K], xs and s float [M, K / 32] (see the top); K a multiple of 32.
 * For an int8 weight on the VNNI path, xq is stored offset to unsigned (xq + 128: the byte's top bit flipped),
 * the operand vpdpbusd multiplies as unsigned (the weight's 128 sum(q) is taken off again: `wsum`). */
void lmq_q8_rows(const float *x, long ldx, int M, long K, signed char *xq, float *xs, float *s, int bits) {
    const long G = K / GROUP;
    for (int r = 0; r < M; r++) {
        for (long g = 0; g < G; g++) {
            const float *xr = x + r * ldx + g * GROUP;
            const float a = group_amax(xr);
            const int sum = group_round(xr, a > 0.0f ? 127.0f / a : 0.0f, xq + r * K + g * GROUP);
            xs[r * G + g] = a / 127.0f;
            s[r * G + g] = xs[r * G + g] * (float)sum;
        }
        if (bits == 8 && X_UNSIGNED8)
            for (long k = 0; k < K; k++) xq[r * K + k] = (signed char)((unsigned char)xq[r * K + k] ^ 0x80u);
    }
}

/* out[i] (+)= acc[i] for the panel's outputs below N */
static inline void store_panel(float *y, const float *acc, int valid, int accumulate) {
    for (int i = 0; i < valid; i++) y[i] = accumulate ? y[i] + acc[i] : acc[i];
}

/* A panel's weights: qp its bytes, dp its d, mp its m (int4) or wsum (int8, as int32) */
typedef struct { const unsigned char *q; const float *d; const void *m; } panel;

#if QPATH == 512
/* rows [0, R) (R <= RB) x the panel's 16 outputs; bits 4 or 8 (a constant where it is inlined) */
static inline __attribute__((always_inline)) void panel_rows(
        panel w, long K, const signed char *xq, const float *xs, const float *s, const int R,
        float *y, long ldy, int valid, int accumulate, const int bits) {
    const long G = K / GROUP;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[RB];
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (long g = 0; g < G; g++) {
        __m512i wv[8], off = _mm512_setzero_si512();
        if (bits == 4) {
            _Pragma("GCC unroll 4")
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512((const void *)(w.q + (g * 4 + c) * 64));
                wv[2 * c] = _mm512_and_si512(v, low);
                wv[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
        } else {
            _Pragma("GCC unroll 8")
            for (int c = 0; c < 8; c++) wv[c] = _mm512_loadu_si512((const void *)(w.q + (g * 8 + c) * 64));
            off = _mm512_slli_epi32(_mm512_loadu_si512((const int *)w.m + g * PW), 7);    /* 128 wsum */
        }
        const __m512 d = _mm512_loadu_ps(w.d + g * PW);
        const __m512 m = bits == 4 ? _mm512_loadu_ps((const float *)w.m + g * PW) : d;
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; r++) {
            const unaligned_int *xr = (const unaligned_int *)(xq + r * K + g * GROUP);
            __m512i sum = _mm512_setzero_si512();
            _Pragma("GCC unroll 8")
            for (int j = 0; j < 8; j++)
                sum = bits == 4 ? _mm512_dpbusd_epi32(sum, wv[j], _mm512_set1_epi32(xr[j]))
                                : _mm512_dpbusd_epi32(sum, _mm512_set1_epi32(xr[j]), wv[j]);
            if (bits == 8) sum = _mm512_sub_epi32(sum, off);
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), d), _mm512_set1_ps(xs[r * G + g]));
            KEEP(v);
            acc[r] = _mm512_add_ps(acc[r], v);
            if (bits == 4) {
                __m512 u = _mm512_mul_ps(m, _mm512_set1_ps(s[r * G + g]));
                KEEP(u);
                acc[r] = _mm512_add_ps(acc[r], u);
            }
        }
    }
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; r++) {
        float out[PW];
        _mm512_storeu_ps(out, acc[r]);
        store_panel(y + r * ldy, out, valid, accumulate);
    }
}
#elif QPATH == 256
/* 4 bytes of x a lane times each lane's 4 weights, summed to int32 lanes (exact: see the top) */
static inline __m256i dot8(const __m256i *w, const unaligned_int *xr, const int bits) {
#if defined(__AVXVNNI__)
    if (bits == 4) {
        __m256i sum = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) sum = _mm256_dpbusd_avx_epi32(sum, w[j], _mm256_set1_epi32(xr[j]));
        return sum;
    }
#endif
    const __m256i ones = _mm256_set1_epi16(1);
    if (bits == 4) {   /* int16 pairs: at most 2 x 15 x 127 an instruction, 8 of them 30,480 < 32,767 */
        __m256i pairs = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(xr[0]));
        for (int j = 1; j < 8; j++)
            pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(xr[j])));
        return _mm256_madd_epi16(pairs, ones);
    }
    __m256i sum = _mm256_setzero_si256();   /* |x| times q with x's sign: a pair at most 2 x 127 x 127 */
    for (int j = 0; j < 8; j++) {
        const __m256i x = _mm256_set1_epi32(xr[j]);
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(w[j], x)), ones));
    }
    return sum;
}

/* rows [0, R) x the panel's 16 outputs, 8 (one half of each 64-byte chunk) at a time */
static inline __attribute__((always_inline)) void panel_rows(
        panel w, long K, const signed char *xq, const float *xs, const float *s, const int R,
        float *y, long ldy, int valid, int accumulate, const int bits) {
    const long G = K / GROUP;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {
        __m256 acc[RB];
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (long g = 0; g < G; g++) {
            __m256i wv[8];
            if (bits == 4) {
                _Pragma("GCC unroll 4")
                for (int c = 0; c < 4; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(w.q + (g * 4 + c) * 64 + 32 * h));
                    wv[2 * c] = _mm256_and_si256(v, low);
                    wv[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                }
            } else {
                _Pragma("GCC unroll 8")
                for (int c = 0; c < 8; c++)
                    wv[c] = _mm256_loadu_si256((const __m256i *)(w.q + (g * 8 + c) * 64 + 32 * h));
            }
            const __m256 d = _mm256_loadu_ps(w.d + g * PW + 8 * h);
            const __m256 m = bits == 4 ? _mm256_loadu_ps((const float *)w.m + g * PW + 8 * h) : d;
            _Pragma("GCC unroll 16")
            for (int r = 0; r < R; r++) {
                const __m256i sum = dot8(wv, (const unaligned_int *)(xq + r * K + g * GROUP), bits);
                __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), d),
                                         _mm256_set1_ps(xs[r * G + g]));
                KEEP(v);
                acc[r] = _mm256_add_ps(acc[r], v);
                if (bits == 4) {
                    __m256 u = _mm256_mul_ps(m, _mm256_set1_ps(s[r * G + g]));
                    KEEP(u);
                    acc[r] = _mm256_add_ps(acc[r], u);
                }
            }
        }
        const int part = valid - 8 * h < 0 ? 0 : valid - 8 * h > 8 ? 8 : valid - 8 * h;
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; r++) {
            float out[8];
            _mm256_storeu_ps(out, acc[r]);
            store_panel(y + r * ldy + 8 * h, out, part, accumulate);
        }
    }
}
#else
/* portable: the same sums, one output at a time */
static inline void panel_rows(panel w, long K, const signed char *xq, const float *xs, const float *s,
                              const int R, float *y, long ldy, int valid, int accumulate, const int bits) {
    const long G = K / GROUP;
    for (int r = 0; r < R; r++) {
        float acc[PW] = {0};
        for (long g = 0; g < G; g++) {
            const signed char *xr = xq + r * K + g * GROUP;
            for (int i = 0; i < PW; i++) {
                int sum = 0;
                if (bits == 4)
                    for (int c = 0; c < 4; c++) {
                        const unsigned char *b = w.q + (g * 4 + c) * 64 + i * 4;
                        for (int j = 0; j < 4; j++)
                            sum += (b[j] & 15) * xr[8 * c + j] + (b[j] >> 4) * xr[8 * c + 4 + j];
                    }
                else
                    for (int c = 0; c < 8; c++) {
                        const signed char *b = (const signed char *)w.q + (g * 8 + c) * 64 + i * 4;
                        for (int j = 0; j < 4; j++) sum += b[j] * xr[4 * c + j];
                    }
                float v = (float)sum * w.d[g * PW + i] * xs[r * G + g];
                KEEP(v);
                acc[i] += v;
                if (bits == 4) {
                    float u = ((const float *)w.m)[g * PW + i] * s[r * G + g];
                    KEEP(u);
                    acc[i] += u;
                }
            }
        }
        store_panel(y + r * ldy, acc, valid, accumulate);
    }
}
#endif

/* Thread t of nt's share of y (+)= x @ W^T from x already quantized (lmq_q8_rows, with the same `bits`): a
 * contiguous range of panels, RB rows a pass. Called inside a parallel region (lmq_qgemm below, or
 * cpu_step.c's). qp, dp, mp: the weight (see the top; mp is wsum for int8). */
void lmq_qgemm_share(const signed char *xq, const float *xs, const float *s, int M, long K,
                     const void *qp, const float *dp, const void *mp, long N, int bits,
                     float *y, long ldy, int accumulate, int t, int nt) {
    const long P = (N + PW - 1) / PW, G = K / GROUP;
    if (M * K * N < SERIAL_BELOW) nt = 1;
    if (t >= nt) return;
    for (long p = P * t / nt; p < P * (t + 1) / nt; p++) {
        const int valid = N - p * PW < PW ? (int)(N - p * PW) : PW;
        const panel w = {(const unsigned char *)qp + p * (K / 8) * 64 * (bits / 4), dp + p * G * PW,
                         (const char *)mp + p * G * PW * 4};
        float *yp = y + p * PW;
        int r = 0;
#define PASS(R, BITS) panel_rows(w, K, xq + r * K, xs + r * G, s + r * G, R, yp + r * ldy, ldy, valid, \
                                 accumulate, BITS)
        if (bits == 4) {
            for (; M - r >= RB; r += RB) PASS(RB, 4);
            if (r < M) PASS(M - r, 4);
        } else {
            for (; M - r >= RB; r += RB) PASS(RB, 8);
            if (r < M) PASS(M - r, 8);
        }
#undef PASS
    }
}

/* Rows a chunk of a long x: the weight is streamed once a chunk, the chunk's quantized rows stay in cache */
#define CHUNK_ROWS 64

/* The scratch lmq_qgemm needs for M rows of K: M K bytes + 8 M K / 32. */
long lmq_qgemm_scratch(int M, long K) { return (long)M * K + 2L * M * (K / GROUP) * (long)sizeof(float); }

/* y (+)= x @ W^T on `threads` threads (W int4 or int8: bits 4 or 8). */
void lmq_qgemm(const float *x, long ldx, int M, long K, const void *qp, const float *dp, const void *mp,
               long N, int bits, float *y, long ldy, int accumulate, void *scratch, int threads) {
    signed char *xq = scratch;
    float *xs = (float *)(xq + (long)M * K), *s = xs + (long)M * (K / GROUP);
    const long G = K / GROUP;
    if (M * K * N < SERIAL_BELOW) threads = 1;
    #pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int r0 = (int)((long)M * t / nt), r1 = (int)((long)M * (t + 1) / nt);
        lmq_q8_rows(x + r0 * ldx, ldx, r1 - r0, K, xq + r0 * K, xs + r0 * G, s + r0 * G, bits);
        #pragma omp barrier
        for (int c = 0; c < M; c += CHUNK_ROWS) {
            const int rows = M - c < CHUNK_ROWS ? M - c : CHUNK_ROWS;
            lmq_qgemm_share(xq + c * K, xs + c * G, s + c * G, rows, K, qp, dp, mp, N, bits, y + c * ldy, ldy,
                            accumulate, t, nt);
        }
    }
}
