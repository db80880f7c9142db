/* A CPU decode step's layers in one call: every layer of a Llama-family model for B rows (one new token a
 * row), in one OpenMP parallel region:
 *
 *   per layer:  h = rmsnorm(x) (each thread its own copy)      qkv = h @ Wqkv (+ bias)       | barrier
 *               q = rope(qnorm(q)); K/V -> the store (rows)                                   | barrier
 *               attn = attention(q, the store)   (tasks | barrier | combine | barrier)
 *               x += attn @ Wo                                                                | barrier
 *               h = rmsnorm(x)                   gu = h @ [Wgate; Wup]                        | barrier
 *               act = silu(gate) * up (columns)                                               | barrier
 *               x += act @ Wdown                                                              | barrier
 *
 * Why: the same step as ~9 calls a layer from Python (fused/decoder.py's loop) costs Python, ctypes and an
 * OpenMP fork/join a call, more once the GEMMs' weights have pushed the interpreter out of the caches: a
 * noticeable share of a one-row step. Here a phase ends in a barrier instead.
 *
 * Every op is the per-op kernel's own code (lmq_gemm_share, lmq_qgemm_*_share, lmq_rope_append_rows,
 * lmq_attention_body, lmq_rmsnorm, lmq_silu_mul_share): each output is the same arithmetic in the same order
 * as there, so a row's bits do not depend on the batch, the thread count or which of the two paths ran
 * (when the per-op path runs lmq's kernels; calibration picks between the paths: step.py).
 *
 * Weights: float32 K-major ([K, N], row stride ldw: gemm.c) or panel-major ([N / P][K][P]: each thread
 * streams a contiguous region, lmq_gemm_panels_share), int8 or int4 [N, K] (qgemm.c).
 */
#include <stdlib.h>
#include <string.h>
#include <omp.h>

enum { W_F32 = 0, W_I8 = 1, W_I4 = 2, W_F32_PANELS = 3 };

typedef struct {
    int kind;                      /* W_F32, W_I8, W_I4, W_F32_PANELS */
    long n, k;                     /* y[M, n] (+)= x[M, k] @ W */
    const void *w;                 /* float32 [k, n] K-major | int8 [n, k] | uint8 [n, k / 2] |
                                      float32 [n / P][k][P] panel-major */
    long ldw;                      /* float32: the row stride of [k, n]; panels: P */
    const float *scale, *zero;     /* int8: scale [n, k / 32]; int4: d and m [n, k / 32] */
} lmq_weight;

typedef struct {
    const float *in_norm, *post_norm, *q_norm, *k_norm, *bqkv;   /* q_norm, k_norm, bqkv may be NULL */
    float eps, qk_eps, scaling;
    lmq_weight qkv, o, gu, down;
    float *kc, *vc;                /* the store's K and V of this layer: [slots, Hkv, D] */
    long sks, skh, svs, svh;
} lmq_layer;

void lmq_gemm_share(const float *x, long ldx, const float *w, long ldw, float *y, long ldy,
                    int M, long K, long N, int accumulate, int t, int nt);
void lmq_gemm_panels_share(const float *x, long ldx, const float *w, long P, float *y, long ldy,
                           int M, long K, long N, int accumulate, int t, int nt);
void lmq_qgemm_i8_share(const float *x, long ldx, const signed char *q, const float *scale, float *y, long ldy,
                        int M, long K, long N, int accumulate, int t, int nt);
void lmq_qgemm_i4_share(const float *x, long ldx, const unsigned char *q, const float *d, const float *mn,
                        float *y, long ldy, int M, long K, long N, int accumulate, int t, int nt);
void lmq_rmsnorm(const float *x, long ldx, const float *w, float *y, long ldy, int M, int N, float eps,
                 int threads);
void lmq_silu_mul_share(const float *gu, long ldgu, float *out, long ldo, int M, int I, int t, int nt);
void lmq_rope_append_rows(const float *qkv, long ldqkv, const float *cos_, const float *sin_, const int *pos,
                          const float *qn, const float *kn, float eps, float *q, long sqr, long sqh,
                          float *kc, long sks, long skh, float *vc, long svs, long svh, const int *table, long stb,
                          long r0, long r1, int T, long end, int nrows, int Hq, int Hkv, int D);
void lmq_attention_body(const float *q, long sqb, long sqh, const float *k, long skh, long sks,
                        const float *v, long svh, long svs, const int *table, long stb, const int *start,
                        float *out, long sob, long soh, int B, int Hq, int Hkv, long S, int D, float scale,
                        float *parts);
long lmq_attention_parts(int B, int Hq, int Hkv, long S, int D);
void lmq_attention_groups(const int *table, long stb, const int *start, int B, int Hq, int Hkv, long S, int D,
                          float *parts);

