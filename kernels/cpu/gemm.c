/* Small-M float32 GEMM for CPU decode steps: y[M, N] (+)= x[M, K] @ W, with W stored K-major ([K, N],
 * row stride ldw), the layout lmq's CPU path keeps the model's Linear weights in (fused_decode._k_major).
 *
 * Why: at 1-16 rows a decode step's GEMMs stream every weight once and do little arithmetic per byte, so
 * they should cost what one row costs. BLAS small-M paths do not get there (benchmarks/RESULTS.md). What
 * costs the time is memory latency: each thread reads a chunk of weight rows at a time in short segments (a
 * thread's share of a row is a few KB), too short for the hardware prefetchers to run ahead. This kernel
 * asks for the next chunk's rows explicitly while it computes on the current one.
 *
 * Shape per instruction set (simd.h's vf: the target's own vector of LMQ_VL lanes): a register block
 * is MR rows x NV vectors of accumulators, plus NV weight vectors and a broadcast, within the target's
 * registers: AVX-512 (32 x 16 lanes) 6 x 4 (24 accumulators: a block is a whole 64-column panel row, one
 * contiguous stream), AVX2/AVX (16 x 8 lanes) and SSE/generic (16 x 4) 4 x 3 (12), NEON (32 x 4) 6 x 4. More rows than MR are
 * further passes over the same chunk's weights (from L1). On AVX2, over panel-major weights, one row takes a
 * whole 64-column panel as its block (panel_one_row) and more than 4 rows a 6 x 2 block (MR2 x NV2). (One
 * 16-lane shape for all would spill on AVX2: 32 accumulators in 16 registers.)
 * LMQ_GEMM_MR / LMQ_GEMM_NV (and LMQ_GEMM_MR2 / LMQ_GEMM_NV2) override them at build time (for measurements).
 *
 * Chunks and panels: a chunk of K-major weights is 4 weight rows at 1-2 rows of x, 8 at 3-4, 16 above (the
 * accumulators go back to y between chunks: more rows of x amortise that over longer chunks); a panel of a
 * panel-major copy, one stream, takes 64 at every row count (see `columns`); K-major chunks are 4 and 8 when
 * the weight's row stride is a multiple of 4 KB (the lm_head of a 49152 vocabulary, a 3072-wide gate_up):
 * such rows share their cache sets, and a long chunk is evicted before it is used. A thread walks its columns in panels of LMQ_GEMM_PANEL_KB of chunk (the prefetched rows stay in
 * L2 until used).
 * Weights under 64K elements run on one thread (a second one costs more than it saves).
 *
 * Exactness: every output is one fused multiply-add chain over k = 0..K-1 in order, whatever M, the
 * thread count, the blocking or the column block it falls in, so a row's result does not depend on the
 * other rows of the batch (a decode step gives each row the same logits batched as alone).
 *
 * Built at first use with the machine's C compiler (-march=native, or a chosen target: build.py).
 * OpenMP: the process's runtime (torch's libgomp).
 */
#include <string.h>
#include <omp.h>

#include "simd.h"

/* A second block for panel-major weights times more than FEW_ROWS rows: on AVX2 6 x 2 (12 accumulators, two
 * weight vectors, a broadcast: 15 registers), which is faster than 4 x 3 from 5 rows on (4 x 3 leaves the
 * last 16 columns of a 64-column panel to 1-vector passes; 6 x 2 divides the panel), while at 2-4 rows 4 x 3
 * is the faster. Elsewhere the same block as FEW_ROWS and below. */
#ifndef LMQ_GEMM_MR2
#if LMQ_VL == 8 && !defined(LMQ_GEMM_MR) && !defined(LMQ_GEMM_NV)
#define LMQ_GEMM_MR2 6
#define LMQ_GEMM_NV2 2
#else
#define LMQ_GEMM_MR2 LMQ_GEMM_MR
#define LMQ_GEMM_NV2 LMQ_GEMM_NV
#endif
#endif
#define FEW_ROWS 4

