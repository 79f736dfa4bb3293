/* y = x @ W.T (+ bias) with W held as 4-bit codes: every group of 32 weights
 * along a row is w = d * q + m (q in 0..15, d and m float32), the Q4_1 grid of
 * GGUF files. Activations stay float32: the weights are dequantised in
 * registers, each exactly as the loader dequantised it (d * q rounded, then
 * + m rounded: this file is built with -ffp-contract=off), so the result is
 * the float32 matmul up to summation order. A decode step reads a sixth of
 * the bytes the float32 weights take, which is what bounds it on a CPU.
 *
 * Layout (engine/quantized.py writes it), for W [N, K], K a multiple of 32:
 *     codes [N, K / 2] uint8: byte j of a group holds q[j] (low nibble) and q[j + 16] (high)
 *     scales [N, K / 32, 2] float32: (d, m) of each group
 */
#include <stddef.h>
#include <stdint.h>

#include "vector.h"

#define GROUP 32
#define ROWS 4  /* rows of x per pass over a weight row: each group is dequantised once for them */

#if VECTOR_LANES
/* The 32 weights of one group, as four vectors of eight. */
static inline void dequantise(const uint8_t *codes, const float *dm, __m256 w[4]) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)codes);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(packed, mask);                      /* q[0..15] */
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  /* q[16..31] */
    const __m256 d = _mm256_set1_ps(dm[0]), m = _mm256_set1_ps(dm[1]);
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int i = 0; i < 4; i++) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
        w[i] = _mm256_add_ps(_mm256_mul_ps(d, q), m);  /* two roundings, as the loader's */
    }
}

/* y[r][n] for rows r < rows (<= ROWS) of x against weight row n. Inlined with
 * `rows` a constant (see rows_dot), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dot_rows(const float *x, size_t x_stride, int rows, const uint8_t *codes, const float *dm,
                            int k, float *out) {
    __m256 acc[ROWS][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int g = 0; g < k / GROUP; g++) {
        __m256 w[4];
        dequantise(codes + g * (GROUP / 2), dm + 2 * g, w);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + r * x_stride + g * GROUP;
            /* two accumulators a row: the four products of a group are not one dependent chain */
            acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w[0], acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w[1], acc[r][1]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w[2], acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w[3], acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = horizontal_sum(_mm256_add_ps(acc[r][0], acc[r][1]));
}
#else
static inline __attribute__((always_inline)) void dot_rows(const float *x, size_t x_stride, int rows, const uint8_t *codes, const float *dm,
                            int k, float *out) {
    for (int r = 0; r < rows; r++) {
        float sum = 0.0f;
        for (int g = 0; g < k / GROUP; g++)
            for (int j = 0; j < GROUP; j++) {
                const uint8_t byte = codes[g * (GROUP / 2) + j % (GROUP / 2)];
                const float q = (float)(j < GROUP / 2 ? byte & 0x0F : byte >> 4);
                const float w = dm[2 * g] * q + dm[2 * g + 1];
                sum += x[r * x_stride + g * GROUP + j] * w;
            }
        out[r] = sum;
    }
}
#endif

static void rows_dot(const float *x, size_t x_stride, int rows, const uint8_t *codes, const float *dm, int k,
                     float *out) {
    switch (rows) {
        case 1: dot_rows(x, x_stride, 1, codes, dm, k, out); break;
        case 2: dot_rows(x, x_stride, 2, codes, dm, k, out); break;
        case 3: dot_rows(x, x_stride, 3, codes, dm, k, out); break;
        default: dot_rows(x, x_stride, ROWS, codes, dm, k, out); break;
    }
}

/* x [m, k] float32 (rows contiguous), y [m, n] float32, bias [n] or NULL.
 * Returns 0, or -1 when k is not a multiple of 32. */
int q4_linear_f32(const float *x, const uint8_t *codes, const float *scales, const float *bias, float *y,
                  int m, int n, int k, int threads) {
    if (k % GROUP != 0) return -1;
    const size_t code_row = (size_t)k / 2, scale_row = (size_t)k / GROUP * 2;
    /* Output features split over the threads, in chunks that keep a thread on
     * consecutive weight rows (the memory it streams). */
    #pragma omp parallel for schedule(static, 16) num_threads(threads)
    for (int j = 0; j < n; j++) {
        float out[ROWS];
        for (int r0 = 0; r0 < m; r0 += ROWS) {
            const int rows = m - r0 < ROWS ? m - r0 : ROWS;
            rows_dot(x + (size_t)r0 * k, (size_t)k, rows, codes + j * code_row, scales + j * scale_row, k, out);
            for (int r = 0; r < rows; r++) y[(size_t)(r0 + r) * n + j] = out[r] + (bias ? bias[j] : 0.0f);
        }
    }
    return 0;
}
