/* y = x @ W.T (+ bias) in bfloat16 with float32 sums by AVX-512 BF16 vectors
 * (VDPBF16PS), for CPUs without AMX, from W in panels of `panel_cols` (32 or
 * 64) output columns in VNNI pairs of k:
 *
 *     panels[p][k / 2][c][k % 2] = W[p * panel_cols + c][k], zero past N,
 *
 * which is the layout of oneDNN's packed bf16 weights on such CPUs (64
 * columns on a Zen 4; models/panels.py checks that per weight and reads
 * oneDNN's copy). One k-pair of a 32-column block is a 64-byte vector, and
 * one row's pair of x broadcast against it adds 16 columns' two products.
 *
 * Small steps are bound by streaming the weights. oneDNN's linear streamed
 * them at 11 to 20 GB/s from 1 to 16 rows on a 2-core Zen 4 whose memory
 * gives 24 GB/s to a plain read of the same bytes; reading each panel's rows
 * whole, in memory order, this kernel runs at 16 to 26 GB/s there (1.27x to
 * 1.76x), and at 1.0x to 1.2x from 24 to 2048 rows, where both become bound
 * by the vectors' arithmetic (benchmarks/bench_linear.py, docs/benchmarks-engine.md).
 * A pass over half a panel (every other 128 bytes of its rows) streamed at
 * 16 GB/s.
 *
 * Threads split a weight's 32-column blocks evenly; a thread takes a panel's
 * two blocks in one pass (4 vectors wide, up to 6 rows at a time) when both
 * are its own, else one block (2 vectors wide, up to 12 rows), so that 24 sums
 * stay in registers either way. A second pass of rows over a panel finds it
 * in L2.
 */
#include <stddef.h>
#include <stdint.h>

#include "bf16_panels.h"

#if defined(__AVX512BF16__)
#include <omp.h>

#define SUMS 24 /* float32 sum vectors of a pass: rows x vectors */

/* 1 when this build can run panel_linear_bf16_vec (its CPU has AVX-512 BF16). */
int panel_linear_bf16_vec_available(void) { return 1; }

/* `rows` rows of x (k apart) against `vectors` 16-column vectors of a panel's rows (`w`, `stride`
 * values apart) -> y (n apart); the first `cols` columns are kept. Inlined with constant `rows`
 * and `vectors`, so that the sums stay in registers. */
static inline __attribute__((always_inline)) void pass(const int rows, const int vectors, const uint16_t *x, int k,
                                                       const uint16_t *w, size_t stride, const uint16_t *bias,
                                                       uint16_t *y, int n, int cols) {
    __m512 sums[SUMS];
    #pragma GCC unroll 24
    for (int s = 0; s < rows * vectors; s++) sums[s] = _mm512_setzero_ps();
    for (int j = 0; j < k / 2; j++) {
        __m512bh pairs[4];
        #pragma GCC unroll 4
        for (int v = 0; v < vectors; v++) pairs[v] = (__m512bh)_mm512_loadu_si512(w + (size_t)j * stride + v * 32);
        #pragma GCC unroll 12
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            __builtin_memcpy(&pair, x + (size_t)r * k + 2 * j, sizeof pair);
            const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
            #pragma GCC unroll 4
            for (int v = 0; v < vectors; v++) sums[r * vectors + v] = _mm512_dpbf16_ps(sums[r * vectors + v], xr, pairs[v]);
        }
    }
    #pragma GCC unroll 2
    for (int b = 0; b < vectors / 2; b++) {
        if (b * BF16_BLOCK >= cols) continue;
        const __mmask32 mask = block_mask(cols - b * BF16_BLOCK);
        const struct panel_bias block_bias = load_bias(bias == NULL ? NULL : bias + b * BF16_BLOCK, mask);
        #pragma GCC unroll 12
        for (int r = 0; r < rows; r++)
            store_row(sums[r * vectors + 2 * b], sums[r * vectors + 2 * b + 1], block_bias,
                      y + (size_t)r * n + b * BF16_BLOCK, mask);
    }
}

#define PASS(R, V) case R: pass(R, V, x, k, w, stride, bias, y, n, cols); break;

/* Every row of x against one block (`vectors` 2) or a panel's two (4), in passes of SUMS / vectors rows. */
static void blocks(int vectors, const uint16_t *x, int rows, int k, const uint16_t *w, size_t stride,
                   const uint16_t *bias, uint16_t *y, int n, int cols) {
    const int pass_rows = SUMS / vectors;
    for (int m = 0; m < rows; m += pass_rows, x += (size_t)pass_rows * k, y += (size_t)pass_rows * n) {
        const int left = rows - m < pass_rows ? rows - m : pass_rows;
        if (vectors == 4) {
            switch (left) { PASS(1, 4) PASS(2, 4) PASS(3, 4) PASS(4, 4) PASS(5, 4) PASS(6, 4) }
        } else {
            switch (left) {
                PASS(1, 2) PASS(2, 2) PASS(3, 2) PASS(4, 2) PASS(5, 2) PASS(6, 2)
                PASS(7, 2) PASS(8, 2) PASS(9, 2) PASS(10, 2) PASS(11, 2) PASS(12, 2)
            }
        }
    }
}

/* x [rows, k] bf16, panels [ceil(n / panel_cols), k / 2, panel_cols, 2], bias [n] or NULL,
 * y [rows, n] bf16; k even. 0, or -2 for a panel width other than 32 or 64, or odd k. */
int panel_linear_bf16_vec(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int rows,
                          int n, int k, int panel_cols, int threads) {
    if (k % 2 || (panel_cols != BF16_BLOCK && panel_cols != 2 * BF16_BLOCK)) return -2;
    const int num_blocks = (n + BF16_BLOCK - 1) / BF16_BLOCK, per_panel = panel_cols / BF16_BLOCK;
    const size_t stride = (size_t)panel_cols * 2;
    #pragma omp parallel num_threads(threads)
    {
        const int team = omp_get_num_threads(), t = omp_get_thread_num();
        const int end = (int)((long)num_blocks * (t + 1) / team);
        for (int b = (int)((long)num_blocks * t / team); b < end;) {
            const int whole = per_panel == 2 && b % 2 == 0 && b + 1 < end;
            const int col = b * BF16_BLOCK;
            const uint16_t *w = panels + (size_t)(b / per_panel) * k * panel_cols + (size_t)(b % per_panel) * 2 * BF16_BLOCK;
            blocks(whole ? 4 : 2, x, rows, k, w, stride, bias == NULL ? NULL : bias + col, y + col, n, n - col);
            b += whole ? 2 : 1;
        }
    }
    return 0;
}

#else
int panel_linear_bf16_vec_available(void) { return 0; }

int panel_linear_bf16_vec(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int rows,
                          int n, int k, int panel_cols, int threads) {
    (void)x, (void)panels, (void)bias, (void)y, (void)rows, (void)n, (void)k, (void)panel_cols, (void)threads;
    return -1;
}
#endif
