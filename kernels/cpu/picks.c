/* The greedy pick of each row of a step's logits under its token mask, on a CPU (float32):
 *
 *   lmq_masked_argmax   out[r] = the first index of the largest logits[r, v] with masks[r][v] != 0 (no mask:
 *                       every v); 0 where the mask allows nothing
 *
 * torch's form, `torch.where(mask, logits, -inf).argmax(-1)` (lmq_backend/engine/picks.py), writes a [rows, V]
 * copy and reads it again, the where costing more than the argmax. Here a row is one pass over its logits and mask bytes. The pick is exact and the same as torch's: per
 * lane the first strictly larger value, then of the lanes holding the largest value the smallest index (the
 * first maximal logit overall); logits hold no NaN. A row's pick depends on that row alone.
 */
#include <omp.h>

#include "simd.h"

typedef unsigned char vbytes __attribute__((vector_size(LMQ_VL), aligned(1)));

#define ACC 4   /* independent (value, index) accumulators: the compare-and-select chains overlap */

/* Lanes where the mask bytes at m are not 0: -1, else 0 (widened in one instruction where the target has it:
 * GCC turns the generic conversion into a byte at a time). */
static inline vfi keep_of(const unsigned char *m) {
#if defined(__AVX512F__) && LMQ_VL == 16
    return (vfi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)m)) != 0;
#elif defined(__AVX2__) && LMQ_VL == 8
    return (vfi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m)) != 0;
#else
    return __builtin_convertvector(*(const vbytes *)m, vfi) != 0;
#endif
}

static long pick_row(const float *x, const unsigned char *m, long V) {
    const vf neg = (vf){0} - __builtin_inff();
    vf best[ACC];
    vfi at[ACC], lane;
    for (int a = 0; a < ACC; a++) best[a] = neg, at[a] = (vfi){0};
    for (int j = 0; j < LMQ_VL; j++) lane[j] = j;
    long v = 0;
    for (; v + ACC * LMQ_VL <= V; v += ACC * LMQ_VL)
        for (int a = 0; a < ACC; a++) {
            const long o = v + a * LMQ_VL;
            vf xv = *(const vf *)(x + o);
            if (m) {
                const vfi keep = keep_of(m + o);
                xv = (vf)(((vfi)xv & keep) | ((vfi)neg & ~keep));
            }
            const vfi gt = xv > best[a];
            best[a] = (vf)(((vfi)xv & gt) | ((vfi)best[a] & ~gt));
            at[a] = ((lane + (int)o) & gt) | (at[a] & ~gt);
        }
    /* the largest of every accumulator's lanes, at its smallest index (each lane holds the first maximal
     * value of the indices it saw) */
    float top = -__builtin_inff();
    long idx = 0;
    int found = 0;
    for (int a = 0; a < ACC; a++)
        for (int j = 0; j < LMQ_VL; j++)
            if (best[a][j] > top || (found && best[a][j] == top && at[a][j] < idx)) {
                top = best[a][j], idx = at[a][j], found = 1;
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
