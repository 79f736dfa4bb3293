/* y = x @ W.T (+ bias) in float32, W packed once into panels of PANEL output
 * columns: panels[p][k][c] = W[p * PANEL + c][k], zero past N (models/panels.py
 * packs it). A tile of up to TILE_ROWS rows of x runs down one panel: per k,
 * two vector loads of the panel and a broadcast of each row's x[k] feed
 * 2 * TILE_ROWS independent FMA chains held in registers (12 of AVX2's 16), so
 * the kernel is bound by the FMA units, not by their latency or by loads.
 * Each output is one chain over k in order, rounded once at the end.
 *
 * Threads split the panels; rows go in blocks of BLOCK_ROWS, so that a block
 * of x stays in cache while every panel passes over it.
 */
#include <stddef.h>
#include <string.h>

#include "vector.h"

#define PANEL 16      /* output columns per panel: two AVX2 vectors */
#define TILE_ROWS 6   /* rows of x per tile: 12 accumulators, 2 panel loads, 1 broadcast */
#define BLOCK_ROWS 192

/* y[r][0..cols) for r < rows (<= TILE_ROWS) of the tile at x (rows k floats apart), y rows n apart. */
static inline __attribute__((always_inline)) void tile(int rows, const float *restrict x, int k,
                                                       const float *restrict panel, const float *restrict bias,
                                                       float *restrict y, int n, int cols) {
    float out[TILE_ROWS][PANEL];
#if VECTOR_LANES
    __m256 acc[TILE_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int i = 0; i < k; i++) {
        const __m256 w0 = _mm256_loadu_ps(panel + (size_t)i * PANEL);
        const __m256 w1 = _mm256_loadu_ps(panel + (size_t)i * PANEL + 8);
        for (int r = 0; r < rows; r++) {
            const __m256 a = _mm256_broadcast_ss(x + (size_t)r * k + i);
            acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(out[r], acc[r][0]);
        _mm256_storeu_ps(out[r] + 8, acc[r][1]);
    }
#else
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < PANEL; c++) {
            float sum = 0.0f;
            for (int i = 0; i < k; i++) sum += x[(size_t)r * k + i] * panel[(size_t)i * PANEL + c];
            out[r][c] = sum;
        }
#endif
    for (int r = 0; r < rows; r++) {
        if (bias != NULL)
            for (int c = 0; c < cols; c++) out[r][c] += bias[c];
        memcpy(y + (size_t)r * n, out[r], sizeof(float) * (size_t)cols);
    }
}

/* The tiles of rows [first, last) against one panel; `rows` a constant in each
 * call of tile, so that its accumulators stay in registers. */
static void panel_rows(const float *x, int first, int last, int k, const float *panel, const float *bias,
                       float *y, int n, int cols) {
    int m = first;
    for (; m + TILE_ROWS <= last; m += TILE_ROWS)
        tile(TILE_ROWS, x + (size_t)m * k, k, panel, bias, y + (size_t)m * n, n, cols);
    const float *xm = x + (size_t)m * k;
    float *ym = y + (size_t)m * n;
    switch (last - m) {
        case 5: tile(5, xm, k, panel, bias, ym, n, cols); break;
        case 4: tile(4, xm, k, panel, bias, ym, n, cols); break;
        case 3: tile(3, xm, k, panel, bias, ym, n, cols); break;
        case 2: tile(2, xm, k, panel, bias, ym, n, cols); break;
        case 1: tile(1, xm, k, panel, bias, ym, n, cols); break;
        default: break;
    }
}

/* x [rows, k], panels [ceil(n / PANEL), k, PANEL], bias [n] or NULL, y [rows, n]. */
void panel_linear_f32(const float *x, const float *panels, const float *bias, float *y, int rows, int n, int k,
                      int threads) {
    const int num_panels = (n + PANEL - 1) / PANEL;
    for (int first = 0; first < rows; first += BLOCK_ROWS) {
        const int last = rows - first < BLOCK_ROWS ? rows : first + BLOCK_ROWS;
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int p = 0; p < num_panels; p++) {
            const int col = p * PANEL;
            const int cols = n - col < PANEL ? n - col : PANEL;
            panel_rows(x, first, last, k, panels + (size_t)p * k * PANEL, bias == NULL ? NULL : bias + col,
                       y + col, n, cols);
        }
    }
}
