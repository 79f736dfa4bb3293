/* Causal attention of a prompt's new tokens over its keys, in float32 with
 * AVX2 and FMA (a flash attention: the scores never leave a thread's buffers).
 *
 * PyTorch's SDPA ran a float32 prefill's attention of the embedded default
 * (9 heads, 3 KV heads, head_dim 64, 256 tokens) at about 40 GFLOP/s on two
 * AVX2 cores (1.9 ms a layer), where its projections run at 100-160; that was
 * an eighth of a prefill step. This kernel: 0.85-0.95 ms, 80-90 GFLOP/s (the
 * causal half's flops; benchmarks/bench_prefill_attention.py). Here each task is ROWS query rows of one head against its KV
 * head's keys, which the call first transposes once for all its tasks,
 *
 *     keys_t[g][d][j] = K[j][g][d]   (zero past kv_len),
 *
 * so that a score micro-kernel keeps ROWS x 16 sums in registers, each step a
 * query value broadcast against 16 keys' values of one dimension. Keys go in
 * chunks of up to CHUNK: the chunk's scores, their softmax (each row's max and
 * sum carried across chunks, as an online softmax) and P V summed into the
 * rows' float32 outputs, ROWS x 16 columns at a time, reading the values in
 * place. Keys past the last query row's position are never read; those within
 * its last 16 are masked. Query row r sits at position kv_len - q_len + r (a
 * cached prefix shifts it) and sees keys 0..its position.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define ROWS 6        /* query rows per task: 6 x 2 vectors of sums, two of keys and a broadcast fill the 16 registers */
#define KEY_STEP 16   /* keys per micro-kernel: two 8-lane vectors */
#define CHUNK 256     /* keys per softmax chunk: a task's scores (6 KB) stay in L1 */
#define MAX_HEAD_DIM 256

/* e^x for x <= 0 on 8 lanes, as exp_nonpositive in vector.h (0 below e^-87). */
static inline __m256 exp8_nonpositive(__m256 x) {
    const __m256 clamped = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                     _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), clamped));
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 in_range = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm256_and_ps(in_range, _mm256_mul_ps(p, _mm256_castsi256_ps(exponent)));
}

/* Lanes j + 0..7 of a row that sees `valid` keys of the chunk: all ones where j + lane < valid. */
static inline __m256 lanes_below(int valid, int j) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(valid - j), lane));
}

static inline float max8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

static inline float sum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* Keys [first, first + KEY_STEP) of KV head g, transposed into keys_t (zero past kv_len). */
static void transpose_keys(const float *k, size_t kv_stride, int g, int first, int kv_len, int kv_pad, int head_dim,
                           float *keys_t) {
    float *kt = keys_t + (size_t)g * head_dim * kv_pad;
    for (int j = first; j < first + KEY_STEP; j++) {
        const float *key = k + (size_t)j * kv_stride + (size_t)g * head_dim;
        for (int d = 0; d < head_dim; d++) kt[(size_t)d * kv_pad + j] = j < kv_len ? key[d] : 0.0f;
    }
}

/* The running softmax of a task's rows and their outputs summed in float32. */
struct rows_state {
    float max[ROWS], sum[ROWS];
    float out[ROWS][MAX_HEAD_DIM];
};

/* scores[r][j] = q_r . k_j for keys [first, first + span) of one KV head's transposed keys. */
static void scores_chunk(const float queries[ROWS][MAX_HEAD_DIM], const float *kt, int kv_pad, int head_dim,
                         int first, int span, float scores[ROWS][CHUNK]) {
    for (int j = 0; j < span; j += KEY_STEP) {
        __m256 sums[ROWS][2];
        for (int r = 0; r < ROWS; r++) sums[r][0] = sums[r][1] = _mm256_setzero_ps();
        const float *column = kt + first + j;
        for (int d = 0; d < head_dim; d++) {
            const __m256 k0 = _mm256_loadu_ps(column + (size_t)d * kv_pad);
            const __m256 k1 = _mm256_loadu_ps(column + (size_t)d * kv_pad + 8);
            for (int r = 0; r < ROWS; r++) {
                const __m256 q = _mm256_broadcast_ss(&queries[r][d]);
                sums[r][0] = _mm256_fmadd_ps(q, k0, sums[r][0]);
                sums[r][1] = _mm256_fmadd_ps(q, k1, sums[r][1]);
            }
        }
        for (int r = 0; r < ROWS; r++) {
            _mm256_storeu_ps(&scores[r][j], sums[r][0]);
            _mm256_storeu_ps(&scores[r][j + 8], sums[r][1]);
        }
    }
}

