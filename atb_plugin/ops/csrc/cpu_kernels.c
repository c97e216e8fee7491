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
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif

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

int paged_decode_f32(const float *query, const float *key_cache, const float *value_cache,
                     const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                     float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     int64_t block_size, float scale, int num_threads) {
    return paged_decode(query, key_cache, value_cache, 0, block_tables, table_stride, seq_lens, out, batch, heads,
                        kv_heads, head_dim, block_size, scale, num_threads);
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
 * One row (decode of a single stream) streams the panels once, front to back; with more rows,
 * the panel (K x 256 bytes) stays in L2 for all its row tiles, which share out prefetching the
 * next panel into L2 while they compute, so reading the weights from DRAM overlaps the
 * arithmetic instead of alternating with it (benchmarks/RESULTS.md, bench_engine "Fourth round"). */
#define PANEL 64
#define MR 6
#define PREFETCH_AHEAD 8 /* steps (of 256 bytes) a tile streaming its own panel prefetches ahead */
#define STEP_BYTES 256   /* one step of a panel, either format */
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

static inline float bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> bfloat16, rounding to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
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
#define LINEAR_ROWS(B)                                      \
    switch (rows) {                                         \
    case 1: { const int bf16 = B; LINEAR_TILE(1); } break;  \
    case 2: { const int bf16 = B; LINEAR_TILE(2); } break;  \
    case 3: { const int bf16 = B; LINEAR_TILE(3); } break;  \
    case 4: { const int bf16 = B; LINEAR_TILE(4); } break;  \
    case 5: { const int bf16 = B; LINEAR_TILE(5); } break;  \
    default: { const int bf16 = B; LINEAR_TILE(MR); } break; \
    }
static void linear_rows(const float *x, int64_t x_stride, int rows, int weights_bf16, int64_t steps,
                        const char *panel, const float *bias, float *y, int64_t y_stride, int64_t cols,
                        const char *prefetch, int64_t lines) {
    if (weights_bf16) LINEAR_ROWS(1) else LINEAR_ROWS(0)
}

/* The panels' sweep, either format: y (M, N), rows y_stride apart; x (M, steps or 2 * steps),
 * rows x_stride apart; bias NULL or ceil(N/PANEL)*PANEL floats. */
static void linear_panels(const float *x, int64_t M, int64_t steps, int64_t x_stride, const char *panels,
                          int weights_bf16, int64_t N, const float *bias, float *y, int64_t y_stride,
                          int num_threads) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL, row_tiles = (M + MR - 1) / MR;
    const int64_t panel_bytes = steps * STEP_BYTES, panel_lines = panel_bytes / 64;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_panels > 1)
    for (int64_t p = 0; p < num_panels; p++) {
        const char *panel = panels + p * panel_bytes;
        const int64_t cols = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
        for (int64_t t = 0; t < row_tiles; t++) {
            const int64_t m0 = t * MR;
            const int rows = (int)(M - m0 < MR ? M - m0 : MR);
            /* What this tile prefetches into L2, spread evenly over its steps: a lone tile (at
             * most MR rows) and the first panel's first tile stream their own panel, ahead of
             * where they read; otherwise the tiles share out the next panel's lines in proportion
             * to their rows (the first panel's first tile sits that out), so the next panel
             * arrives while this one is computed. A prefetch past the panels' end is a wasted
             * hint, never a fault. */
            const char *prefetch = NULL;
            int64_t lines = 0;
            if (row_tiles == 1 || (t == 0 && p == 0)) {
                prefetch = panel + PREFETCH_AHEAD * STEP_BYTES;
                lines = panel_lines;
            } else if (p + 1 < num_panels) {
                const int64_t skip = p == 0 ? MR : 0, first = panel_lines * (m0 - skip) / (M - skip);
                lines = panel_lines * (m0 + rows - skip) / (M - skip) - first;
                prefetch = panel + panel_bytes + first * 64;
            }
            linear_rows(x + m0 * x_stride, x_stride, rows, weights_bf16, steps, panel, bias ? bias + p * PANEL : NULL,
                        y + m0 * y_stride + p * PANEL, y_stride, cols, prefetch, lines);
        }
    }
}

/* float32 panels: y (M, N), rows y_stride apart; x (M, K), rows x_stride apart; bias NULL or
 * ceil(N/PANEL)*PANEL floats. */
