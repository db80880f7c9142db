/* Grouped-query attention of one new token a row (a CPU decode step), straight on the paged K/V store:
 * float32 q [B, Hq, D], k and v [slots, Hkv, D] (one layer of the store; any strides, the last dimension
 * contiguous), out [B, Hq, D]; column c of row b is slot table[b * stb + c] (int32 page tables, S columns).
 * Row b attends to its own columns [start[b], S): the left padding is never read (start is clamped to
 * [0, S]; a row without a column gets zeros).
 *
 * Why: a decode step reads each row's K/V once and does little arithmetic per byte. torch's CPU path
 * gathers the rows' columns first (a copy) and its fused attention then reads every row from the batch's
 * first column, padding included; this kernel reads each row's valid columns once, in place.
 *
 * Split-K (flash decoding): a task is (row, kv head, chunk of CH columns counted from the row's first
 * column), so that one row's few kv heads still feed every thread. A task computes, for each of the G = Hq /
 * Hkv query heads of its kv head, the scores of its columns, their max m, the sum l of exp(score - m) and
 * the exp-weighted sum of V rows (prefetching the next K and V rows while it reads the scores' K rows); a
 * second pass combines a (row, head)'s chunks in order: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
 * Within a task the group's query heads share each K and V row's load (as many heads at once as the
 * registers hold), and a score's horizontal sum is done for VL columns at once (one shuffle tree for VL
 * product vectors instead of one per column). Consecutive rows whose chunk holds the same slots (a prefix
 * they share in the trie) are one task (cascade): the chunk's K/V is read once for all their heads.
 *
 * Exactness: every product chain is written out in fma_vf (not left to -ffp-contract, which fused one or the
 * other product of a chain's first two), a score's lanes are added in one fixed tree, and the chunks of a row
 * depend on its own columns only, each sum in a fixed order: a row gets the same bits in any batch, on any
 * number of threads (tasks may run on any thread: each writes its own partial), in either path (the per-op
 * call and step.c's fused step run this body).
 *
 * Built with gemm.c into one library (see __init__.py); OpenMP: the process's runtime (torch's libgomp).
 */
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "simd.h"

#ifndef PF
#define PF 8         /* K/V rows prefetched ahead (a task's streams are short for the hardware prefetchers), into
                        L2 (locality 2): the V rows are read only after the chunk's scores, and prefetched
                        non-temporally (locality 0) they would be gone by then */
#endif
#ifndef LMQ_ATTN_CH
#define LMQ_ATTN_CH 128   /* columns a task */
#endif
#define CH LMQ_ATTN_CH

static inline vf load_vf(const float *p) { return *(const vf *)p; }   /* vf is aligned(4) */

/* The lane sums of VL columns' product vectors at once: u holds column c's vector at u + rev[c] * LMQ_VL (rev:
 * the bit reversal of c's log2(VL) bits); lane c of the result is column c's sum, added in lanes_total's
 * order (lane i + lane i + VL/2, then + the lane VL/4 further, ..., 1 further): each level adds the two
 * halves of every column's segment, packing two vectors' segments into one (HALF). 15 two-vector shuffles
 * and adds per 16 columns instead of 4 per column. An output lane depends on its own column's vector only
 * (the slots of a group's missing columns hold anything: their lanes are not used). */
