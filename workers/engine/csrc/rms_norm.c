/* RMSNorm of float32 or bfloat16 rows: out = x * (1 / sqrt(mean(x^2) + eps)) * weight,
 * as the reference models compute it (each product rounded; this file is built
 * with -ffp-contract=off), the sum of squares in vector lanes. One call instead
 * of the seven ops PyTorch's float32 rms_norm dispatches (~60 us a row on a
 * decode step's single row, for 576 values). In bfloat16 the reference models
 * work in float32, round x * inverse to bfloat16, then multiply by the
 * bfloat16 weight and round again: so does rms_norm_bf16. */
#include <math.h>
#include <stddef.h>

#include "vector.h"

#define PARALLEL_ROWS 64  /* fewer rows are not worth waking threads for */

static float sum_of_squares(const float *x, int dim) {
    int i = 0;
    float sum = 0.0f;
#if VECTOR_LANES
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= dim; i += 16) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        acc0 = _mm256_add_ps(acc0, _mm256_mul_ps(a, a));
        acc1 = _mm256_add_ps(acc1, _mm256_mul_ps(b, b));
    }
    sum = horizontal_sum(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < dim; i++) sum += x[i] * x[i];
    return sum;
}

/* x, out [rows, dim] (out may be x), weight [dim]. */
void rms_norm_f32(const float *x, const float *weight, float eps, float *out, int rows, int dim, int threads) {
    #pragma omp parallel for if(rows >= PARALLEL_ROWS) num_threads(threads)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *yr = out + (size_t)r * dim;
        const float inverse = 1.0f / sqrtf(sum_of_squares(xr, dim) / (float)dim + eps);
        for (int i = 0; i < dim; i++) yr[i] = weight[i] * (xr[i] * inverse);
    }
}

/* x, out [rows, dim] bfloat16 (out may be x), weight [dim] bfloat16. */
void rms_norm_bf16(const uint16_t *x, const uint16_t *weight, float eps, uint16_t *out, int rows, int dim,
                   int threads) {
    #pragma omp parallel for if(rows >= PARALLEL_ROWS) num_threads(threads)
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (size_t)r * dim;
        uint16_t *yr = out + (size_t)r * dim;
        float sum = 0.0f;
        #pragma omp simd reduction(+:sum)
        for (int i = 0; i < dim; i++) sum += bf16_to_float(xr[i]) * bf16_to_float(xr[i]);
        const float inverse = 1.0f / sqrtf(sum / (float)dim + eps);
        #pragma omp simd
        for (int i = 0; i < dim; i++)
            yr[i] = float_to_bf16(bf16_to_float(weight[i]) * round_bf16(bf16_to_float(xr[i]) * inverse));
    }
}