/* scores -> probabilities in place for one chunk; row r sees keys up to positions[r]. Updates each
 * row's max and sum and scales its output by how much its max rose. */
static void softmax_chunk(float scores[ROWS][CHUNK], const int *positions, int first, int span, float scale,
                          struct rows_state *state, int head_dim) {
    for (int r = 0; r < ROWS; r++) {
        const int valid = positions[r] - first + 1; /* keys of this chunk the row sees */
        __m256 top = _mm256_set1_ps(-INFINITY);
        for (int j = 0; j < span; j += 8)
            top = _mm256_max_ps(top, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(&scores[r][j]),
                                                      lanes_below(valid, j)));
        const float old_max = state->max[r], new_max = fmaxf(old_max, max8(top));
        if (new_max == -INFINITY) { /* no key yet (a padding row past the chunk): nothing to add */
            memset(scores[r], 0, (size_t)span * sizeof(float));
            continue;
        }
        const float rescale = old_max == -INFINITY ? 0.0f : expf((old_max - new_max) * scale);
        const __m256 shift = _mm256_set1_ps(new_max), by = _mm256_set1_ps(scale);
        __m256 sum = _mm256_setzero_ps();
        for (int j = 0; j < span; j += 8) {
            const __m256 x = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(&scores[r][j]), shift), by);
            const __m256 p = _mm256_and_ps(lanes_below(valid, j), exp8_nonpositive(x));
            sum = _mm256_add_ps(sum, p);
            _mm256_storeu_ps(&scores[r][j], p);
        }
        state->sum[r] = state->sum[r] * rescale + sum8(sum);
        state->max[r] = new_max;
        if (old_max != -INFINITY && rescale != 1.0f) /* (a row's first keys: its outputs are still 0) */
            for (int d = 0; d < head_dim; d += 8)
                _mm256_storeu_ps(&state->out[r][d],
                                 _mm256_mul_ps(_mm256_loadu_ps(&state->out[r][d]), _mm256_set1_ps(rescale)));
    }
}

/* out += P V over keys [first, first + span) of KV head g (values read in place, kv_stride apart),
 * 16 output columns at a time. */
static void values_chunk(float probs[ROWS][CHUNK], const float *v, size_t kv_stride, int g, int head_dim, int first,
                         int span, struct rows_state *state) {
    for (int col = 0; col < head_dim; col += 16) {
        __m256 sums[ROWS][2];
        for (int r = 0; r < ROWS; r++) {
            sums[r][0] = _mm256_loadu_ps(&state->out[r][col]);
            sums[r][1] = _mm256_loadu_ps(&state->out[r][col + 8]);
        }
        const float *value = v + (size_t)first * kv_stride + (size_t)g * head_dim + col;
        for (int j = 0; j < span; j++, value += kv_stride) {
            const __m256 v0 = _mm256_loadu_ps(value), v1 = _mm256_loadu_ps(value + 8);
            for (int r = 0; r < ROWS; r++) {
                const __m256 p = _mm256_broadcast_ss(&probs[r][j]);
                sums[r][0] = _mm256_fmadd_ps(p, v0, sums[r][0]);
                sums[r][1] = _mm256_fmadd_ps(p, v1, sums[r][1]);
            }
        }
        for (int r = 0; r < ROWS; r++) {
            _mm256_storeu_ps(&state->out[r][col], sums[r][0]);
            _mm256_storeu_ps(&state->out[r][col + 8], sums[r][1]);
        }
    }
}