#ifndef LMQ_GEMM_MR
#if LMQ_VREGS >= 32
#define LMQ_GEMM_MR 6
#else
#define LMQ_GEMM_MR 4
#endif
#endif
#ifndef LMQ_GEMM_NV
#if LMQ_VREGS >= 32
#define LMQ_GEMM_NV 4
#else
#define LMQ_GEMM_NV 3
#endif
#endif

#define MR LMQ_GEMM_MR               /* rows per pass */
#define NV LMQ_GEMM_NV               /* vectors of columns per register block */
#define NB (NV * LMQ_VL)             /* output columns per register block */
#define MR2 LMQ_GEMM_MR2             /* the same, over panels at more than FEW_ROWS rows */
#define NV2 LMQ_GEMM_NV2
#define MR_MAX (MR > MR2 ? MR : MR2)
#define NV_MAX (NV > NV2 ? NV : NV2)
#ifndef LMQ_GEMM_SERIAL_BELOW
#define LMQ_GEMM_SERIAL_BELOW (1L << 16)   /* weights of fewer elements (256 KB) run on one thread */
#endif
#ifndef LMQ_GEMM_PANEL_KB
#define LMQ_GEMM_PANEL_KB 128   /* a chunk's weight rows x a panel's columns: what is prefetched ahead */
#endif

/* Rows [0, M) x columns [n, n + V * LMQ_VL) over weight rows [0, K) from here (w holds k_left rows from
 * here on: the next chunk's are prefetched when `prefetch`). M and V are constants in each instance. */
static inline __attribute__((always_inline)) void block(
        const float *x, long ldx, const float *w, long ldw, float *y, long ldy,
        const int M, const int V, long K, long k_left, long n, int accumulate, int prefetch, long kc_rows,
        int stream) {
    vf a[MR_MAX][NV_MAX];    /* fixed sizes (not M, V: a variable-length array would live on the stack) */
    _Pragma("GCC unroll 8")
    for (int m = 0; m < M; m++)
        _Pragma("GCC unroll 8")
        for (int j = 0; j < V; j++) {
            if (accumulate) a[m][j] = *(const vf *)(y + m * ldy + n + LMQ_VL * j);
            else a[m][j] = (vf){0};
        }
    for (long k = 0; k < K; k++) {
        vf wv[NV_MAX];
        _Pragma("GCC unroll 8")
        for (int j = 0; j < V; j++) wv[j] = *(const vf *)(w + k * ldw + n + LMQ_VL * j);
        if (prefetch && stream) {   /* this block's share of the next chunk, in memory order (see `stream`) */
            if (kc_rows < k_left) {
                const float *p = w + kc_rows * ldw + n * kc_rows + k * (V * LMQ_VL);
                _Pragma("GCC unroll 8")
                for (int j = 0; j < V * LMQ_VL; j += 16) __builtin_prefetch(p + j, 0, 2);
            }
        } else if (prefetch && k + kc_rows < k_left) {  /* the same columns a chunk further, into L2 */
            _Pragma("GCC unroll 8")
            for (int j = 0; j < V; j++) __builtin_prefetch(w + (k + kc_rows) * ldw + n + LMQ_VL * j, 0, 2);
        }
        _Pragma("GCC unroll 8")
        for (int m = 0; m < M; m++) {
            const vf xv = vf_splat(x + m * ldx + k);    /* broadcast to the vector's lanes */
            _Pragma("GCC unroll 8")
            for (int j = 0; j < V; j++) a[m][j] = fma_vf(xv, wv[j], a[m][j]);
        }
    }
    _Pragma("GCC unroll 8")
    for (int m = 0; m < M; m++)
        _Pragma("GCC unroll 8")
        for (int j = 0; j < V; j++) *(vf *)(y + m * ldy + n + LMQ_VL * j) = a[m][j];
}

#define PASS(R, V) case R: if (R <= mr) block(x + m0 * ldx, ldx, w, ldw, y + m0 * ldy, ldy, R, V, kc, k_left, \
                                                n, acc, m0 == 0, kc_rows, stream); break;
