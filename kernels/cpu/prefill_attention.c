/* Causal grouped-query attention of the T new tokens of B left-padded rows (a CPU prefill), straight on the
 * paged K/V store: float32 q [B x T tokens, Hq, D] (token t of row b at b * T + t), k and v [slots, Hkv, D]
 * (one layer of the store; any strides, the last dimension contiguous), out like q. Column c of row b is
 * slot table[b * stb + c]; token t of row b sits at column end - T + t and attends to the row's columns
 * [start[b], end - T + t]. Its last m[b] tokens are real; the padding before them gets zeros.
 *
 * Why: the model's forward (and torch's attention) wants each row's K/V as one dense tensor, so every layer
 * of a prefill gathered every row's columns first (rows after a long shared prefix copy that prefix once
 * per row and layer), a large share of the layer's time. This kernel reads the columns in place.
 *
 * Tasks: (row, kv head, tile of TQ tokens counted back from the row's last token), the latest tiles (the
 * longest) first. A task's R = nt x G query rows (token, head of the group; padded to whole vectors) walk
 * the row's columns from start[b] in chunks of CH, with an online softmax whose every step is a vector
 * over the R query rows (no horizontal sums):
 *   S[c][r] = q_r . k_c                              an FMA chain over d; q held transposed ([D][R])
 *   m_r' = max(m_r, max_c S[c][r]);  a_r = exp(m_r - m_r');  P[c][r] = exp(S[c][r] - m_r')
 *   l_r = a_r l_r + sum_c P[c][r];   O_r = a_r O_r + sum_c P[c][r] v_c     (c in order)
 * with columns right of a query's own (causality) at -inf (P = 0). out_r = O_r / l_r.
 *
 * Exactness: a query's result depends on its row's columns and the chunk boundaries (counted from start[b])
 * only: which tile it falls in, how far its chunk runs for the tile's other queries (they add exact zeros)
 * and the batch do not change its bits, so a row gets the same attention alone as in any batch, with any
 * amount of padding, on any number of threads.
 *
 * Built with the other kernels into one library (build.py); OpenMP: the process's runtime.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "simd.h"

#ifndef LMQ_PREFILL_CH
#define LMQ_PREFILL_CH 64    /* columns a chunk */
#endif
#ifndef LMQ_PREFILL_TQ
#define LMQ_PREFILL_TQ 16    /* tokens a task */
#endif
#define CH LMQ_PREFILL_CH
#define TQ LMQ_PREFILL_TQ

/* Score block: SC columns (each broadcast from its K row) x SV vectors of query rows, within the registers */
#if LMQ_VREGS >= 32
#define SC 8
#define SV 3
#else
#define SC 4
#define SV 3
#endif
/* Value block: PR query rows x PV vectors of the head dimension */
#define PR 4
#define PV (LMQ_VREGS >= 32 ? 4 : 2)

static inline vf ld(const float *p) { return *(const vf *)p; }   /* vf is aligned(4) */
static inline void st(float *p, vf x) { *(vf *)p = x; }

/* S[c][rv..] for columns [0, C) (C <= SC, constant per instance) and query vectors [rv, rv + V):
 * S[c][r] = sum_d qt[d][r] k_c[d], in order of d. */
static inline __attribute__((always_inline)) void score_block(
        const float *const *kr, const float *qt, long R, float *s, long rv, int D, const int C, const int V) {
    vf a[SC][SV];
    _Pragma("GCC unroll 8")
    for (int c = 0; c < C; c++)
        _Pragma("GCC unroll 4")
        for (int j = 0; j < V; j++) a[c][j] = (vf){0};
    for (int d = 0; d < D; d++) {
        vf w[SV];
        _Pragma("GCC unroll 4")
        for (int j = 0; j < V; j++) w[j] = ld(qt + d * R + (rv + j) * LMQ_VL);
        _Pragma("GCC unroll 8")
        for (int c = 0; c < C; c++) {
            const vf x = vf_splat(kr[c] + d);
            _Pragma("GCC unroll 4")
            for (int j = 0; j < V; j++) a[c][j] = fma_vf(x, w[j], a[c][j]);
        }
    }
    _Pragma("GCC unroll 8")
    for (int c = 0; c < C; c++)
        _Pragma("GCC unroll 4")
        for (int j = 0; j < V; j++) st(s + c * R + (rv + j) * LMQ_VL, a[c][j]);
}

