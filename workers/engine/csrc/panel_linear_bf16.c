/* y = x @ W.T (+ bias) in bfloat16 with float32 sums by AMX, W packed once into
 * panels of 32 output columns in AMX's VNNI layout, which is the layout of
 * oneDNN's packed bf16 weights on AMX CPUs (models/panels.py checks that per
 * weight, and reads oneDNN's copy):
 *
 *     panels[p][k / 2][c][k % 2] = W[p * 32 + c][k], zero past N,
 *
 * so 16 k-pair rows of a panel (128 bytes apart) are two B tiles of 16 columns.
 * Blocks of 16 rows of x are A tiles read in place (rows k apart); a pair of
 * blocks against a panel keeps 2 x 2 tiles of 16 x 16 sums, and each chunk of
 * 32 k loads two A and two B tiles for four tile products. Rows short of a
 * block (a decode's batch, a prefill's last rows) run as one block with the
 * tiles configured for that many rows. From 1 to 32 rows that ran 1.4x to
 * 2.1x faster than oneDNN's packed bf16 linear, which streamed a step's
 * weights at half the memory's speed; from 256 rows, 0.8x to 1.0x, so larger
 * steps stay with oneDNN (benchmarks/bench_linear.py,
 * docs/benchmarks-engine.md). VDPBF16PS vectors were tried for short blocks
 * and were no faster at 1 row, 3x slower at 8 (CPUs without AMX take them:
 * panel_linear_bf16_vec.c).
 * Each output is float32 sums over k, rounded to bfloat16 once after the bias,
 * as PyTorch's bf16 linear rounds.
 *
 * Threads split the panels; rows go in blocks of BLOCK_ROWS so that a block of
 * x stays in L2 while every panel passes over it.
 */
#include <stddef.h>
#include <stdint.h>

#include "bf16_panels.h"

#if defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

#define PANEL 32      /* output columns per panel: two 16-lane vectors, two AMX tile columns */
#define PAIR_ROW 64   /* bf16 values per k-pair row of a panel (128 bytes) */
#define AMX_ROWS 16   /* rows of an AMX tile */
#define AMX_K 32      /* k values per AMX tile (16 pairs of 64 bytes) */
#define BLOCK_ROWS 256
/* On a panel's first pass, each k chunk asks for the bytes PREFETCH_AHEAD further on (the next
 * panels follow in memory): a decode's few rows left the tile loads waiting on memory; a step's
 * weights streamed at 16.6 GB/s with it, 13.0 without (2 KB ahead: 13.0, 16 KB: 15.2). */
#define PREFETCH_AHEAD 8192
#define PREFETCH_LINES 32 /* the 64-byte lines of a k chunk's two B tiles */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux lends AMX's tile registers to a process that asks once (they enlarge its saved state). */
static int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

/* 1 when this build and this process can run panel_linear_bf16. */
int panel_linear_bf16_available(void) { return amx_permitted(); }

/* AMX's tile shapes: tmm0-3 sums (`rows` x 16 float32), tmm4-5 x (`rows` x 32 bf16), tmm6-7 the
 * panel (16 k-pairs x 16 columns x 2). */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

