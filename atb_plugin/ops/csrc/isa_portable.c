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

static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t x_stride, int8_t *q, int64_t q_stride,
                          float *s) {
    quantize_rows_with(x, M, K, x_stride, q, q_stride, s, NULL, NULL);
}

const struct cpu_variant cpu_variant_portable = {
    "portable", 0,
    {FLOAT_KERNELS, .quantize_rows = quantize_rows, .w8a16_block = w8a16_block, .w8a8_block = w8a8_block},
};