#define DV_MAX (256 / LMQ_VL)   /* the head dimension in vectors, at most (D <= 256) */
#define HALF(x, y, A, B) (LMQ_SHUFFLE(x, y, A) + LMQ_SHUFFLE(x, y, B))
#if LMQ_VL == 16
static const unsigned char rev[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#define L8A 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define L8B 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define L4A 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define L4B 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define L2A 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define L2B 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define L1A 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define L1B 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
static inline vf columns_total(const float *u) {
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) a[i] = HALF(load_vf(u + 2 * i * 16), load_vf(u + (2 * i + 1) * 16), L8A, L8B);
    for (int i = 0; i < 4; i++) b[i] = HALF(a[2 * i], a[2 * i + 1], L4A, L4B);
    for (int i = 0; i < 2; i++) c[i] = HALF(b[2 * i], b[2 * i + 1], L2A, L2B);
    return HALF(c[0], c[1], L1A, L1B);
}
#elif LMQ_VL == 8
static const unsigned char rev[8] = {0, 4, 2, 6, 1, 5, 3, 7};
#define L4A 0, 1, 2, 3, 8, 9, 10, 11
#define L4B 4, 5, 6, 7, 12, 13, 14, 15
#define L2A 0, 1, 8, 9, 4, 5, 12, 13
#define L2B 2, 3, 10, 11, 6, 7, 14, 15
#define L1A 0, 8, 2, 10, 4, 12, 6, 14
#define L1B 1, 9, 3, 11, 5, 13, 7, 15
static inline vf columns_total(const float *u) {
    vf a[4], b[2];
    for (int i = 0; i < 4; i++) a[i] = HALF(load_vf(u + 2 * i * 8), load_vf(u + (2 * i + 1) * 8), L4A, L4B);
    for (int i = 0; i < 2; i++) b[i] = HALF(a[2 * i], a[2 * i + 1], L2A, L2B);
    return HALF(b[0], b[1], L1A, L1B);
}
#else
static const unsigned char rev[4] = {0, 2, 1, 3};
#define L2A 0, 1, 4, 5
#define L2B 2, 3, 6, 7
#define L1A 0, 4, 2, 6
#define L1B 1, 5, 3, 7
static inline vf columns_total(const float *u) {
    const vf a0 = HALF(load_vf(u), load_vf(u + 4), L2A, L2B), a1 = HALF(load_vf(u + 8), load_vf(u + 12), L2A, L2B);
    return HALF(a0, a1, L1A, L1B);
}
#endif

/* The query heads qp[0 .. J) (J constant per instance): the scores of the chunk's cn columns into
 * sc[j * CH + c] (lanes past cn: anything). Each K row is loaded once for the J heads; each (column, head)
 * product is lanes_total(a0 + a1) of two FMA chains over the head dimension's even and odd vectors. */
static inline __attribute__((always_inline)) void scores(
        const float *const *qp, const float *kb, long sks, const float *vb, long svs, const int *tb, long cn,
        float scale, float *sc, float *u, int prefetch, const int DV, const int J) {
    vf qv[4][DV_MAX];                                     /* fixed sizes: registers, not a stack array */
    _Pragma("GCC unroll 4")
    for (int j = 0; j < J; j++)
        _Pragma("GCC unroll 16")
        for (int d = 0; d < DV; d++) qv[j][d] = load_vf(qp[j] + d * LMQ_VL) * scale;
    for (long c0 = 0; c0 < cn; c0 += LMQ_VL) {
        const long nc = cn - c0 < LMQ_VL ? cn - c0 : LMQ_VL;
        for (long i = 0; i < nc; i++) {
            const long c = c0 + i;
            const float *kr = kb + tb[c] * sks;
            if (prefetch && c + PF < cn)
                for (int d = 0; d < DV * LMQ_VL; d += 16) {
                    __builtin_prefetch(kb + tb[c + PF] * sks + d, 0, 2);
                    __builtin_prefetch(vb + tb[c + PF] * svs + d, 0, 2);
                }
            vf kv[DV_MAX];
            _Pragma("GCC unroll 16")
            for (int d = 0; d < DV; d++) kv[d] = load_vf(kr + d * LMQ_VL);
            _Pragma("GCC unroll 4")
            for (int j = 0; j < J; j++) {
                vf a0 = qv[j][0] * kv[0], a1 = qv[j][1] * kv[1];
                _Pragma("GCC unroll 8")
                for (int d = 2; d < DV; d += 2) {
                    a0 = fma_vf(qv[j][d], kv[d], a0);
                    a1 = fma_vf(qv[j][d + 1], kv[d + 1], a1);
                }
                *(vf *)(u + (j * LMQ_VL + rev[i]) * LMQ_VL) = a0 + a1;
            }
        }
        for (int j = 0; j < J; j++) *(vf *)(sc + j * CH + c0) = columns_total(u + j * LMQ_VL * LMQ_VL);
    }
}

/* acc_j = sum_c p_j[c] v_c over the chunk's columns, in order, for the heads whose partials are pp[0 .. J)
 * (p_j: sc + j * CH; acc_j to pp[j] + 2); each V row loaded once for the J heads. */
