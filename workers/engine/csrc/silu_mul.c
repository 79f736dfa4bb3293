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

/* The library is built for 256-bit vectors (cpu_kernels.FLAGS); this loop, all
 * arithmetic (an exponential and a division per value), ran 1.1x-1.5x faster in
 * 512-bit ones at 32 and 2048 rows, with the same bits (bench_silu_mul.py,
 * docs/benchmarks-engine.md). The attribute is GCC's; other compilers keep 256. */
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#define WIDE_VECTORS __attribute__((target("prefer-vector-width=512")))
#else
#define WIDE_VECTORS
#endif

static inline float silu(float g) {
    const float e = exp_nonpositive(-fabsf(g));
    return (g >= 0.0f ? g : g * e) / (1.0f + e);
}

/* gate_up [rows, 2 * width] -> out [rows, width]. In bfloat16, rounded where PyTorch's two
 * bfloat16 ops round: silu(gate), then the product. */
#define DEFINE_SILU_MUL(SUFFIX, ELEM, LOAD, ROUND, STORE)                                             \
WIDE_VECTORS void silu_mul_##SUFFIX(const ELEM *gate_up, ELEM *out, int rows, int width, int threads) { \
    _Pragma("omp parallel for if((long)rows * width >= PARALLEL_VALUES) num_threads(threads)")      \
    for (int r = 0; r < rows; r++) {                                                                 \
        const ELEM *gate = gate_up + (size_t)r * 2 * width;                                          \
        const ELEM *up = gate + width;                                                               \
        ELEM *o = out + (size_t)r * width;                                                           \
        _Pragma("omp simd")                                                                          \
        for (int i = 0; i < width; i++) o[i] = STORE(ROUND(silu(LOAD(gate[i]))) * LOAD(up[i]));      \
    }                                                                                                \
}

DEFINE_SILU_MUL(f32, float, as_is, as_is, as_is)
DEFINE_SILU_MUL(bf16, uint16_t, bf16_to_float, round_bf16, float_to_bf16)
