/* Rotate-half RoPE in place: each head's pair (i, i + half) turns by its
 * token's angle, x -> x * cos + [x2, x1] * [-sin, sin] (models/layers.py's
 * apply_rope). One pass over q and k where PyTorch makes four (the swapped
 * copy, two products, their sum); each product and the sum are rounded as
 * PyTorch rounds them (this file is built with -ffp-contract=off), so the
 * result is the same to the bit.
 */
#include <stddef.h>

#include "vector.h"

#define PARALLEL_VALUES 16384  /* fewer are not worth waking threads for */

/* x: tokens x heads rows of head_dim values, the heads of a token contiguous,
 * tokens `token_stride` values apart; cos, signed_sin: [tokens, head_dim]
 * (cos repeated, and [-sin, sin], over the two halves). In bfloat16, each
 * product and the sum rounded to bfloat16 as PyTorch's bfloat16 ops round them. */
#define DEFINE_ROPE(SUFFIX, ELEM, LOAD, ROUND, STORE)                                                 \
void rope_##SUFFIX(ELEM *x, const ELEM *cos, const ELEM *signed_sin, int tokens, int heads, int head_dim, \
                   long token_stride, int threads) {                                                 \
    const int half = head_dim / 2;                                                                   \
    _Pragma("omp parallel for if((long)tokens * heads * head_dim >= PARALLEL_VALUES) num_threads(threads)") \
    for (int t = 0; t < tokens; t++) {                                                               \
        const ELEM *c = cos + (size_t)t * head_dim, *s = signed_sin + (size_t)t * head_dim;         \
        for (int h = 0; h < heads; h++) {                                                            \
            ELEM *v = x + (size_t)t * token_stride + (size_t)h * head_dim;                          \
            _Pragma("omp simd")                                                                      \
            for (int i = 0; i < half; i++) {                                                         \
                const float x1 = LOAD(v[i]), x2 = LOAD(v[i + half]);                                 \
                v[i] = STORE(ROUND(x1 * LOAD(c[i])) + ROUND(x2 * LOAD(s[i])));                       \
                v[i + half] = STORE(ROUND(x2 * LOAD(c[i + half])) + ROUND(x1 * LOAD(s[i + half])));  \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
}

DEFINE_ROPE(f32, float, as_is, as_is, as_is)
DEFINE_ROPE(bf16, uint16_t, bf16_to_float, round_bf16, float_to_bf16)
