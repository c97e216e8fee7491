/* The float kernels, written once in GCC vector types and compiled by each file that includes
 * this header (isa_portable.c, isa_avx2.c, isa_avx512.c) for that file's instruction set: the
 * compiler maps the vectors onto the widest registers the file's flags allow, and the dispatch
 * table (dispatch.c) takes the best file the probe allows. Everything here is static: each file
 * gets its own copy, reached only through its `struct cpu_variant` (FLOAT_KERNELS below).
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
 * (each V row read once), in explicit 16-float vectors (one AVX-512 register, two AVX2 ones, four
 * SSE ones: whatever the including file's flags give). head_dim must be a multiple of 16 (every
 * model here; the caller sends others to SDPA). Requests run in parallel (OpenMP, the caller's
 * thread count). Returns 0, or 1 when a scratch allocation failed (the output is then incomplete).
 */
#ifndef ATB_FLOAT_KERNELS_H
#define ATB_FLOAT_KERNELS_H
#include "cpu_kernels.h"
#include "panel_sweep.h"

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

/* The address of token t's row (all kv heads) in a cache of `elem`-byte values, and a prefetch
 * of the row LANES tokens on: blocks are scattered, so at a block's end the hardware prefetcher
 * has nothing to follow. */
static inline const char *row_of(const char *cache, const int32_t *table, int64_t t, int64_t len,
                                 int64_t block_size, int64_t token_stride, int64_t elem) {
    const int64_t block_stride = block_size * token_stride, ahead = t + LANES;
    if (ahead < len) {
        const char *next = cache + ((int64_t)table[ahead / block_size] * block_stride + (ahead % block_size) * token_stride) * elem;
        for (int64_t f = 0; f < token_stride * elem; f += 64) __builtin_prefetch(next + f);
    }
    return cache + ((int64_t)table[t / block_size] * block_stride + (t % block_size) * token_stride) * elem;
}

/* LANES cache values as float32: a float32 cache's as they are, a bfloat16 cache's widened (the
 * 16 bits are the top half of the float32). */
typedef uint16_t vh __attribute__((vector_size(LANES * sizeof(uint16_t))));
static inline vf load_kv(const char *p, const int bf16) {
    if (!bf16) return load((const float *)p);
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vi) << 16);
}

/* head_dim a multiple of LANES (faster than the same passes in plain C loops on a 30-layer,
 * 32-request step: benchmarks/RESULTS.md, bench_engine "Third round"). V is summed LANES
 * tokens at a time so each head's accumulator stays in registers over the chunk while the
 * chunk's V rows stay in L1. */
static inline __attribute__((always_inline)) int decode_vec(
    const float *q, const void *key_cache, const void *value_cache, const int bf16, const int32_t *table,
    int64_t len, float *out, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
    float scale) {
    const int64_t group = heads / kv_heads, chunks = head_dim / LANES, token_stride = kv_heads * head_dim;
    const int64_t padded = (len + LANES - 1) / LANES * LANES, elem = bf16 ? 2 : 4;
    float *scores = malloc(sizeof(float) * heads * (padded + head_dim)); /* (heads, padded), then (heads, head_dim) */
    if (!scores) return 1;
    float *acc = scores + heads * padded;
    for (int64_t t = 0; t < len; t++) {
        const char *k = row_of(key_cache, table, t, len, block_size, token_stride, elem);
        for (int64_t h = 0; h < heads; h++) {
            const char *kh = k + (h / group) * head_dim * elem;
            const float *qh = q + h * head_dim;
            vf s = load(qh) * load_kv(kh, bf16);
            for (int64_t c = 1; c < chunks; c++) s += load(qh + c * LANES) * load_kv(kh + c * LANES * elem, bf16);
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
        const char *rows[LANES];
        for (int64_t j = 0; j < n; j++) rows[j] = row_of(value_cache, table, t0 + j, len, block_size, token_stride, elem);
        for (int64_t h = 0; h < heads; h++) {
            const float *p = scores + h * padded + t0;
            const int64_t offset = (h / group) * head_dim;
            for (int64_t c = 0; c < chunks; c++) {
                vf a = load(acc + h * head_dim + c * LANES);
                for (int64_t j = 0; j < n; j++) a += p[j] * load_kv(rows[j] + (offset + c * LANES) * elem, bf16);
                store(acc + h * head_dim + c * LANES, a);
            }
        }
    }
    memcpy(out, acc, sizeof(float) * heads * head_dim);
    free(scores);
    return 0;
}

/* A constant head_dim and cache format let the compiler unroll the loops over them. */
#define DECODE_VEC(D, B) decode_vec(q, key_cache, value_cache, B, table, len, o, heads, kv_heads, D, block_size, scale)
#define DECODE_FORMAT(B)                                     \
    switch (head_dim) {                                      \
        case 64: failed |= DECODE_VEC(64, B); break;         \
        case 128: failed |= DECODE_VEC(128, B); break;       \
        default: failed |= DECODE_VEC(head_dim, B);          \
    }

/* Decode attention over a float32 (kv_bf16 0) or bfloat16 (kv_bf16 1) cache; float32 query, sums
 * and output. */
static int paged_decode(const float *query, const void *key_cache, const void *value_cache, int kv_bf16,
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
        if (kv_bf16) DECODE_FORMAT(1) else DECODE_FORMAT(0)
    }
    return failed;
}

