/* int4 weights x int8 activations (W4A8, as llama.cpp's Q4_1 x Q8_1): y[M, N] (+)= x[M, K] @ W^T on the CPU,
 * for every M (decode steps and prefills alike).
 *
 *   weight   w[n, k] = d[n, g] q[n, k] + m[n, g],  q in 0..15, g = k / 32 (GGUF's Q4_1 values)
 *   x        per row r and group g: a = max |x|, xs = a / 127, xq = round(x * (127 / a)) (to even; 0 where
 *            a = 0), s = xs * sum(xq)                                      (lmq_q8_rows)
 *   y[r, n]  = sum over g, in order, of  (float(sum_k q xq) * d) * xs  then  m * s   (two adds a group)
 *
 * The dot products are integers (exact: at most 32 x 15 x 127 a group), so the order they are summed in does
 * not matter; the float part is the same six roundings a group on every target (products kept out of FMAs):
 * a row's result does not depend on the batch, the blocking, the thread count or the instruction set, and
 * torch's emulation (cpu_quantized.py, `q4a8_torch`) gives the same bits.
 *
 * The weight is stored in panels of 16 outputs (cpu_quantized.py, `pack_q4`):
 *   qp  uint8 [P][K / 8][16][4]   byte (p, c, i, j): q[16 p + i, 8 c + j] | q[16 p + i, 8 c + 4 + j] << 4
 *   dp, mp  float [P][K / 32][16] d and m of output 16 p + i     (P = ceil(N / 16); the padding is zeros)
 * so that one 64-byte load holds 4 k of 16 outputs twice over (low and high nibbles): with AVX-512 VNNI one
 * vpdpbusd multiplies it by a broadcast of 4 bytes of x and adds each output's 4 products to its lane; the
 * AVX2 path does the same with vpmaddubsw + vpmaddwd on 8 outputs a register (or AVX-VNNI's vpdpbusd).
 * The weight is unpacked once for a block of RB rows. Why: the float kernel it replaces (x float32,
 * the weight de-quantized in registers) spent ~4 instructions of de-quantization and an FMA per weight and
 * row; an 8-row int4 step was FMA-bound at ~3x a one-row step (issue #15; benchmarks/RESULTS.md).
 */
#include <omp.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define GROUP 32
#define PW 16                 /* outputs a panel */
#define SERIAL_BELOW (1L << 17)   /* weights of fewer elements run on one thread */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q4A8_PATH 512
#elif defined(__AVX2__)
#define Q4A8_PATH 256
#else
#define Q4A8_PATH 0
#endif

#ifndef LMQ_Q4A8_RB
#if Q4A8_PATH == 512
#define LMQ_Q4A8_RB 8
#elif Q4A8_PATH == 256
#define LMQ_Q4A8_RB 4
#else
#define LMQ_Q4A8_RB 4
#endif
#endif
#define RB LMQ_Q4A8_RB        /* rows a block: the weight's panel is unpacked once for them */

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

/* x [M, K] (row stride ldx) -> xq int8 [M, K], xs and s float [M, K / 32] (see the top). K a multiple of 32. */
void lmq_q8_rows(const float *x, long ldx, int M, long K, signed char *xq, float *xs, float *s) {
    const long G = K / GROUP;
    for (int r = 0; r < M; r++)
        for (long g = 0; g < G; g++) {
            const float *xr = x + r * ldx + g * GROUP;
            const float a = group_amax(xr);
            const int sum = group_round(xr, a > 0.0f ? 127.0f / a : 0.0f, xq + r * K + g * GROUP);
            xs[r * G + g] = a / 127.0f;
            s[r * G + g] = xs[r * G + g] * (float)sum;
        }
}

/* out[i] (+)= acc[i] for the panel's outputs below N */
static inline void store_panel(float *y, const float *acc, int valid, int accumulate) {
    for (int i = 0; i < valid; i++) y[i] = accumulate ? y[i] + acc[i] : acc[i];
}

