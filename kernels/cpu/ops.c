/* The small ops of the fused step on a CPU (float32), the C counterparts of its Triton kernels:
 *
 *   lmq_rmsnorm      y = w * (x * rsqrt(mean(x^2) + eps))                        rows of x
 *   lmq_silu_mul     out = silu(gate) * up, gu = [gate | up]                       rows of gu
 *   lmq_rope_append  q = rope(qnorm(q)); k = rope(knorm(k)) and v into the store  tokens of qkv
 *
 * Why: in torch each is several small ops that cost more in dispatch than in arithmetic, and a decode step
 * makes several of them a layer; here each is one short call. Each row (token) is computed alone, in a fixed
 * order: the same bits in any batch.
 *
 * rope_append follows the Triton kernel's contract (lmq_kernels.triton.ops._rope_append_kernel): token r of
 * the [N = rows x T, (Hq + 2 Hkv) D] projection is new token t = r % T of row b = r // T; its K/V go to the store
 * slot of column end - (T - 1) + t of row b's page table (table[b * stb + col]; the store's K and V are
 * [slots, Hkv, D] a layer), unless its position is negative (a prefill's left padding) or b >= nrows.
 * RoPE's cos/sin come in per token ([N, D/2], rotate-half convention).
 *
 * Built with gemm.c and attention.c into one library (see __init__.py).
 */
#include <math.h>
#include <string.h>
#include <omp.h>

#include "simd.h"

#define PARALLEL_FROM 16384   /* elements from which a per-op call splits its rows or columns over threads */

/* 1 / sqrt(mean(x^2) + eps): the squares summed in a fixed order whatever the target (lane i of 16 takes
 * elements i, i + 16, ... in one FMA chain; then hsum's order; then the tail, one at a time). */
static inline float rstd_of(const float *x, int n, float eps) {
    vf acc[LMQ_PARTS];
    for (int p = 0; p < LMQ_PARTS; p++) acc[p] = (vf){0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int p = 0; p < LMQ_PARTS; p++) {
            const vf v = *(const vf *)(x + i + p * LMQ_VL);
            acc[p] = fma_vf(v, v, acc[p]);
        }
    v16 all;
    __builtin_memcpy(&all, acc, sizeof(all));
    float ss = hsum(all);
    for (; i < n; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / n + eps);
}

static void rmsnorm_rows(const float *x, long ldx, const float *w, float *y, long ldy, int m0, int m1, int N,
                         float eps) {
    for (int m = m0; m < m1; m++) {
        const float *xr = x + m * ldx;
        float *yr = y + m * ldy;
        const float r = rstd_of(xr, N, eps);
        for (int i = 0; i < N; i++) yr[i] = w[i] * (xr[i] * r);
    }
}

/* Rows of x on `threads` threads (1: the caller's thread alone, as inside a fused step's parallel region). */
void lmq_rmsnorm(const float *x, long ldx, const float *w, float *y, long ldy, int M, int N, float eps,
                 int threads) {
    if (threads > 1 && (long)M * N >= PARALLEL_FROM) {
        #pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            rmsnorm_rows(x, ldx, w, y, ldy, (long)M * t / nt, (long)M * (t + 1) / nt, N, eps);
        }
    } else {
        rmsnorm_rows(x, ldx, w, y, ldy, 0, M, N, eps);
    }
}

/* silu(g) u = g sigmoid(g) u, sigmoid from e = exp(-|g|) (vexp's domain): 1 / (1 + e) or e / (1 + e); on the
 * target's own vectors, part by part (a 16-lane comparison is 16 scalar ones on AVX2: simd.h), the same
 * operations on every lane. */
static inline vf silu_mul_vf(vf g, vf u) {
    const vfi pos = g > 0;
    const vf one = (vf){0} + 1.0f, e = vexp_vf((vf)(((vfi)-g & pos) | ((vfi)g & ~pos)));
    return g * ((vf)(((vfi)one & pos) | ((vfi)e & ~pos)) / (one + e)) * u;
}

static inline v16 silu_mul16(v16 g, v16 u) {
    vf gp[LMQ_PARTS], up[LMQ_PARTS];
    __builtin_memcpy(gp, &g, sizeof(g));
    __builtin_memcpy(up, &u, sizeof(u));
    for (int p = 0; p < LMQ_PARTS; p++) gp[p] = silu_mul_vf(gp[p], up[p]);
    __builtin_memcpy(&g, gp, sizeof(g));
    return g;
}

/* Columns [i0, i1) of out = silu(gate) * up, gate and up row m at g + m * ldg, u + m * ldu: lane by lane,
 * so any split of the columns gives the same bits. */
