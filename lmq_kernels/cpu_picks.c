/* The greedy pick of each row of a step's logits under its token mask, on a CPU (float32):
 *
 *   lmq_masked_argmax   out[r] = the first index of the largest logits[r, v] with masks[r][v] != 0 (no mask:
 *                       every v); 0 where the mask allows nothing
 *
 * torch's form, `torch.where(mask, logits, -inf).argmax(-1)` (lmq_backend/engine/picks.py), writes a [rows, V]
 * copy and reads it again; on two Zen 5 cores its where alone took ~90 us a row of 49,152 tokens, the argmax
 * ~14. Here a row is one pass over its logits and mask bytes. The pick is exact and the same as torch's: per
 * lane the first strictly larger value, then of the lanes holding the largest value the smallest index (the
 * first maximal logit overall); logits hold no NaN. A row's pick depends on that row alone.
 */
#include <omp.h>

#include "cpu_simd.h"

typedef unsigned char vbytes __attribute__((vector_size(LMQ_VL)));

static long pick_row(const float *x, const unsigned char *m, long V) {
    const vf neg = (vf){0} - __builtin_inff();
    vf best = neg;
    vfi at = (vfi){0}, lane;
    for (int j = 0; j < LMQ_VL; j++) lane[j] = j;
    long v = 0;
    for (; v + LMQ_VL <= V; v += LMQ_VL) {
        vf xv;
        __builtin_memcpy(&xv, x + v, sizeof(xv));
        if (m) {
            vbytes mb;
            __builtin_memcpy(&mb, m + v, sizeof(mb));
            const vfi keep = __builtin_convertvector(mb, vfi) != 0;
            xv = (vf)(((vfi)xv & keep) | ((vfi)neg & ~keep));
        }
        const vfi gt = xv > best;
        best = (vf)(((vfi)xv & gt) | ((vfi)best & ~gt));
        at = ((lane + (int)v) & gt) | (at & ~gt);
    }
    float top = -__builtin_inff();
    long idx = 0;
    int found = 0;
    for (int j = 0; j < LMQ_VL; j++)   /* the largest of the lanes, at its smallest index */
        if (best[j] > top || (found && best[j] == top && at[j] < idx)) {
            top = best[j], idx = at[j], found = 1;
        }
    for (; v < V; v++)                  /* the tail: later indices, so only a strictly larger value wins */
        if ((!m || m[v]) && x[v] > top) top = x[v], idx = v;
    return idx;
}

/* Rows on `threads` threads. logits: rows of V floats, ldl apart; row r under the V mask bytes at masks[r]
 * (masks NULL, or masks[r] NULL: every token). */
void lmq_masked_argmax(const float *logits, long ldl, const unsigned char *const *masks, int rows, long V,
                       long long *out, int threads) {
    #pragma omp parallel for num_threads(threads > rows ? rows : threads) schedule(static) if (threads > 1 && rows > 1)
    for (int r = 0; r < rows; r++)
        out[r] = pick_row(logits + r * ldl, masks ? masks[r] : 0, V);
}