#if MR_MAX > 8 || (MR != 2 && MR != 4 && MR != 6 && MR != 8) || (MR2 != 2 && MR2 != 4 && MR2 != 6 && MR2 != 8)
#error "LMQ_GEMM_MR and LMQ_GEMM_MR2 must be 2, 4, 6 or 8"
#endif
#if MR_MAX == 8
#define PASSES(V) PASS(1, V) PASS(2, V) PASS(3, V) PASS(4, V) PASS(5, V) PASS(6, V) PASS(7, V) PASS(8, V)
#elif MR_MAX == 6
#define PASSES(V) PASS(1, V) PASS(2, V) PASS(3, V) PASS(4, V) PASS(5, V) PASS(6, V)
#elif MR_MAX == 4
#define PASSES(V) PASS(1, V) PASS(2, V) PASS(3, V) PASS(4, V)
#else
#define PASSES(V) PASS(1, V) PASS(2, V)
#endif

/* One register block of columns at n (V vectors wide) for all M rows, passes of mr rows; the first pass
 * prefetches. mr and V are constants in each instance. */
static inline __attribute__((always_inline)) void all_rows(
        const float *x, long ldx, const float *w, long ldw, float *y, long ldy,
        int M, const int mr, const int V, long kc, long k_left, long n, int acc, long kc_rows, int stream) {
    for (int m0 = 0; m0 < M; m0 += mr) {
        switch (M - m0 < mr ? M - m0 : mr) { PASSES(V) }
    }
}

/* Columns [n0, n1) (whole register blocks of mr x nv), then [n1, n2) one vector at a time, in chunks of
 * kc_rows weight rows (the accumulators go back to y between chunks, so a chunk's rows are read as kc_rows
 * sequential streams across the columns). */
static inline __attribute__((always_inline)) void panel(
        const float *x, long ldx, const float *w, long ldw, float *y, long ldy, int M, long K, int accumulate,
        long n0, long n1, long n2, long kc_rows, const int mr, const int nv, int stream) {
    for (long k0 = 0; k0 < K; k0 += kc_rows) {
        const long kc = K - k0 < kc_rows ? K - k0 : kc_rows, k_left = K - k0;
        const float *wk = w + k0 * ldw, *xk = x + k0;
        const int acc = accumulate || k0 > 0;
        for (long n = n0; n < n1; n += nv * LMQ_VL)
            all_rows(xk, ldx, wk, ldw, y, ldy, M, mr, nv, kc, k_left, n, acc, kc_rows, stream);
        for (long n = n1; n < n2; n += LMQ_VL)
            all_rows(xk, ldx, wk, ldw, y, ldy, M, mr, 1, kc, k_left, n, acc, kc_rows, stream);
    }
}

/* A thread's columns [n0, n1) (whole blocks of mr x nv) and its vector tail up to n2, in panels (see the top).
 * `contiguous`: the weight is one panel of a panel-major copy (its rows ldw = P apart, one stream). */
static inline __attribute__((always_inline)) void columns_of(
        const float *x, long ldx, const float *w, long ldw, float *y, long ldy, int M, long K, int accumulate,
        long n0, long n1, long n2, int contiguous, const int mr, const int nv) {
    /* weight rows whose stride is a multiple of 4 KB share their L1 sets (and of 64 KB their L2 sets): a
     * long chunk of such rows does not stay in cache between its prefetch and its use, nor between passes.
     * A panel's chunk of 64 rows is 16 KB of one stream, the faster at every row count: the accumulators go
     * back to y less often and the prefetch runs further ahead than with chunks of 4-16 rows. */
    const int aliased = (ldw * (long)sizeof(float)) % 4096 == 0;
    const long kc_rows = contiguous ? 64 : M <= 2 ? 4 : M <= 4 ? (aliased ? 4 : 8) : (aliased ? 8 : 16);
    const long nb = nv * LMQ_VL, cols = (LMQ_GEMM_PANEL_KB * 1024L / (kc_rows * 4)) / nb * nb;
    const long step = cols > nb ? cols : nb;
    /* a whole panel (its columns [0, ldw), its rows one stream): its next chunk is prefetched in memory order,
     * each block's pass over the chunk taking its share (a block of columns [n, n + w) the chunk's floats
     * [n kc_rows, (n + w) kc_rows), w floats an iteration), rather than as the block's own columns a chunk
     * further (lines 4 apart at 64 columns): the hardware's prefetchers then run ahead of the stream, and the
     * weights of a chunk of many rows arrive while it computes (rather than after) */
    if (contiguous && n0 == 0 && n2 == ldw) {      /* (a constant `stream` in each instance of the loops) */
        panel(x, ldx, w, ldw, y, ldy, M, K, accumulate, n0, n1, n2, kc_rows, mr, nv, 1);
        return;
    }
    for (long p = n0; p < n1; p += step) {
        const long p1 = n1 - p < step ? n1 : p + step;
        panel(x, ldx, w, ldw, y, ldy, M, K, accumulate, p, p1, p1 == n1 ? n2 : p1, kc_rows, mr, nv, 0);
    }
    if (n0 == n1) panel(x, ldx, w, ldw, y, ldy, M, K, accumulate, n1, n1, n2, kc_rows, mr, nv, 0);
}