static void silu_mul_cols(const float *g, const float *u, long ldg, float *out, long ldo, int M, int i0, int i1) {
    for (int m = 0; m < M; m++) {
        const float *gr = g + m * ldg, *ur = u + m * ldg;
        float *o = out + m * ldo;
        int i = i0;
        for (; i + 16 <= i1; i += 16) {
            v16 gv, uv;
            memcpy(&gv, gr + i, 64);
            memcpy(&uv, ur + i, 64);
            gv = silu_mul16(gv, uv);
            memcpy(o + i, &gv, 64);
        }
        if (i < i1) {   /* the tail through the same vector arithmetic */
            v16 gv = (v16){0}, uv = (v16){0};
            memcpy(&gv, gr + i, (i1 - i) * sizeof(float));
            memcpy(&uv, ur + i, (i1 - i) * sizeof(float));
            gv = silu_mul16(gv, uv);
            memcpy(o + i, &gv, (i1 - i) * sizeof(float));
        }
    }
}

/* Thread t of nt's share of out = silu(gate) * up: a range of columns in whole 16-lane blocks. */
void lmq_silu_mul_share(const float *gu, long ldgu, float *out, long ldo, int M, int I, int t, int nt) {
    const int blocks = (I + 15) / 16, b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
    const int i0 = b0 * 16, i1 = b1 * 16 < I ? b1 * 16 : I;
    if (i0 < i1) silu_mul_cols(gu, gu + I, ldgu, out, ldo, M, i0, i1);
}

void lmq_silu_mul(const float *gu, long ldgu, float *out, long ldo, int M, int I, int threads) {
    if (threads > 1 && (long)M * I >= PARALLEL_FROM) {
        #pragma omp parallel num_threads(threads)
        lmq_silu_mul_share(gu, ldgu, out, ldo, M, I, omp_get_thread_num(), omp_get_num_threads());
    } else {
        silu_mul_cols(gu, gu + I, ldgu, out, ldo, M, 0, I);
    }
}

/* One head of one token: optional RMSNorm (weight nw), then rotate-half RoPE into dst. */
static inline void rope_head(const float *src, const float *nw, float eps, const float *c, const float *s,
                             float *dst, int D) {
    const int H = D / 2;
    float x[D];
    memcpy(x, src, D * sizeof(float));
    if (nw) {
        const float r = rstd_of(x, D, eps);
        for (int i = 0; i < D; i++) x[i] = nw[i] * (x[i] * r);
    }
    for (int i = 0; i < H; i++) {
        dst[i] = x[i] * c[i] - x[i + H] * s[i];
        dst[i + H] = x[i + H] * c[i] + x[i] * s[i];
    }
}

/* Tokens [r0, r1) of lmq_rope_append (each token's work depends on that token alone). */
void lmq_rope_append_rows(const float *qkv, long ldqkv, const float *cos_, const float *sin_, const int *pos,
                          const float *qn, const float *kn, float eps,
                          float *q, long sqr, long sqh,
                          float *kc, long sks, long skh, float *vc, long svs, long svh,
                          const int *table, long stb,
                          long r0, long r1, int T, long end, int nrows, int Hq, int Hkv, int D) {
    const int H = D / 2;
    for (long r = r0; r < r1; r++) {
        const long b = r / T, col = end - (T - 1) + r % T;
        const int write = b < nrows && pos[r] >= 0;
        const float *x = qkv + r * ldqkv, *c = cos_ + r * H, *s = sin_ + r * H;
        for (int h = 0; h < Hq; h++) rope_head(x + h * D, qn, eps, c, s, q + r * sqr + h * sqh, D);
        if (!write) continue;
        const long slot = table[b * stb + col];
        for (int h = 0; h < Hkv; h++) {
            rope_head(x + (Hq + h) * D, kn, eps, c, s, kc + slot * sks + h * skh, D);
            memcpy(vc + slot * svs + h * svh, x + (Hq + Hkv + h) * D, D * sizeof(float));
        }
    }
}

void lmq_rope_append(const float *qkv, long ldqkv, const float *cos_, const float *sin_, const int *pos,
                     const float *qn, const float *kn, float eps,
                     float *q, long sqr, long sqh,
                     float *kc, long sks, long skh, float *vc, long svs, long svh,
                     const int *table, long stb,
                     long N, int T, long end, int nrows, int Hq, int Hkv, int D, int threads) {
    #pragma omp parallel num_threads(threads) if (N > 64)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        lmq_rope_append_rows(qkv, ldqkv, cos_, sin_, pos, qn, kn, eps, q, sqr, sqh, kc, sks, skh, vc, svs, svh,
                             table, stb, N * t / nt, N * (t + 1) / nt, T, end, nrows, Hq, Hkv, D);
    }
}