void linear_f32(const float *x, int64_t M, int64_t K, int64_t x_stride, const float *panels, int64_t N,
                const float *bias, float *y, int64_t y_stride, int num_threads) {
    linear_panels(x, M, K, x_stride, (const char *)panels, 0, N, bias, y, y_stride, num_threads);
}

/* bfloat16 panels (K padded to even), float32 sums. x (M, K) float32 or bfloat16 (x_bf16), rows
 * x_stride elements apart; y (M, N) float32 or bfloat16 (y_bf16, rounded to nearest even), rows
 * y_stride apart. bfloat16 or odd-K input is first widened into a float32 copy (even width, the
 * pad column zero); bfloat16 output is computed into float32 and rounded at the end. Returns 0,
 * or 1 when a scratch allocation failed (nothing written). */
int linear_bf16w(const void *x, int x_bf16, int64_t M, int64_t K, int64_t x_stride, const uint16_t *panels,
                 int64_t N, const float *bias, void *y, int y_bf16, int64_t y_stride, int num_threads) {
    const int64_t steps = (K + 1) / 2, width = 2 * steps;
    float *xs = NULL, *ys = NULL;
    const float *xf = x;
    int64_t xf_stride = x_stride;
    if (x_bf16 || K % 2) {
        xs = malloc(sizeof(float) * M * width);
        if (!xs) return 1;
        for (int64_t r = 0; r < M; r++) {
            float *row = xs + r * width;
            if (x_bf16)
                for (int64_t k = 0; k < K; k++) row[k] = bf16_to_float(((const uint16_t *)x)[r * x_stride + k]);
            else
                memcpy(row, (const float *)x + r * x_stride, sizeof(float) * K);
            if (K % 2) row[K] = 0.f;
        }
        xf = xs;
        xf_stride = width;
    }
    float *yf = y;
    int64_t yf_stride = y_stride;
    if (y_bf16) {
        ys = malloc(sizeof(float) * M * N);
        if (!ys) { free(xs); return 1; }
        yf = ys;
        yf_stride = N;
    }
    linear_panels(xf, M, steps, xf_stride, (const char *)panels, 1, N, bias, yf, yf_stride, num_threads);
    if (y_bf16)
        for (int64_t r = 0; r < M; r++)
            for (int64_t n = 0; n < N; n++) ((uint16_t *)y)[r * y_stride + n] = float_to_bf16(ys[r * N + n]);
    free(xs);
    free(ys);
    return 0;
}

/* ---- int8 weights: W8A16 (weights dequantised in registers) and W8A8 (dynamic per-token) -----
 *
 * Both take the checkpoint's weight as it is, (N, K) int8 row-major, and take dot products along
 * its contiguous K (docs/architecture.md, "Native CPU kernels"). A block of OT weight rows (OT x
 * K bytes, in L1 for the K of the models here) is multiplied with every row of x, RT rows at a
 * time; blocks of weight rows are shared out between the threads.
 *
 * The instruction set is chosen per call from what the probe found (cpu_set_features; the probe
 * is csrc/cpu_probe.c): kernels for sets beyond the library's base flags are compiled with
 * __attribute__((target(...))) and called only when the probe saw their instructions execute. */

#define FEATURE_AVX2 1
#define FEATURE_AVX512 2
#define FEATURE_AVX512_BF16 4
#define FEATURE_AVX512_VNNI 8
#define FEATURE_AVX_VNNI 16
#define FEATURE_AMX_BF16 32
#define FEATURE_AMX_INT8 64
static int g_features;

/* The features the kernels may use from now on (the probe's, or fewer: the tests take each
 * variant in turn). Returns what was set. */
int cpu_set_features(int mask) {
    g_features = mask;
    return g_features;
}

/* The int8 kernels' instruction-set variant the next call takes (0 = portable C, 1 = AVX2,
 * 2 = AVX-VNNI, 3 = AVX-512 VNNI), for the tests and benchmarks to report. */
int w8a8_variant(void) {
#if defined(__x86_64__) && defined(__AVX2__)
    if (g_features & FEATURE_AVX512_VNNI) return 3;
    if (g_features & FEATURE_AVX_VNNI) return 2;
    return 1;
#else
    return 0;
#endif
}