/* columns_of in the block for up to FEW_ROWS rows (K-major weights: at every row count), and in the one for
 * more rows over panels. */
static void columns(const float *x, long ldx, const float *w, long ldw, float *y, long ldy,
                    int M, long K, int accumulate, long n0, long n1, long n2, int contiguous) {
    columns_of(x, ldx, w, ldw, y, ldy, M, K, accumulate, n0, n1, n2, contiguous, MR, NV);
}

static void columns_many(const float *x, long ldx, const float *w, long ldw, float *y, long ldy,
                         int M, long K, int accumulate, long n0, long n1, long n2) {
    columns_of(x, ldx, w, ldw, y, ldy, M, K, accumulate, n0, n1, n2, 1, MR2, NV2);
}

/* Leftover columns (fewer than a vector), one scalar chain each, the same arithmetic as a vector lane. */
static void scalar_tail(const float *x, long ldx, const float *w, long ldw, float *y, long ldy,
                        int M, long K, int accumulate, long n0, long n1) {
    for (int m = 0; m < M; m++)
        for (long n = n0; n < n1; n++) {
            float acc = accumulate ? y[m * ldy + n] : 0.0f;
            for (long k = 0; k < K; k++) acc = __builtin_fmaf(x[m * ldx + k], w[k * ldw + n], acc);
            y[m * ldy + n] = acc;
        }
}

/* Thread t of nt's share of y (+)= x @ w: a contiguous range of column blocks (the last working thread also
 * the leftover columns); weights under LMQ_GEMM_SERIAL_BELOW elements on thread 0 alone. Called inside a
 * parallel region (lmq_small_m_gemm's, or a fused step's: step.c); a row's bits do not depend on t, nt. */
void lmq_gemm_share(const float *x, long ldx, const float *w, long ldw, float *y, long ldy,
                    int M, long K, long N, int accumulate, int t, int nt) {
    const long blocks = N / NB, vec_end = N / LMQ_VL * LMQ_VL;
    if (nt > blocks) nt = blocks > 0 ? (int)blocks : 1;
    if (K * N < LMQ_GEMM_SERIAL_BELOW) nt = 1;   /* a small weight: a second thread costs more than it saves */
    if (t >= nt) return;
    const long b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt, last = t == nt - 1;
    columns(x, ldx, w, ldw, y, ldy, M, K, accumulate, b0 * NB, b1 * NB, last ? vec_end : b1 * NB, 0);
    if (last) scalar_tail(x, ldx, w, ldw, y, ldy, M, K, accumulate, vec_end, N);
}

/* One row of x over a 64-column panel, the panel's whole width a block (WIDE accumulators): where a register
 * block is narrower than a panel (AVX2's 4 x 3: 24 columns), one row's few independent FMA chains wait on the
 * FMA's latency, and a panel row is read in three passes (24 + 8 + 8 columns). The weights stream through
 * in one pass, prefetched 64 rows ahead (the same distance as a chunk). Each output is the same FMA chain.
 * AVX2 only (8 accumulators and the broadcast in 16 registers, the weights FMA operands from memory).
 * AVX-512's block is a panel's width already. */
