/* Small-M float32 GEMM for CPU decode steps: y[M, N] (+)= x[M, K] @ W, with W stored K-major ([K, N],
 * row stride ldw), the layout lmq's CPU path keeps the model's Linear weights in (fused_decode._k_major).
 *
 * Why: at 2-16 rows a decode step's GEMMs stream every weight once and do little arithmetic per byte, so
 * they should cost what one row costs. BLAS small-M paths do not get there (MKL, SmolLM2-135M's 30 layers
 * on two AVX-512 cores: 20 ms at 1 row, 32 ms at 8). What costs the time is memory latency: each thread
 * reads KC weight rows at a time in short segments (a thread's share of a row is 1-12 KB), too short for
 * the hardware prefetchers to run ahead. This kernel asks for the next chunk's rows explicitly while it
 * computes on the current one, and reaches ~25 ms at 8 rows (weights at ~17 GB/s).
 *
 * Exactness: every output is one fused multiply-add chain over k = 0..K-1 in order, whatever M, the
 * thread count or the column block it falls in, so a row's result does not depend on the other rows of
 * the batch (a decode step gives each row the same logits batched as alone).
 *
 * Built at first use with the machine's C compiler (-march=native: AVX-512, AVX2 or whatever the CPU
 * has; GCC's vector extensions), see cpu.py. OpenMP: the process's runtime (torch's libgomp).
 */
#include <string.h>
#include <omp.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));

#define NB 32        /* output columns per register block: two 16-float vectors */
#define MR 8         /* rows per pass: MR x 2 accumulators stay in registers */
#define KC 16        /* weight rows per chunk; the next chunk's rows are prefetched during this one */

static inline __attribute__((always_inline)) void block(
        const float *x, long ldx, const float *w, long ldw, float *y, long ldy,
        const int M, long K, long k_left, long n, int accumulate) {
    /* rows [0, K) of w from here; w holds k_left rows from here on (the next chunk's are prefetched) */
    v16 a[MR][2];
    for (int m = 0; m < M; m++)
        for (int j = 0; j < 2; j++) {
            if (accumulate) memcpy(&a[m][j], y + m * ldy + n + 16 * j, 64);
            else a[m][j] = (v16){0};
        }
    for (long k = 0; k < K; k++) {
        v16 w0, w1;
        memcpy(&w0, w + k * ldw + n, 64);
        memcpy(&w1, w + k * ldw + n + 16, 64);
        if (k + KC < k_left) {  /* the same columns KC rows further: the next chunk's, into L2 */
            __builtin_prefetch(w + (k + KC) * ldw + n, 0, 2);
            __builtin_prefetch(w + (k + KC) * ldw + n + 16, 0, 2);
        }
        for (int m = 0; m < M; m++) {
            float xv = x[m * ldx + k];     /* broadcast to the vector's lanes */
            a[m][0] += xv * w0;            /* contracted to FMA (-ffp-contract=fast) */
            a[m][1] += xv * w1;
        }
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < 2; j++) memcpy(y + m * ldy + n + 16 * j, &a[m][j], 64);
}

/* Columns [n0, n1) of up to MR rows, in chunks of KC weight rows (the accumulators go back to y between
 * chunks, so a chunk's KC rows are read as KC sequential streams across the thread's columns). */
static inline __attribute__((always_inline)) void rows_mr(
        const float *x, long ldx, const float *w, long ldw, float *y, long ldy,
        const int M, long K, int accumulate, long n0, long n1) {
    for (long k0 = 0; k0 < K; k0 += KC) {
        long kc = K - k0 < KC ? K - k0 : KC;
        for (long n = n0; n < n1; n += NB)
            block(x + k0, ldx, w + k0 * ldw, ldw, y, ldy, M, kc, K - k0, n, accumulate || k0 > 0);
    }
}

#define CASE(R) case R: rows_mr(x, ldx, w, ldw, y, ldy, R, K, accumulate, n0, n1); break;

static void rows(const float *x, long ldx, const float *w, long ldw, float *y, long ldy,
                 int M, long K, int accumulate, long n0, long n1) {
    for (int m0 = 0; m0 < M; m0 += MR, x += MR * ldx, y += MR * ldy) {
        switch (M - m0 < MR ? M - m0 : MR) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
    }
}

/* Leftover columns (N % NB), one scalar chain each, the same arithmetic as a vector lane. */
static void tail(const float *x, long ldx, const float *w, long ldw, float *y, long ldy,
                 int M, long K, int accumulate, long n0, long n1) {
    for (int m = 0; m < M; m++)
        for (long n = n0; n < n1; n++) {
            float acc = accumulate ? y[m * ldy + n] : 0.0f;
            for (long k = 0; k < K; k++) acc = __builtin_fmaf(x[m * ldx + k], w[k * ldw + n], acc);
            y[m * ldy + n] = acc;
        }
}

/* y (+)= x @ w on `threads` threads, each taking a contiguous range of column blocks. Row strides ldx, ldw,
 * ldy in elements; the last dimension of each is contiguous. */
void lmq_small_m_gemm(const float *x, long ldx, const float *w, long ldw, float *y, long ldy,
                      int M, long K, long N, int accumulate, int threads) {
    long blocks = N / NB;
    if (threads > blocks) threads = blocks > 0 ? (int)blocks : 1;
    #pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
        rows(x, ldx, w, ldw, y, ldy, M, K, accumulate, b0 * NB, b1 * NB);
        if (t == nt - 1) tail(x, ldx, w, ldw, y, ldy, M, K, accumulate, blocks * NB, N);
    }
}
