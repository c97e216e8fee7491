/* Native CPU kernels, float32: decode attention over the paged KV cache, RMSNorm, rotary, SiLU-and-mul.
 *
 * Built and loaded by atb_plugin/ops/cpu_native.py (why they exist, how they are built, what they
 * are checked against: docs/architecture.md, "Native CPU kernels").
 *
 * Decode attention: one new token per request. The torch path gathers each request's blocks into
 * a padded copy and runs SDPA over the copy; this reads the blocks in place, so K and V are read
 * once and nothing is written but the output.
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
 * (each V row read once), in explicit vectors (GCC vector extensions: AVX-512 or AVX2 as
 * -march=native allows). head_dim must be a multiple of 16 (every model here; the caller sends
 * others to SDPA). Requests run in parallel (OpenMP, the caller's thread count). Returns 0, or 1
 * when a scratch allocation failed (the output is then incomplete).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));
static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* e^x, within ~2 ulp of expf: x = n ln2 + r with |r| <= ln2/2, e^r by Cephes' expf polynomial,
 * 2^n added to the exponent bits. x is clamped to [-87, 88]: e^-87 ~ 1.6e-38 stands for every
 * smaller value (nothing beside a softmax maximum's 1, or in silu's 1 + e^-x), e^88 ~ 1.7e38
 * for every larger one (silu(x) for x < -88 is then x / 1.7e38 ~ -0). libm's expf, one value
 * at a time, was a large share of the attention kernel's time and made SiLU slower than torch's
 * (benchmarks/RESULTS.md, bench_engine "Third round"). */
static inline vf vexp(vf x) {
    const vi below = x < -87.f, above = x > 88.f;
    x = (vf)((below & (vi)(x * 0.f - 87.f)) | (above & (vi)(x * 0.f + 88.f)) | (~(below | above) & (vi)x));
    const vf y = x * 1.44269504088896341f;
    const vf half = (vf)(((vi)y & (int32_t)0x80000000) | 0x3f000000); /* 0.5 with y's sign */
    const vi n = __builtin_convertvector(y + half, vi); /* round(x / ln2), halves away from 0 */
    const vf fn = __builtin_convertvector(n, vf);
    const vf r = x - fn * 0.693359375f + fn * 2.12194440e-4f; /* ln2 in two parts: r exact */
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    return (vf)((vi)p + (n << 23));
}

/* The address of token t's row (all kv heads) in a cache, and a prefetch of the row LANES tokens
 * on: blocks are scattered, so at a block's end the hardware prefetcher has nothing to follow. */
static inline const float *row_of(const float *cache, const int32_t *table, int64_t t, int64_t len,
                                  int64_t block_size, int64_t token_stride) {
    const int64_t block_stride = block_size * token_stride, ahead = t + LANES;
    if (ahead < len) {
        const float *next = cache + (int64_t)table[ahead / block_size] * block_stride + (ahead % block_size) * token_stride;
        for (int64_t f = 0; f < token_stride; f += 64 / sizeof(float)) __builtin_prefetch(next + f);
    }
    return cache + (int64_t)table[t / block_size] * block_stride + (t % block_size) * token_stride;
}

/* head_dim a multiple of LANES (faster than the same passes in plain C loops on a 30-layer,
 * 32-request step: benchmarks/RESULTS.md, bench_engine "Third round"). V is summed LANES
 * tokens at a time so each head's accumulator stays in registers over the chunk while the
 * chunk's V rows stay in L1. */
