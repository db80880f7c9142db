/* Weight-only quantized small-M GEMM for CPU decode steps: y[M, N] (+)= x[M, K] @ W^T, W [N, K] stored
 *
 *   int8   q int8 [N, K] row-major, scale [N, K / 32]:      w[n, k] = q[n, k] * scale[n, g], g = k / 32
 *   int4   q uint8 [N, K / 2], d and m [N, K / 32]:          w[n, k] = d[n, g] * q + m[n, g], g = k / 32,
 *          one 16-byte block per group (GGUF's Q4_1 order): element j < 16 in the low nibble of byte j,
 *          element j >= 16 in the high nibble of byte j - 16
 *
 * Why: torch's weight-only kernels (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) have no AVX2 path
 * worth the name: they are many times slower than float32 torch.mm at a few rows
 * (benchmarks/bench_quantized.py). Here each output is a dot product over K of x's row and the
 * weight row, de-quantized in registers into the target's float vectors (simd.h's vf), MR rows x NB
 * outputs a register block; larger M makes more passes over the same weight rows (from L1).
 *
 * Exactness: each output is one chain of vector FMAs over k in order, its lanes summed in a fixed order
 * (simd.h's lanes_total: a shuffle tree, cheaper than a sequential sum of the lanes), whatever M, the thread count or the block it falls in: a row's result does
 * not depend on the batch.
 */
#include <omp.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "simd.h"

#ifndef LMQ_QGEMM_MR
#define LMQ_QGEMM_MR 4
#endif
#ifndef LMQ_QGEMM_NB
#define LMQ_QGEMM_NB 2
#endif
#define MR LMQ_QGEMM_MR   /* rows per pass below 8 rows (up to 4) */
#define NB LMQ_QGEMM_NB   /* outputs per register block (up to 4) */
/* outputs per register block at 8 rows (1 or 2): 2 where 32 vector registers hold the 8 x 2 accumulators
 * (AVX-512: the faster), 1 with AVX2's 16 (2 would spill) */
#ifndef LMQ_QGEMM_NB8
#if LMQ_VREGS >= 32
#define LMQ_QGEMM_NB8 2
#else
#define LMQ_QGEMM_NB8 1
#endif
#endif
#define NB8 LMQ_QGEMM_NB8
/* outputs per register block below 8 rows, within a block of NB (1 or NB): one output at a time streams the
 * weight rows one after another, faster where the weight comes from memory, as in a decode step (int8),
 * slower where it is hot in cache (int4: no gain); the same sums either way */
#ifndef LMQ_QGEMM_NB1_I8
#define LMQ_QGEMM_NB1_I8 1
#endif
#ifndef LMQ_QGEMM_NB1_I4
#define LMQ_QGEMM_NB1_I4 NB
#endif
#define GROUP 32      /* int4 weights per (d, m) */
#define QSERIAL_BELOW (1L << 17)   /* weights of fewer elements run on one thread */

typedef signed char vi8 __attribute__((vector_size(LMQ_VL)));
typedef unsigned char vu8 __attribute__((vector_size(LMQ_VL)));

/* LMQ_VL bytes widened to int lanes (sign- or zero-extended): GCC scalarizes a char -> float
 * __builtin_convertvector on x86, so the x86 targets use the extending loads */
