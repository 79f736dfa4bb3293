/* y = x @ W.T for W in llama.cpp's Q4_1 shape (per 32 weights: w = d * q + m, q in [0, 15]),
 * the way llama.cpp multiplies it: x quantised per 32 values to int8 (one scale each), then
 * integer dot products (AVX2 vpmaddubsw: u8 x s8, no saturation at 15 * 127 * 2).
 * A prototype for benchmarks/bench_quant.py: one thread, AVX2 + FMA, K a multiple of 32.
 *
 * qw  [N][K/32][16]: byte j of a block holds q[j] (low nibble) and q[j + 16] (high nibble)
 * d, m [N][K/32]; x [M][K]; y [M][N]; scratch: xq [M][K] int8, dx and xsum [M][K/32] */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define BLOCK 32
#define ROWS 4 /* activation rows sharing one weight block load */

static void quantize_rows(const float *x, int M, int K, int8_t *xq, float *dx, float *xsum) {
    for (int i = 0; i < M * K / BLOCK; i++) {
        const float *v = x + i * BLOCK;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < BLOCK; j++) {
            amax = fmaxf(amax, fabsf(v[j]));
            sum += v[j];
        }
        float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int j = 0; j < BLOCK; j++) xq[i * BLOCK + j] = (int8_t)lrintf(v[j] * inv);
        dx[i] = scale;
        xsum[i] = sum;
    }
}

static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

void q4_1_linear(const float *x, int M, int K, int N, const uint8_t *qw, const float *d, const float *m,
                 float *y, int8_t *xq, float *dx, float *xsum) {
    const int nb = K / BLOCK;
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    quantize_rows(x, M, K, xq, dx, xsum);
    for (int n = 0; n < N; n++) {
        const uint8_t *wq = qw + (size_t)n * nb * 16;
        const float *wd = d + (size_t)n * nb, *wm = m + (size_t)n * nb;
        for (int r0 = 0; r0 < M; r0 += ROWS) {
            int rows = M - r0 < ROWS ? M - r0 : ROWS;
            __m256 acc[ROWS];
            float macc[ROWS];
            for (int r = 0; r < ROWS; r++) { acc[r] = _mm256_setzero_ps(); macc[r] = 0.0f; }
            for (int b = 0; b < nb; b++) {
                __m128i raw = _mm_loadu_si128((const __m128i *)(wq + b * 16));
                __m128i lo = _mm_and_si128(raw, low4);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
                __m256i q = _mm256_set_m128i(hi, lo); /* q[0..31] in order */
                for (int r = 0; r < rows; r++) {
                    int row = r0 + r;
                    __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (size_t)row * K + b * BLOCK));
                    __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(wd[b] * dx[row * nb + b]), acc[r]);
                    macc[r] += wm[b] * xsum[row * nb + b];
                }
            }
            for (int r = 0; r < rows; r++) y[(size_t)(r0 + r) * N + n] = hsum(acc[r]) + macc[r];
        }
    }
}
