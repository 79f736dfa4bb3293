/* The gated MLP's middle: out = silu(gate) * up, where each row of the input
 * holds [gate | up] (the fused gate_up projection's output). One pass instead
 * of PyTorch's two (silu into a new tensor, then the product into another),
 * over tensors of rows x 2 x intermediate floats that outgrow the caches on a
 * prefill.
 *
 * silu(g) = g / (1 + e^-g) as PyTorch computes it, with e = e^-|g|
 * (exp_nonpositive, never overflowing): g / (1 + e) for g >= 0, g * e / (1 + e)
 * below. It differs from PyTorch's by the exponential's error (< 2e-7 relative).
 */
#include <math.h>
#include <stddef.h>

#include "vector.h"

#define PARALLEL_VALUES 16384  /* fewer are not worth waking threads for */

static inline float silu(float g) {
    const float e = exp_nonpositive(-fabsf(g));
    return (g >= 0.0f ? g : g * e) / (1.0f + e);
}

/* gate_up [rows, 2 * width] -> out [rows, width]. */
void silu_mul_f32(const float *gate_up, float *out, int rows, int width, int threads) {
    #pragma omp parallel for if((long)rows * width >= PARALLEL_VALUES) num_threads(threads)
    for (int r = 0; r < rows; r++) {
        const float *gate = gate_up + (size_t)r * 2 * width;
        const float *up = gate + width;
        float *o = out + (size_t)r * width;
        #pragma omp simd
        for (int i = 0; i < width; i++) o[i] = silu(gate[i]) * up[i];
    }
}

/* The same in bfloat16, rounded where PyTorch's two bfloat16 ops round: silu(gate), then the product. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int width, int threads) {
    #pragma omp parallel for if((long)rows * width >= PARALLEL_VALUES) num_threads(threads)
    for (int r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + (size_t)r * 2 * width;
        const uint16_t *up = gate + width;
        uint16_t *o = out + (size_t)r * width;
        #pragma omp simd
        for (int i = 0; i < width; i++) o[i] = float_to_bf16(round_bf16(silu(bf16_to_float(gate[i]))) * bf16_to_float(up[i]));
    }
}
