/* The AVX-512 BF16 variant: the bfloat16 panels' product with `vdpbf16ps` (compiled with the
 * AVX-512 flags and -mavx512bf16: cpu_native.UNITS). A bfloat16 panel's step (float_kernels.h
 * draws the layout) is 64 columns x a pair of k, each 32-bit lane one column's W[.][k] (low half)
 * and W[.][k+1] (high half): exactly the operand `vdpbf16ps` takes, so the kernel reads the panels
 * the widening kernel reads, and one instruction does the two multiply-adds the widening kernel
 * does after two integer ops. Its x is bfloat16 pairs too (linear_bf16w makes them): the products
 * of two bfloat16 values are exact in float32, the sums float32 (the instruction's rounding:
 * nearest even, denormals as zero). A float32 x is split by the caller into a bfloat16 part and a
 * bfloat16 remainder (x_lo), each multiplied in: x is then carried to 2^-18 of itself, inside
 * the float32 sums' own error bound (ops/calibration.py, `tolerance`).
 *
 * Which rows run here rather than on the widening kernel is the calibration's choice per row
 * bucket (docs/architecture.md, "Chosen by measurement"); the slot is filled here and, as a
 * reference in plain C, by isa_portable.c. */
#include <immintrin.h>

#include "panel_sweep.h"

struct dot_call {
    const uint32_t *x, *x_lo;
    const float *bias;
    float *y;
    int64_t x_stride, y_stride, steps;
};

/* A tile of `rows` (constant: one loop per row count, its 4 x rows sums in registers) times one
 * panel: per step 4 vector loads of the panel, one broadcast pair of x per row (two with x_lo),
 * 4 x rows dot products (8 x rows). */
static inline __attribute__((always_inline)) void dot_tile(const struct dot_call *c, int64_t m0, const int rows,
                                                           const int split, int64_t p, const char *panel,
                                                           int64_t cols, const char *prefetch, int64_t lines) {
    const uint32_t *x = c->x + m0 * c->x_stride, *x_lo = split ? c->x_lo + m0 * c->x_stride : NULL;
    const int64_t steps = c->steps, x_stride = c->x_stride;
    const float *bias = c->bias ? c->bias + p * PANEL : NULL;
    __m512 acc[MR][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
    int64_t due = 0; /* lines * (s + 1) / steps prefetches are due after step s (float_kernels.h) */
    for (int64_t s = 0; s < steps; s++) {
        for (due += lines; due >= steps; due -= steps, prefetch += 64) __builtin_prefetch(prefetch, 0, 2);
        const char *w = panel + s * STEP_BYTES;
        __m512bh wv[4];
        for (int j = 0; j < 4; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + 64 * j);
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)x[r * x_stride + s]);
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], b);
            if (split) {
                const __m512bh lo = (__m512bh)_mm512_set1_epi32((int)x_lo[r * x_stride + s]);
                for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], lo);
            }
        }
    }
    float *y = c->y + m0 * c->y_stride + p * PANEL;
    for (int r = 0; r < rows; r++) {
        if (cols == PANEL) {
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(y + r * c->y_stride + 16 * j, acc[r][j]);
        } else {
            float full[PANEL];
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(full + 16 * j, acc[r][j]);
            memcpy(y + r * c->y_stride, full, cols * sizeof(float));
        }
    }
}

#define DOT_TILE(n) dot_tile(c, m0, n, split, p, panel, cols, prefetch, lines)
static void dot_rows(const void *ctx, int64_t m0, int rows, int64_t p, const char *panel, int64_t cols,
                     const char *prefetch, int64_t lines) {
    const struct dot_call *c = ctx;
    PANEL_TILE_ROWS_BY(c->x_lo != NULL, split, DOT_TILE)
}

static void linear_bf16_dot(const uint32_t *x, const uint32_t *x_lo, int64_t M, int64_t steps, int64_t x_stride,
                            const char *panels, int64_t N, const float *bias, float *y, int64_t y_stride,
                            int num_threads) {
    const struct dot_call call = {x, x_lo, bias, y, x_stride, y_stride, steps};
    sweep_panels(M, N, steps, panels, num_threads, dot_rows, &call);
}

const struct cpu_variant cpu_variant_avx512_bf16 = {
    "avx512_bf16", FEATURE_AVX2 | FEATURE_AVX512 | FEATURE_AVX512_BF16, {.linear_bf16_dot = linear_bf16_dot}};
