/* Paged decode attention on the CPU: one new query token per sequence,
 * attending over its cached keys and values read in place through its block
 * table (no gathered copy of the context).
 *
 * Cache layout of one layer (see workers/engine/attention.py):
 *     [num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim]
 * Each (sequence, KV head) pair is one task: its group of query heads walks
 * the sequence's blocks once with an online softmax (running max and sum), so
 * every K and V row is read once, for the whole group.
 *
 * Built by workers/engine/cpu_attention.py with -O3 -fopenmp; the OpenMP
 * runtime is the one torch already loaded (same soname), so these threads are
 * torch's. The cache holds float32, or bfloat16 widened to float32 on load;
 * queries and the output are float32. With AVX512-BF16, a bfloat16 cache's
 * scores are dot products of bfloat16 pairs (VDPBF16PS), the query rounded to
 * bfloat16: exact when the model runs in bfloat16, as it does whenever its
 * cache does (the query is then a bfloat16 value widened).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector.h"

#define MAX_GROUP 32      /* query heads per KV head */
#define MAX_ROWS 64       /* query heads per task (a task per sequence needs heads <= this) */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256     /* tokens per block */

/* Scores (scale * q . k for each key row of a block) and acc += p * v over a
 * block's value rows, for float32 or bfloat16 rows: vector loops where the
 * CPU has them (below), then scalar loops for what they leave. */

#define DEFINE_SCORES(SUFFIX, ELEM, SCALAR)                                                          \
static inline void scores_##SUFFIX(const float *restrict q, const char *restrict keys, int tokens,  \
                                   size_t token_bytes, int n, float scale, float *restrict out) {    \
    int t = 0;                                                                                       \
    VECTOR_SCORES_##SUFFIX                                                                           \
    for (; t < tokens; t++) {                                                                        \
        const ELEM *k = (const ELEM *)(keys + (size_t)t * token_bytes);                              \
        float sum = 0.0f;                                                                            \
        for (int d = 0; d < n; d++) sum += q[d] * SCALAR(k[d]);                                      \
        out[t] = sum * scale;                                                                        \
    }                                                                                                \
}

/* acc = acc * rescale + sum over t of w[t] * row t of `values` (rows token_bytes apart). */
#define DEFINE_ACCUMULATE(SUFFIX, ELEM, SCALAR)                                                      \
static inline void accumulate_##SUFFIX(float *restrict acc, float rescale, const float *restrict w, \
                                       const char *restrict values, int tokens, size_t token_bytes, \
                                       int n) {                                                      \
    int d = 0;                                                                                       \
    VECTOR_ACCUMULATE_##SUFFIX                                                                       \
    for (; d < n; d++) {                                                                             \
        float sum = acc[d] * rescale;                                                                \
        for (int t = 0; t < tokens; t++) sum += w[t] * SCALAR(((const ELEM *)(values + t * token_bytes))[d]); \
        acc[d] = sum;                                                                                \
    }                                                                                                \
}

#if VECTOR_LANES
#define LOAD8_f32(p) _mm256_loadu_ps(p)
#define LOAD8_bf16(p) load8_bf16(p)

/* 8 vectors -> one whose lane i is the sum of v[i]'s lanes. */
static inline __m256 sum_each8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* Eight keys at a time: a vector of partial sums per key, then one transposing
 * sum for the eight (a horizontal sum per key would be a chain of shuffles each,
 * waited on one after another). */
#define VECTOR_SCORES(SUFFIX, ELEM)                                                                  \
    for (; n % 8 == 0 && t + 8 <= tokens; t += 8) {                                                  \
        __m256 part[8];                                                                              \
        for (int i = 0; i < 8; i++) {                                                                \
            const ELEM *k = (const ELEM *)(keys + (size_t)(t + i) * token_bytes);                    \
            part[i] = _mm256_setzero_ps();                                                           \
            for (int d = 0; d < n; d += 8)                                                           \
                part[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), LOAD8_##SUFFIX(k + d), part[i]);   \
        }                                                                                            \
        _mm256_storeu_ps(out + t, _mm256_mul_ps(sum_each8(part), _mm256_set1_ps(scale)));            \
    }

