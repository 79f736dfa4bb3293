/* What the bf16 panel kernels (panel_linear_bf16.c by AMX, panel_linear_bf16_vec.c by
 * VDPBF16PS vectors) share: a panel's bias and the rounding of its rows' sums. */
#ifndef DISAGG_BF16_PANELS_H
#define DISAGG_BF16_PANELS_H

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <stdint.h>

#define BF16_BLOCK 32 /* output columns per block: two 16-lane vectors of float32 sums */

/* A block's bias as two float32 vectors: -0.0 past it or without one, which adds nothing. */
struct panel_bias {
    __m512 left, right;
};

static inline struct panel_bias load_bias(const uint16_t *bias, __mmask32 mask) {
    const __m512 none = _mm512_set1_ps(-0.0f);
    if (bias == NULL) return (struct panel_bias){none, none};
    const __m512i wide = _mm512_maskz_loadu_epi16(mask, bias);
    const __m512 left = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(wide)), 16));
    const __m512 right =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(wide, 1)), 16));
    return (struct panel_bias){_mm512_mask_blend_ps((__mmask16)mask, none, left),
                               _mm512_mask_blend_ps((__mmask16)(mask >> 16), none, right)};
}

/* The mask of a block's first `cols` columns (all 32 from 32 on). */
static inline __mmask32 block_mask(int cols) {
    return (__mmask32)(cols >= BF16_BLOCK ? ~0u : (1u << cols) - 1u);
}

/* A row's 32 sums plus the bias -> y under the block's column mask, rounded to bfloat16 (ties to even, as torch). */
static inline void store_row(__m512 left, __m512 right, struct panel_bias bias, uint16_t *y, __mmask32 mask) {
    const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_add_ps(right, bias.right), _mm512_add_ps(left, bias.left));
    _mm512_mask_storeu_epi16(y, mask, (__m512i)both);
}
#endif

#endif