#define SCORE(C, V) score_block(kr + c, qt, R, s + c * R, rv, D, C, V)
#define SCORES(C) switch (nv - rv < SV ? nv - rv : SV) { \
    case 1: SCORE(C, 1); break; case 2: SCORE(C, 2); break; default: SCORE(C, 3); break; }

/* O[r][d0 + ..] = a_r O[r][..] + sum_{c < cn} P[c][r] v_c[..] for query rows [r0, r0 + NR) (NR <= PR). */
static inline __attribute__((always_inline)) void value_block(
        const float *const *vr, long cn, const float *p, long R, const float *alpha, float *o, int D,
        int r0, int d0, const int NR) {
    vf a[PR][PV];
    _Pragma("GCC unroll 4")
    for (int r = 0; r < NR; r++)
        _Pragma("GCC unroll 4")
        for (int j = 0; j < PV; j++) a[r][j] = ld(o + (r0 + r) * D + d0 + j * LMQ_VL) * alpha[r0 + r];
    for (long c = 0; c < cn; c++) {
        vf w[PV];
        _Pragma("GCC unroll 4")
        for (int j = 0; j < PV; j++) w[j] = ld(vr[c] + d0 + j * LMQ_VL);
        _Pragma("GCC unroll 4")
        for (int r = 0; r < NR; r++) {
            const vf x = vf_splat(p + c * R + r0 + r);
            _Pragma("GCC unroll 4")
            for (int j = 0; j < PV; j++) a[r][j] = fma_vf(x, w[j], a[r][j]);
        }
    }
    _Pragma("GCC unroll 4")
    for (int r = 0; r < NR; r++)
        _Pragma("GCC unroll 4")
        for (int j = 0; j < PV; j++) st(o + (r0 + r) * D + d0 + j * LMQ_VL, a[r][j]);
}

/* Per-thread scratch of a task with R query rows. */
typedef struct {
    float *qt, *s, *o, *m, *l, *alpha;
    int *col;
    const float **kr, **vr;
} scratch;

/* One task: row b's tokens [t0, t0 + nt) (all real), kv head g. */
static void task(const float *q, long sqt, long sqh, const float *k, long sks, long skh,
                 const float *v, long svs, long svh, const int *tb, long s0, long col0,
                 long t0, int nt, int g, int G, int D, float scale, float *out, long sot, long soh,
                 long R, scratch *w) {
    /* the task's query rows, padded to whole vectors (a short tile computes no more vectors than it fills;
     * R stays the scratch's row stride) */
    const long Rt = ((long)nt * G + LMQ_VL - 1) / LMQ_VL * LMQ_VL, nv = Rt / LMQ_VL;
    const long last = col0 + nt - 1;                           /* col0: the column of token t0 */
    for (long r = 0; r < Rt; r++) {                            /* q^T, scaled; padding lanes: zero */
        const int i = r / G, j = r % G;
        const float *qr = q + (t0 + i) * sqt + (g * G + j) * sqh;
        for (int d = 0; d < D; d++) w->qt[d * R + r] = i < nt ? qr[d] * scale : 0.0f;
        w->col[r] = i < nt ? (int)(col0 + i) : -1;              /* the query's last column; -1: none */
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->o, 0, sizeof(float) * Rt * D);
    for (long c0 = s0; c0 <= last; c0 += CH) {
        const long cn = last - c0 + 1 < CH ? last - c0 + 1 : CH;
        const float *const *kr = w->kr;
        for (long c = 0; c < cn; c++) {
            w->kr[c] = k + (long)tb[c0 + c] * sks + g * skh;
            w->vr[c] = v + (long)tb[c0 + c] * svs + g * svh;
        }
        const float *qt = w->qt;
        float *s = w->s;
        long c = 0;
        for (; c + SC <= cn; c += SC)
            for (long rv = 0; rv < nv; rv += SV) SCORES(SC)
        for (; c < cn; c++)
            for (long rv = 0; rv < nv; rv += SV) SCORES(1)
        for (long rv = 0; rv < nv; rv++) {                     /* the online softmax, a vector of rows */
            const long r = rv * LMQ_VL;
            vfi col;
            memcpy(&col, w->col + r, sizeof(col));                /* vfi is not aligned(4) */
            vf mx = ld(w->m + r);
            for (c = 0; c < cn; c++) {
                const vfi ok = col >= (vfi){0} + (int)(c0 + c);
                const vf x = (vf)(((vfi)ld(s + c * R + r) & ok) | ((vfi)((vf){0} - INFINITY) & ~ok));
                st(s + c * R + r, x);
                mx = (vf)(((vfi)mx & (vfi)(mx >= x)) | ((vfi)x & ~(vfi)(mx >= x)));
            }
            const vf a = vexp_vf(ld(w->m + r) - mx);           /* exp(-inf - m) and exp(NaN) are 0 */
            vf ps = (vf){0};
            for (c = 0; c < cn; c++) {
                const vf p = vexp_vf(ld(s + c * R + r) - mx);
                st(s + c * R + r, p);
                ps += p;
            }
            st(w->m + r, mx);
            st(w->l + r, fma_vf(ld(w->l + r), a, ps));   /* one rounding, written out (never contracted) */
            st(w->alpha + r, a);
        }
        for (int d0 = 0; d0 < D; d0 += PV * LMQ_VL) {
            int r0 = 0;
            for (; r0 + PR <= Rt; r0 += PR) value_block(w->vr, cn, s, R, w->alpha, w->o, D, r0, d0, PR);
            for (; r0 < Rt; r0++) value_block(w->vr, cn, s, R, w->alpha, w->o, D, r0, d0, 1);
        }
    }
    for (long r = 0; r < (long)nt * G; r++) {
        const int i = r / G, j = r % G;
        float *o = out + (t0 + i) * sot + (g * G + j) * soh;
        const float inv = w->l[r] > 0.0f ? 1.0f / w->l[r] : 0.0f;
        for (int d = 0; d < D; d++) o[d] = w->o[r * D + d] * inv;
    }
}