/* 64 lanes (8 registers) at a time while they last, then 8: each register a
 * chain of FMAs over the block's tokens, eight chains in flight. */
#define VECTOR_ACCUMULATE(SUFFIX, ELEM)                                                              \
    const __m256 r = _mm256_set1_ps(rescale);                                                        \
    for (; d + 64 <= n; d += 64) {                                                                   \
        __m256 a[8];                                                                                 \
        for (int j = 0; j < 8; j++) a[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 8 * j), r);       \
        for (int t = 0; t < tokens; t++) {                                                           \
            const ELEM *v = (const ELEM *)(values + t * token_bytes) + d;                            \
            const __m256 p = _mm256_set1_ps(w[t]);                                                   \
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(p, LOAD8_##SUFFIX(v + 8 * j), a[j]);  \
        }                                                                                            \
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(acc + d + 8 * j, a[j]);                         \
    }                                                                                                \
    for (; d + 8 <= n; d += 8) {                                                                     \
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + d), r);                                       \
        for (int t = 0; t < tokens; t++)                                                             \
            a = _mm256_fmadd_ps(_mm256_set1_ps(w[t]),                                                \
                                LOAD8_##SUFFIX((const ELEM *)(values + t * token_bytes) + d), a);    \
        _mm256_storeu_ps(acc + d, a);                                                                \
    }
#define VECTOR_SCORES_f32 VECTOR_SCORES(f32, float)
#define VECTOR_ACCUMULATE_f32 VECTOR_ACCUMULATE(f32, float)
#else
#define VECTOR_SCORES_f32
#define VECTOR_ACCUMULATE_f32
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
/* bfloat16 keys: 32 pairs per VDPBF16PS, no widening; the two halves of each
 * key's partial sums folded to 8 lanes for sum_each8. */
#define VECTOR_SCORES_bf16                                                                           \
    if (n % 32 == 0) {                                                                               \
        __m512bh query[MAX_HEAD_DIM / 32];                                                           \
        for (int c = 0; c < n / 32; c++)                                                             \
            query[c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 32 * c + 16), _mm512_loadu_ps(q + 32 * c)); \
        for (; t + 8 <= tokens; t += 8) {                                                            \
            __m256 part[8];                                                                          \
            for (int i = 0; i < 8; i++) {                                                            \
                const char *k = keys + (size_t)(t + i) * token_bytes;                                \
                __m512 sum = _mm512_setzero_ps();                                                    \
                for (int c = 0; c < n / 32; c++)                                                     \
                    sum = _mm512_dpbf16_ps(sum, query[c], (__m512bh)_mm512_loadu_si512(k + 64 * c)); \
                part[i] = _mm256_add_ps(_mm512_castps512_ps256(sum),                                 \
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sum), 1))); \
            }                                                                                        \
            _mm256_storeu_ps(out + t, _mm256_mul_ps(sum_each8(part), _mm256_set1_ps(scale)));        \
        }                                                                                            \
    }

/* bfloat16 values widened 16 at a time into 512-bit accumulators: half the
 * instructions of 8-lane vectors, where widening costs as much as the FMA. */
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#define VECTOR_ACCUMULATE_bf16                                                                       \
    const __m512 r = _mm512_set1_ps(rescale);                                                        \
    for (; d + 64 <= n; d += 64) {                                                                   \
        __m512 a[4];                                                                                 \
        for (int j = 0; j < 4; j++) a[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 16 * j), r);      \
        for (int t = 0; t < tokens; t++) {                                                           \
            const uint16_t *v = (const uint16_t *)(values + t * token_bytes) + d;                    \
            const __m512 p = _mm512_set1_ps(w[t]);                                                   \
            for (int j = 0; j < 4; j++) a[j] = _mm512_fmadd_ps(p, load16_bf16(v + 16 * j), a[j]);    \
        }                                                                                            \
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + d + 16 * j, a[j]);                        \
    }
#elif VECTOR_LANES
#define VECTOR_SCORES_bf16 VECTOR_SCORES(bf16, uint16_t)
#define VECTOR_ACCUMULATE_bf16 VECTOR_ACCUMULATE(bf16, uint16_t)
#else
#define VECTOR_SCORES_bf16
#define VECTOR_ACCUMULATE_bf16
#endif

