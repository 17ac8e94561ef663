/* Rows times a weight kept in a GGUF's own blocks, y = x W^T, with float32 activations: the products of a
 * step with few rows, straight from the 4- and 8-bit codes (a token reads a fifth of float32's bytes), and
 * the blocks widened back to float32 for a step with many (`*_dequantize`, then the BLAS).
 *
 * A weight [out, in] is held as blocks of 32 inputs, each with a float32 scale `d` [out, in / 32]:
 *   Q4_1: codes [out, in / 2] uint8, 16 bytes a block, byte j holding weight j in its low four bits and
 *         weight j + 16 in its high four; a minimum `m` [out, in / 32];  w = d * code + m
 *   Q8_0: codes [out, in] int8;                                          w = d * code
 * exactly as llama.cpp stores them (the float16 scales widened once at load).
 *
 * x [rows, in] and y [rows, out] are float32, contiguous. Output channels are split over n_threads; each
 * channel's codes are widened once for up to four rows at a time. The sums run in another order than the
 * BLAS's over the dequantized weight: results agree to float32 rounding, not bit for bit.
 *
 * The dequantizers compute w as gguf-py does (a rounded product, then a rounded sum: no fused multiply-add),
 * so they give bit for bit the float32 weight that a model converted from the file holds.
 *
 * Built with -fopenmp; loaded after torch, it shares torch's OpenMP runtime. Returns 0, or -1 when the
 * rows' block sums could not be allocated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define ROWS_AT_ONCE 4
#define CHANNELS 4

typedef float f16x __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

static inline f16x load_f(const float *at) {
    f16x v;
    memcpy(&v, at, sizeof v);
    return v;
}

static inline float sum16(f16x v) {
    float total = 0.0f;
    for (int i = 0; i < 16; ++i) total += v[i];
    return total;
}

/* The 32 weights' codes of one block as two float vectors (weights 0-15, 16-31). */
static inline void q4_1_codes(const uint8_t *codes, f16x *low, f16x *high) {
    u8x16 packed;
    memcpy(&packed, codes, sizeof packed);
    /* Through int32: GCC widens bytes to floats element by element, but bytes to int32 in one instruction. */
    *low = __builtin_convertvector(__builtin_convertvector(packed & 0x0F, i32x16), f16x);
    *high = __builtin_convertvector(__builtin_convertvector(packed >> 4, i32x16), f16x);
}

static inline void q8_0_codes(const int8_t *codes, f16x *low, f16x *high) {
    u8x16 a, b; /* as unsigned bytes, offset by 128: GCC widens unsigned bytes in one instruction, signed ones not */
    memcpy(&a, codes, sizeof a);
    memcpy(&b, codes + 16, sizeof b);
    *low = __builtin_convertvector(__builtin_convertvector(a ^ 0x80, i32x16) - 128, f16x);
    *high = __builtin_convertvector(__builtin_convertvector(b ^ 0x80, i32x16) - 128, f16x);
}

/* Block b of output channel o's codes, of a Q4_1 (`q4`) or a Q8_0 weight of `in` inputs. */
static inline void block_codes(const uint8_t *codes, const int q4, int64_t in, int64_t o, int64_t b, f16x *low, f16x *high) {
    if (q4)
        q4_1_codes(codes + o * (in / 2) + b * (BLOCK / 2), low, high);
    else
        q8_0_codes((const int8_t *)codes + o * in + b * BLOCK, low, high);
}

/* Sum of each row's inputs over each block, [rows, in / 32]: a Q4_1 block's minimum multiplies it. */
static float *block_sums(const float *x, int64_t rows, int64_t in) {
    const int64_t blocks = in / BLOCK;
    float *sums = malloc((size_t)(rows * blocks) * sizeof *sums);
    if (sums == NULL) return NULL;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < blocks; ++b) sums[r * blocks + b] = sum16(load_f(x + r * in + b * BLOCK) + load_f(x + r * in + b * BLOCK + 16));
    return sums;
}

