/* y = x @ W.T (+ bias) with W held as the codes of a GGUF quantisation grid.
 * Every group of 32 weights along a row is one of:
 *     Q4_1: w = d * q + m, q in 0..15 (two codes a byte), d and m float32
 *     Q8_0: w = d * q,     q in -127..127 (one int8 a weight), d float32
 * Activations stay float32: the weights are dequantised in registers, each
 * exactly as the loader dequantised it (Q4_1: d * q rounded, then + m
 * rounded; this file is built with -ffp-contract=off; Q8_0: d * q is exact),
 * so the result is the float32 matmul up to summation order. A decode step
 * reads a sixth (Q4_1) or a quarter (Q8_0) of the bytes the float32 weights
 * take, which is what bounds it on a CPU.
 *
 * Layout (models/grids.py writes it), for W [N, K], K a multiple of 32:
 *     Q4_1: codes [N, K / 2] uint8 (byte j of a group holds q[j] low, q[j + 16] high),
 *           scales [N, K / 32, 2] float32 (d, m)
 *     Q8_0: codes [N, K] int8, scales [N, K / 32] float32 (d)
 */
#include <stddef.h>
#include <stdint.h>

#include "vector.h"

#define GROUP 32
#define ROWS 8  /* rows of x per pass over a weight row: each group is dequantised once for them */

enum grid_format { Q4_1 = 0, Q8_0 = 1 };

/* Bytes of codes and floats of scales per group. */
static inline int code_bytes(int format) { return format == Q4_1 ? GROUP / 2 : GROUP; }
static inline int scale_floats(int format) { return format == Q4_1 ? 2 : 1; }

#if VECTOR_LANES
/* The 32 weights of one group, as four vectors of eight. */
static inline void dequantise(int format, const uint8_t *codes, const float *scale, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(scale[0]);
    if (format == Q8_0) {
        for (int i = 0; i < 4; i++) {
            const __m128i q8 = _mm_loadl_epi64((const __m128i *)(codes + 8 * i));
            w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
        }
        return;
    }
    const __m128i packed = _mm_loadu_si128((const __m128i *)codes);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(packed, mask);                      /* q[0..15] */
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  /* q[16..31] */
    const __m256 m = _mm256_set1_ps(scale[1]);
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int i = 0; i < 4; i++) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
        w[i] = _mm256_add_ps(_mm256_mul_ps(d, q), m);  /* two roundings, as the loader's */
    }
}

/* y[r][n] for rows r < rows (<= ROWS) of x against weight row n. Inlined with
 * `format` and `rows` constants (see rows_dot), so the accumulators stay in
 * registers: two a row for up to four rows (the four products of a group are
 * then not one dependent chain), one a row beyond (the rows are independent
 * chains, and sixteen registers would not hold two a row). */
static inline __attribute__((always_inline)) void dot_rows(int format, const float *x, size_t x_stride, int rows,
                                                           const uint8_t *codes, const float *scales, int k,
                                                           float *out) {
    const int two_chains = rows <= ROWS / 2;
    __m256 acc[ROWS], odd[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = odd[r] = _mm256_setzero_ps();
    for (int g = 0; g < k / GROUP; g++) {
        __m256 w[4];
        dequantise(format, codes + g * code_bytes(format), scales + g * scale_floats(format), w);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + r * x_stride + g * GROUP;
            __m256 *second = two_chains ? &odd[r] : &acc[r];
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w[0], acc[r]);
            *second = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w[1], *second);
            acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w[2], acc[r]);
            *second = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w[3], *second);
        }
    }
    for (int r = 0; r < rows; r++) out[r] = horizontal_sum(two_chains ? _mm256_add_ps(acc[r], odd[r]) : acc[r]);
}
#else
static inline float weight_at(int format, const uint8_t *codes, const float *scale, int j) {
    if (format == Q8_0) return scale[0] * (float)(int8_t)codes[j];
    const uint8_t byte = codes[j % (GROUP / 2)];
    return scale[0] * (float)(j < GROUP / 2 ? byte & 0x0F : byte >> 4) + scale[1];
}

static inline __attribute__((always_inline)) void dot_rows(int format, const float *x, size_t x_stride, int rows,
                                                           const uint8_t *codes, const float *scales, int k,
                                                           float *out) {
    for (int r = 0; r < rows; r++) {
        float sum = 0.0f;
        for (int g = 0; g < k / GROUP; g++)
            for (int j = 0; j < GROUP; j++)
                sum += x[r * x_stride + g * GROUP + j] *
                       weight_at(format, codes + g * code_bytes(format), scales + g * scale_floats(format), j);
        out[r] = sum;
    }
}
#endif

#define ROWS_DOT(format)                                                                   \
    switch (rows) {                                                                        \
        case 1: dot_rows(format, x, x_stride, 1, codes, scales, k, out); break;            \
        case 2: dot_rows(format, x, x_stride, 2, codes, scales, k, out); break;            \
        case 3: dot_rows(format, x, x_stride, 3, codes, scales, k, out); break;            \
        case 4: dot_rows(format, x, x_stride, 4, codes, scales, k, out); break;            \
        case 5: dot_rows(format, x, x_stride, 5, codes, scales, k, out); break;            \
        case 6: dot_rows(format, x, x_stride, 6, codes, scales, k, out); break;            \
        case 7: dot_rows(format, x, x_stride, 7, codes, scales, k, out); break;            \
        default: dot_rows(format, x, x_stride, ROWS, codes, scales, k, out); break;        \
    }

static void rows_dot(int format, const float *x, size_t x_stride, int rows, const uint8_t *codes,
                     const float *scales, int k, float *out) {
    if (format == Q8_0) {
        ROWS_DOT(Q8_0)
    } else {
        ROWS_DOT(Q4_1)
    }
}

/* x [m, k] float32 (rows contiguous), y [m, n] float32, bias [n] or NULL.
 * Returns 0, or -1 when k is not a multiple of 32 or the format is unknown. */
int grid_linear_f32(int format, const float *x, const uint8_t *codes, const float *scales, const float *bias,
                    float *y, int m, int n, int k, int threads) {
    if (k % GROUP != 0 || (format != Q4_1 && format != Q8_0)) return -1;
    const size_t code_row = (size_t)k / GROUP * code_bytes(format);
    const size_t scale_row = (size_t)k / GROUP * scale_floats(format);
    /* Output features split over the threads in chunks that keep a thread on
     * consecutive weight rows (the memory it streams), handed out as threads
     * come free: a thread the OS preempts (a co-located prefill and decode
     * share the cores) delays its chunk, not the whole split. */
    #pragma omp parallel for schedule(dynamic, 32) num_threads(threads)
    for (int j = 0; j < n; j++) {
        float out[ROWS];
        for (int r0 = 0; r0 < m; r0 += ROWS) {
            const int rows = m - r0 < ROWS ? m - r0 : ROWS;
            rows_dot(format, x + (size_t)r0 * k, (size_t)k, rows, codes + j * code_row, scales + j * scale_row, k,
                     out);
            for (int r = 0; r < rows; r++) y[(size_t)(r0 + r) * n + j] = out[r] + (bias ? bias[j] : 0.0f);
        }
    }
    return 0;
}