static inline __attribute__((always_inline)) void values(
        const float *vb, long svs, const int *tb, long cn, const float *sc, float *const *pp, const int DV,
        const int J) {
    vf acc[4][DV_MAX];                                    /* fixed sizes: registers, not a stack array */
    _Pragma("GCC unroll 4")
    for (int j = 0; j < J; j++)
        _Pragma("GCC unroll 16")
        for (int d = 0; d < DV; d++) acc[j][d] = (vf){0};
    for (long c = 0; c < cn; c++) {
        const float *vr = vb + tb[c] * svs;
        vf vv[DV_MAX];
        _Pragma("GCC unroll 16")
        for (int d = 0; d < DV; d++) vv[d] = load_vf(vr + d * LMQ_VL);
        _Pragma("GCC unroll 4")
        for (int j = 0; j < J; j++) {
            const vf p = vf_splat(sc + j * CH + c);
            _Pragma("GCC unroll 16")
            for (int d = 0; d < DV; d++) acc[j][d] = fma_vf(p, vv[d], acc[j][d]);
        }
    }
    _Pragma("GCC unroll 4")
    for (int j = 0; j < J; j++)
        _Pragma("GCC unroll 16")
        for (int d = 0; d < DV; d++) *(vf *)(pp[j] + 2 + d * LMQ_VL) = acc[j][d];
}

/* Query heads taken together (each K and V row loaded once for them): as many as keep their query vectors,
 * or their accumulators, in a quarter to a half of the registers; one where registers are few. */
#define JB (LMQ_VREGS >= 32 ? (16 / DV > 0 ? 16 / DV : 1) : 1)

/* One task: the P query heads qp[0 .. P) (the G heads of a kv head, of one row or of several rows that
 * share the chunk's slots) over the chunk's columns, slots tb[0 .. cn) of kv head bases kb, vb; head p's
 * partial [m, l, acc[D]] to pp[p]. sc: P * CH floats of scratch (scores, then exp), u: JB * VL * VL floats
 * (the scores' product vectors). A head's arithmetic is the same whatever P and its place in the list.
 * DV = D / LMQ_VL, constant per instantiation. */
static inline __attribute__((always_inline)) void chunk(
        const float *const *qp, float *const *pp, int P, const float *kb, long sks, const float *vb, long svs,
        const int *tb, long cn, float scale, float *sc, float *u, const int DV) {
    for (long c = 0; c < PF && c < cn; c++) {
        __builtin_prefetch(kb + tb[c] * sks, 0, 2);
        __builtin_prefetch(vb + tb[c] * svs, 0, 2);
    }
    for (int p0 = 0; p0 < P; p0 += JB)              /* JB heads a pass (J: a constant in each instance) */
        switch (P - p0 < JB ? P - p0 : JB) {
#define SCORES(J) case J: scores(qp + p0, kb, sks, vb, svs, tb, cn, scale, sc + p0 * CH, u, p0 == 0, DV, J); break;
        SCORES(1) SCORES(2) SCORES(3) default: SCORES(4)
#undef SCORES
        }
    for (int p = 0; p < P; p++) {
        float *s = sc + p * CH;
        long c = 0;
        float m = s[0];
        if (cn >= LMQ_VL) {                          /* a max is exact in any order: a vector's, then its lanes */
            vf mv = load_vf(s);
            for (c = LMQ_VL; c + LMQ_VL <= cn; c += LMQ_VL) {
                const vf x = load_vf(s + c);
                mv = (vf)(((vfi)mv & (vfi)(mv >= x)) | ((vfi)x & ~(vfi)(mv >= x)));
            }
            for (int i = 0; i < LMQ_VL; i++) m = mv[i] > m ? mv[i] : m;
        }
        for (; c < cn; c++) m = s[c] > m ? s[c] : m;
        vf lv = (vf){0};
        for (c = 0; c + LMQ_VL <= cn; c += LMQ_VL) {
            const vf x = vexp_vf(load_vf(s + c) - m);
            *(vf *)(s + c) = x;
            lv += x;
        }
        float l = lanes_total(lv);
        if (c < cn) {                                /* the tail: one vector, its lanes added one at a time */
            const vf x = vexp_vf(load_vf(s + c) - m);
            *(vf *)(s + c) = x;
            for (; c < cn; c++) l += s[c];
        }
        pp[p][0] = m;
        pp[p][1] = l;
    }
    for (int p0 = 0; p0 < P; p0 += JB)
        switch (P - p0 < JB ? P - p0 : JB) {
#define VALUES(J) case J: values(vb, svs, tb, cn, sc + p0 * CH, pp + p0, DV, J); break;
        VALUES(1) VALUES(2) VALUES(3) default: VALUES(4)
#undef VALUES
        }
}