/* D must be a multiple of PV * LMQ_VL (64, 128 and 256 are; the caller checks). */
void lmq_prefill_attention(const float *q, long sqt, long sqh, const float *k, long sks, long skh,
                           const float *v, long svs, long svh, const int *table, long stb,
                           const int *start, const int *m, long end, int B, int T,
                           float *out, long sot, long soh, int Hq, int Hkv, int D, float scale, int threads) {
    const int G = Hq / Hkv, tiles = (T + TQ - 1) / TQ;
    const long R = ((long)TQ * G + LMQ_VL - 1) / LMQ_VL * LMQ_VL;
    #pragma omp parallel num_threads(threads)
    {
        scratch w;
        float *buf = malloc(sizeof(float) * (R * D * 2 + R * CH + 3 * R) + sizeof(int) * R
                            + sizeof(float *) * 2 * CH);
        w.qt = buf;
        w.o = w.qt + R * D;
        w.s = w.o + R * D;
        w.m = w.s + R * CH;
        w.l = w.m + R;
        w.alpha = w.l + R;
        w.col = (int *)(w.alpha + R);
        w.kr = (const float **)(w.col + R);
        w.vr = w.kr + CH;
        #pragma omp for schedule(dynamic, 1)
        for (long t = 0; t < (long)B * Hkv * tiles; t++) {
            const int b = t / ((long)Hkv * tiles), g = (t / tiles) % Hkv, tile = t % tiles;
            const long hi = T - (long)tile * TQ, lo = hi - TQ > 0 ? hi - TQ : 0;   /* tokens [lo, hi) */
            const long first_real = T - (m[b] < T ? (m[b] > 0 ? m[b] : 0) : T);
            const long t0 = lo > first_real ? lo : first_real;
            const long s0 = start[b] < 0 ? 0 : start[b];
            for (long i = lo; i < t0 && i < hi; i++)             /* padding tokens: zeros */
                for (int j = 0; j < G; j++)
                    memset(out + (b * (long)T + i) * sot + (g * G + j) * soh, 0, sizeof(float) * D);
            if (t0 >= hi) continue;
            task(q + b * (long)T * sqt, sqt, sqh, k, sks, skh, v, svs, svh, table + b * stb, s0,
                 end - T + t0, t0, (int)(hi - t0), g, G, D, scale, out + b * (long)T * sot, sot, soh, R, &w);
        }
        free(buf);
    }
}