static inline __attribute__((always_inline)) int decode_vec(
    const float *q, const float *key_cache, const float *value_cache, const int32_t *table,
    int64_t len, float *out, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
    float scale) {
    const int64_t group = heads / kv_heads, chunks = head_dim / LANES, token_stride = kv_heads * head_dim;
    const int64_t padded = (len + LANES - 1) / LANES * LANES;
    float *scores = malloc(sizeof(float) * heads * (padded + head_dim)); /* (heads, padded), then (heads, head_dim) */
    if (!scores) return 1;
    float *acc = scores + heads * padded;
    for (int64_t t = 0; t < len; t++) {
        const float *k = row_of(key_cache, table, t, len, block_size, token_stride);
        for (int64_t h = 0; h < heads; h++) {
            const float *kh = k + (h / group) * head_dim, *qh = q + h * head_dim;
            vf s = load(qh) * load(kh);
            for (int64_t c = 1; c < chunks; c++) s += load(qh + c * LANES) * load(kh + c * LANES);
            float total = 0.f;
            for (int l = 0; l < LANES; l++) total += s[l];
            scores[h * padded + t] = total * scale;
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        float *s = scores + h * padded, top = s[0];
        for (int64_t t = 1; t < len; t++) top = s[t] > top ? s[t] : top;
        for (int64_t t = len; t < padded; t++) s[t] = -INFINITY; /* unused lanes of the last chunk */
        vf sums = {0};
        for (int64_t t = 0; t < padded; t += LANES) {
            const vf e = vexp(load(s + t) - top);
            store(s + t, e);
            sums += e;
        }
        float sum = 0.f;
        for (int l = 0; l < LANES; l++) sum += sums[l];
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < padded; t += LANES) store(s + t, load(s + t) * inv);
    }
    memset(acc, 0, sizeof(float) * heads * head_dim);
    for (int64_t t0 = 0; t0 < len; t0 += LANES) {
        const int64_t n = len - t0 < LANES ? len - t0 : LANES;
        const float *rows[LANES];
        for (int64_t j = 0; j < n; j++) rows[j] = row_of(value_cache, table, t0 + j, len, block_size, token_stride);
        for (int64_t h = 0; h < heads; h++) {
            const float *p = scores + h * padded + t0;
            const int64_t offset = (h / group) * head_dim;
            for (int64_t c = 0; c < chunks; c++) {
                vf a = load(acc + h * head_dim + c * LANES);
                for (int64_t j = 0; j < n; j++) a += p[j] * load(rows[j] + offset + c * LANES);
                store(acc + h * head_dim + c * LANES, a);
            }
        }
    }
    memcpy(out, acc, sizeof(float) * heads * head_dim);
    free(scores);
    return 0;
}

/* A constant head_dim lets the compiler unroll the loops over it. */
#define DECODE_VEC(D) decode_vec(q, key_cache, value_cache, table, len, o, heads, kv_heads, D, block_size, scale)

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
            case 64: failed |= DECODE_VEC(64); break;
            case 128: failed |= DECODE_VEC(128); break;
            default: failed |= DECODE_VEC(head_dim);
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

/* out = silu(x[:, :width]) * x[:, width:], silu(a) = a / (1 + e^-a). x rows `x_stride` apart. */
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t width,
                      int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + width;
        float *o = out + r * width;
        int64_t i = 0;
        for (; i + LANES <= width; i += LANES) {
            const vf g = load(gate + i);
            store(o + i, g / (1.f + vexp(-g)) * load(up + i));
        }
        for (; i < width; i++) o[i] = gate[i] / (1.f + expf(-gate[i])) * up[i];
    }
}

/* out[r] = the index of row r's largest value, the first on ties, as torch.argmax (greedy
 * sampling over the vocabulary; torch's takes several times longer here: benchmarks/RESULTS.md,
 * bench_engine "Fifth round"). A row holding NaN gives its first NaN, as torch's does (NaN
 * counts as the largest). x rows `x_stride` apart. */
