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

/* x: tokens x heads rows of head_dim floats, the heads of a token contiguous,
 * tokens `token_stride` floats apart; cos, signed_sin: [tokens, head_dim]
 * (cos repeated, and [-sin, sin], over the two halves). */
void rope_f32(float *x, const float *cos, const float *signed_sin, int tokens, int heads, int head_dim,
              long token_stride, int threads) {
    const int half = head_dim / 2;
    #pragma omp parallel for if((long)tokens * heads * head_dim >= PARALLEL_VALUES) num_threads(threads)
    for (int t = 0; t < tokens; t++) {
        const float *c = cos + (size_t)t * head_dim, *s = signed_sin + (size_t)t * head_dim;
        for (int h = 0; h < heads; h++) {
            float *v = x + (size_t)t * token_stride + (size_t)h * head_dim;
            #pragma omp simd
            for (int i = 0; i < half; i++) {
                const float x1 = v[i], x2 = v[i + half];
                v[i] = x1 * c[i] + x2 * s[i];
                v[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}

/* The same over bfloat16 x, cos and signed_sin, each product and the sum rounded
 * to bfloat16 as PyTorch's bfloat16 ops round them. */
void rope_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *signed_sin, int tokens, int heads, int head_dim,
               long token_stride, int threads) {
    const int half = head_dim / 2;
    #pragma omp parallel for if((long)tokens * heads * head_dim >= PARALLEL_VALUES) num_threads(threads)
    for (int t = 0; t < tokens; t++) {
        const uint16_t *c = cos + (size_t)t * head_dim, *s = signed_sin + (size_t)t * head_dim;
        for (int h = 0; h < heads; h++) {
            uint16_t *v = x + (size_t)t * token_stride + (size_t)h * head_dim;
            #pragma omp simd
            for (int i = 0; i < half; i++) {
                const float x1 = bf16_to_float(v[i]), x2 = bf16_to_float(v[i + half]);
                v[i] = float_to_bf16(round_bf16(x1 * bf16_to_float(c[i])) + round_bf16(x2 * bf16_to_float(s[i])));
                v[i + half] = float_to_bf16(round_bf16(x2 * bf16_to_float(c[i + half]))
                                            + round_bf16(x1 * bf16_to_float(s[i + half])));
            }
        }
    }
}
