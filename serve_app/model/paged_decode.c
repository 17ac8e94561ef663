/* Decode attention straight from the KV cache's pages: one new query token per sequence.
 *
 * query, out      [num_seqs, n_heads, head_dim]                 float32, contiguous
 * k, v            [n_pages, page_size, n_kv_heads, head_dim]   one layer of the cache, contiguous
 * page_tables    [num_seqs, max_pages]                        int64, the pages of each sequence in order
 * context_lens    [num_seqs]                                    int64, tokens each query attends to (>= 1)
 *
 * Query head h reads kv head h / (n_heads / n_kv_heads), the order of transformers' repeat_kv.
 * Each sequence is one task: scores of all its query heads against every context token (a
 * page is a contiguous run of token rows), a softmax per head, then the weighted sum of
 * values. Nothing is copied out of the cache and no padding is attended over. The pages sit
 * anywhere in memory, so while one key page is scored the next key page and this value
 * page are prefetched: the loop is bound by memory, not arithmetic.
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

int paged_decode_attention(const float *query, const float *k, const float *v, const int64_t *page_tables,
                           const int64_t *context_lens, float *out, int64_t num_seqs, int64_t n_heads,
                           int64_t n_kv_heads, int64_t head_dim, int64_t page_size, int64_t max_pages,
                           float scale, int n_threads) {
    const int64_t group = n_heads / n_kv_heads;
    const int64_t token_floats = n_kv_heads * head_dim;
    const int64_t page_floats = page_size * token_floats;
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
            const int64_t n_pages = (len + page_size - 1) / page_size;
            const int64_t *table = page_tables + seq * max_pages;
            const float *q = query + seq * n_heads * head_dim;
            float *o = out + seq * n_heads * head_dim;

            for (int64_t b = 0; b < n_pages; ++b) {
                const float *page = k + table[b] * page_floats;
                if (b + 1 < n_pages) prefetch(k + table[b + 1] * page_floats, page_floats);
                prefetch(v + table[b] * page_floats, page_floats);
                const int64_t count = len - b * page_size < page_size ? len - b * page_size : page_size;
                for (int64_t j = 0; j < count; ++j) {
                    const float *row = page + j * token_floats;
                    for (int64_t h = 0; h < n_heads; ++h) {
                        const float *qh = q + h * head_dim, *kh = row + (h / group) * head_dim;
                        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t i = 0; i < head_dim; ++i) dot += qh[i] * kh[i];
                        scores[h * len + b * page_size + j] = dot * scale;
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
            for (int64_t b = 0; b < n_pages; ++b) {
                const float *page = v + table[b] * page_floats;
                const int64_t count = len - b * page_size < page_size ? len - b * page_size : page_size;
                for (int64_t j = 0; j < count; ++j) {
                    const float *row = page + j * token_floats;
                    for (int64_t h = 0; h < n_heads; ++h) {
                        const float p = scores[h * len + b * page_size + j];
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
