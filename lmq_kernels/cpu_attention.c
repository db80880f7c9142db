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
 * The chunks of a row depend on its own columns only and every sum runs in a fixed order, so a row gets the
 * same bits in any batch, on any number of threads (tasks may run on any thread: each writes its own partial).
 *
 * Built with cpu_gemm.c into one library (see cpu.py); OpenMP: the process's runtime (torch's libgomp).
 */
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_simd.h"

#ifndef PF
#define PF 8         /* K/V rows prefetched ahead (a task's streams are short for the hardware prefetchers), into
                        L2 (locality 2): the V rows are read only after the chunk's scores, and prefetched
                        non-temporally (locality 0) they were gone by then on Zen 4 (8 rows x 450 columns,
                        30 cold layers: 400 -> 310 us a layer, AVX-512 and AVX2 builds alike) */
#endif
#ifndef LMQ_ATTN_CH
#define LMQ_ATTN_CH 128   /* columns a task */
#endif
#define CH LMQ_ATTN_CH

static inline vf load_vf(const float *p) { return *(const vf *)p; }   /* vf is aligned(4) */

/* The sum of a native vector's lanes in a fixed order (halves, then quarters, ...). */
static inline float lanes_total(vf a) {
#if LMQ_VL == 16
    a += __builtin_shuffle(a, (vfi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
#endif
#if LMQ_VL >= 8
    a += __builtin_shuffle(a, (vfi){4, 5, 6, 7, 0, 1, 2, 3
#if LMQ_VL == 16
                                    , 12, 13, 14, 15, 8, 9, 10, 11
#endif
                                    });
#endif
    a += __builtin_shuffle(a, (vfi){2, 3, 0, 1
#if LMQ_VL >= 8
                                    , 6, 7, 4, 5
#endif
#if LMQ_VL == 16
                                    , 10, 11, 8, 9, 14, 15, 12, 13
#endif
                                    });
    return a[0] + a[1];
}

/* One task: row b, kv head g, columns [c0, c0 + cn) of the row. part: per query head j of the group,
 * [m, l, acc[D]] (D + 2 floats). sc: G * CH floats of scratch. DV = D / LMQ_VL, constant per instantiation. */
static inline __attribute__((always_inline)) void chunk(
        const float *q, long sqb, long sqh, const float *k, long skh, long sks,
        const float *v, long svh, long svs, const int *tb, int b, int g, long cn,
        int G, float scale, float *part, float *sc, const int DV) {
    const float *kb = k + g * skh, *vb = v + g * svh;
    const int D = DV * LMQ_VL;
    for (long c = 0; c < PF && c < cn; c++) {
        __builtin_prefetch(kb + tb[c] * sks, 0, 2);
        __builtin_prefetch(vb + tb[c] * svs, 0, 2);
    }
    for (int j = 0; j < G; j++) {
        vf qv[DV];
        const float *qr = q + b * sqb + (g * G + j) * sqh;
        for (int d = 0; d < DV; d++) qv[d] = load_vf(qr + d * LMQ_VL) * scale;
        float *s = sc + j * CH;
        for (long c = 0; c < cn; c++) {
            const float *kr = kb + tb[c] * sks;
            if (j == 0 && c + PF < cn)
                for (int d = 0; d < D; d += 16) {
                    __builtin_prefetch(kb + tb[c + PF] * sks + d, 0, 2);
                    __builtin_prefetch(vb + tb[c + PF] * svs + d, 0, 2);
                }
            vf a0 = qv[0] * load_vf(kr), a1 = qv[1] * load_vf(kr + LMQ_VL);
            for (int d = 2; d < DV; d += 2) {
                a0 += qv[d] * load_vf(kr + d * LMQ_VL);
                a1 += qv[d + 1] * load_vf(kr + (d + 1) * LMQ_VL);
            }
            s[c] = lanes_total(a0 + a1);
        }
        float m = s[0];
        for (long c = 1; c < cn; c++) m = s[c] > m ? s[c] : m;
        vf lv = (vf){0};
        long c = 0;
        for (; c + LMQ_VL <= cn; c += LMQ_VL) {
            const vf x = vexp_vf(load_vf(s + c) - m);
            *(vf *)(s + c) = x;
            lv += x;
        }
        float l = lanes_total(lv);
        for (; c < cn; c++) {        /* the tail, one lane at a time (lane 0 of a vector) */
            const float x = vexp_vf((vf){0} + (s[c] - m))[0];
            s[c] = x;
            l += x;
        }
        vf acc[DV];
        for (int d = 0; d < DV; d++) acc[d] = (vf){0};
        for (c = 0; c < cn; c++) {
            const float *vr = vb + tb[c] * svs;
            const float p = s[c];
            for (int d = 0; d < DV; d++) acc[d] += p * load_vf(vr + d * LMQ_VL);
        }
        float *pj = part + j * (D + 2);
        pj[0] = m;
        pj[1] = l;
        memcpy(pj + 2, acc, sizeof(acc));
    }
}

#define CASE(DV) case DV: chunk(q, sqb, sqh, k, skh, sks, v, svh, svs, table + b * stb + c0, b, g, cn, \
                               G, scale, part, sc, DV); break;

/* The attention's work inside a parallel region (lmq_attention's, or a fused step's: cpu_step.c): the
 * tasks (a dynamic worksharing loop), then the combine (a static one), each ending in a barrier. `parts`:
 * B * Hkv * chunks * G * (D + 2) floats shared by the threads. D must be 64, 128 or 256 (the caller checks). */
void lmq_attention_body(const float *q, long sqb, long sqh,
                        const float *k, long skh, long sks,
                        const float *v, long svh, long svs,
                        const int *table, long stb, const int *start, float *out, long sob, long soh,
                        int B, int Hq, int Hkv, long S, int D, float scale, float *parts) {
    const int G = Hq / Hkv;
    const long nch = S > 0 ? (S + CH - 1) / CH : 1, stride = (long)G * (D + 2);  /* a task's partials */
    float *sc = malloc(sizeof(float) * G * CH);
    #pragma omp for schedule(dynamic, 1)
    for (long t = 0; t < (long)B * Hkv * nch; t++) {
        const int b = t / (Hkv * nch), g = (t / nch) % Hkv;
        const long s0 = start[b] < 0 ? 0 : start[b], c0 = s0 + (t % nch) * CH;
        if (c0 >= S) continue;
        const long cn = S - c0 < CH ? S - c0 : CH;
        float *part = parts + t * stride;
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

/* The number of floats lmq_attention_body's `parts` holds. */
long lmq_attention_parts(int B, int Hq, int Hkv, long S, int D) {
    const long nch = S > 0 ? (S + CH - 1) / CH : 1;
    return (long)B * Hkv * nch * (Hq / Hkv) * (D + 2);
}

void lmq_attention(const float *q, long sqb, long sqh,
                   const float *k, long skh, long sks,
                   const float *v, long svh, long svs,
                   const int *table, long stb, const int *start, float *out, long sob, long soh,
                   int B, int Hq, int Hkv, long S, int D, float scale, int threads) {
    float *parts = malloc(sizeof(float) * lmq_attention_parts(B, Hq, Hkv, S, D));
    #pragma omp parallel num_threads(threads)
    lmq_attention_body(q, sqb, sqh, k, skh, sks, v, svh, svs, table, stb, start, out, sob, soh,
                       B, Hq, Hkv, S, D, scale, parts);
    free(parts);
}
