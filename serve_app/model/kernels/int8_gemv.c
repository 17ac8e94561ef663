/* One row times an int8 weight, y = x W^T: the int8 layers of a step with one row (one sequence decoding).
 *
 * x      [in]        float32, quantized here to int8 at one scale (its largest magnitude / 127)
 * w      [out, in]   int8, one scale per output channel (w_scale [out]); w_sums [out] their row sums
 * y      [out]       float32
 *
 * With AVX512-VNNI the product is vpdpbusd (unsigned by signed bytes): x is shifted by 128 into
 * unsigned bytes and 128 times each row's sum taken back off. Output channels are split over
 * n_threads in blocks of four rows, so each block loads x once. Without VNNI (or on another
 * architecture) a plain loop computes the same sums. Returns 0, or -1 when x's int8 copy could not
 * be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VNNI 1
#endif

static inline int32_t dot_row(const uint8_t *xu, const int8_t *w, int64_t in) {
    int32_t acc = 0;
    for (int64_t i = 0; i < in; ++i) acc += (int32_t)xu[i] * (int32_t)w[i];
    return acc;
}

int int8_gemv(const float *x, const int8_t *w, const float *w_scale, const int32_t *w_sums, float *y, int64_t in,
              int64_t out, int n_threads) {
    uint8_t stack[8192];
    uint8_t *xu = in <= (int64_t)sizeof(stack) ? stack : malloc((size_t)in);
    if (xu == NULL) return -1;
    float amax = 0.0f;
    for (int64_t i = 0; i < in; ++i) amax = fmaxf(amax, fabsf(x[i]));
    const float x_scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    const float inv = 1.0f / x_scale;
    for (int64_t i = 0; i < in; ++i) xu[i] = (uint8_t)(lrintf(x[i] * inv) + 128);
    const int64_t blocks = (out + 3) / 4;

#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t o0 = b * 4;
        const int64_t rows = out - o0 < 4 ? out - o0 : 4;
        int32_t acc[4] = {0, 0, 0, 0};
#ifdef VNNI
        if (rows == 4) {
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
            const int8_t *w0 = w + o0 * in, *w1 = w0 + in, *w2 = w1 + in, *w3 = w2 + in;
            int64_t i = 0;
            for (; i + 64 <= in; i += 64) {
                const __m512i xv = _mm512_loadu_si512(xu + i);
                a0 = _mm512_dpbusd_epi32(a0, xv, _mm512_loadu_si512(w0 + i));
                a1 = _mm512_dpbusd_epi32(a1, xv, _mm512_loadu_si512(w1 + i));
                a2 = _mm512_dpbusd_epi32(a2, xv, _mm512_loadu_si512(w2 + i));
                a3 = _mm512_dpbusd_epi32(a3, xv, _mm512_loadu_si512(w3 + i));
            }
            if (i < in) {
                const __mmask64 m = (__mmask64)-1 >> (64 - (in - i));
                const __m512i xv = _mm512_maskz_loadu_epi8(m, xu + i);
                a0 = _mm512_dpbusd_epi32(a0, xv, _mm512_maskz_loadu_epi8(m, w0 + i));
                a1 = _mm512_dpbusd_epi32(a1, xv, _mm512_maskz_loadu_epi8(m, w1 + i));
                a2 = _mm512_dpbusd_epi32(a2, xv, _mm512_maskz_loadu_epi8(m, w2 + i));
                a3 = _mm512_dpbusd_epi32(a3, xv, _mm512_maskz_loadu_epi8(m, w3 + i));
            }
            acc[0] = _mm512_reduce_add_epi32(a0);
            acc[1] = _mm512_reduce_add_epi32(a1);
            acc[2] = _mm512_reduce_add_epi32(a2);
            acc[3] = _mm512_reduce_add_epi32(a3);
        } else
#endif
            for (int64_t r = 0; r < rows; ++r) acc[r] = dot_row(xu, w + (o0 + r) * in, in);
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t o = o0 + r;
            y[o] = (float)(acc[r] - 128 * w_sums[o]) * x_scale * w_scale[o];
        }
    }
    if (xu != stack) free(xu);
    return 0;
}
