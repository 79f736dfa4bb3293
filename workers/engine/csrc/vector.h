/* Helpers the CPU kernels share. With AVX2 (the build passes -march=native),
 * VECTOR_LANES is 8 and the __m256 helpers exist; without it, 0 and the
 * kernels take their scalar loops. */
#ifndef DISAGG_VECTOR_H
#define DISAGG_VECTOR_H

#include <stdint.h>

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)h << 16 };
    return v.f;
}

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