/* ---- elementwise ops, one call where torch dispatches 4 to 8 ops ------------------------------ */

/* out = weight * x / sqrt(mean(x^2) + eps), row by row. x rows `x_stride` floats apart; out and
 * weight contiguous. */
static void rms_norm(const float *x, int64_t x_stride, const float *weight, float *out, int64_t rows, int64_t width,
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
static void rotary(const float *x, int64_t token_stride, int64_t head_stride, const float *cos, const float *sin,
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
static void silu_and_mul(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t width,
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
static void argmax(const float *x, int64_t x_stride, int64_t rows, int64_t width, int64_t *out, int num_threads) {
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
 *   float32:  panels[p][k][j] = W[p * PANEL + j][k]        p < ceil(N / PANEL), columns past N are zero
 *   bfloat16: panels[p][k/2][j][k%2] = W[p * PANEL + j][k] (pairs of k interleaved, K padded to even)
 *
 *        k ->                    panel p, read front to back:
 *   W  [ row p*64     ]          k=0: W[p*64..p*64+63][0]   (64 floats: 256 bytes)
 *      [ ...          ]   --->   k=1: W[p*64..p*64+63][1]
 *      [ row p*64+63  ]          ...  one contiguous K x 64 block per panel
 *
 * A bfloat16 panel has the same 256 bytes per step, a step being a pair of k: each 32-bit lane
 * holds one column's W[.][k] (low half) and W[.][k+1] (high half), so the two float32 values are
 * `lane << 16` and `lane & 0xffff0000`: two integer ops per vector, and the same layout would feed
 * AVX-512 BF16's pairwise dot product (vdpbf16ps) unchanged.
 *
 * A tile of rows of x times one panel keeps rows x nv vector sums in registers: per step, nv
 * vector loads of the panel, one broadcast of x per row, rows x nv fused multiply-adds; a panel
 * wider than nv vectors is swept in passes of nv vectors. nv is chosen per row count so the
 * sums, the panel's vectors and a broadcast fit the register file (32 vectors with AVX-512: 6
 * rows x the whole 64-column panel; 16 with AVX2 or SSE: 6 rows x 16 columns per pass). The
 * first version held 6 x 64 columns always, which on AVX2 (vectors of 8 floats, 16 registers)
 * spilled 48 sums to the stack (benchmarks/RESULTS.md, bench_moe and "Low precision").
 * How the tiles sweep the panels and prefetch: panel_sweep.h. */
#define BLOCK_STEPS 256  /* steps per block of a tile that sweeps its panel in several passes (64 KiB) */

#if defined(__AVX512F__)
#define VL 16
#define VREGS 32
#elif defined(__AVX__)
#define VL 8
#define VREGS 16
#elif defined(__aarch64__)
#define VL 4
#define VREGS 32
#else
#define VL 4
#define VREGS 16
#endif
#define NVEC (PANEL / VL)
typedef float vn __attribute__((vector_size(VL * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(VL * sizeof(uint32_t))));
static inline vn loadn(const float *p) { vn v; memcpy(&v, p, sizeof v); return v; }
static inline vu loadu(const void *p) { vu v; memcpy(&v, p, sizeof v); return v; }
static inline void storen(float *p, vn v) { memcpy(p, &v, sizeof v); }

/* Vectors per pass for a tile of `rows`: one row takes the whole panel width in one pass (its
 * sums and a broadcast are all it keeps; each panel vector feeds one multiply-add straight from
 * memory); more rows take the widest of 4, 2, 1 (dividing NVEC) whose sums, panel vectors and one
 * broadcast fit the registers. Constant-folded: `rows` is a constant in every inlined linear_tile. */
static inline __attribute__((always_inline)) int vectors_per_pass(int rows) {
    if (rows == 1) return NVEC;
    for (int nv = NVEC < 4 ? NVEC : 4; nv > 1; nv /= 2)
        if (rows * nv + nv + 1 <= VREGS) return nv;
    return 1;
}

/* Always inlined and called with constant `rows` and `bf16` (linear_rows below), so that each
 * row count gets its own loop with its sums in registers: a loop over a variable row count keeps
 * them in memory (benchmarks/RESULTS.md, bench_engine "Fourth round"). `steps` is K (float32) or
 * K / 2 (bfloat16 pairs; x then holds 2 * steps floats per row). */
static inline __attribute__((always_inline)) void linear_tile(
        const float *x, int64_t x_stride, const int rows, const int bf16, int64_t steps, const char *panel,
        const float *bias, float *y, int64_t y_stride, int64_t cols, const char *prefetch, int64_t lines) {
    const int nv = vectors_per_pass(rows);
    const int64_t total = steps * (NVEC / nv); /* prefetches spread over every pass's steps */
    int64_t due = 0; /* lines * (s + 1) / total prefetches are due after step s, issued as they fall due */
    float full[MR][PANEL]; /* the last, partial panel: its columns gathered here, only the real ones copied */
    /* With several passes, the panel is swept in blocks of BLOCK_STEPS steps (64 KiB), every pass
     * over one block before the next, the sums parked in the output between blocks: a whole panel
     * (K x 256 bytes: 1.4 MiB at K = 5632) does not stay in L2 from one pass to the next
     * (benchmarks/RESULTS.md, "Low precision"). The sums are added in the same order either way. */
    const int64_t block = NVEC / nv > 1 ? BLOCK_STEPS : steps;
    for (int64_t s0 = 0; s0 < steps; s0 += block) {
        const int64_t s1 = steps - s0 < block ? steps : s0 + block;
        for (int q = 0; q < NVEC; q += nv) {
            vn acc[MR][NVEC];
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < nv; j++) {
                    const float *sum = (cols == PANEL ? y + r * y_stride : full[r]) + (q + j) * VL;
                    acc[r][j] = s0 ? loadn(sum) : bias ? loadn(bias + (q + j) * VL) : (vn){0};
                }
            for (int64_t s = s0; s < s1; s++) {
                for (due += lines; due >= total; due -= total, prefetch += 64) __builtin_prefetch(prefetch, 0, 2);
                const char *w = panel + s * STEP_BYTES + q * VL * 4;
                if (!bf16) {
                    vn wv[NVEC];
                    for (int j = 0; j < nv; j++) wv[j] = loadn((const float *)w + j * VL);
#pragma GCC unroll 6
                    for (int r = 0; r < rows; r++) {
                        const float b = x[r * x_stride + s];
                        for (int j = 0; j < nv; j++) acc[r][j] += wv[j] * b;
                    }
                } else {
                    vn w0[NVEC], w1[NVEC];
                    for (int j = 0; j < nv; j++) {
                        const vu lane = loadu(w + j * VL * 4);
                        w0[j] = (vn)(lane << 16);
                        w1[j] = (vn)(lane & 0xffff0000u);
                    }
#pragma GCC unroll 6
                    for (int r = 0; r < rows; r++) {
                        const float b0 = x[r * x_stride + 2 * s], b1 = x[r * x_stride + 2 * s + 1];
                        for (int j = 0; j < nv; j++) { /* two fused multiply-adds, not a product, an FMA and an add */
                            acc[r][j] += w0[j] * b0;
                            acc[r][j] += w1[j] * b1;
                        }
                    }
                }
            }
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < nv; j++)
                    storen((cols == PANEL ? y + r * y_stride : full[r]) + (q + j) * VL, acc[r][j]);
        }
    }
    if (cols != PANEL)
        for (int r = 0; r < rows; r++) memcpy(y + r * y_stride, full[r], cols * sizeof(float));
}

#define LINEAR_TILE(n) linear_tile(x, x_stride, n, bf16, steps, panel, bias, y, y_stride, cols, prefetch, lines)
/* x, y and bias of one linear_panels call, for its tiles (panel_sweep.h). */
struct float_panels_call {
    const float *x, *bias;
    float *y;
    int64_t x_stride, y_stride, steps;
    int weights_bf16;
};

static void linear_rows(const void *ctx, int64_t m0, int rows, int64_t p, const char *panel, int64_t cols,
                        const char *prefetch, int64_t lines) {
    const struct float_panels_call *c = ctx;
    const float *x = c->x + m0 * c->x_stride, *bias = c->bias ? c->bias + p * PANEL : NULL;
    float *y = c->y + m0 * c->y_stride + p * PANEL;
    const int64_t x_stride = c->x_stride, y_stride = c->y_stride, steps = c->steps;
    PANEL_TILE_ROWS_BY(c->weights_bf16, bf16, LINEAR_TILE)
}

/* The panels' sweep, either format: y (M, N), rows y_stride apart; x (M, steps or 2 * steps),
 * rows x_stride apart; bias NULL or ceil(N/PANEL)*PANEL floats. */
static void linear_panels(const float *x, int64_t M, int64_t steps, int64_t x_stride, const char *panels,
                          int weights_bf16, int64_t N, const float *bias, float *y, int64_t y_stride,
                          int num_threads) {
    const struct float_panels_call call = {x, bias, y, x_stride, y_stride, steps, weights_bf16};
    sweep_panels(M, N, steps, panels, num_threads, linear_rows, &call);
}

/* This file's float kernels, as the slots of its `struct cpu_variant`. */
#define FLOAT_KERNELS                                                                                       \
    .paged_decode = paged_decode, .rms_norm = rms_norm, .rotary = rotary, .silu_and_mul = silu_and_mul,    \
    .argmax = argmax, .linear_panels = linear_panels

#endif
