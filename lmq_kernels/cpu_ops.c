/* The small ops of the fused step on a CPU (float32), the C counterparts of its Triton kernels:
 *
 *   lmq_rmsnorm      y = w * (x * rsqrt(mean(x^2) + eps))                        rows of x
 *   lmq_silu_mul     out = silu(gate) * up, gu = [gate | up]                       rows of gu
 *   lmq_rope_append  q = rope(qnorm(q)); k = rope(knorm(k)) and v into the store  tokens of qkv
 *
 * Why: in torch each is 3-15 small ops of a few microseconds' dispatch each; a decode step of SmolLM2-135M
 * makes 121 of these calls (~3.8 ms of a ~31 ms step at one row); here each is one call of a microsecond or
 * two. Each row (token) is computed alone, in a fixed order: the same bits in any batch.
 *
 * rope_append follows the Triton kernel's contract (fused_decode._rope_append_kernel): token r of the
 * [N = rows x T, (Hq + 2 Hkv) D] projection is new token t = r % T of row b = r // T; its K/V go to the store
 * slot of column end - (T - 1) + t of row b's page table (table[b * stb + col]; the store's K and V are
 * [slots, Hkv, D] a layer), unless its position is negative (a prefill's left padding) or b >= nrows.
 * RoPE's cos/sin come in per token ([N, D/2], rotate-half convention).
 *
 * Built with cpu_gemm.c and cpu_attention.c into one library (see cpu.py).
 */
#include <math.h>
#include <string.h>
#include <omp.h>

#include "cpu_simd.h"

static inline float rstd_of(const float *x, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / n + eps);
}

void lmq_rmsnorm(const float *x, long ldx, const float *w, float *y, long ldy, int M, int N, float eps) {
    for (int m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        float *yr = y + m * ldy;
        const float r = rstd_of(xr, N, eps);
        for (int i = 0; i < N; i++) yr[i] = w[i] * (xr[i] * r);
    }
}

/* silu(g) u = g sigmoid(g) u, sigmoid from e = exp(-|g|) (vexp's domain): 1 / (1 + e) or e / (1 + e). */
static inline v16 silu_mul16(v16 g, v16 u) {
    const v16 e = vexp(vselect(g > 0, -g, g)), one = (v16){0} + 1.0f;
    return g * (vselect(g > 0, one, e) / (one + e)) * u;
}

void lmq_silu_mul(const float *gu, long ldgu, float *out, long ldo, int M, int I) {
    for (int m = 0; m < M; m++) {
        const float *g = gu + m * ldgu, *u = g + I;
        float *o = out + m * ldo;
        int i = 0;
        for (; i + 16 <= I; i += 16) {
            v16 gv, uv;
            memcpy(&gv, g + i, 64);
            memcpy(&uv, u + i, 64);
            gv = silu_mul16(gv, uv);
            memcpy(o + i, &gv, 64);
        }
        if (i < I) {   /* the tail through the same vector arithmetic */
            v16 gv = (v16){0}, uv = (v16){0};
            memcpy(&gv, g + i, (I - i) * sizeof(float));
            memcpy(&uv, u + i, (I - i) * sizeof(float));
            gv = silu_mul16(gv, uv);
            memcpy(o + i, &gv, (I - i) * sizeof(float));
        }
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

void lmq_rope_append(const float *qkv, long ldqkv, const float *cos_, const float *sin_, const int *pos,
                     const float *qn, const float *kn, float eps,
                     float *q, long sqr, long sqh,
                     float *kc, long sks, long skh, float *vc, long svs, long svh,
                     const int *table, long stb,
                     long N, int T, long end, int nrows, int Hq, int Hkv, int D, int threads) {
    const int H = D / 2;
    #pragma omp parallel for num_threads(threads) schedule(static) if (N > 64)
    for (long r = 0; r < N; r++) {
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
