/* Native CPU kernels, float32: decode attention over the paged KV cache, RMSNorm, rotary, SiLU-and-mul.
 *
 * Built and loaded by atb_plugin/ops/cpu_native.py (why they exist, how they are built, what they
 * are checked against: docs/architecture.md, "Native CPU kernels").
 *
 * Decode attention: one new token per request. The torch path gathers
 * each request's blocks into a padded copy and runs SDPA over the copy; this reads the blocks in
 * place, so K and V are read once and nothing is written but the output.
 *
 * Layouts (all contiguous, row-major):
 *   query, out     (batch, heads, head_dim)
 *   key/value      (num_blocks, block_size, kv_heads, head_dim)   one layer's cache
 *   block_tables   (batch, table_stride) int32                    request b's blocks, in order
 *   seq_lens       (batch) int32                                   cached tokens incl. the new one
 * Query head h reads KV head h / (heads / kv_heads) (grouped-query attention).
 *
 * Per request, in three passes: scores[h][t] = scale * q_h . k_t for every cached token t (each
 * token's K row, all kv heads, read once), a softmax per head, then out_h = sum_t p[h][t] v_t
 * (each V row read once). Requests run in parallel (OpenMP, the caller's thread count).
 * Returns 0, or 1 when a scratch allocation failed (the output is then incomplete).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline __attribute__((always_inline)) int decode_one(
    const float *q, const float *key_cache, const float *value_cache, const int32_t *table,
    int64_t len, float *out, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
    float scale) {
    const int64_t group = heads / kv_heads;
    const int64_t token_stride = kv_heads * head_dim, block_stride = block_size * token_stride;
    float *scores = malloc(sizeof(float) * heads * (len + head_dim)); /* (heads, len), then (heads, head_dim) */
    if (!scores) return 1;
    float *acc = scores + heads * len;
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const float *k = key_cache + (int64_t)table[t0 / block_size] * block_stride;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t j = 0; j < n; j++, k += token_stride)
            for (int64_t h = 0; h < heads; h++) {
                const float *kh = k + (h / group) * head_dim, *qh = q + h * head_dim;
                float s = 0.f;
                for (int64_t d = 0; d < head_dim; d++) s += qh[d] * kh[d];
                scores[h * len + t0 + j] = s * scale;
            }
    }
    for (int64_t h = 0; h < heads; h++) {
        float *s = scores + h * len, top = s[0], sum = 0.f;
        for (int64_t t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
        for (int64_t t = 0; t < len; t++) {
            s[t] = expf(s[t] - top);
            sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * heads * head_dim);
    for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const float *v = value_cache + (int64_t)table[t0 / block_size] * block_stride;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t j = 0; j < n; j++, v += token_stride)
            for (int64_t h = 0; h < heads; h++) {
                const float p = scores[h * len + t0 + j], *vh = v + (h / group) * head_dim;
                float *a = acc + h * head_dim;
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * vh[d];
            }
    }
    memcpy(out, acc, sizeof(float) * heads * head_dim);
    free(scores);
    return 0;
}

/* A constant head_dim lets the compiler unroll the dot products and keep them in registers. */
#define DECODE_ONE(D) decode_one(q, key_cache, value_cache, table, len, o, heads, kv_heads, D, block_size, scale)

int paged_decode_f32(const float *query, const float *key_cache, const float *value_cache,
                     const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                     float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     int64_t block_size, float scale, int num_threads) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) reduction(| : failed)
    for (int64_t b = 0; b < batch; b++) {
        const float *q = query + b * heads * head_dim;
        float *o = out + b * heads * head_dim;
        const int32_t *table = block_tables + b * table_stride;
        const int64_t len = seq_lens[b];
        switch (head_dim) {
            case 64: failed |= DECODE_ONE(64); break;
            case 128: failed |= DECODE_ONE(128); break;
            default: failed |= DECODE_ONE(head_dim);
        }
    }
    return failed;
}

/* ---- elementwise ops, one call where torch dispatches 4 to 8 ops ------------------------------ */

/* out = weight * x / sqrt(mean(x^2) + eps), row by row. x rows `x_stride` floats apart; out and
 * weight contiguous. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out, int64_t rows, int64_t width,
                  float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * width, sum = 0.f;
        for (int64_t i = 0; i < width; i++) sum += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(sum / (float)width + eps);
        for (int64_t i = 0; i < width; i++) o[i] = weight[i] * (xr[i] * inv);
    }
}

/* Rotary embedding, "rotate half" form: with x = [x1, x2] (halves of head_dim),
 * out = x * cos + [-x2, x1] * sin. x is (tokens, heads, head_dim) with token / head strides in
 * floats (a slice of the fused QKV output); cos and sin (tokens, head_dim); out contiguous. */
void rotary_f32(const float *x, int64_t token_stride, int64_t head_stride, const float *cos, const float *sin,
                float *out, int64_t tokens, int64_t heads, int64_t head_dim, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xh = x + t * token_stride + h * head_stride;
            float *o = out + (t * heads + h) * head_dim;
            for (int64_t i = 0; i < half; i++) o[i] = xh[i] * c[i] - xh[i + half] * s[i];
            for (int64_t i = half; i < head_dim; i++) o[i] = xh[i] * c[i] + xh[i - half] * s[i];
        }
    }
}

/* out = silu(x[:, :width]) * x[:, width:], silu(a) = a / (1 + exp(-a)). x rows `x_stride` apart. */
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t width,
                      int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + width;
        float *o = out + r * width;
        for (int64_t i = 0; i < width; i++) o[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
    }
}
