/* Decode attention straight from the KV cache's pages: one new query token per sequence.
 *
 * query, out      [num_seqs, n_heads, head_dim]                 float32, contiguous
 * k, v            [n_pages, page_size, n_kv_heads, head_dim]   one layer of the cache, contiguous, float32,
 *                                                              bfloat16 or float16 (`kv_type`), read as float32
 * page_tables    [num_seqs, max_pages]                        int64, the pages of each sequence in order
 * context_lens    [num_seqs]                                    int64, tokens each query attends to (>= 1)
 *
 * Query head h reads kv head h / (n_heads / n_kv_heads), the order of transformers' repeat_kv.
 * Each (sequence, kv head) is one task: the scores of the query heads that share the kv head
 * against every context token (a page is a contiguous run of token rows), a softmax per head,
 * then the weighted sum of values. Nothing is copied out of the cache and no padding is attended
 * over. In a step the pages come from memory (the layer's matrix products between two calls
 * evict them), so while 16 tokens are scored the next 16 key rows and these 16 value rows are
 * prefetched. With the pages in cache the arithmetic bounds it, so the loops are shaped for the
 * vector units: 16 tokens' scores at a time with one shuffle tree summing their products (not
 * one horizontal sum per token), an exp that vectorizes, and the output of up to 4 heads x 64
 * dims held in registers while the value rows stream by once. A head_dim that is not a multiple
 * of 16 (scores) or 64 (values) takes plain loops.
 *
 * Built with -fopenmp; loaded after torch, it shares torch's OpenMP runtime (libgomp.so.1).
 * Returns 0, or -1 when a score buffer could not be allocated.
 */
#include <math.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef _Float16 h16 __attribute__((vector_size(32)));

/* The cache's element type; a 16-bit one is widened to float32 as it is read. */
typedef enum { KV_FLOAT32 = 0, KV_BFLOAT16 = 1, KV_FLOAT16 = 2 } KvType;

typedef struct {
    const char *base;
    KvType type;
    int64_t element_bytes;
} KvPages;

/* Elements at..at+15 of `pages` as float32. */
static inline v16 load16(const KvPages *pages, int64_t at) {
    v16 out;
    if (pages->type == KV_FLOAT32) {
        memcpy(&out, pages->base + at * 4, sizeof out);
    } else if (pages->type == KV_BFLOAT16) { /* a bfloat16 is a float32's upper half */
        u16x16 half;
        memcpy(&half, pages->base + at * 2, sizeof half);
        const i16 wide = __builtin_convertvector(half, i16) << 16;
        memcpy(&out, &wide, sizeof out);
    } else {
#if defined(__AVX512F__) /* vcvtph2ps: GCC widens a _Float16 vector element by element */
        const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pages->base + at * 2)));
        memcpy(&out, &wide, sizeof out);
#else
        h16 half;
        memcpy(&half, pages->base + at * 2, sizeof half);
        out = __builtin_convertvector(half, v16);
#endif
    }
    return out;
}

static inline float load1(const KvPages *pages, int64_t at) {
    if (pages->type == KV_FLOAT32) return ((const float *)pages->base)[at];
    if (pages->type == KV_BFLOAT16) {
        const int32_t wide = (int32_t)((const uint16_t *)pages->base)[at] << 16;
        float out;
        memcpy(&out, &wide, sizeof out);
        return out;
    }
    return (float)((const _Float16 *)pages->base)[at];
}

static inline void prefetch(const KvPages *pages, int64_t at) {
    __builtin_prefetch(pages->base + at * pages->element_bytes, 0, 3);
}

/* e^x for x <= 0 (a score minus its row's maximum), within 2 ulp of expf: x = n ln2 + r, e^r by
 * Cephes' polynomial, 2^n by the exponent bits. Unlike expf it vectorizes (no errno, no call). */
#pragma omp declare simd
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f; /* rounded to nearest: 1.5 * 2^23 */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    union { int32_t bits; float value; } two_n = {.bits = ((int32_t)n + 127) << 23};
    return p * two_n.value;
}