#define OT 8 /* weight rows per block (a thread's unit of work) */
#define STACK_ROWS 64        /* rows of x whose int8 scratch may live on the stack */
#define STACK_Q_BYTES 16384  /* ... and no more quantised bytes than this */
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

#if defined(__x86_64__) && defined(__AVX2__)
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

#define DOT_AVX2(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)))
#define DOT_AVX_VNNI(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#define DOT_AVX512_VNNI(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)

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

static void w8a16_block(const float *x0, int64_t M, int64_t K, int64_t x_stride, const int8_t *w0, int count,
                        float *sums) {
#define W8A16_AT(R, O) do { const float *x = x0 + m * x_stride; const int8_t *w = w0 + o0 * K; \
                            float *out = sums + m * OT + o0; W8A16_TILE(R, O); } while (0)
    BLOCK_TILES(W8A16_AT(RT, TO), W8A16_AT(1, TO), W8A16_AT(RT, 1), W8A16_AT(1, 1))
#undef W8A16_AT
}

#define W8A8_BLOCK(NAME, ATTR, DOT)                                                                        \
    static ATTR void NAME(const int8_t *q0, int64_t M, int64_t K, int64_t q_stride, const int8_t *w0, int count, \
                          int32_t *sums) {                                                                  \
        BLOCK_TILES(W8A8_AT(RT, TO, DOT), W8A8_AT(1, TO, DOT), W8A8_AT(RT, 1, DOT), W8A8_AT(1, 1, DOT))     \
    }
#define W8A8_AT(R, O, DOT) do { const int8_t *q = q0 + m * q_stride; const int8_t *w = w0 + o0 * K; \
                                int32_t *out = sums + m * OT + o0; W8A8_TILE(R, O, DOT); } while (0)
W8A8_BLOCK(w8a8_block_avx2, , DOT_AVX2)
W8A8_BLOCK(w8a8_block_avx_vnni, __attribute__((target("avx2,fma,avxvnni"))), DOT_AVX_VNNI)
W8A8_BLOCK(w8a8_block_avx512_vnni, __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni"))),
           DOT_AVX512_VNNI)

static void w8a8_block(const int8_t *q, int64_t M, int64_t K, int64_t q_stride, const int8_t *w, int count,
                       int32_t *sums) {
    if (g_features & FEATURE_AVX512_VNNI) w8a8_block_avx512_vnni(q, M, K, q_stride, w, count, sums);
    else if (g_features & FEATURE_AVX_VNNI) w8a8_block_avx_vnni(q, M, K, q_stride, w, count, sums);
    else w8a8_block_avx2(q, M, K, q_stride, w, count, sums);
}

#else /* portable C: what the compiler makes of plain loops */

static void w8a16_block(const float *x, int64_t M, int64_t K, int64_t x_stride, const int8_t *w, int count,
                        float *sums) {
    for (int64_t m = 0; m < M; m++)
        for (int o = 0; o < count; o++) {
            float sum = 0.f;
            for (int64_t k = 0; k < K; k++) sum += x[m * x_stride + k] * (float)w[o * K + k];
            sums[m * OT + o] = sum;
        }
}

static void w8a8_block(const int8_t *q, int64_t M, int64_t K, int64_t q_stride, const int8_t *w, int count,
                       int32_t *sums) {
    for (int64_t m = 0; m < M; m++)
        for (int o = 0; o < count; o++) {
            int32_t sum = 0;
            for (int64_t k = 0; k < K; k++) sum += (int32_t)q[m * q_stride + k] * w[o * K + k];
            sums[m * OT + o] = sum;
        }
}
#endif

/* y = x @ ((w + offset[:, None]) * scale[:, None]).T + bias, computed as
 * scale[o] * (x . w[o] + offset[o] * sum(x)) + bias[o]: int8 weights widened to float32 in
 * registers, float32 sums. x (M, K) rows x_stride apart; w (N, K) int8; scale (N); offset and
 * bias (N) or NULL; y (M, N) rows y_stride apart. Returns 0, or 1 when scratch failed. */
