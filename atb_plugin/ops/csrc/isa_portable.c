/* The portable variant: plain C, compiled without instruction-set flags (baseline x86-64; on other
 * architectures -march=native: cpu_native.UNITS). Every slot has a kernel here, so the table is
 * complete on any CPU; the float kernels still run in vectors (SSE2 on baseline x86-64). */
#include "cpu_kernels.h"
#include "float_kernels.h"

/* The int8 blocks as plain loops (int8_block_fn): what the compiler makes of them. */
#define SCALAR_BLOCK(NAME, A, SUM)                                                                          \
    static void NAME(const void *a_, int64_t M, int64_t K, int64_t a_stride, const int8_t *w, int count,      \
                     void *sums_) {                                                                         \
        const A *a = a_;                                                                                    \
        SUM *sums = sums_;                                                                                  \
        for (int64_t m = 0; m < M; m++)                                                                     \
            for (int o = 0; o < count; o++) {                                                               \
                SUM sum = 0;                                                                                \
                for (int64_t k = 0; k < K; k++) sum += (SUM)a[m * a_stride + k] * w[o * K + k];            \
                sums[m * OT + o] = sum;                                                                     \
            }                                                                                               \
    }
SCALAR_BLOCK(w8a16_block, float, float)
SCALAR_BLOCK(w8a8_block, int8_t, int32_t)

/* The bfloat16 dot-product product (linear_bf16_dot_fn) in plain C: the reference the AVX-512 BF16
 * kernel is tested against, and the slot's filler where no such kernel executes (the calibration
 * never times it: cpu_native.bf16_dot_variant). Each pair: the k + 1 product added, then k's. */
static void linear_bf16_dot(const uint32_t *x, const uint32_t *x_lo, int64_t M, int64_t steps, int64_t x_stride,
                            const char *panels, int64_t N, const float *bias, float *y, int64_t y_stride,
                            int num_threads) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(num_threads) if (num_panels > 1)
    for (int64_t p = 0; p < num_panels; p++) {
        const uint32_t *panel = (const uint32_t *)(panels + p * steps * PANEL * 4);
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < PANEL && p * PANEL + j < N; j++) {
                float sum = bias ? bias[p * PANEL + j] : 0.f;
                for (int64_t s = 0; s < steps; s++) {
                    const uint32_t w = panel[s * PANEL + j];
                    for (int part = 0; part < (x_lo ? 2 : 1); part++) {
                        const uint32_t a = (part ? x_lo : x)[m * x_stride + s];
                        sum += bf16_to_float((uint16_t)(w >> 16)) * bf16_to_float((uint16_t)(a >> 16));
                        sum += bf16_to_float((uint16_t)w) * bf16_to_float((uint16_t)a);
                    }
                }
                y[m * y_stride + p * PANEL + j] = sum;
            }
    }
}

static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t x_stride, int8_t *q, int64_t q_stride,
                          float *s) {
    quantize_rows_with(x, M, K, x_stride, q, q_stride, s, NULL, NULL);
}

const struct cpu_variant cpu_variant_portable = {
    "portable", 0,
    {FLOAT_KERNELS, .quantize_rows = quantize_rows, .w8a16_block = w8a16_block, .w8a8_block = w8a8_block,
     .linear_bf16_dot = linear_bf16_dot},
};