static void configure_tiles(int rows) {
    struct tile_config config = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = t >= 6 ? AMX_K / 2 : rows;
        config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* Two sum tiles (a block's two 16-column halves) -> its `rows` rows of y. */
#define STORE_BLOCK(left, right, rows, y, n, bias, mask)                                           \
    do {                                                                                           \
        float sums[2][AMX_ROWS][16];                                                               \
        _tile_stored(left, sums[0], 64);                                                           \
        _tile_stored(right, sums[1], 64);                                                          \
        for (int r = 0; r < (rows); r++)                                                           \
            store_row(_mm512_loadu_ps(sums[0][r]), _mm512_loadu_ps(sums[1][r]), bias, (y) + (size_t)r * (n), mask); \
    } while (0)

/* One block of `rows` rows at x (k apart), or two (the second right after), against one
 * panel by AMX, with the tiles configured for `rows`; `prefetch` on the panel's first pass;
 * the panel's columns under `mask`. */
static void amx_rows(const uint16_t *x, int rows, int two_blocks, int prefetch, int k, const uint16_t *panel,
                     struct panel_bias bias, uint16_t *y, int n, __mmask32 mask) {
    const size_t x_stride = (size_t)k * sizeof(uint16_t), block = (size_t)rows * k;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int i = 0; i < k; i += AMX_K) {
        const uint16_t *w = panel + (size_t)(i / 2) * PAIR_ROW;
        for (int line = 0; prefetch && line < PREFETCH_LINES; line++)
            _mm_prefetch((const char *)w + PREFETCH_AHEAD + line * 64, _MM_HINT_T0);
        _tile_loadd(6, w, PAIR_ROW * sizeof(uint16_t));
        _tile_loadd(7, w + PAIR_ROW / 2, PAIR_ROW * sizeof(uint16_t));
        _tile_loadd(4, x + i, x_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two_blocks) {
            _tile_loadd(5, x + block + i, x_stride);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    STORE_BLOCK(0, 1, rows, y, n, bias, mask);
    if (two_blocks) STORE_BLOCK(2, 3, rows, y + (size_t)rows * n, n, bias, mask);
}

/* Rows [first, end) of x against panel p, in blocks of `rows` (which divides end - first). */
static void panel_blocks(const uint16_t *x, int first, int end, int rows, int p,
                         const uint16_t *panels, const uint16_t *bias, uint16_t *y, int n, int k) {
    const int col = p * PANEL, cols = n - col < PANEL ? n - col : PANEL;
    const __mmask32 mask = block_mask(cols);
    const struct panel_bias panel_bias = load_bias(bias == NULL ? NULL : bias + col, mask);
    for (int m = first; m < end; m += 2 * rows)
        amx_rows(x + (size_t)m * k, rows, m + 2 * rows <= end, m == first, k, panels + (size_t)p * k * PANEL,
                 panel_bias, y + (size_t)m * n + col, n, mask);
}

/* x [rows, k] bf16, panels [ceil(n / 32), k / 2, 32, 2] (`panel_cols` 32), bias [n] or NULL, y [rows, n]
 * bf16; k a multiple of 32 (the AMX chunks; models/panels.py packs only such weights). 0; -1 without
 * AMX, -2 for panels of another width. */
int panel_linear_bf16(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int rows, int n,
                      int k, int panel_cols, int threads) {
    if (!amx_permitted()) return -1;
    if (panel_cols != PANEL) return -2;
    const int num_panels = (n + PANEL - 1) / PANEL;
    for (int first = 0; first < rows; first += BLOCK_ROWS) {
        const int last = rows - first < BLOCK_ROWS ? rows : first + BLOCK_ROWS;
        const int tail = (last - first) % AMX_ROWS, tail_first = last - tail;
        #pragma omp parallel num_threads(threads)
        {
            /* The tile configuration is each thread's own; a static schedule gives a thread
             * the same panels in both loops. */
            if (tail_first > first) {
                configure_tiles(AMX_ROWS);
                #pragma omp for schedule(static) nowait
                for (int p = 0; p < num_panels; p++)
                    panel_blocks(x, first, tail_first, AMX_ROWS, p, panels, bias, y, n, k);
            }
            if (tail > 0) {
                configure_tiles(tail);
                #pragma omp for schedule(static) nowait
                for (int p = 0; p < num_panels; p++)
                    panel_blocks(x, tail_first, last, tail, p, panels, bias, y, n, k);
            }
            _tile_release();
        }
    }
    return 0;
}

#else
int panel_linear_bf16_available(void) { return 0; }

int panel_linear_bf16(const uint16_t *x, const uint16_t *panels, const uint16_t *bias, uint16_t *y, int rows, int n,
                      int k, int panel_cols, int threads) {
    (void)x, (void)panels, (void)bias, (void)y, (void)rows, (void)n, (void)k, (void)panel_cols, (void)threads;
    return -1;
}
#endif