int w8a16_linear_f32(const float *x, int64_t M, int64_t K, int64_t x_stride, const int8_t *w, int64_t N,
                     const float *scale, const float *offset, const float *bias, float *y, int64_t y_stride,
                     int num_threads) {
    const int64_t blocks = (N + OT - 1) / OT;
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
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (blocks > 1) reduction(| : failed)
    {
        float *sums = malloc(sizeof(float) * M * OT);
        if (!sums) failed = 1;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (!sums) continue;
            const int64_t o0 = b * OT;
            const int count = N - o0 < OT ? (int)(N - o0) : OT;
            w8a16_block(x, M, K, x_stride, w + o0 * K, count, sums);
            for (int64_t m = 0; m < M; m++)
                for (int o = 0; o < count; o++) {
                    float v = sums[m * OT + o];
                    if (offset) v += offset[o0 + o] * rowsum[m];
                    v *= scale[o0 + o];
                    y[m * y_stride + o0 + o] = bias ? v + bias[o0 + o] : v;
                }
        }
        free(sums);
    }
    free(rowsum);
    return failed;
}

/* Per-token symmetric int8: s[m] = max|x[m]| / 127 (0 for a row of zeros, whose q are 0), q =
 * x / s rounded to nearest even (torch.round's rule, the current rounding mode's default),
 * clamped to -128..127. q rows q_stride apart. */
void quantize_rows_s8(const float *x, int64_t M, int64_t K, int64_t x_stride, int8_t *q, int64_t q_stride,
                      float *s) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * x_stride;
        int8_t *qr = q + m * q_stride;
        float top = 0.f;
        int64_t k = 0;
#if defined(__x86_64__) && defined(__AVX2__)
        /* max_ps(v, acc) returns acc where v is NaN: NaNs are skipped, as fmaxf skips them */
        __m256 tops = _mm256_setzero_ps();
        const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        for (; k + 8 <= K; k += 8) tops = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xr + k), magnitude), tops);
        float lanes[8];
        _mm256_storeu_ps(lanes, tops);
        for (int l = 0; l < 8; l++) top = fmaxf(top, lanes[l]);
#endif
        for (; k < K; k++) top = fmaxf(top, fabsf(xr[k]));
        const float scale = top / 127.f;
        s[m] = scale;
        if (scale == 0.f) {
            memset(qr, 0, K);
            continue;
        }
        k = 0;
#if defined(__x86_64__) && defined(__AVX2__)
        const __m256 sv = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-128.f), hi = _mm256_set1_ps(127.f);
        for (; k + 32 <= K; k += 32) {
            __m256i v[4];
            for (int j = 0; j < 4; j++) {
                __m256 f = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xr + k + 8 * j), sv),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                v[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(f, lo), hi));
            }
            /* packs interleave the 128-bit halves: the permute puts the 32 bytes back in order */
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
            const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            _mm256_storeu_si256((__m256i *)(qr + k), _mm256_permutevar8x32_epi32(p, order));
        }
#endif
        for (; k < K; k++) {
            const float f = nearbyintf(xr[k] / scale);
            qr[k] = (int8_t)(f < -128.f ? -128.f : f > 127.f ? 127.f : f);
        }
    }
}

/* Blocks lo .. hi-1 of OT weight rows of w8a8_dynamic_linear_f32 (q, s: x quantised per row).
 * Returns 0, or 1 when scratch failed. */
static int w8a8_blocks(const int8_t *q, int64_t M, int64_t K, const int8_t *w, int64_t N, const float *w_scale,
                       const float *bias, float *y, int64_t y_stride, const float *s, int64_t lo, int64_t hi) {
    int32_t sums_stack[STACK_ROWS * OT];
    int32_t *sums = M <= STACK_ROWS ? sums_stack : malloc(sizeof(int32_t) * M * OT);
    if (!sums) return 1;
    for (int64_t b = lo; b < hi; b++) {
        const int64_t o0 = b * OT;
        const int count = N - o0 < OT ? (int)(N - o0) : OT;
        w8a8_block(q, M, K, K, w + o0 * K, count, sums);
        for (int64_t m = 0; m < M; m++)
            for (int o = 0; o < count; o++) {
                const float v = (float)sums[m * OT + o] * s[m] * w_scale[o0 + o];
                y[m * y_stride + o0 + o] = bias ? v + bias[o0 + o] : v;
            }
    }
    if (sums != sums_stack) free(sums);
    return 0;
}

