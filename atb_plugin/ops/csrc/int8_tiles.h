/* The int8 tiles on 256-bit registers (AVX2 and VNNI), shared by isa_avx2.c, isa_avx_vnni.c and
 * isa_avx512_vnni.c: each includes this header and instantiates the blocks for its own instruction
 * set (INT8_BLOCK: the inner kernels of int8_driver.c, which says what they compute).
 *
 * A block of `count` <= OT weight rows is multiplied with all M rows of the activations in tiles
 * of TO weight rows by RT rows, the TO x RT sums in registers. One tile (INT8_TILE) serves both
 * formats; what differs, W8A16's float32 x and W8A8's int8 q, are the format's pieces below. */
#ifndef ATB_INT8_TILES_H
#define ATB_INT8_TILES_H
#include <immintrin.h>

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
#define PREFETCH_TILES_AHEAD(O, K, k)                                                                       \
    for (int c = 0; c < (O) * 32; c += 64) __builtin_prefetch((const char *)w + TILES_AHEAD * (O) * (K) + (k) * (O) + c)

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

/* W8A16's pieces: float32 x, float32 sums; per step 8 int8 weights -> 8 int32 -> 8 floats, one
 * fused multiply-add with 8 floats of x (the 32 bytes of each weight row prefetched every 4th). */
#define W8A16_IN float
#define W8A16_ACC __m256
#define W8A16_SUM float
#define W8A16_ZERO _mm256_setzero_ps
#define W8A16_HSUM hsum_ps
#define W8A16_STEP 8
#define W8A16_PREFETCH(O, K, k) if (((k) & 31) == 0) PREFETCH_TILES_AHEAD(O, K, k)
#define W8A16_WEIGHTS(O, k)                                                                                 \
    __m256 wv[O];                                                                                           \
    for (int o = 0; o < O; o++)                                                                             \
        wv[o] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + o * K + k))))
#define W8A16_ROW(r, k) const __m256 av = _mm256_loadu_ps(a + r * a_stride + k)
#define W8A16_MAC(sum, o, DOT) _mm256_fmadd_ps(av, wv[o], sum)

/* W8A8's pieces, exact int32 sums. maddubs multiplies unsigned by signed bytes and adds pairs into
 * int16 with saturation, so the operands are |w| (0..128, unsigned) and q with w's sign (q in
 * -127..127: a symmetric per-token scale never makes -128 from finite x, so negating q cannot
 * overflow): |w| * (q * sign(w)) = q * w, and a pair's sum is at most 2 * 128 * 127 = 32512 <
 * 32767: never saturates. DOT is the instruction set's: AVX2's maddubs, then madd with ones to
 * widen the pairs into int32, or VNNI's one vpdpbusd (u8 x s8, four products into each int32, no
 * saturation). */
#define W8A8_IN int8_t
#define W8A8_ACC __m256i
#define W8A8_SUM int32_t
#define W8A8_ZERO _mm256_setzero_si256
#define W8A8_HSUM hsum_epi32
#define W8A8_STEP 32
#define W8A8_PREFETCH(O, K, k) PREFETCH_TILES_AHEAD(O, K, k)
#define W8A8_WEIGHTS(O, k)                                                                                  \
    __m256i wv[O], aw[O];                                                                                   \
    for (int o = 0; o < O; o++) {                                                                           \
        wv[o] = _mm256_loadu_si256((const __m256i *)(w + o * K + k));                                       \
        aw[o] = _mm256_abs_epi8(wv[o]);                                                                     \
    }
#define W8A8_ROW(r, k) const __m256i av = _mm256_loadu_si256((const __m256i *)(a + r * a_stride + k))
#define W8A8_MAC(sum, o, DOT) DOT(sum, aw[o], _mm256_sign_epi8(av, wv[o]))

/* out[r][o] = sum_k a[r][k] * w[o][k] for R rows of `a` and O weight rows, in format F (W8A16 or
 * W8A8) with dot product DOT (W8A8). R and O are literal constants: the loops unroll and the
 * R x O sums stay in registers. The columns past the last whole step are summed one by one. */
#define INT8_TILE(R, O, F, DOT)                                                                             \
    do {                                                                                                    \
        F##_ACC acc[R][O];                                                                                  \
        for (int r = 0; r < R; r++)                                                                         \
            for (int o = 0; o < O; o++) acc[r][o] = F##_ZERO();                                             \
        int64_t k = 0;                                                                                      \
        for (; k + F##_STEP <= K; k += F##_STEP) {                                                          \
            F##_PREFETCH(O, K, k);                                                                          \
            F##_WEIGHTS(O, k);                                                                              \
            for (int r = 0; r < R; r++) {                                                                   \
                F##_ROW(r, k);                                                                              \
                for (int o = 0; o < O; o++) acc[r][o] = F##_MAC(acc[r][o], o, DOT);                         \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int o = 0; o < O; o++) {                                                                   \
                F##_SUM sum = F##_HSUM(acc[r][o]);                                                          \
                for (int64_t t = k; t < K; t++) sum += (F##_SUM)a[r * a_stride + t] * w[o * K + t];         \
                out[r * OT + o] = sum;                                                                      \
            }                                                                                               \
    } while (0)

/* The tiles covering one block of `count` (<= OT) weight rows and all M rows of x: TO weight rows
 * by RT rows where they fit, then narrower ones. Sums land in sums[r * OT + o]. */
#define BLOCK_TILES(TILE_FULL, TILE_ROW, TILE_ONE_W, TILE_ONE)                                              \
    for (int o0 = 0; o0 < count; o0 += TO) {                                                                \
        const int pair = count - o0 >= TO;                                                                  \
        for (int64_t m = 0; m < M;) {                                                                       \
            const int full = M - m >= RT;                                                                   \
            if (pair) { if (full) TILE_FULL; else TILE_ROW; }                                               \
            else { if (full) TILE_ONE_W; else TILE_ONE; }                                                   \
            m += full ? RT : 1;                                                                             \
        }                                                                                                   \
    }

/* An int8 block (int8_block_fn) of format F (W8A16 or W8A8) with dot product DOT (W8A8; empty for
 * W8A16), for the including file's instruction set. Aligned to 64 bytes so that its loops sit the
 * same way in the instruction cache whatever is linked before it: the same AVX-512 VNNI block 32
 * bytes off a 64-byte boundary ran 7-10 % slower at one row (SmolLM2's shapes, AMD EPYC Zen 5). */
#define INT8_AT(R, O, F, DOT)                                                                               \
    do {                                                                                                    \
        const F##_IN *a = (const F##_IN *)a0 + m * a_stride;                                                \
        const int8_t *w = w0 + o0 * K;                                                                      \
        F##_SUM *out = (F##_SUM *)sums + m * OT + o0;                                                       \
        INT8_TILE(R, O, F, DOT);                                                                            \
    } while (0)
#define INT8_BLOCK(NAME, F, DOT)                                                                            \
    static __attribute__((aligned(64))) void NAME(const void *a0, int64_t M, int64_t K, int64_t a_stride,   \
                                                  const int8_t *w0, int count, void *sums) {                \
        BLOCK_TILES(INT8_AT(RT, TO, F, DOT), INT8_AT(1, TO, F, DOT), INT8_AT(RT, 1, F, DOT),                \
                    INT8_AT(1, 1, F, DOT))                                                                  \
    }

#endif