void argmax_f32(const float *x, int64_t x_stride, int64_t rows, int64_t width, int64_t *out, int num_threads) {
    vi lane;
    for (int l = 0; l < LANES; l++) lane[l] = l;
#pragma omp parallel for num_threads(num_threads) if (rows >= 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * x_stride;
        float top = -INFINITY;
        int64_t index = 0, i = 0;
        int nan = 0;
        if (width >= LANES) { /* per lane: its largest value and where it first occurs */
            vf best = load(row);
            vi where = lane, nans = best != best;
            for (i = LANES; i + LANES <= width; i += LANES) {
                const vf v = load(row + i);
                const vi more = v > best;
                best = (vf)((more & (vi)v) | (~more & (vi)best));
                where = (more & (lane + (int32_t)i)) | (~more & where);
                nans |= v != v;
            }
            top = best[0];
            index = where[0];
            for (int l = 1; l < LANES; l++) {
                if (best[l] > top || (best[l] == top && where[l] < index)) {
                    top = best[l];
                    index = where[l];
                }
                nan |= nans[l] != 0;
            }
            nan |= nans[0] != 0;
        } else {
            top = row[0];
            i = 1;
            nan = row[0] != row[0];
        }
        for (; i < width; i++) { /* the tail: later than every index above, so only a larger value wins */
            if (row[i] > top) {
                top = row[i];
                index = i;
            }
            nan |= row[i] != row[i];
        }
        if (nan)
            for (index = 0; row[index] == row[index]; index++) {}
        out[r] = index;
    }
}

/* Linear layers: y = x W^T (+ bias) with W (N, K) held as column panels (docs/architecture.md,
 * "Native CPU kernels"):
 *
 *   panels[p][k][j] = W[p * PANEL + j][k]        p < ceil(N / PANEL), columns past N are zero
 *
 *        k ->                    panel p, read front to back:
 *   W  [ row p*64     ]          k=0: W[p*64..p*64+63][0]   (64 floats, 4 vectors)
 *      [ ...          ]   --->   k=1: W[p*64..p*64+63][1]
 *      [ row p*64+63  ]          ...  one contiguous K x 64 block per panel
 *
 * A tile of MR rows of x times one panel keeps MR x 4 vector sums in registers: per k, 4 vector
 * loads of the panel, MR broadcasts of x, 4 MR fused multiply-adds. One row (decode of a single
 * stream) streams the panels once, front to back; with more rows, the panel (K x 256 bytes) stays
 * in L2 for all its row tiles, which share out prefetching the next panel into L2 while they
 * compute, so reading the weights from DRAM overlaps the arithmetic instead of alternating with it
 * (that overlap is what beats oneDNN's packed GEMM at 32 rows: benchmarks/RESULTS.md). */
#define PANEL 64
#define MR 6
#define PREFETCH_AHEAD 8 /* k steps (of 256 bytes) a tile streaming its own panel prefetches ahead */

/* Always inlined and called with a constant `rows` (linear_rows below), so that each row count
 * gets its own loop with its rows x 4 sums in registers: a loop over a variable row count keeps
 * them in memory (what made the first version slower than oneDNN at 1-4 rows and at 2048:
 * benchmarks/RESULTS.md, bench_engine "Fourth round"). */
static inline __attribute__((always_inline)) void linear_tile(
        const float *x, int64_t x_stride, const int rows, int64_t K, const float *panel, const float *bias, float *y,
        int64_t y_stride, int64_t cols, const float *prefetch, int64_t lines) {
    vf acc[MR][4];
    int64_t due = 0; /* lines * (k + 1) / K prefetches are due after step k, issued as they fall due */
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = bias ? load(bias + LANES * j) : (vf){0};
    for (int64_t k = 0; k < K; k++) {
        const float *w = panel + k * PANEL;
        for (due += lines; due >= K; due -= K, prefetch += LANES) __builtin_prefetch(prefetch, 0, 2);
        const vf w0 = load(w), w1 = load(w + LANES), w2 = load(w + 2 * LANES), w3 = load(w + 3 * LANES);
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++) {
            const float b = x[r * x_stride + k];
            acc[r][0] += w0 * b; acc[r][1] += w1 * b; acc[r][2] += w2 * b; acc[r][3] += w3 * b;
        }
    }
    for (int r = 0; r < rows; r++) {
        float *out = y + r * y_stride;
        if (cols == PANEL) {
            for (int j = 0; j < 4; j++) store(out + LANES * j, acc[r][j]);
        } else { /* the last, partial panel: only its real columns */
            float full[PANEL];
            for (int j = 0; j < 4; j++) store(full + LANES * j, acc[r][j]);
            memcpy(out, full, cols * sizeof(float));
        }
    }
}