/* y = (sum_k q[m][k] * w[o][k]) * s[m] * w_scale[o] + bias[o], the sum exact in int32 (|q|, |w|
 * <= 128: exact for K < 2^31 / 128^2 = 131072). x (M, K) float32 rows x_stride apart, quantised
 * per row first (quantize_rows_s8); w (N, K) int8; w_scale (N); bias (N) or NULL; y (M, N) rows
 * y_stride apart. Returns 0, or 1 when scratch failed. */
int w8a8_dynamic_linear_f32(const float *x, int64_t M, int64_t K, int64_t x_stride, const int8_t *w, int64_t N,
                            const float *w_scale, const float *bias, float *y, int64_t y_stride, int num_threads) {
    const int64_t blocks = (N + OT - 1) / OT;
    /* A decode step's few rows quantise into the stack and one thread runs without a team: a
     * step makes ~4 of these calls per layer, and heap scratch and an OpenMP region per call
     * were host time a one-request step paid for nothing. */
    int8_t q_stack[STACK_Q_BYTES] __attribute__((aligned(64)));
    float s_stack[STACK_ROWS];
    const int small = M <= STACK_ROWS && M * K <= STACK_Q_BYTES;
    int8_t *q = small ? q_stack : malloc((size_t)(M * K));
    float *s = small ? s_stack : malloc(sizeof(float) * M);
    int failed = !q || !s;
    if (!failed) {
        quantize_rows_s8(x, M, K, x_stride, q, K, s);
        if (num_threads <= 1 || blocks <= 1) {
            failed = w8a8_blocks(q, M, K, w, N, w_scale, bias, y, y_stride, s, 0, blocks);
        } else {
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
            {
                const int64_t share = (blocks + omp_get_num_threads() - 1) / omp_get_num_threads();
                const int64_t lo = share * omp_get_thread_num(), hi = lo + share < blocks ? lo + share : blocks;
                if (lo < hi) failed |= w8a8_blocks(q, M, K, w, N, w_scale, bias, y, y_stride, s, lo, hi);
            }
        }
    }
    if (!small) {
        free(q);
        free(s);
    }
    return failed;
}

/* ---- the captured decode step: every decoder layer of one decode step in one call ------------
 *
 * What atb_plugin/models/native_decode.py records once (docs/architecture.md, "The captured
 * decode step"): the address of every layer's weights (each linear layer in its own format, the
 * norms) and KV cache, and a scratch area for the activations. A decode step then costs one call
 * from Python instead of ~20 ops per layer, each with its wrapper and output allocation (host
 * time that was a large share of a single-stream step: benchmarks/RESULTS.md, bench_engine "Fifth
 * round"). The step runs the eager path's kernels, in the same order:
 *
 *   residual = embeds
 *   per layer:  x = rms_norm(residual)            qkv = linear(x)            q, k = rotary(q, k)
 *               cache[slot] = k, v                a = paged_decode(q)        residual += linear(a)
 *               x = rms_norm(residual)            residual += down(silu_and_mul(gate_up(x)))
 *   out = rms_norm(residual)
 *
 * Activations are float32 whatever the weights: a float32 model's step is bit-identical to its
 * eager path; so is one whose linear layers are int8 (the eager layers call the same kernels).
 * A bfloat16 model keeps its weights (bfloat16 panels) and its KV cache (rows rounded to nearest
 * even as they are written) in bfloat16, but not its activations: its eager path rounds every
 * op's output to bfloat16, this step does not (closer to float32, not bit-identical to eager).
 *
 * Scratch (floats), rows * each of: hidden (x), qkv_n (qkv), q_size (q), kv_size (k), q_size (a),
 * hidden (proj), 2 * intermediate (gate_up), intermediate (act), hidden (the residual stream):
 * decode_scratch_floats. */
enum { LINEAR_F32 = 0, LINEAR_BF16 = 1, LINEAR_W8A16 = 2, LINEAR_W8A8_DYNAMIC = 3 };

typedef struct {
    int64_t format;      /* LINEAR_*: what `weight` holds */
    const void *weight;  /* float32 / bfloat16 panels, or int8 (out, in) rows */
    const float *bias;   /* NULL; padded to whole panels for panels, (out) for int8 rows */
    const float *scale;  /* int8: (out) per output channel */
    const float *offset; /* W8A16: (out) */
} decode_linear;