/* The lanes of `a` and `b` summed in pairs into one vector: `a`'s in its first half, `b`'s in its second. */
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector((a), (b), __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle((a), (b), (i16){__VA_ARGS__})
#endif
#define FOLD(a, b, first, second) (SHUFFLE(a, b, first) + SHUFFLE(a, b, second))
#define L1 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define H1 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define L2 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define H2 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define L3 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define H3 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define L4 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define H4 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31

/* q . the key row at rows[t] for t < 16 (an offset of -1 gives 0), head_dim a multiple of 16: each row's
 * products in one vector, then the 16 vectors summed lane-wise by four folds into one vector of 16 dots. */
static inline v16 dots16(const float *q, const KvPages *k, const int64_t rows[16], int64_t head_dim) {
    v16 acc[16];
    for (int t = 0; t < 16; ++t) {
        v16 sum = {0};
        if (rows[t] >= 0)
            for (int64_t i = 0; i < head_dim; i += 16) {
                v16 x;
                memcpy(&x, q + i, sizeof x);
                sum += x * load16(k, rows[t] + i);
            }
        acc[t] = sum;
    }
    v16 eight[8], four[4], two[2];
    for (int p = 0; p < 8; ++p) eight[p] = FOLD(acc[2 * p], acc[2 * p + 1], L1, H1);
    for (int p = 0; p < 4; ++p) four[p] = FOLD(eight[2 * p], eight[2 * p + 1], L2, H2);
    for (int p = 0; p < 2; ++p) two[p] = FOLD(four[2 * p], four[2 * p + 1], L3, H3);
    return FOLD(two[0], two[1], L4, H4);
}

/* Where one sequence's rows of one kv head lie: row t is at k (or v) + row_offset(t). */
typedef struct {
    const int64_t *table;
    int64_t page_size, page_floats, token_floats, kv_offset;
} Rows;

static inline int64_t row_offset(const Rows *rows, int64_t t) {
    return rows->table[t / rows->page_size] * rows->page_floats + rows->kv_offset + (t % rows->page_size) * rows->token_floats;
}

/* scores[h * len + t] = scale * q_h . k_t for the `group` query heads at `qg` (prefetching the value
 * rows `weigh_values` reads next). */
static void score(const float *qg, const KvPages *k, const KvPages *v, const Rows *rows, int64_t len, int64_t group,
                  int64_t head_dim, float scale, float *scores) {
    if (head_dim % 16 == 0) {
        for (int64_t start = 0; start < len; start += 16) {
            int64_t block[16];
            for (int64_t t = 0; t < 16; ++t) block[t] = start + t < len ? row_offset(rows, start + t) : -1;
            for (int64_t t = start + 16; t < start + 32 && t < len; ++t) /* the next block's keys */
                for (int64_t i = 0; i < head_dim; i += 16) prefetch(k, row_offset(rows, t) + i);
            for (int64_t t = start; t < start + 16 && t < len; ++t) /* this block's values */
                for (int64_t i = 0; i < head_dim; i += 16) prefetch(v, row_offset(rows, t) + i);
            const int64_t count = len - start < 16 ? len - start : 16;
            for (int64_t h = 0; h < group; ++h) {
                const v16 dots = dots16(qg + h * head_dim, k, block, head_dim) * scale;
                memcpy(scores + h * len + start, &dots, sizeof(float) * (size_t)count);
            }
        }
        return;
    }
    for (int64_t t = 0; t < len; ++t) {
        const int64_t kt = row_offset(rows, t);
        for (int64_t h = 0; h < group; ++h) {
            const float *qh = qg + h * head_dim;
            float dot = 0.f;
            for (int64_t i = 0; i < head_dim; ++i) dot += qh[i] * load1(k, kt + i);
            scores[h * len + t] = dot * scale;
        }
    }
}

static void softmax(float *row, int64_t len) {
    float top = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : top)
    for (int64_t t = 0; t < len; ++t) top = row[t] > top ? row[t] : top;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
        row[t] = exp_nonpositive(row[t] - top);
        sum += row[t];
    }
    const float inverse = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) row[t] *= inverse;
}

/* og[h] = sum over t of probs[h * len + t] * v_t, for the `group` heads. */
static void weigh_values(const float *probs, const KvPages *v, const Rows *rows, int64_t len, int64_t group,
                         int64_t head_dim, float *og) {
    if (head_dim % 64 == 0) {
        for (int64_t d0 = 0; d0 < head_dim; d0 += 64)
            for (int64_t h0 = 0; h0 < group; h0 += 4) {
                const int64_t heads = group - h0 < 4 ? group - h0 : 4;
                v16 acc[4][4] = {{{0}}};
                for (int64_t t = 0; t < len; ++t) {
                    const int64_t at = row_offset(rows, t) + d0;
                    const v16 x[4] = {load16(v, at), load16(v, at + 16), load16(v, at + 32), load16(v, at + 48)};
                    for (int h = 0; h < 4 && h < heads; ++h) {
                        const float p = probs[(h0 + h) * len + t];
                        for (int c = 0; c < 4; ++c) acc[h][c] += p * x[c];
                    }
                }
                for (int h = 0; h < heads; ++h) memcpy(og + (h0 + h) * head_dim + d0, acc[h], sizeof acc[h]);
            }
        return;
    }
    memset(og, 0, sizeof(float) * (size_t)(group * head_dim));
    for (int64_t t = 0; t < len; ++t) {
        const int64_t vt = row_offset(rows, t);
        for (int64_t h = 0; h < group; ++h) {
            const float p = probs[h * len + t];
            float *oh = og + h * head_dim;
            for (int64_t i = 0; i < head_dim; ++i) oh[i] += p * load1(v, vt + i);
        }
    }
}

int paged_decode_attention(const float *query, const void *k, const void *v, int kv_type, const int64_t *page_tables,
                           const int64_t *context_lens, float *out, int64_t num_seqs, int64_t n_heads,
                           int64_t n_kv_heads, int64_t head_dim, int64_t page_size, int64_t max_pages,
                           float scale, int n_threads) {
    const int64_t group = n_heads / n_kv_heads;
    const int64_t element_bytes = kv_type == KV_FLOAT32 ? 4 : 2;
    const KvPages k_pages = {k, (KvType)kv_type, element_bytes}, v_pages = {v, (KvType)kv_type, element_bytes};
    int64_t max_len = 1;
    for (int64_t s = 0; s < num_seqs; ++s) max_len = context_lens[s] > max_len ? context_lens[s] : max_len;
    int failed = 0;

#pragma omp parallel num_threads(n_threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * max_len)); /* [group][len] */
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t seq = 0; seq < num_seqs; ++seq)
            for (int64_t g = 0; g < n_kv_heads; ++g) {
                if (scores == NULL) continue;
                const int64_t len = context_lens[seq];
                const Rows rows = {page_tables + seq * max_pages, page_size, page_size * n_kv_heads * head_dim,
                                   n_kv_heads * head_dim, g * head_dim};
                const int64_t first = (seq * n_heads + g * group) * head_dim; /* query head g * group onwards */
                score(query + first, &k_pages, &v_pages, &rows, len, group, head_dim, scale, scores);
                for (int64_t h = 0; h < group; ++h) softmax(scores + h * len, len);
                weigh_values(scores, &v_pages, &rows, len, group, head_dim, out + first);
            }
        free(scores);
    }
    return failed ? -1 : 0;
}
