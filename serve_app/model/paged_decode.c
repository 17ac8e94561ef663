/* Decode attention straight from the KV cache's blocks: one new query token per sequence.
 *
 * query, out      [num_seqs, n_heads, head_dim]                 float32, contiguous
 * k, v            [n_blocks, block_len, n_kv_heads, head_dim]   one layer of the cache, contiguous
 * block_tables    [num_seqs, max_blocks]                        int64, the blocks of each sequence in order
 * context_lens    [num_seqs]                                    int64, tokens each query attends to (>= 1)
 *
 * Query head h reads kv head h / (n_heads / n_kv_heads), the order of transformers' repeat_kv.
 * Each sequence is one task: scores of all its query heads against every context token (a
 * block is a contiguous run of token rows), a softmax per head, then the weighted sum of
 * values. Nothing is copied out of the cache and no padding is attended over. The blocks sit
 * anywhere in memory, so while one key block is scored the next key block and this value
 * block are prefetched: the loop is bound by memory, not arithmetic.
 *
 * Built with -fopenmp; loaded after torch, it shares torch's OpenMP runtime (libgomp.so.1).
 * Returns 0, or -1 when a score buffer could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline void prefetch(const float *start, int64_t floats) {
    const char *bytes = (const char *)start;
    for (int64_t offset = 0; offset < floats * (int64_t)sizeof(float); offset += 64) __builtin_prefetch(bytes + offset, 0, 3);
}

int paged_decode_attention(const float *query, const float *k, const float *v, const int64_t *block_tables,
                           const int64_t *context_lens, float *out, int64_t num_seqs, int64_t n_heads,
                           int64_t n_kv_heads, int64_t head_dim, int64_t block_len, int64_t max_blocks,
                           float scale, int n_threads) {
    const int64_t group = n_heads / n_kv_heads;
    const int64_t token_floats = n_kv_heads * head_dim;
    const int64_t block_floats = block_len * token_floats;
    int64_t max_len = 1;
    for (int64_t s = 0; s < num_seqs; ++s) max_len = context_lens[s] > max_len ? context_lens[s] : max_len;
    int failed = 0;

#pragma omp parallel num_threads(n_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(n_heads * max_len)); /* [n_heads][len] */
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t seq = 0; seq < num_seqs; ++seq) {
            if (scores == NULL) continue;
            const int64_t len = context_lens[seq];
            const int64_t n_blocks = (len + block_len - 1) / block_len;
            const int64_t *table = block_tables + seq * max_blocks;
            const float *q = query + seq * n_heads * head_dim;
            float *o = out + seq * n_heads * head_dim;

            for (int64_t b = 0; b < n_blocks; ++b) {
                const float *block = k + table[b] * block_floats;
                if (b + 1 < n_blocks) prefetch(k + table[b + 1] * block_floats, block_floats);
                prefetch(v + table[b] * block_floats, block_floats);
                const int64_t count = len - b * block_len < block_len ? len - b * block_len : block_len;
                for (int64_t j = 0; j < count; ++j) {
                    const float *row = block + j * token_floats;
                    for (int64_t h = 0; h < n_heads; ++h) {
                        const float *qh = q + h * head_dim, *kh = row + (h / group) * head_dim;
                        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t i = 0; i < head_dim; ++i) dot += qh[i] * kh[i];
                        scores[h * len + b * block_len + j] = dot * scale;
                    }
                }
            }
            for (int64_t h = 0; h < n_heads; ++h) {
                float *row = scores + h * len;
                float top = -INFINITY, sum = 0.f;
                for (int64_t t = 0; t < len; ++t) top = row[t] > top ? row[t] : top;
                for (int64_t t = 0; t < len; ++t) {
                    row[t] = expf(row[t] - top);
                    sum += row[t];
                }
                const float inverse = 1.f / sum;
                for (int64_t t = 0; t < len; ++t) row[t] *= inverse;
            }
            memset(o, 0, sizeof(float) * (size_t)(n_heads * head_dim));
            for (int64_t b = 0; b < n_blocks; ++b) {
                const float *block = v + table[b] * block_floats;
                const int64_t count = len - b * block_len < block_len ? len - b * block_len : block_len;
                for (int64_t j = 0; j < count; ++j) {
                    const float *row = block + j * token_floats;
                    for (int64_t h = 0; h < n_heads; ++h) {
                        const float p = scores[h * len + b * block_len + j];
                        const float *vh = row + (h / group) * head_dim;
                        float *oh = o + h * head_dim;
#pragma omp simd
                        for (int64_t i = 0; i < head_dim; ++i) oh[i] += p * vh[i];
                    }
                }
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
