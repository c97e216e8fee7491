/* The int8 tiles on 256-bit registers (AVX2 and VNNI), shared by isa_avx2.c and isa_vnni.c: each
 * includes this header and instantiates the blocks for its own instruction set (the inner kernels
 * of int8_driver.c, which says what they compute).
 *
 * A block of `count` <= OT weight rows is multiplied with all M rows of the activations in tiles
 * of TO weight rows by RT rows, the TO x RT sums in registers. */
#ifndef ATB_INT8_TILES_H
#define ATB_INT8_TILES_H
#include "cpu_kernels.h"

#define TO 2 /* weight rows per tile */
#define RT 4 /* rows of x per tile: RT x TO sums, TO weight vectors (and their |w|) in registers */
#define TILES_AHEAD 2
/* What a tile prefetches: its O weight rows are O * K contiguous bytes, and so are the next
 * tile's, so the weights are one stream read in order; each step (32 bytes of each row) a tile
 * prefetches the O * 32 bytes TILES_AHEAD tiles on, keeping pace with what it reads. Prefetching
 * each row 2 KiB ahead instead (two short streams per tile) read SmolLM2's K = 576 rows at ~9 GB/s
 * where this reads ~13 (benchmarks/RESULTS.md, "Low precision"). Past the matrix's end the hints
 * are wasted, never a fault. */
#define PREFETCH_TILES_AHEAD(O, K, k, bytes_per_k)                                                      \
    for (int c = 0; c < (O) * (bytes_per_k); c += 64)                                                   \
        __builtin_prefetch((const char *)w + TILES_AHEAD * (O) * (K) + (k) * (O) + c)


#include <immintrin.h>

static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* W8A16: out[r][o] = sum_k x[r][k] * w[o][k] for R rows and O weight rows (literal constants: the
 * loops unroll and the R x O sums stay in registers). 8 int8 weights -> 8 int32 -> 8 floats. */
#define W8A16_TILE(R, O)                                                                                    \
    do {                                                                                                    \
        __m256 acc[R][O];                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int o = 0; o < O; o++) acc[r][o] = _mm256_setzero_ps();                                   \
        int64_t k = 0;                                                                                      \
        for (; k + 8 <= K; k += 8) {                                                                        \
            if ((k & 31) == 0) PREFETCH_TILES_AHEAD(O, K, k, 32);                                           \
            __m256 wv[O];                                                                                   \
            for (int o = 0; o < O; o++)                                                                     \
                wv[o] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + o * K + k)))); \
            for (int r = 0; r < R; r++) {                                                                   \
                const __m256 xv = _mm256_loadu_ps(x + r * x_stride + k);                                   \
                for (int o = 0; o < O; o++) acc[r][o] = _mm256_fmadd_ps(xv, wv[o], acc[r][o]);            \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int o = 0; o < O; o++) {                                                                   \
                float sum = hsum_ps(acc[r][o]);                                                             \
                for (int64_t t = k; t < K; t++) sum += x[r * x_stride + t] * (float)w[o * K + t];          \
                out[r * OT + o] = sum;                                                                      \
            }                                                                                               \
    } while (0)

/* W8A8, exact int32 sums. maddubs multiplies unsigned by signed bytes and adds pairs into int16
 * with saturation, so the operands are |w| (0..128, unsigned) and q with w's sign (q in
 * -127..127: a symmetric per-token scale never makes -128 from finite x, so negating q cannot
 * overflow): |w| * (q * sign(w)) = q * w, and a pair's sum is at most 2 * 128 * 127 = 32512 <
 * 32767: never saturates. madd with ones then widens the pairs into int32. The VNNI variants do
 * the same in one instruction (vpdpbusd: u8 x s8, four products into each int32, no saturation). */