/* Output channels o0..o0+3 for rows r0..r0+R-1 (R a constant 1..4, so each tile's loops unroll): every block's codes
 * widened once for R rows, each row's inputs loaded once for four channels, 4 x R independent sums. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *sums, const uint8_t *codes,
                                                       const float *d, const float *m, const int q4, int64_t in,
                                                       int64_t out, int64_t o0, int64_t r0, const int R, float *y) {
    const int64_t blocks = in / BLOCK;
    f16x acc[CHANNELS][ROWS_AT_ONCE] = {{0}};
    float offsets[CHANNELS][ROWS_AT_ONCE] = {{0}};
    for (int64_t b = 0; b < blocks; ++b) {
        f16x xl[ROWS_AT_ONCE], xh[ROWS_AT_ONCE];
        for (int r = 0; r < R; ++r) {
            xl[r] = load_f(x + (r0 + r) * in + b * BLOCK);
            xh[r] = load_f(x + (r0 + r) * in + b * BLOCK + 16);
        }
        for (int c = 0; c < CHANNELS; ++c) {
            const int64_t o = o0 + c;
            f16x low, high;
            block_codes(codes, q4, in, o, b, &low, &high);
            const float scale = d[o * blocks + b];
            for (int r = 0; r < R; ++r) acc[c][r] += scale * (low * xl[r] + high * xh[r]);
            if (q4)
                for (int r = 0; r < R; ++r) offsets[c][r] += m[o * blocks + b] * sums[(r0 + r) * blocks + b];
        }
    }
    for (int c = 0; c < CHANNELS; ++c)
        for (int r = 0; r < R; ++r) y[(r0 + r) * out + o0 + c] = sum16(acc[c][r]) + offsets[c][r];
}

static void channels(const float *x, const float *sums, const uint8_t *codes, const float *d, const float *m,
                     const int q4, int64_t rows, int64_t in, int64_t out, int64_t o0, float *y) {
    int64_t r0 = 0;
    for (; r0 + 4 <= rows; r0 += 4) tile(x, sums, codes, d, m, q4, in, out, o0, r0, 4, y);
    switch (rows - r0) {
        case 3: tile(x, sums, codes, d, m, q4, in, out, o0, r0, 3, y); break;
        case 2: tile(x, sums, codes, d, m, q4, in, out, o0, r0, 2, y); break;
        case 1: tile(x, sums, codes, d, m, q4, in, out, o0, r0, 1, y); break;
    }
}

/* out must be a multiple of CHANNELS (the caller checks). */
static int matmul(const float *x, int64_t rows, const uint8_t *codes, const float *d, const float *m, int q4, int64_t in,
                  int64_t out, float *y, int n_threads) {
    float *sums = NULL;
    if (q4 && (sums = block_sums(x, rows, in)) == NULL) return -1;
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t o0 = 0; o0 < out; o0 += CHANNELS) {
        if (q4)
            channels(x, sums, codes, d, m, 1, rows, in, out, o0, y);
        else
            channels(x, sums, codes, d, m, 0, rows, in, out, o0, y);
    }
    free(sums);
    return 0;
}

int q4_1_matmul(const float *x, int64_t rows, const uint8_t *codes, const float *d, const float *m, int64_t in,
                int64_t out, float *y, int n_threads) {
    return matmul(x, rows, codes, d, m, 1, in, out, y, n_threads);
}

int q8_0_matmul(const float *x, int64_t rows, const int8_t *codes, const float *d, int64_t in, int64_t out, float *y,
                int n_threads) {
    return matmul(x, rows, (const uint8_t *)codes, d, NULL, 0, in, out, y, n_threads);
}

/* The float32 weight of output channels [first, first + count): w [count, in], each product and sum rounded apart, as
 * gguf-py's are. */
static __attribute__((optimize("fp-contract=off"))) void dequantize(const uint8_t *codes, const float *d, const float *m,
                                                                    const int q4, int64_t in, int64_t first,
                                                                    int64_t count, float *w, int n_threads) {
    const int64_t blocks = in / BLOCK;
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t o = 0; o < count; ++o)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t at = (first + o) * blocks + b;
            f16x low, high;
            block_codes(codes, q4, in, first + o, b, &low, &high);
            f16x lw = low * d[at], hw = high * d[at];
            if (q4) {
                lw += m[at];
                hw += m[at];
            }
            memcpy(w + o * in + b * BLOCK, &lw, sizeof lw);
            memcpy(w + o * in + b * BLOCK + 16, &hw, sizeof hw);
        }
}

void q4_1_dequantize(const uint8_t *codes, const float *d, const float *m, int64_t in, int64_t first, int64_t count,
                     float *w, int n_threads) {
    dequantize(codes, d, m, 1, in, first, count, w, n_threads);
}

void q8_0_dequantize(const int8_t *codes, const float *d, int64_t in, int64_t first, int64_t count, float *w,
                     int n_threads) {
    dequantize((const uint8_t *)codes, d, NULL, 0, in, first, count, w, n_threads);
}