#define AS_FLOAT(x) (x)
DEFINE_SCORES(f32, float, AS_FLOAT)
DEFINE_SCORES(bf16, uint16_t, bf16_to_float)
DEFINE_ACCUMULATE(f32, float, AS_FLOAT)
DEFINE_ACCUMULATE(bf16, uint16_t, bf16_to_float)

/* Asks for share `part` of `parts` of the 64-byte lines of the next block's rows (`bytes` of each
 * of `tokens` rows, `token_bytes` apart) while the current block is computed, one share per head's
 * pass over the block. A sequence's blocks lie anywhere in the cache, too short for the hardware's
 * stride prefetcher to find them; asking for a whole block at once instead stalled on the core's
 * few fill buffers (perf put a third of the kernel's time on those prefetches). */
static inline void prefetch_part(const char *rows_base, int tokens, size_t token_bytes, size_t bytes, int part,
                                 int parts) {
    const int per_token = (int)((bytes + 63) / 64), lines = tokens * per_token;
    const int begin = part * lines / parts, end = (part + 1) * lines / parts;
    int t = begin / per_token, line = begin % per_token;
    for (int i = begin; i < end; i++) {
        __builtin_prefetch(rows_base + (size_t)t * token_bytes + (size_t)line * 64);
        if (++line == per_token) line = 0, t++;
    }
}

/* One task: a sequence's query heads of KV heads [first, first + span); q and
 * out point at the first of those query heads. Per block: the block's key rows
 * are read in memory order once for every head (scores), each head's running
 * max and sum take the block in, and its value rows are summed while the block
 * is in cache. (Tasks of one KV head each would read a third of every row and
 * leave the rest of each cache line to a later task: three times the traffic.) */
static inline __attribute__((always_inline)) void attend(
        const float *restrict q, const char *restrict cache, const int32_t *restrict table, int context,
        float *restrict out, int group, int kv_heads, int head_dim, int block_size, int first, int span,
        float scale, int bf16) {
    float acc[MAX_ROWS][MAX_HEAD_DIM];
    float row_max[MAX_ROWS], row_sum[MAX_ROWS], weights[MAX_ROWS][MAX_BLOCK];
    const int rows = span * group;
    for (int r = 0; r < rows; r++) {
        memset(acc[r], 0, sizeof(float) * (size_t)head_dim);
        row_max[r] = -INFINITY;
        row_sum[r] = 0.0f;
    }
    const size_t elem = bf16 ? 2 : 4;
    const size_t head_bytes = (size_t)head_dim * elem;
    const size_t token_bytes = (size_t)kv_heads * head_bytes;
    const size_t half_block = (size_t)block_size * token_bytes;  /* the K rows, then the V rows */
    for (int start = 0; start < context; start += block_size) {
        const int tokens = context - start < block_size ? context - start : block_size;
        const char *keys = cache + (size_t)table[start / block_size] * 2 * half_block + (size_t)first * head_bytes;
        const char *values = keys + half_block;
        const char *next = NULL;
        int next_tokens = 0;
        if (start + block_size < context) {
            next_tokens = context - start - block_size < block_size ? context - start - block_size : block_size;
            next = cache + (size_t)table[start / block_size + 1] * 2 * half_block + (size_t)first * head_bytes;
        }
        for (int r = 0; r < rows; r++) {
            if (next) prefetch_part(next, next_tokens, token_bytes, (size_t)span * head_bytes, r, rows);
            const char *k = keys + (size_t)(r / group) * head_bytes;
            const float *qr = q + (size_t)r * head_dim;
            if (bf16) scores_bf16(qr, k, tokens, token_bytes, head_dim, scale, weights[r]);
            else scores_f32(qr, k, tokens, token_bytes, head_dim, scale, weights[r]);
        }
        for (int r = 0; r < rows; r++) {
            float *w = weights[r];
            float block_max = row_max[r];
            #pragma omp simd reduction(max:block_max)  /* without it, a scalar chain: a tenth of the kernel */
            for (int t = 0; t < tokens; t++) block_max = w[t] > block_max ? w[t] : block_max;
            const float rescale = exp_nonpositive(row_max[r] - block_max);  /* e^-inf = 0 on the first block */
            float block_sum = 0.0f;
            #pragma omp simd reduction(+:block_sum)
            for (int t = 0; t < tokens; t++) {
                w[t] = exp_nonpositive(w[t] - block_max);
                block_sum += w[t];
            }
            if (next) prefetch_part(next + half_block, next_tokens, token_bytes, (size_t)span * head_bytes, r, rows);
            const char *v = values + (size_t)(r / group) * head_bytes;
            if (bf16) accumulate_bf16(acc[r], rescale, w, v, tokens, token_bytes, head_dim);
            else accumulate_f32(acc[r], rescale, w, v, tokens, token_bytes, head_dim);
            row_sum[r] = row_sum[r] * rescale + block_sum;
            row_max[r] = block_max;
        }
    }
    for (int r = 0; r < rows; r++) {
        const float inv = 1.0f / row_sum[r];  /* >= 1: the max score's own term is e^0 */
        float *o = out + (size_t)r * head_dim;
        for (int d = 0; d < head_dim; d++) o[d] = acc[r][d] * inv;
    }
}

