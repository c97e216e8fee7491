/* The AVX2 variant (with FMA and F16C: cpu_native.UNITS compiles this file with those flags): the
 * float kernels of float_kernels.h on 256-bit registers, the int8 tiles of int8_tiles.h (W8A16,
 * and W8A8 with maddubs), and the per-row quantisation in 8-float vectors. */
#include "float_kernels.h"
#include "int8_tiles.h"

#define DOT_AVX2(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)))
INT8_BLOCK(w8a16_block, W8A16, )
INT8_BLOCK(w8a8_block, W8A8, DOT_AVX2)

/* max|row| over the whole 8-float vectors. max_ps(v, acc) returns acc where v is NaN: NaNs are
 * skipped, as fmaxf skips them. */
static int64_t quantize_top(const float *row, int64_t K, float *top) {
    int64_t k = 0;
    __m256 tops = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; k + 8 <= K; k += 8) tops = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(row + k), magnitude), tops);
    float lanes[8];
    _mm256_storeu_ps(lanes, tops);
    for (int l = 0; l < 8; l++) *top = fmaxf(*top, lanes[l]);
    return k;
}

/* q for the whole runs of 32 floats. */
static int64_t quantize_round(const float *row, int64_t K, float scale, int8_t *q) {
    int64_t k = 0;
    const __m256 sv = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-128.f), hi = _mm256_set1_ps(127.f);
    for (; k + 32 <= K; k += 32) {
        __m256i v[4];
        for (int j = 0; j < 4; j++) {
            __m256 f = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + k + 8 * j), sv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(f, lo), hi));
        }
        /* packs interleave the 128-bit halves: the permute puts the 32 bytes back in order */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        _mm256_storeu_si256((__m256i *)(q + k), _mm256_permutevar8x32_epi32(p, order));
    }
    return k;
}

static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t x_stride, int8_t *q, int64_t q_stride,
                          float *s) {
    quantize_rows_with(x, M, K, x_stride, q, q_stride, s, quantize_top, quantize_round);
}

const struct cpu_variant cpu_variant_avx2 = {
    "avx2", FEATURE_AVX2,
    {FLOAT_KERNELS, .quantize_rows = quantize_rows, .w8a16_block = w8a16_block, .w8a8_block = w8a8_block},
};