#define WIDE (64 / LMQ_VL)
#if LMQ_VL == 8 && defined(__FMA__) && WIDE > NV
#define ONE_ROW_WIDE 1
#else
#define ONE_ROW_WIDE 0
#endif
#if ONE_ROW_WIDE
static void panel_one_row(const float *x, const float *w, float *y, long K, int accumulate) {
    vf a[WIDE];
    _Pragma("GCC unroll 16")
    for (int j = 0; j < WIDE; j++) a[j] = accumulate ? *(const vf *)(y + LMQ_VL * j) : (vf){0};
    for (long k = 0; k < K; k++) {
        const float *wk = w + k * 64;
        if (k + 64 < K) {
            _Pragma("GCC unroll 16")
            for (int j = 0; j < 64; j += 16) __builtin_prefetch(wk + 64 * 64 + j, 0, 2);
        }
        const vf xv = vf_splat(x + k);
        _Pragma("GCC unroll 16")
        for (int j = 0; j < WIDE; j++) a[j] = fma_vf(xv, *(const vf *)(wk + LMQ_VL * j), a[j]);
    }
    _Pragma("GCC unroll 16")
    for (int j = 0; j < WIDE; j++) *(vf *)(y + LMQ_VL * j) = a[j];
}
#endif

/* Thread t of nt's share of y (+)= x @ w over panel-major weights: w holds N / P panels of P columns (a
 * multiple of NB), each [K, P] contiguous ([N / P][K][P]); a thread takes a contiguous range of panels, so
 * that it streams one contiguous region of memory. (Two threads that each read their half of every row of
 * K-major weights stream at a rate that varies from process to process; their own panels stream steadily
 * near memory speed.) Each output is the same FMA chain over k as with K-major
 * weights: the same bits. */
void lmq_gemm_panels_share(const float *x, long ldx, const float *w, long P, float *y, long ldy,
                           int M, long K, long N, int accumulate, int t, int nt) {
    const long panels = N / P;
    if (nt > panels) nt = panels > 0 ? (int)panels : 1;
    if (K * N < LMQ_GEMM_SERIAL_BELOW) nt = 1;
    if (t >= nt) return;
    for (long p = panels * t / nt; p < panels * (t + 1) / nt; p++) {
#if ONE_ROW_WIDE
        if (M == 1 && P == 64) {
            panel_one_row(x, w + p * K * P, y + p * P, K, accumulate);
            continue;
        }
#endif
        if (M > FEW_ROWS)
            columns_many(x, ldx, w + p * K * P, P, y + p * P, ldy, M, K, accumulate, 0,
                         P / (NV2 * LMQ_VL) * NV2 * LMQ_VL, P);
        else
            columns(x, ldx, w + p * K * P, P, y + p * P, ldy, M, K, accumulate, 0, P / NB * NB, P, 1);
    }
}

/* y (+)= x @ w on `threads` threads (lmq_gemm_share each). Row strides ldx, ldw, ldy in elements; the last
 * dimension of each is contiguous. */
void lmq_small_m_gemm(const float *x, long ldx, const float *w, long ldw, float *y, long ldy,
                      int M, long K, long N, int accumulate, int threads) {
    const long blocks = N / NB;
    if (threads > blocks) threads = blocks > 0 ? (int)blocks : 1;
    if (K * N < LMQ_GEMM_SERIAL_BELOW) threads = 1;
    #pragma omp parallel num_threads(threads)
    lmq_gemm_share(x, ldx, w, ldw, y, ldy, M, K, N, accumulate, omp_get_thread_num(), omp_get_num_threads());
}

/* y (+)= x @ w over panel-major weights (lmq_gemm_panels_share) on `threads` threads. */
void lmq_small_m_gemm_panels(const float *x, long ldx, const float *w, long P, float *y, long ldy,
                             int M, long K, long N, int accumulate, int threads) {
    #pragma omp parallel num_threads(threads)
    lmq_gemm_panels_share(x, ldx, w, P, y, ldy, M, K, N, accumulate, omp_get_thread_num(), omp_get_num_threads());
}

/* The blocking this library was built with: {lanes, MR, NV, vector registers, MR2, NV2} (for tests and
 * benchmarks). */
void lmq_gemm_shape(int *out) {
    out[0] = LMQ_VL;
    out[1] = MR;
    out[2] = NV;
    out[3] = LMQ_VREGS;
    out[4] = MR2;
    out[5] = NV2;
}