#define LINEAR_TILE(n) linear_tile(x, x_stride, n, K, panel, bias, y, y_stride, cols, prefetch, lines)
static void linear_rows(const float *x, int64_t x_stride, int rows, int64_t K, const float *panel, const float *bias,
                        float *y, int64_t y_stride, int64_t cols, const float *prefetch, int64_t lines) {
    switch (rows) {
    case 1: LINEAR_TILE(1); break;
    case 2: LINEAR_TILE(2); break;
    case 3: LINEAR_TILE(3); break;
    case 4: LINEAR_TILE(4); break;
    case 5: LINEAR_TILE(5); break;
    default: LINEAR_TILE(MR); break;
    }
}

/* y (M, N), rows y_stride apart; x (M, K), rows x_stride apart; bias NULL or ceil(N/PANEL)*PANEL. */
void linear_f32(const float *x, int64_t M, int64_t K, int64_t x_stride, const float *panels, int64_t N,
                const float *bias, float *y, int64_t y_stride, int num_threads) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL, row_tiles = (M + MR - 1) / MR;
    const int64_t panel_lines = K * PANEL / LANES; /* 64-byte lines in one panel */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_panels > 1)
    for (int64_t p = 0; p < num_panels; p++) {
        const float *panel = panels + p * K * PANEL;
        const int64_t cols = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
        for (int64_t t = 0; t < row_tiles; t++) {
            const int64_t m0 = t * MR;
            const int rows = (int)(M - m0 < MR ? M - m0 : MR);
            /* What this tile prefetches into L2, spread evenly over its K steps: a lone tile (at
             * most MR rows) and the first panel's first tile stream their own panel, ahead of
             * where they read; otherwise the tiles share out the next panel's lines in proportion
             * to their rows (the first panel's first tile sits that out), so the next panel
             * arrives while this one is computed. A prefetch past the panels' end is a wasted
             * hint, never a fault. */
            const float *prefetch = NULL;
            int64_t lines = 0;
            if (row_tiles == 1 || (t == 0 && p == 0)) {
                prefetch = panel + PREFETCH_AHEAD * PANEL;
                lines = panel_lines;
            } else if (p + 1 < num_panels) {
                const int64_t skip = p == 0 ? MR : 0, first = panel_lines * (m0 - skip) / (M - skip);
                lines = panel_lines * (m0 + rows - skip) / (M - skip) - first;
                prefetch = panel + K * PANEL + first * LANES;
            }
            linear_rows(x + m0 * x_stride, x_stride, rows, K, panel, bias ? bias + p * PANEL : NULL,
                        y + m0 * y_stride + p * PANEL, y_stride, cols, prefetch, lines);
        }
    }
}

/* ---- the captured decode step: every decoder layer of one decode step in one call ------------
 *
 * What atb_plugin/models/native_decode.py records once (docs/architecture.md, "The captured
 * decode step"): the address of every layer's weights (column panels, norms) and KV cache, and a
 * scratch area for the activations. A decode step then costs one call from Python instead of
 * ~20 ops per layer, each with its wrapper and output allocation (host time that was a large
 * share of a single-stream step: benchmarks/RESULTS.md, bench_engine "Fifth round"). The step
 * runs the same kernels as the eager path, in the same order, so its results are bit-identical
 * to it:
 *
 *   residual = embeds
 *   per layer:  x = rms_norm(residual)            qkv = linear(x)            q, k = rotary(q, k)
 *               cache[slot] = k, v                a = paged_decode(q)        residual += linear(a)
 *               x = rms_norm(residual)            residual += down(silu_and_mul(gate_up(x)))
 *   out = rms_norm(residual)
 *
 * Scratch (floats), rows * each of: hidden (x), qkv_n (qkv), q_size (q), kv_size (k), q_size (a),
 * hidden (proj), 2 * intermediate (gate_up), intermediate (act), hidden (the residual stream):
 * decode_scratch_floats. */