#define CASE(DV) case DV: chunk(qp, pp, P, kb, sks, vb, svs, tb, cn, scale, sc, u, DV); break;

/* Cascade: rows whose chunk holds the same store slots (a prefix they share in the trie: the same slot at
 * the same position of two rows is one token of one trie path, and so is every slot before it) read it
 * once: consecutive rows whose chunk i has as many columns and the same slots (compared whole) form one task
 * a kv head, up to CASCADE_HEADS query heads. */
#define CASCADE_HEADS 32

typedef struct { int b, rows, i; } group;          /* rows [b, b + rows) share their chunk i */

/* The groups of the B rows' chunks (chunk-major), into gs; returns their number (<= B * nch). */
static long groups_of(const int *table, long stb, const int *start, int B, long S, long nch, int max_rows,
                      group *gs) {
    long n = 0;
    for (long i = 0; i < nch; i++) {
        long lead_c0 = 0, lead_cn = 0;
        for (int b = 0; b < B; b++) {
            const long s0 = start[b] < 0 ? 0 : start[b], c0 = s0 + i * CH;
            if (c0 >= S) continue;
            const long cn = S - c0 < CH ? S - c0 : CH;
            const int *tb = table + b * stb + c0;
            group *last = n ? gs + n - 1 : NULL;
            if (last && last->i == i && last->b + last->rows == b && last->rows < max_rows && cn == lead_cn) {
                const int *lt = table + last->b * stb + lead_c0;
                if (tb[cn - 1] == lt[cn - 1] && tb[0] == lt[0] && !memcmp(tb, lt, sizeof(int) * cn)) {
                    last->rows++;
                    continue;
                }
            }
            gs[n++] = (group){b, 1, (int)i};
            lead_c0 = c0;
            lead_cn = cn;
        }
    }
    return n;
}

/* The rows a cascade task takes at most (CASCADE_HEADS query heads). */
static int cascade_rows(int G) { return CASCADE_HEADS / G > 1 ? CASCADE_HEADS / G : 1; }

/* The cascade's groups of the rows' chunks, written into `parts` after the chunks' partials (see
 * lmq_attention_parts), for lmq_attention_body to read: once per page-table state (a fused step computes them
 * once for all its layers: every layer reads the same columns). */
void lmq_attention_groups(const int *table, long stb, const int *start, int B, int Hq, int Hkv, long S, int D,
                          float *parts) {
    const int G = Hq / Hkv;
    const long nch = S > 0 ? (S + CH - 1) / CH : 1;
    int *ngroups = (int *)(parts + (long)B * Hkv * nch * G * (D + 2));
    *ngroups = (int)groups_of(table, stb, start, B, S, nch, cascade_rows(G), (group *)(ngroups + 1));
}

/* The attention's work inside a parallel region (lmq_attention's, or a fused step's: step.c): the
 * tasks (a dynamic worksharing loop), then the combine (a static one), each ending in a barrier. `parts`:
 * lmq_attention_parts floats shared by the threads, its groups written by lmq_attention_groups for this
 * table, start and S. D must be 64, 128 or 256 (the caller checks). */
