/* The int8 linear layers: W8A16 (weights dequantised in registers) and W8A8 (dynamic per-token),
 * one driver for both (docs/architecture.md, "Native CPU kernels").
 *
 * Both take the checkpoint's weight as it is, (N, K) int8 row-major, and take dot products along
 * its contiguous K. A block of OT weight rows (OT x K bytes, in L1 for the K of the models here)
 * is multiplied with every row of the activations by the slot's inner kernel (w8a16_block on
 * float32 x, w8a8_block on x quantised per row: isa_*.c); blocks are shared out between the
 * threads; each block's sums are then scaled here. The two formats differ only in what the inner
 * kernel reads and in that last step. */
#include "cpu_kernels.h"

#define STACK_Q_BYTES 16384 /* quantised bytes of x that may live on the stack (with STACK_ROWS rows) */

/* One call's operands, as each block reads them. */
struct int8_call {
    int format;           /* LINEAR_W8A16 or LINEAR_W8A8_DYNAMIC */
    int8_block_fn *block; /* the inner kernel */
    const void *a;        /* W8A16: x (float32); W8A8: q (int8) */
    int64_t a_stride, M, K, N;
    const int8_t *w;
    const float *scale, *offset, *bias; /* (N); offset W8A16 only, offset and bias may be NULL */
    const float *rowsum;                /* W8A16 with an offset: sum(x[m]) */
    const float *s;                     /* W8A8: x's per-row scales */
    float *y;
    int64_t y_stride;
};

/* W8A16: y = scale[o] * (x . w[o] + offset[o] * sum(x)) + bias[o], from float32 sums. */
static void finish_w8a16(const struct int8_call *c, const float *sums, int64_t o0, int count) {
    const float *offset = c->offset, *rowsum = c->rowsum, *scale = c->scale, *bias = c->bias;
    float *y = c->y;
    for (int64_t m = 0; m < c->M; m++)
        for (int o = 0; o < count; o++) {
            float v = sums[m * OT + o];
            if (offset) v += offset[o0 + o] * rowsum[m];
            v *= scale[o0 + o];
            y[m * c->y_stride + o0 + o] = bias ? v + bias[o0 + o] : v;
        }
}

/* W8A8: y = acc * s[m] * w_scale[o] + bias[o], from exact int32 sums. */
static void finish_w8a8(const struct int8_call *c, const int32_t *sums, int64_t o0, int count) {
    const float *s = c->s, *w_scale = c->scale, *bias = c->bias;
    float *y = c->y;
    for (int64_t m = 0; m < c->M; m++)
        for (int o = 0; o < count; o++) {
            const float v = (float)sums[m * OT + o] * s[m] * w_scale[o0 + o];
            y[m * c->y_stride + o0 + o] = bias ? v + bias[o0 + o] : v;
        }
}

/* Blocks lo .. hi-1 of OT weight rows. Returns 0, or 1 when scratch failed. */
static int int8_blocks(const struct int8_call *c, int64_t lo, int64_t hi) {
    union { float f[STACK_ROWS * OT]; int32_t i[STACK_ROWS * OT]; } stack; /* either format's sums */
    void *sums = c->M <= STACK_ROWS ? (void *)&stack : malloc(sizeof(int32_t) * c->M * OT);
    if (!sums) return 1;
    for (int64_t b = lo; b < hi; b++) {
        const int64_t o0 = b * OT;
        const int count = c->N - o0 < OT ? (int)(c->N - o0) : OT;
        c->block(c->a, c->M, c->K, c->a_stride, c->w + o0 * c->K, count, sums);
        if (c->format == LINEAR_W8A16) finish_w8a16(c, sums, o0, count);
        else finish_w8a8(c, sums, o0, count);
    }
    if (sums != (void *)&stack) free(sums);
    return 0;
}

/* Every block, shared out in contiguous runs between the threads. One thread runs without an
 * OpenMP team and, for few rows, with its scratch on the stack: a decode step makes ~4 of these
 * calls per layer, and heap scratch and a parallel region per call were host time a one-request
 * step paid for nothing. Each block's sums are the same whichever thread computes them. */