#define W8A8_TILE(R, O, DOT)                                                                                \
    do {                                                                                                    \
        __m256i acc[R][O];                                                                                  \
        for (int r = 0; r < R; r++)                                                                         \
            for (int o = 0; o < O; o++) acc[r][o] = _mm256_setzero_si256();                                \
        int64_t k = 0;                                                                                      \
        for (; k + 32 <= K; k += 32) {                                                                      \
            PREFETCH_TILES_AHEAD(O, K, k, 32);                                                              \
            __m256i wv[O], aw[O];                                                                           \
            for (int o = 0; o < O; o++) {                                                                   \
                wv[o] = _mm256_loadu_si256((const __m256i *)(w + o * K + k));                               \
                aw[o] = _mm256_abs_epi8(wv[o]);                                                             \
            }                                                                                               \
            for (int r = 0; r < R; r++) {                                                                   \
                const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + r * q_stride + k));             \
                for (int o = 0; o < O; o++) acc[r][o] = DOT(acc[r][o], aw[o], _mm256_sign_epi8(qv, wv[o])); \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int o = 0; o < O; o++) {                                                                   \
                int32_t sum = hsum_epi32(acc[r][o]);                                                        \
                for (int64_t t = k; t < K; t++) sum += (int32_t)q[r * q_stride + t] * w[o * K + t];        \
                out[r * OT + o] = sum;                                                                      \
            }                                                                                               \
    } while (0)

/* The tiles covering one block of `count` (<= OT) weight rows and all M rows of x: TO weight rows
 * by RT rows where they fit, then narrower ones. Sums land in sums[r * OT + o]. */
#define BLOCK_TILES(TILE_FULL, TILE_ROW, TILE_ONE_W, TILE_ONE)                                            \
    for (int o0 = 0; o0 < count; o0 += TO) {                                                                \
        const int pair = count - o0 >= TO;                                                                  \
        for (int64_t m = 0; m < M;) {                                                                       \
            const int full = M - m >= RT;                                                                   \
            if (pair) { if (full) TILE_FULL; else TILE_ROW; }                                               \
            else { if (full) TILE_ONE_W; else TILE_ONE; }                                                   \
            m += full ? RT : 1;                                                                             \
        }                                                                                                   \
    }


/* A W8A16 block (int8_block_fn) of this file's instruction set. */
#define W8A16_AT(R, O) do { const float *x = x0 + m * x_stride; const int8_t *w = w0 + o0 * K; \
                            float *out = sums + m * OT + o0; W8A16_TILE(R, O); } while (0)
#define W8A16_BLOCK(NAME, ATTR)                                                                             \
    static ATTR void NAME(const void *a, int64_t M, int64_t K, int64_t x_stride, const int8_t *w0, int count,  \
                          void *sums_) {                                                                    \
        const float *x0 = a;                                                                                \
        float *sums = sums_;                                                                                \
        BLOCK_TILES(W8A16_AT(RT, TO), W8A16_AT(1, TO), W8A16_AT(RT, 1), W8A16_AT(1, 1))                     \
    }

/* A W8A8 block (int8_block_fn) whose dot product of 32 unsigned by 32 signed bytes into 8 int32
 * lanes is DOT. */
#define W8A8_AT(R, O, DOT) do { const int8_t *q = q0 + m * q_stride; const int8_t *w = w0 + o0 * K; \
                                int32_t *out = sums + m * OT + o0; W8A8_TILE(R, O, DOT); } while (0)
#define W8A8_BLOCK(NAME, ATTR, DOT)                                                                         \
    static ATTR void NAME(const void *a, int64_t M, int64_t K, int64_t q_stride, const int8_t *w0, int count,  \
                          void *sums_) {                                                                    \
        const int8_t *q0 = a;                                                                               \
        int32_t *sums = sums_;                                                                              \
        BLOCK_TILES(W8A8_AT(RT, TO, DOT), W8A8_AT(1, TO, DOT), W8A8_AT(RT, 1, DOT), W8A8_AT(1, 1, DOT))     \
    }

#endif