void lmq_attention_body(const float *q, long sqb, long sqh,
                        const float *k, long skh, long sks,
                        const float *v, long svh, long svs,
                        const int *table, long stb, const int *start, float *out, long sob, long soh,
                        int B, int Hq, int Hkv, long S, int D, float scale, float *parts) {
    const int G = Hq / Hkv, most = cascade_rows(G) * G;
    const long nch = S > 0 ? (S + CH - 1) / CH : 1, stride = (long)G * (D + 2);  /* a chunk's partials */
    const int *ngroups = (const int *)(parts + (long)B * Hkv * nch * stride);
    const group *gs = (const group *)(ngroups + 1);
    float *sc = malloc(sizeof(float) * ((long)most * CH + 4L * LMQ_VL * LMQ_VL)), *u = sc + (long)most * CH;
    memset(u, 0, sizeof(float) * 4 * LMQ_VL * LMQ_VL);   /* a short last group's unused slots: read, not used */
    const float **qp = malloc(sizeof(float *) * most);
    float **pp = malloc(sizeof(float *) * most);
    #pragma omp for schedule(dynamic, 1)
    for (long t = 0; t < (long)*ngroups * Hkv; t++) {
        const group *gr = gs + t / Hkv;
        const int g = t % Hkv, P = gr->rows * G;
        const long s0 = start[gr->b] < 0 ? 0 : start[gr->b], c0 = s0 + (long)gr->i * CH;
        const long cn = S - c0 < CH ? S - c0 : CH;
        for (int r = 0; r < gr->rows; r++)
            for (int j = 0; j < G; j++) {
                const long b = gr->b + r;
                qp[r * G + j] = q + b * sqb + (g * G + j) * sqh;
                pp[r * G + j] = parts + ((b * Hkv + g) * nch + gr->i) * stride + j * (D + 2);
            }
        const float *kb = k + g * skh, *vb = v + g * svh;
        const int *tb = table + gr->b * stb + c0;
        switch (D / LMQ_VL) {
#if LMQ_VL == 16
            CASE(4) CASE(8) CASE(16)
#elif LMQ_VL == 8
            CASE(8) CASE(16) CASE(32)
#else
            CASE(16) CASE(32) CASE(64)
#endif
        }
    }
    free(sc);
    free(qp);
    free(pp);
    #pragma omp for schedule(static)
    for (long t = 0; t < (long)B * Hq; t++) {     /* combine a (row, query head)'s chunks in order */
        const int b = t / Hq, h = t % Hq, g = h / G, j = h % G;
        const long s0 = start[b] < 0 ? 0 : start[b];
        const long used = s0 >= S ? 0 : (S - s0 + CH - 1) / CH;
        float *o = out + b * sob + h * soh;
        if (used == 0) {
            memset(o, 0, sizeof(float) * D);
            continue;
        }
        const float *p0 = parts + ((long)(b * Hkv + g) * nch) * stride + j * (D + 2);
        float mx = p0[0];
        for (long c = 1; c < used; c++) mx = p0[c * stride] > mx ? p0[c * stride] : mx;
        float l = 0.0f;
        for (int d = 0; d < D; d++) o[d] = 0.0f;
        for (long c = 0; c < used; c++) {
            const float *pc = p0 + c * stride, w = vexp_vf((vf){0} + (pc[0] - mx))[0];
            l += w * pc[1];
            for (int d = 0; d < D; d++) o[d] += w * pc[2 + d];
        }
        const float inv = 1.0f / l;
        for (int d = 0; d < D; d++) o[d] *= inv;
    }
}

/* The number of floats lmq_attention_body's `parts` holds: the chunks' partials, then the groups. */
long lmq_attention_parts(int B, int Hq, int Hkv, long S, int D) {
    const long nch = S > 0 ? (S + CH - 1) / CH : 1;
    return (long)B * Hkv * nch * (Hq / Hkv) * (D + 2) + 1 + (long)B * nch * (sizeof(group) / sizeof(float));
}

void lmq_attention(const float *q, long sqb, long sqh,
                   const float *k, long skh, long sks,
                   const float *v, long svh, long svs,
                   const int *table, long stb, const int *start, float *out, long sob, long soh,
                   int B, int Hq, int Hkv, long S, int D, float scale, int threads) {
    float *parts = malloc(sizeof(float) * lmq_attention_parts(B, Hq, Hkv, S, D));
    lmq_attention_groups(table, stb, start, B, Hq, Hkv, S, D, parts);
    #pragma omp parallel num_threads(threads)
    lmq_attention_body(q, sqb, sqh, k, skh, sks, v, svh, svs, table, stb, start, out, sob, soh,
                       B, Hq, Hkv, S, D, scale, parts);
    free(parts);
}