typedef struct {
    const float *input_norm, *post_norm; /* (hidden), float32 */
    decode_linear qkv, o, gate_up, down;
    void *key_cache, *value_cache;       /* (num_blocks, block_size, kv_heads, head_dim) */
} decode_layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, kv_bf16;
    float eps, scale;
    const decode_layer *layers;
    const float *final_norm;
} decode_model;

int64_t decode_scratch_floats(const decode_model *m, int64_t rows) {
    const int64_t q_size = m->heads * m->head_dim, kv_size = m->kv_heads * m->head_dim;
    return rows * (3 * m->hidden + (q_size + 2 * kv_size) + 2 * q_size + kv_size + 3 * m->intermediate);
}

/* y (rows, N) = x (rows, K) through L, both contiguous. Returns 0, or 1 when scratch failed. */
static int decode_linear_rows(const decode_linear *L, const float *x, int64_t rows, int64_t K, float *y, int64_t N,
                              int num_threads) {
    switch (L->format) {
        case LINEAR_BF16: /* float32 rows: no widening copy unless K is odd */
            return linear_bf16w(x, 0, rows, K, K, L->weight, N, L->bias, y, 0, N, num_threads);
        case LINEAR_W8A16:
            return w8a16_linear_f32(x, rows, K, K, L->weight, N, L->scale, L->offset, L->bias, y, N, num_threads);
        case LINEAR_W8A8_DYNAMIC:
            return w8a8_dynamic_linear_f32(x, rows, K, K, L->weight, N, L->scale, L->bias, y, N, num_threads);
        default:
            linear_f32(x, rows, K, K, L->weight, N, L->bias, y, N, num_threads);
            return 0;
    }
}

static void add_rows(float *residual, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) residual[i] += x[i];
}

/* A cache row of n values from float32 `v`: copied, or rounded to bfloat16. */
static void write_kv(void *cache, int64_t index, const float *v, int64_t n, int bf16) {
    if (!bf16) {
        memcpy((float *)cache + index, v, sizeof(float) * n);
        return;
    }
    uint16_t *row = (uint16_t *)cache + index;
    for (int64_t i = 0; i < n; i++) row[i] = float_to_bf16(v[i]);
}

/* embeds, out (rows, hidden); cos, sin (rows, head_dim); slots (rows) int64, -1 = do not write;
 * block_tables, seq_lens as paged_decode_f32 takes them. The caller has checked every slot and
 * block id against the caches. Returns 0, or 1 when a kernel's scratch allocation failed. */
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
        if (decode_linear_rows(&L->qkv, x, rows, H, qkv, qkv_n, num_threads)) return 1;
        rotary_f32(qkv, qkv_n, D, cos, sin, q, rows, m->heads, D, num_threads);
        rotary_f32(qkv + q_size, qkv_n, D, cos, sin, k, rows, m->kv_heads, D, num_threads);
        for (int64_t r = 0; r < rows; r++) {
            if (slots[r] < 0) continue;
            write_kv(L->key_cache, slots[r] * kv_size, k + r * kv_size, kv_size, (int)m->kv_bf16);
            write_kv(L->value_cache, slots[r] * kv_size, qkv + r * qkv_n + q_size + kv_size, kv_size, (int)m->kv_bf16);
        }
        if (paged_decode(q, L->key_cache, L->value_cache, (int)m->kv_bf16, block_tables, table_stride, seq_lens, a,
                         rows, m->heads, m->kv_heads, D, m->block_size, m->scale, num_threads))
            return 1;
        if (decode_linear_rows(&L->o, a, rows, q_size, proj, H, num_threads)) return 1;
        add_rows(stream, proj, rows * H);
        rms_norm_f32(stream, H, L->post_norm, x, rows, H, m->eps, num_threads);
        if (decode_linear_rows(&L->gate_up, x, rows, H, gate_up, 2 * I, num_threads)) return 1;
        silu_and_mul_f32(gate_up, 2 * I, act, rows, I, num_threads);
        if (decode_linear_rows(&L->down, act, rows, I, proj, H, num_threads)) return 1;
        add_rows(stream, proj, rows * H);
    }
    rms_norm_f32(stream, H, m->final_norm, out, rows, H, m->eps, num_threads);
    return 0;
}