static int int8_linear(const struct int8_call *c, int num_threads) {
    const int64_t blocks = (c->N + OT - 1) / OT;
    if (num_threads <= 1 || blocks <= 1) return int8_blocks(c, 0, blocks);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int64_t share = (blocks + omp_get_num_threads() - 1) / omp_get_num_threads();
        const int64_t lo = share * omp_get_thread_num(), hi = lo + share < blocks ? lo + share : blocks;
        if (lo < hi) failed |= int8_blocks(c, lo, hi);
    }
    return failed;
}

/* y = x @ ((w + offset[:, None]) * scale[:, None]).T + bias, computed as
 * scale[o] * (x . w[o] + offset[o] * sum(x)) + bias[o]: int8 weights widened to float32 in
 * registers, float32 sums. x (M, K) rows x_stride apart; w (N, K) int8; scale (N); offset and
 * bias (N) or NULL; y (M, N) rows y_stride apart. Returns 0, or 1 when scratch failed. */
int w8a16_linear_f32(const float *x, int64_t M, int64_t K, int64_t x_stride, const int8_t *w, int64_t N,
                     const float *scale, const float *offset, const float *bias, float *y, int64_t y_stride,
                     int num_threads) {
    float *rowsum = NULL;
    if (offset) {
        rowsum = malloc(sizeof(float) * M);
        if (!rowsum) return 1;
        for (int64_t m = 0; m < M; m++) {
            float sum = 0.f;
            for (int64_t k = 0; k < K; k++) sum += x[m * x_stride + k];
            rowsum[m] = sum;
        }
    }
    const struct int8_call c = {.format = LINEAR_W8A16, .block = cpu_kernels.w8a16_block, .a = x, .a_stride = x_stride,
                                .M = M, .K = K, .N = N, .w = w, .scale = scale, .offset = offset, .bias = bias,
                                .rowsum = rowsum, .y = y, .y_stride = y_stride};
    const int failed = int8_linear(&c, num_threads);
    free(rowsum);
    return failed;
}

/* Per-token symmetric int8 (quantize_rows_with in cpu_kernels.h: the rule). q rows q_stride apart. */
void quantize_rows_s8(const float *x, int64_t M, int64_t K, int64_t x_stride, int8_t *q, int64_t q_stride,
                      float *s) {
    cpu_kernels.quantize_rows(x, M, K, x_stride, q, q_stride, s);
}

/* y = (sum_k q[m][k] * w[o][k]) * s[m] * w_scale[o] + bias[o], the sum exact in int32 (|q|, |w|
 * <= 128: exact for K < 2^31 / 128^2 = 131072). x (M, K) float32 rows x_stride apart, quantised
 * per row first (quantize_rows_s8); w (N, K) int8; w_scale (N); bias (N) or NULL; y (M, N) rows
 * y_stride apart. Returns 0, or 1 when scratch failed. */
int w8a8_dynamic_linear_f32(const float *x, int64_t M, int64_t K, int64_t x_stride, const int8_t *w, int64_t N,
                            const float *w_scale, const float *bias, float *y, int64_t y_stride, int num_threads) {
    /* A decode step's few rows quantise into the stack (as int8_linear keeps its sums there). */
    int8_t q_stack[STACK_Q_BYTES] __attribute__((aligned(64)));
    float s_stack[STACK_ROWS];
    const int small = M <= STACK_ROWS && M * K <= STACK_Q_BYTES;
    int8_t *q = small ? q_stack : malloc((size_t)(M * K));
    float *s = small ? s_stack : malloc(sizeof(float) * M);
    int failed = !q || !s;
    if (!failed) {
        cpu_kernels.quantize_rows(x, M, K, x_stride, q, K, s);
        const struct int8_call c = {.format = LINEAR_W8A8_DYNAMIC, .block = cpu_kernels.w8a8_block, .a = q,
                                    .a_stride = K, .M = M, .K = K, .N = N, .w = w, .scale = w_scale, .bias = bias,
                                    .s = s, .y = y, .y_stride = y_stride};
        failed = int8_linear(&c, num_threads);
    }
    if (!small) {
        free(q);
        free(s);
    }
    return failed;
}
