/* Helpers the CPU kernels share. With AVX2 (the build passes -march=native),
 * VECTOR_LANES is 8 and the __m256 helpers exist; without it, 0 and the
 * kernels take their scalar loops. */
#ifndef DISAGG_VECTOR_H
#define DISAGG_VECTOR_H

#include <stdint.h>

/* e^x for x <= 0 (attention scores minus their running max, SiLU's e^-|x|),
 * branch-free so that loops over it vectorise: x = n ln2 + f with n rounded
 * and f taken in two steps (ln2 split so that n * its first part is exact),
 * e^f by its Taylor polynomial of degree 7 on |f| <= ln2 / 2, times 2^n set in
 * the exponent bits; within 2 ulp; 0 below e^-87. */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;  /* (not fmaxf: a libm call, which stops vectorisation) */
    const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round: 1.5 * 2^23 */
    const float f = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * f + 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } two_to_n = { .u = (uint32_t)((int32_t)n + 127) << 23 };
    return p * two_to_n.f * (float)(x >= -87.0f);
}

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)h << 16 };
    return v.f;
}

/* x rounded to the nearest bfloat16, ties to even, as PyTorch rounds (NaN stays NaN). */
static inline uint16_t float_to_bf16(float x) {
    union { float f; uint32_t u; } v = { .f = x };
    const uint16_t rounded = (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
    return x != x ? (uint16_t)0x7FC0 : rounded;
}

/* x rounded to bfloat16 and widened back: a bfloat16 op's result, for the next op to take. */
static inline float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

/* A float32 value as its own load, store and rounding: kernels written once for
 * both element types take these for float32 and the bf16 ones above for bfloat16. */
static inline float as_is(float x) { return x; }

#ifdef __AVX2__
#include <immintrin.h>
#define VECTOR_LANES 8

static inline float horizontal_sum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline __m256 load8_bf16(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#else
#define VECTOR_LANES 0
#endif

#endif
