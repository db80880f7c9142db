/* Grouped-query attention of one new token a row (a CPU decode step), straight on the paged K/V store:
 * float32 q [B, Hq, D], k and v [slots, Hkv, D] (one layer of the store; any strides, the last dimension
 * contiguous), out [B, Hq, D]; column c of row b is slot table[b * stb + c] (int32 page tables, S columns).
 * Row b attends to its own columns [start[b], S): the left padding is never read (start is clamped to
 * [0, S]; a row without a column gets zeros).
 *
 * Why: a decode step of several rows reads each row's K/V once and does little arithmetic per byte. torch's
 * fused CPU attention reads every row from the batch's first column, padding included, at ~12 GB/s
 * (SmolLM2-135M, 8 rows of 380-660 tokens: 19-24 ms over 30 layers for 187 MB of valid K/V); this kernel
 * reads each row's valid columns once, prefetching ahead (16 ms there).
 *
 * One task per (row, kv head): its G = Hq / Hkv query heads share every K and V row loaded. Two passes:
 * the scores q.k of every column (kept in a per-thread buffer), softmax, then the p-weighted sum of V rows.
 * Each output depends only on its own row and is computed in a fixed order, so a row gets the same bits in
 * any batch, on any number of threads.
 *
 * Built with cpu_gemm.c into one library (see cpu.py); OpenMP: the process's runtime (torch's libgomp).
 */
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_simd.h"

#ifndef PF
#define PF 8         /* K/V rows prefetched ahead (a task's streams are short for the hardware prefetchers) */
#endif

/* One task: row b, kv head g. DV = D / 16, a constant in each instantiation (see lmq_attention). */
static inline __attribute__((always_inline)) void task(
        const float *q, long sqb, long sqh, const float *k, long skh, long sks,
        const float *v, long svh, long svs, const int *table, long stb, const int *start, float *out, long sob, long soh,
        int Hkv, int G, long S, float scale, long task_id, float **buf, long *cap, const int DV) {
    const int b = task_id / Hkv, g = task_id % Hkv;
    const long s0 = start[b] < 0 ? 0 : start[b], n = S - s0;   /* start is clamped to [0, S] */
    if (n <= 0) {   /* no column: zeros */
        for (int j = 0; j < G; j++) memset(out + b * sob + (g * G + j) * soh, 0, 64 * DV);
        return;
    }
    if (G * n > *cap) {
        free(*buf);
        *cap = G * n;
        *buf = malloc(*cap * sizeof(float));
    }
    float *sc = *buf;    /* scores [G][n] */
    const float *kb = k + g * skh, *vb = v + g * svh;
    const int *tb = table + b * stb + s0;  /* the row's slots from its first column */
    v16 qv[G][DV];       /* the group's queries, pre-scaled */
    for (int j = 0; j < G; j++)
        for (int d = 0; d < DV; d++) {
            v16 x;
            memcpy(&x, q + b * sqb + (g * G + j) * sqh + 16 * d, 64);
            qv[j][d] = x * scale;
        }
    for (long c = 0; c < n; c++) {
        v16 kr[DV];
        memcpy(kr, kb + tb[c] * sks, 64 * DV);
        if (c + PF < n)
            for (int d = 0; d < DV; d++) __builtin_prefetch(kb + tb[c + PF] * sks + 16 * d, 0, 0);
        for (int j = 0; j < G; j++) {
            v16 acc = qv[j][0] * kr[0];
            for (int d = 1; d < DV; d++) acc += qv[j][d] * kr[d];
            sc[j * n + c] = hsum(acc);
        }
    }
    float inv[G];
    for (int j = 0; j < G; j++) {
        float *s = sc + j * n;
        v16 mv = (v16){0} - 3.0e38f;
        long c = 0;
        for (; c + 16 <= n; c += 16) {
            v16 x;
            memcpy(&x, s + c, 64);
            mv = vselect(x > mv, x, mv);
        }
        float m = -3.0e38f;
        for (int r = 0; r < 16; r++) m = mv[r] > m ? mv[r] : m;
        for (long r = c; r < n; r++) m = s[r] > m ? s[r] : m;
        v16 sum = (v16){0};
        for (c = 0; c + 16 <= n; c += 16) {
            v16 x;
            memcpy(&x, s + c, 64);
            x = vexp(x - m);
            memcpy(s + c, &x, 64);
            sum += x;
        }
        float tail = 0.0f;
        if (c < n) {   /* the last n - c columns, the rest of the vector at exp(-inf) = 0 */
            v16 x = (v16){0} - 1.0e30f;
            memcpy(&x, s + c, (n - c) * sizeof(float));
            x = vexp(x - m);
            memcpy(s + c, &x, (n - c) * sizeof(float));
            for (long r = 0; r < n - c; r++) tail += x[r];
        }
        inv[j] = 1.0f / (hsum(sum) + tail);
    }
    v16 acc[G][DV];
    memset(acc, 0, sizeof(acc));
    for (long c = 0; c < n; c++) {
        v16 vr[DV];
        memcpy(vr, vb + tb[c] * svs, 64 * DV);
        if (c + PF < n)
            for (int d = 0; d < DV; d++) __builtin_prefetch(vb + tb[c + PF] * svs + 16 * d, 0, 0);
        for (int j = 0; j < G; j++) {
            const float p = sc[j * n + c];
            for (int d = 0; d < DV; d++) acc[j][d] += p * vr[d];
        }
    }
    for (int j = 0; j < G; j++)
        for (int d = 0; d < DV; d++) {
            v16 x = acc[j][d] * inv[j];
            memcpy(out + b * sob + (g * G + j) * soh + 16 * d, &x, 64);
        }
}

#define CASE(DV) case DV: task(q, sqb, sqh, k, skh, sks, v, svh, svs, table, stb, start, out, sob, soh, \
                              Hkv, G, S, scale, t, &buf, &cap, DV); break;

/* Tasks (row, kv head) split statically between the threads. D must be 64, 128 or 256 (the caller checks). */
void lmq_attention(const float *q, long sqb, long sqh,
                   const float *k, long skh, long sks,
                   const float *v, long svh, long svs,
                   const int *table, long stb, const int *start, float *out, long sob, long soh,
                   int B, int Hq, int Hkv, long S, int D, float scale, int threads) {
    const int G = Hq / Hkv;
    #pragma omp parallel num_threads(threads)
    {
        float *buf = NULL;
        long cap = 0;
        #pragma omp for schedule(static)
        for (long t = 0; t < (long)B * Hkv; t++) {
            switch (D / 16) { CASE(4) CASE(8) CASE(16) }
        }
        free(buf);
    }
}