typedef struct {
    const float *input_norm, *post_norm; /* (hidden) */
    const float *qkv, *qkv_bias;         /* panels (qkv_n outputs); bias NULL or padded */
    const float *o, *gate_up, *down;     /* panels */
    float *key_cache, *value_cache;      /* (num_blocks, block_size, kv_heads, head_dim) */
} decode_layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const decode_layer *layers;
    const float *final_norm;
} decode_model;

int64_t decode_scratch_floats(const decode_model *m, int64_t rows) {
    const int64_t q_size = m->heads * m->head_dim, kv_size = m->kv_heads * m->head_dim;
    return rows * (3 * m->hidden + (q_size + 2 * kv_size) + 2 * q_size + kv_size + 3 * m->intermediate);
}

static void add_rows(float *residual, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) residual[i] += x[i];
}

/* embeds, out (rows, hidden); cos, sin (rows, head_dim); slots (rows) int64, -1 = do not write;
 * block_tables, seq_lens as paged_decode_f32 takes them. The caller has checked every slot and
 * block id against the caches. Returns 0, or 1 when the attention's scratch allocation failed. */
int decode_step_f32(const decode_model *m, const float *embeds, float *out, int64_t rows, const float *cos,
                    const float *sin, const int64_t *slots, const int32_t *block_tables, int64_t table_stride,
                    const int32_t *seq_lens, float *scratch, int num_threads) {
    const int64_t H = m->hidden, D = m->head_dim, I = m->intermediate;
    const int64_t q_size = m->heads * D, kv_size = m->kv_heads * D, qkv_n = q_size + 2 * kv_size;
    float *x = scratch, *qkv = x + rows * H, *q = qkv + rows * qkv_n, *k = q + rows * q_size;
    float *a = k + rows * kv_size, *proj = a + rows * q_size, *gate_up = proj + rows * H, *act = gate_up + rows * 2 * I;
    float *stream = act + rows * I; /* (rows, hidden): the residual stream */
    memcpy(stream, embeds, sizeof(float) * rows * H);
    for (int64_t l = 0; l < m->num_layers; l++) {
        const decode_layer *L = m->layers + l;
        rms_norm_f32(stream, H, L->input_norm, x, rows, H, m->eps, num_threads);
        linear_f32(x, rows, H, H, L->qkv, qkv_n, L->qkv_bias, qkv, qkv_n, num_threads);
        rotary_f32(qkv, qkv_n, D, cos, sin, q, rows, m->heads, D, num_threads);
        rotary_f32(qkv + q_size, qkv_n, D, cos, sin, k, rows, m->kv_heads, D, num_threads);
        for (int64_t r = 0; r < rows; r++) {
            if (slots[r] < 0) continue;
            memcpy(L->key_cache + slots[r] * kv_size, k + r * kv_size, sizeof(float) * kv_size);
            memcpy(L->value_cache + slots[r] * kv_size, qkv + r * qkv_n + q_size + kv_size, sizeof(float) * kv_size);
        }
        if (paged_decode_f32(q, L->key_cache, L->value_cache, block_tables, table_stride, seq_lens, a, rows,
                             m->heads, m->kv_heads, D, m->block_size, m->scale, num_threads))
            return 1;
        linear_f32(a, rows, q_size, q_size, L->o, H, NULL, proj, H, num_threads);
        add_rows(stream, proj, rows * H);
        rms_norm_f32(stream, H, L->post_norm, x, rows, H, m->eps, num_threads);
        linear_f32(x, rows, H, H, L->gate_up, 2 * I, NULL, gate_up, 2 * I, num_threads);
        silu_and_mul_f32(gate_up, 2 * I, act, rows, I, num_threads);
        linear_f32(act, rows, I, I, L->down, H, NULL, proj, H, num_threads);
        add_rows(stream, proj, rows * H);
    }
    rms_norm_f32(stream, H, m->final_norm, out, rows, H, m->eps, num_threads);
    return 0;
}