/* Query rows [first_row, first_row + rows) of head h (rows <= ROWS). */
static void attend_rows(const float *q, size_t q_stride, const float *kt, const float *v, size_t kv_stride, float *out,
                        size_t out_stride, int h, int g, int first_row, int rows, int offset, int kv_len, int kv_pad,
                        int head_dim, float scale) {
    float queries[ROWS][MAX_HEAD_DIM];
    float scores[ROWS][CHUNK];
    struct rows_state state;
    int positions[ROWS];
    for (int r = 0; r < ROWS; r++) {
        const int real = r < rows;
        if (real) memcpy(queries[r], q + (size_t)(first_row + r) * q_stride + (size_t)h * head_dim,
                         head_dim * sizeof(float));
        else memset(queries[r], 0, head_dim * sizeof(float));
        positions[r] = offset + first_row + (real ? r : rows - 1); /* padding rows repeat the last */
        state.max[r] = -INFINITY;
        state.sum[r] = 0.0f;
        memset(state.out[r], 0, head_dim * sizeof(float));
    }
    const int seen = positions[ROWS - 1] + 1, end = (seen + KEY_STEP - 1) / KEY_STEP * KEY_STEP;
    for (int first = 0; first < end; first += CHUNK) {
        const int span = end - first < CHUNK ? end - first : CHUNK;
        scores_chunk((const float(*)[MAX_HEAD_DIM])queries, kt, kv_pad, head_dim, first, span, scores);
        softmax_chunk(scores, positions, first, span, scale, &state, head_dim);
        /* past kv_len the probabilities are 0 and there are no value rows to read */
        values_chunk(scores, v, kv_stride, g, head_dim, first, first + span > kv_len ? kv_len - first : span, &state);
    }
    for (int r = 0; r < rows; r++) {
        const __m256 by = _mm256_set1_ps(1.0f / state.sum[r]);
        float *row = out + (size_t)(first_row + r) * out_stride + (size_t)h * head_dim;
        for (int d = 0; d < head_dim; d += 8) _mm256_storeu_ps(row + d, _mm256_mul_ps(_mm256_loadu_ps(&state.out[r][d]), by));
    }
}

int prefill_attention_f32_available(void) { return 1; }

/* q [q_len, heads, head_dim] (tokens q_stride values apart), k and v [kv_len, kv_heads, head_dim]
 * (kv_stride apart), out [q_len, heads, head_dim] (out_stride apart), all float32; head_dim a
 * multiple of 16 up to 256, heads a multiple of kv_heads, 1 <= q_len <= kv_len.
 * 0; -2 for shapes it does not take; -3 without memory for the transposed keys. */
int prefill_attention_f32(const float *q, const float *k, const float *v, float *out, int q_len, int kv_len,
                          int heads, int kv_heads, int head_dim, long q_stride, long kv_stride, long out_stride,
                          float scale, int threads) {
    if (head_dim % 16 != 0 || head_dim > MAX_HEAD_DIM || kv_heads < 1 || heads % kv_heads != 0 || q_len < 1 ||
        q_len > kv_len || !(scale > 0.0f))
        return -2;
    const int kv_pad = (kv_len + KEY_STEP - 1) / KEY_STEP * KEY_STEP, group = heads / kv_heads;
    float *keys_t = malloc((size_t)kv_heads * head_dim * kv_pad * sizeof(float));
    if (keys_t == NULL) return -3;
    const int steps = kv_pad / KEY_STEP, blocks = (q_len + ROWS - 1) / ROWS;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int t = 0; t < kv_heads * steps; t++)
            transpose_keys(k, (size_t)kv_stride, t / steps, (t % steps) * KEY_STEP, kv_len, kv_pad, head_dim, keys_t);
        /* The last blocks see the most keys: handed out first, so that the threads finish together. */
        #pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < heads * blocks; task++) {
            const int block = blocks - 1 - task / heads, h = task % heads, g = h / group;
            const int first_row = block * ROWS, rows = q_len - first_row < ROWS ? q_len - first_row : ROWS;
            attend_rows(q, (size_t)q_stride, keys_t + (size_t)g * head_dim * kv_pad, v, (size_t)kv_stride, out,
                        (size_t)out_stride, h, g, first_row, rows, kv_len - q_len, kv_len, kv_pad, head_dim, scale);
        }
    }
    free(keys_t);
    return 0;
}

#else
int prefill_attention_f32_available(void) { return 0; }

int prefill_attention_f32(const float *q, const float *k, const float *v, float *out, int q_len, int kv_len,
                          int heads, int kv_heads, int head_dim, long q_stride, long kv_stride, long out_stride,
                          float scale, int threads) {
    (void)q, (void)k, (void)v, (void)out, (void)q_len, (void)kv_len, (void)heads, (void)kv_heads, (void)head_dim;
    (void)q_stride, (void)kv_stride, (void)out_stride, (void)scale, (void)threads;
    return -1;
}
#endif