static inline vfi widen_i8(const signed char *p) {
#if defined(__AVX512F__) && LMQ_VL == 16
    return (vfi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__) && LMQ_VL == 8
    return (vfi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vi8 b;
    __builtin_memcpy(&b, p, sizeof(b));
    return __builtin_convertvector(b, vfi);
#endif
}

static inline vfi widen_u8(const unsigned char *p) {
#if defined(__AVX512F__) && LMQ_VL == 16
    return (vfi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__) && LMQ_VL == 8
    return (vfi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vu8 b;
    __builtin_memcpy(&b, p, sizeof(b));
    return __builtin_convertvector(b, vfi);
#endif
}

static inline vf load_f(const float *p) { return *(const vf *)p; }   /* vf is aligned(4) */

/* y = s * scale (+ y): explicit FMA, so that no inlining context contracts it differently */
static inline void store_out(float *y, float s, float scale, int accumulate) {
    *y = accumulate ? __builtin_fmaf(s, scale, *y) : s * scale;
}

/* Rows [0, M) (M <= MR) x outputs [n, n + V) (V <= NB) of an int8 weight (a scale per group of 32). */
static inline __attribute__((always_inline)) void block_i8(
        const float *x, long ldx, const signed char *q, long K, const float *scale,
        float *y, long ldy, const int M, const int V, long n, int accumulate) {
    vf a[8][NB];
    const long groups = K / GROUP;
    _Pragma("GCC unroll 8")
    for (int m = 0; m < M; m++) for (int j = 0; j < V; j++) a[m][j] = (vf){0};
    for (long g = 0; g < groups; g++) {
        _Pragma("GCC unroll 8")
        for (int p = 0; p < GROUP / LMQ_VL; p++) {
            const long k = g * GROUP + p * LMQ_VL;
            vf w[NB];
            _Pragma("GCC unroll 8")
            for (int j = 0; j < V; j++)
                w[j] = __builtin_convertvector(widen_i8(q + (n + j) * K + k), vf) * scale[(n + j) * groups + g];
            _Pragma("GCC unroll 8")
            for (int m = 0; m < M; m++) {
                const vf xv = load_f(x + m * ldx + k);
                _Pragma("GCC unroll 8")
                for (int j = 0; j < V; j++) a[m][j] += xv * w[j];
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < M; m++)
        _Pragma("GCC unroll 8")
        for (int j = 0; j < V; j++) store_out(y + m * ldy + n + j, lanes_total(a[m][j]), 1.0f, accumulate);
}

/* The same for an int4 weight (see the top for its layout). */
static inline __attribute__((always_inline)) void block_i4(
        const float *x, long ldx, const unsigned char *q, long K, const float *d, const float *mn,
        float *y, long ldy, const int M, const int V, long n, int accumulate) {
    vf a[8][NB];
    const long groups = K / GROUP;
    _Pragma("GCC unroll 8")
    for (int m = 0; m < M; m++) for (int j = 0; j < V; j++) a[m][j] = (vf){0};
    for (long g = 0; g < groups; g++) {
        _Pragma("GCC unroll 8")
        for (int p = 0; p < 16 / LMQ_VL; p++) {          /* LMQ_VL bytes: elements p VL.. (lo), 16 + p VL.. (hi) */
            vf lo[NB], hi[NB];
            _Pragma("GCC unroll 8")
            for (int j = 0; j < V; j++) {
                const vfi b = widen_u8(q + (n + j) * (K / 2) + g * 16 + p * LMQ_VL);
                const vf dv = (vf){0} + d[(n + j) * groups + g], mv = (vf){0} + mn[(n + j) * groups + g];
                lo[j] = __builtin_convertvector(b & 15, vf) * dv + mv;
                hi[j] = __builtin_convertvector(b >> 4, vf) * dv + mv;
            }
            _Pragma("GCC unroll 8")
            for (int m = 0; m < M; m++) {
                const float *xr = x + m * ldx + g * GROUP + p * LMQ_VL;
                const vf xl = load_f(xr), xh = load_f(xr + 16);
                _Pragma("GCC unroll 8")
                for (int j = 0; j < V; j++) {
                    a[m][j] += xl * lo[j];       /* two FMAs (-ffp-contract=fast), in this order */
                    a[m][j] += xh * hi[j];
                }
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < M; m++)
        _Pragma("GCC unroll 8")
        for (int j = 0; j < V; j++) store_out(y + m * ldy + n + j, lanes_total(a[m][j]), 1.0f, accumulate);
}

#define PASS_I8(R, V) block_i8(x + m0 * ldx, ldx, q, K, scale, y + m0 * ldy, ldy, R, V, n, accumulate)
#define PASS_I4(R, V) block_i4(x + m0 * ldx, ldx, q, K, d, mn, y + m0 * ldy, ldy, R, V, n, accumulate)
/* 8 rows at once, NB8 outputs at a time (the weight de-quantized once for 8 rows; at one output: 8 accumulators,
 * the weight's two vectors, x's two, d and m in 16 registers), then the rest MR rows x V outputs at a time, or
 * one output at a time (W1: the weight's rows one after another) */
#define REST(PASS, V) { const int r = M - m0 < MR ? M - m0 : MR; \
        if (r >= 4) PASS(4, V); else if (r == 3) PASS(3, V); else if (r == 2) PASS(2, V); else PASS(1, V); }
#define ROWS(PASS, V, W1) { int m0 = 0; \
        for (; M - m0 >= 8; m0 += 8) for (int j = 0; j < V; j += NB8) { n += j; \
            if (NB8 > 1 && V - j >= 2) PASS(8, 2); else PASS(8, 1); n -= j; } \
        for (; m0 < M; m0 += MR) { \
            if (W1 == 1 && V > 1) { for (int j = 0; j < V; j++) { n += j; REST(PASS, 1) n -= j; } } \
            else REST(PASS, V) } }
#define ROWS_I8(V) ROWS(PASS_I8, V, LMQ_QGEMM_NB1_I8)
#define ROWS_I4(V) ROWS(PASS_I4, V, LMQ_QGEMM_NB1_I4)

/* Thread t of nt's share of y (+)= x @ W^T: a contiguous range of output blocks (NB outputs each); weights
 * under QSERIAL_BELOW elements on thread 0 alone. Called inside a parallel region (the entry points below,
 * or a fused step's: step.c); an output's bits do not depend on t, nt. K a multiple of 32 (int4) or of
 * LMQ_VL (int8). */
void lmq_qgemm_i8_share(const float *x, long ldx, const signed char *q, const float *scale, float *y, long ldy,
                        int M, long K, long N, int accumulate, int t, int nt) {
    const long blocks = (N + NB - 1) / NB;
    if (K * N < QSERIAL_BELOW) nt = 1;
    if (t >= nt) return;
    for (long b = blocks * t / nt; b < blocks * (t + 1) / nt; b++) {
        long n = b * NB;
        if (N - n >= NB) { ROWS_I8(NB) } else if (NB > 3 && N - n == 3) { ROWS_I8(3) }
        else if (N - n == 2) { ROWS_I8(2) } else { ROWS_I8(1) }
    }
}

void lmq_qgemm_i4_share(const float *x, long ldx, const unsigned char *q, const float *d, const float *mn,
                        float *y, long ldy, int M, long K, long N, int accumulate, int t, int nt) {
    const long blocks = (N + NB - 1) / NB;
    if (K * N < QSERIAL_BELOW) nt = 1;
    if (t >= nt) return;
    for (long b = blocks * t / nt; b < blocks * (t + 1) / nt; b++) {
        long n = b * NB;
        if (N - n >= NB) { ROWS_I4(NB) } else if (NB > 3 && N - n == 3) { ROWS_I4(3) }
        else if (N - n == 2) { ROWS_I4(2) } else { ROWS_I4(1) }
    }
}

/* y (+)= x @ W^T, int8 W, on `threads` threads. */
void lmq_qgemm_i8(const float *x, long ldx, const signed char *q, const float *scale, float *y, long ldy,
                  int M, long K, long N, int accumulate, int threads) {
    if (K * N < QSERIAL_BELOW) threads = 1;
    #pragma omp parallel num_threads(threads)
    lmq_qgemm_i8_share(x, ldx, q, scale, y, ldy, M, K, N, accumulate, omp_get_thread_num(), omp_get_num_threads());
}

/* y (+)= x @ W^T, int4 W with groups of 32 along K (K a multiple of 32), on `threads` threads. */
void lmq_qgemm_i4(const float *x, long ldx, const unsigned char *q, const float *d, const float *mn,
                  float *y, long ldy, int M, long K, long N, int accumulate, int threads) {
    if (K * N < QSERIAL_BELOW) threads = 1;
    #pragma omp parallel num_threads(threads)
    lmq_qgemm_i4_share(x, ldx, q, d, mn, y, ldy, M, K, N, accumulate, omp_get_thread_num(), omp_get_num_threads());
}

/* The de-quantized weight, float32 [N, K] row-major (the GEMM of many rows: torch's BLAS on it). Products and
 * sums rounded one at a time (the empty asm keeps the product out of an FMA): the same bits as w = q * scale
 * and w = d * q + m evaluated by torch (QuantizedLinear.dequantize). */
#if defined(__x86_64__) || defined(__i386__)
#define ROUNDED(v) __asm__("" : "+x"(v))
#elif defined(__aarch64__)
#define ROUNDED(v) __asm__("" : "+w"(v))
#else
#define ROUNDED(v) __asm__("" : "+g"(v))
#endif

static inline void store_f(float *p, vf v) { *(vf *)p = v; }

/* Output n's group g of weights (32) as float32 into o[0, 32). */
static inline void group_i8(const signed char *q, const float *scale, long n, long g, long K, float *o) {
    const vf s = (vf){0} + scale[n * (K / GROUP) + g];
    for (int i = 0; i < GROUP; i += LMQ_VL)
        store_f(o + i, __builtin_convertvector(widen_i8(q + n * K + g * GROUP + i), vf) * s);
}

static inline void group_i4(const unsigned char *q, const float *d, const float *mn, long n, long g, long K,
                            float *o) {
    const vf dv = (vf){0} + d[n * (K / GROUP) + g], mv = (vf){0} + mn[n * (K / GROUP) + g];
    for (int i = 0; i < 16; i += LMQ_VL) {
        const vfi b = widen_u8(q + n * (K / 2) + g * 16 + i);
        vf lo = __builtin_convertvector(b & 15, vf) * dv, hi = __builtin_convertvector(b >> 4, vf) * dv;
        ROUNDED(lo);
        ROUNDED(hi);
        store_f(o + i, lo + mv);
        store_f(o + 16 + i, hi + mv);
    }
}

#define PANEL_MAX 64   /* outputs of a panel, at most */
#define GROUP_TO(o, n, g) (q4 ? group_i4(q4, scale, mn, n, g, K, o) : group_i8(q8, scale, n, g, K, o))

/* W as float32: row-major [N, K] (P = 0), or in panels of P outputs [N / P, K, P] (P divides N, P <= 64: the
 * small-M GEMM's panel-major operand, gemm.c) so that a long prefill multiplies in lmq's GEMM without a
 * transposed copy: a panel's rows de-quantized a group at a time into a tile in L1, written out transposed.
 * q8 (int8) or q4 (int4) is given, the other NULL. */
static void dequant(const signed char *q8, const unsigned char *q4, const float *scale, const float *mn, float *w,
                    long N, long K, int P, int threads) {
    if (K * N < QSERIAL_BELOW) threads = 1;
    if (P == 0) {
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (long n = 0; n < N; n++)
            for (long g = 0; g < K / GROUP; g++) GROUP_TO(w + n * K + g * GROUP, n, g);
        return;
    }
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long p = 0; p < N / P; p++) {
        float tile[PANEL_MAX * GROUP] __attribute__((aligned(64)));   /* [P][GROUP] */
        for (long g = 0; g < K / GROUP; g++) {
            float *o = w + (p * K + g * GROUP) * P;
            for (int j = 0; j < P; j++) GROUP_TO(tile + j * GROUP, p * P + j, g);
            for (int i = 0; i < GROUP; i++)
                for (int j = 0; j < P; j++) o[i * P + j] = tile[j * GROUP + i];
        }
    }
}

void lmq_dequant_i8(const signed char *q, const float *scale, float *w, long N, long K, int P, int threads) {
    dequant(q, 0, scale, 0, w, N, K, P, threads);
}

void lmq_dequant_i4(const unsigned char *q, const float *d, const float *mn, float *w, long N, long K, int P,
                    int threads) {
    dequant(0, q, d, mn, w, N, K, P, threads);
}