#if Q4A8_PATH == 512
/* rows [0, R) (R <= RB) x the panel's 16 outputs */
static inline __attribute__((always_inline)) void panel_rows(
        const unsigned char *qp, const float *dp, const float *mp, long K, const signed char *xq,
        const float *xs, const float *s, const int R, float *y, long ldy, int valid, int accumulate) {
    const long G = K / GROUP;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[RB];
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (long g = 0; g < G; g++) {
        __m512i w[8];
        _Pragma("GCC unroll 4")
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512((const void *)(qp + (g * 4 + c) * 64));
            w[2 * c] = _mm512_and_si512(v, low);
            w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        const __m512 d = _mm512_loadu_ps(dp + g * PW), m = _mm512_loadu_ps(mp + g * PW);
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; r++) {
            const unaligned_int *xr = (const unaligned_int *)(xq + r * K + g * GROUP);
            __m512i sum = _mm512_setzero_si512();
            _Pragma("GCC unroll 8")
            for (int j = 0; j < 8; j++) sum = _mm512_dpbusd_epi32(sum, w[j], _mm512_set1_epi32(xr[j]));
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), d), _mm512_set1_ps(xs[r * G + g]));
            KEEP(v);
            acc[r] = _mm512_add_ps(acc[r], v);
            __m512 u = _mm512_mul_ps(m, _mm512_set1_ps(s[r * G + g]));
            KEEP(u);
            acc[r] = _mm512_add_ps(acc[r], u);
        }
    }
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; r++) {
        float out[PW];
        _mm512_storeu_ps(out, acc[r]);
        store_panel(y + r * ldy, out, valid, accumulate);
    }
}
#elif Q4A8_PATH == 256
/* 4 bytes of x a lane times each lane's 4 weights, summed to int32 lanes (exact: see the top) */
static inline __m256i dot8(const __m256i *w, const unaligned_int *xr) {
#if defined(__AVXVNNI__)
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) sum = _mm256_dpbusd_avx_epi32(sum, w[j], _mm256_set1_epi32(xr[j]));
    return sum;
#else
    /* int16 pairs: at most 2 x 15 x 127 an instruction, 8 of them 30,480 < 32,767 */
    __m256i pairs = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(xr[0]));
    for (int j = 1; j < 8; j++) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(xr[j])));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

/* rows [0, R) x the panel's 16 outputs, 8 (one half of each 64-byte chunk) at a time */
static inline __attribute__((always_inline)) void panel_rows(
        const unsigned char *qp, const float *dp, const float *mp, long K, const signed char *xq,
        const float *xs, const float *s, const int R, float *y, long ldy, int valid, int accumulate) {
    const long G = K / GROUP;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {
        __m256 acc[RB];
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (long g = 0; g < G; g++) {
            __m256i w[8];
            _Pragma("GCC unroll 4")
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(qp + (g * 4 + c) * 64 + 32 * h));
                w[2 * c] = _mm256_and_si256(v, low);
                w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            const __m256 d = _mm256_loadu_ps(dp + g * PW + 8 * h), m = _mm256_loadu_ps(mp + g * PW + 8 * h);
            _Pragma("GCC unroll 16")
            for (int r = 0; r < R; r++) {
                const __m256i sum = dot8(w, (const unaligned_int *)(xq + r * K + g * GROUP));
                __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), d),
                                         _mm256_set1_ps(xs[r * G + g]));
                KEEP(v);
                acc[r] = _mm256_add_ps(acc[r], v);
                __m256 u = _mm256_mul_ps(m, _mm256_set1_ps(s[r * G + g]));
                KEEP(u);
                acc[r] = _mm256_add_ps(acc[r], u);
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
static inline void panel_rows(const unsigned char *qp, const float *dp, const float *mp, long K,
                              const signed char *xq, const float *xs, const float *s, const int R, float *y,
                              long ldy, int valid, int accumulate) {
    const long G = K / GROUP;
    for (int r = 0; r < R; r++) {
        float acc[PW] = {0};
        for (long g = 0; g < G; g++) {
            const signed char *xr = xq + r * K + g * GROUP;
            for (int i = 0; i < PW; i++) {
                int sum = 0;
                for (int c = 0; c < 4; c++) {
                    const unsigned char *b = qp + (g * 4 + c) * 64 + i * 4;
                    for (int j = 0; j < 4; j++)
                        sum += (b[j] & 15) * xr[8 * c + j] + (b[j] >> 4) * xr[8 * c + 4 + j];
                }
                float v = (float)sum * dp[g * PW + i] * xs[r * G + g];
                KEEP(v);
                acc[i] += v;
                float u = mp[g * PW + i] * s[r * G + g];
                KEEP(u);
                acc[i] += u;
            }
        }
        store_panel(y + r * ldy, acc, valid, accumulate);
    }
}
#endif