typedef void (*attend_fn)(const float *, const char *, const int32_t *, int, float *, int, int, int, int, int, int,
                          float);

/* attend with the element type fixed, so that its loops vectorise (the OpenMP
 * region below is outlined before inlining, where a flag would stay a variable). */
static void attend_f32(const float *q, const char *cache, const int32_t *table, int context, float *out, int group,
                       int kv_heads, int head_dim, int block_size, int first, int span, float scale) {
    attend(q, cache, table, context, out, group, kv_heads, head_dim, block_size, first, span, scale, 0);
}

static void attend_bf16(const float *q, const char *cache, const int32_t *table, int context, float *out,
                        int group, int kv_heads, int head_dim, int block_size, int first, int span, float scale) {
    attend(q, cache, table, context, out, group, kv_heads, head_dim, block_size, first, span, scale, 1);
}

/* q, out: [batch, heads, head_dim] float32; block_tables: [batch, max_blocks];
 * context_lens: [batch]. Returns 0, or a negative code for shapes it does not
 * take (the caller then uses the gather path). */
static int paged_decode(attend_fn task_fn, const float *q, const void *cache, const int32_t *block_tables,
                        const int32_t *context_lens, float *out, int batch, int heads, int kv_heads, int head_dim,
                        int block_size, int max_blocks, float scale, int threads) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || heads / kv_heads > MAX_GROUP
        || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK)
        return -1;
    for (int b = 0; b < batch; b++)
        if (context_lens[b] < 1 || context_lens[b] > max_blocks * block_size) return -2;
    const int group = heads / kv_heads;
    /* A task per sequence, all its heads, when that keeps every thread busy;
     * else a task per (sequence, KV head). */
    const int span = heads <= MAX_ROWS && batch >= 2 * threads ? kv_heads : 1;
    const int tasks_per_seq = kv_heads / span;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int task = 0; task < batch * tasks_per_seq; task++) {
        const int b = task / tasks_per_seq, h = task % tasks_per_seq * span;
        const size_t first_row = ((size_t)b * heads + (size_t)h * group) * head_dim;
        task_fn(q + first_row, (const char *)cache, block_tables + (size_t)b * max_blocks, context_lens[b],
                out + first_row, group, kv_heads, head_dim, block_size, h, span, scale);
    }
    return 0;
}

int paged_decode_f32(const float *q, const float *cache, const int32_t *block_tables, const int32_t *context_lens,
                     float *out, int batch, int heads, int kv_heads, int head_dim, int block_size, int max_blocks,
                     float scale, int threads) {
    return paged_decode(attend_f32, q, cache, block_tables, context_lens, out, batch, heads, kv_heads, head_dim,
                        block_size, max_blocks, scale, threads);
}

int paged_decode_bf16(const float *q, const uint16_t *cache, const int32_t *block_tables,
                      const int32_t *context_lens, float *out, int batch, int heads, int kv_heads, int head_dim,
                      int block_size, int max_blocks, float scale, int threads) {
    return paged_decode(attend_bf16, q, cache, block_tables, context_lens, out, batch, heads, kv_heads, head_dim,
                        block_size, max_blocks, scale, threads);
}