/* Thread t of nt's share of y (+)= a @ W. */
static void mm_share(const lmq_weight *w, const float *a, long lda, float *y, long ldy, int M, int acc,
                     int t, int nt) {
    switch (w->kind) {
    case W_F32:
        lmq_gemm_share(a, lda, (const float *)w->w, w->ldw, y, ldy, M, w->k, w->n, acc, t, nt);
        break;
    case W_F32_PANELS:
        lmq_gemm_panels_share(a, lda, (const float *)w->w, w->ldw, y, ldy, M, w->k, w->n, acc, t, nt);
        break;
    case W_I8:
        lmq_qgemm_i8_share(a, lda, (const signed char *)w->w, w->scale, y, ldy, M, w->k, w->n, acc, t, nt);
        break;
    default:
        lmq_qgemm_i4_share(a, lda, (const unsigned char *)w->w, w->scale, w->zero, y, ldy, M, w->k, w->n, acc,
                           t, nt);
    }
}

/* The layers [0, L) for rows [0, B) of x [B, hidden] (row stride ldx, updated in place). cos_, sin_ [B, D/2]:
 * RoPE's angles per row; pos int32 [B] (positions: a negative one writes no K/V); the new token's K/V go to
 * column `end` of each row's page table (table int32, row stride stb); row b attends to columns
 * [start[b], end] (start clamped to first <= start: the columns before `first` are not read). Scratch
 * (contiguous rows): qkv [B, (Hq + 2 Hkv) D], q and attn [B, Hq, D], act [B, inter]; gu [B, 2 inter] with row stride
 * ldgu (padded where 2 inter floats are a multiple of 2 KB: rows 4 KB apart share their L1 sets). */
void lmq_decode_layers(const lmq_layer *layers, int L, float *x, long ldx, int B, int hidden,
                       int Hq, int Hkv, int D, int inter,
                       const float *cos_, const float *sin_, const int *pos,
                       const int *table, long stb, const int *start, long first, long end,
                       float *qkv, float *q, float *attn, float *gu, long ldgu, float *act, int threads) {
    const long S = end + 1 - first, nqkv = (long)(Hq + 2 * Hkv) * D, nq = (long)Hq * D;
    int *rel = malloc(sizeof(int) * B);                    /* each row's first column, from `first` on */
    for (int b = 0; b < B; b++) rel[b] = start[b] - first < 0 ? 0 : (int)(start[b] - first);
    float *parts = malloc(sizeof(float) * lmq_attention_parts(B, Hq, Hkv, S, D));
    lmq_attention_groups(table + first, stb, rel, B, Hq, Hkv, S, D, parts);   /* the same for every layer */
    const int width = hidden > inter ? hidden : inter;
    float *hbuf = malloc(sizeof(float) * (size_t)threads * B * width);
    #pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *h = hbuf + (size_t)t * B * width;           /* this thread's normed rows */
        for (int l = 0; l < L; l++) {
            const lmq_layer *ly = layers + l;
            lmq_rmsnorm(x, ldx, ly->in_norm, h, hidden, B, hidden, ly->eps, 1);
            if (ly->bqkv) {                                 /* each sum starts from the bias (cpu.small_m_mm) */
                if (t == 0)
                    for (int b = 0; b < B; b++) memcpy(qkv + b * nqkv, ly->bqkv, sizeof(float) * nqkv);
                #pragma omp barrier
            }
            mm_share(&ly->qkv, h, hidden, qkv, nqkv, B, ly->bqkv != NULL, t, nt);
            #pragma omp barrier
            lmq_rope_append_rows(qkv, nqkv, cos_, sin_, pos, ly->q_norm, ly->k_norm, ly->qk_eps, q, nq, D,
                                 ly->kc, ly->sks, ly->skh, ly->vc, ly->svs, ly->svh, table, stb,
                                 (long)B * t / nt, (long)B * (t + 1) / nt, 1, end, B, Hq, Hkv, D);
            #pragma omp barrier
            lmq_attention_body(q, nq, D, ly->kc, ly->skh, ly->sks, ly->vc, ly->svh, ly->svs,
                               table + first, stb, rel, attn, nq, D, B, Hq, Hkv, S, D, ly->scaling, parts);
            mm_share(&ly->o, attn, nq, x, ldx, B, 1, t, nt);
            #pragma omp barrier
            lmq_rmsnorm(x, ldx, ly->post_norm, h, hidden, B, hidden, ly->eps, 1);
            mm_share(&ly->gu, h, hidden, gu, ldgu, B, 0, t, nt);
            #pragma omp barrier
            lmq_silu_mul_share(gu, ldgu, act, inter, B, inter, t, nt);
            #pragma omp barrier
            mm_share(&ly->down, act, inter, x, ldx, B, 1, t, nt);
            #pragma omp barrier
        }
    }
    free(hbuf);
    free(parts);
    free(rel);
}