/* Thread t of nt's share of y (+)= x @ W^T from x already quantized (lmq_q8_rows): a contiguous range of
 * panels, RB rows a pass. Called inside a parallel region (lmq_q4a8 below, or cpu_step.c's). */
void lmq_q4a8_share(const signed char *xq, const float *xs, const float *s, int M, long K,
                    const unsigned char *qp, const float *dp, const float *mp, long N,
                    float *y, long ldy, int accumulate, int t, int nt) {
    const long P = (N + PW - 1) / PW, G = K / GROUP;
    if (K * N < SERIAL_BELOW) nt = 1;
    if (t >= nt) return;
    for (long p = P * t / nt; p < P * (t + 1) / nt; p++) {
        const int valid = N - p * PW < PW ? (int)(N - p * PW) : PW;
        const unsigned char *q = qp + p * (K / 8) * 64;
        const float *d = dp + p * G * PW, *m = mp + p * G * PW;
        int r = 0;
        for (; M - r >= RB; r += RB)
            panel_rows(q, d, m, K, xq + r * K, xs + r * G, s + r * G, RB, y + r * ldy + p * PW, ldy, valid,
                       accumulate);
        if (r < M)
            panel_rows(q, d, m, K, xq + r * K, xs + r * G, s + r * G, M - r, y + r * ldy + p * PW, ldy, valid,
                       accumulate);
    }
}

/* Rows a chunk of a long x: the weight is streamed once a chunk, the chunk's quantized rows stay in cache */
#define CHUNK_ROWS 64

/* y (+)= x @ W^T on `threads` threads; scratch: M K bytes + 8 M K / 32 bytes (lmq_q4a8_scratch). */
long lmq_q4a8_scratch(int M, long K) { return (long)M * K + 2L * M * (K / GROUP) * (long)sizeof(float); }

void lmq_q4a8(const float *x, long ldx, int M, long K, const unsigned char *qp, const float *dp,
              const float *mp, long N, float *y, long ldy, int accumulate, void *scratch, int threads) {
    signed char *xq = scratch;
    float *xs = (float *)(xq + (long)M * K), *s = xs + (long)M * (K / GROUP);
    const long G = K / GROUP;
    if (K * N < SERIAL_BELOW && M <= RB) threads = 1;
    #pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int r0 = (int)((long)M * t / nt), r1 = (int)((long)M * (t + 1) / nt);
        lmq_q8_rows(x + r0 * ldx, ldx, r1 - r0, K, xq + r0 * K, xs + r0 * G, s + r0 * G);
        #pragma omp barrier
        for (int c = 0; c < M; c += CHUNK_ROWS) {
            const int rows = M - c < CHUNK_ROWS ? M - c : CHUNK_ROWS;
            lmq_q4a8_share(xq + c * K, xs + c * G, s + c * G, rows, K, qp, dp, mp, N, y + c * ldy, ldy,
                           accumulate, t, nt);
        }
    }
}
