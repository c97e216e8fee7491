/* The mixture-of-experts layer of the captured decode step (Qwen3-MoE, Qwen2-MoE's shared expert):
 * the router, the top-k choice and the grouped expert GEMMs, native (docs/architecture.md, "The
 * captured decode step"; the eager op it stands for: atb_plugin/ops/moe.py).
 *
 * Tokens are grouped by expert, as the eager path's `torch._grouped_mm` groups them, and each
 * expert's weights are streamed once for all its rows (a tile of up to EXPERT_ROWS rows; more
 * rows re-read the expert's columns from cache). The experts are read in place, in the layout the
 * model holds them for the eager path (models/moe.py, FusedExperts): w13 (E, H, 2I) and w2
 * (E, I, H), each expert one row-major (K, N) matrix, so the plan adds no second copy of the
 * largest weights of the model. Sums are float32, added over k in order.
 *
 * Why not what the eager op runs (torch._grouped_mm, one MKL GEMM per expert, with a sort, gather
 * and index_add around it): the plan is C and cannot call it, and at decode sizes, where an expert
 * gets a few rows (32 requests x top-8 over 64 experts: ~4), this is faster anyway: 4.5x at one
 * row, 2.2x at 32 (benchmarks/RESULTS.md, "bench_moe.py: MoE in the captured decode step").
 *
 * This file is a base unit (cpu_native.UNITS: compiled for what the probe found), not a dispatch
 * slot: its one kernel is written in GCC vector types sized from the flags it is compiled with. */
#include "cpu_kernels.h"

#if defined(__AVX512F__)
#define EVL 16 /* floats per register */
#define ENV 4  /* registers of columns per tile: 4 x 16 = 64 columns, 4 x 4 sums + 4 weights in 32 registers */
#elif defined(__AVX__)
#define EVL 8
#define ENV 2  /* 16 columns: 4 x 2 sums + 2 weights in 16 registers */
#else
#define EVL 4
#define ENV 2
#endif
#define EXPERT_ROWS 4
#define EXPERT_COLS (EVL * ENV)
#define EXPERT_PREFETCH 8 /* weight rows ahead: the column block is a strided stream (N floats apart) */
typedef float ev __attribute__((vector_size(EVL * sizeof(float))));
static inline ev eload(const float *p) { ev v; memcpy(&v, p, sizeof v); return v; }
static inline void estore(float *p, ev v) { memcpy(p, &v, sizeof v); }

/* y[r][n0 .. n0 + EXPERT_COLS) = sum_k x[r][k] w[k][n0 ..] for `rows` (a constant when inlined)
 * rows of x (x_stride apart); w row-major (K, N). */
static inline __attribute__((always_inline)) void expert_tile(const float *x, int64_t x_stride, const int rows,
                                                              int64_t K, const float *w, int64_t N, float *y,
                                                              int64_t y_stride) {
    ev acc[EXPERT_ROWS][ENV];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < ENV; j++) acc[r][j] = (ev){0};
    for (int64_t k = 0; k < K; k++) {
        const float *wk = w + k * N;
        if (k + EXPERT_PREFETCH < K)
            for (int j = 0; j < ENV * EVL; j += 16) __builtin_prefetch(wk + EXPERT_PREFETCH * N + j, 0, 0);
        ev wv[ENV];
        for (int j = 0; j < ENV; j++) wv[j] = eload(wk + j * EVL);
        for (int r = 0; r < rows; r++) {
            const float b = x[r * x_stride + k];
            for (int j = 0; j < ENV; j++) acc[r][j] += wv[j] * b;
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < ENV; j++) estore(y + r * y_stride + j * EVL, acc[r][j]);
}

/* y (M, N) = x (M, K) w (K, N), all row-major and contiguous but x (x_stride apart). Columns past
 * the last whole block: plain C, in the same k order. Single-threaded: the caller shares out the
 * experts. */
void expert_matmul_f32(const float *x, int64_t M, int64_t K, int64_t x_stride, const float *w, int64_t N,
                       float *y, int64_t y_stride) {
    const int64_t whole = N / EXPERT_COLS * EXPERT_COLS;
    for (int64_t m0 = 0; m0 < M; m0 += EXPERT_ROWS) {
        const int rows = (int)(M - m0 < EXPERT_ROWS ? M - m0 : EXPERT_ROWS);
        const float *xr = x + m0 * x_stride;
        float *yr = y + m0 * y_stride;
        for (int64_t n0 = 0; n0 < whole; n0 += EXPERT_COLS) {
#define EXPERT_TILE(n) expert_tile(xr, x_stride, n, K, w + n0, N, yr + n0, y_stride)
            switch (rows) {
            case 1: EXPERT_TILE(1); break;
            case 2: EXPERT_TILE(2); break;
            case 3: EXPERT_TILE(3); break;
            default: EXPERT_TILE(EXPERT_ROWS); break;
            }
#undef EXPERT_TILE
        }
        for (int r = 0; r < rows; r++)
            for (int64_t n = whole; n < N; n++) {
                float sum = 0.f;
                for (int64_t k = 0; k < K; k++) sum += xr[r * x_stride + k] * w[k * N + n];
                yr[r * y_stride + n] = sum;
            }
    }
}

/* The router's choice for one token, as ops/moe.py's routing rule: softmax over the E logits in
 * float32, the k largest probabilities (ties: the lower expert), then w / sum(w) when renormalize.
 * ids (k), weights (k). */
static void route(const float *logits, int64_t E, int64_t k, int renormalize, float *probs, int32_t *ids,
                  float *weights) {
    float top = logits[0], sum = 0.f;
    for (int64_t e = 1; e < E; e++) top = logits[e] > top ? logits[e] : top;
    for (int64_t e = 0; e < E; e++) sum += probs[e] = expf(logits[e] - top);
    for (int64_t e = 0; e < E; e++) probs[e] /= sum;
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        ids[j] = (int32_t)best;
        weights[j] = probs[best];
    }
    if (renormalize) {
        float total = 0.f;
        for (int64_t j = 0; j < k; j++) total += weights[j];
        for (int64_t j = 0; j < k; j++) weights[j] /= total;
    }
}

/* Floats of scratch moe_experts_f32 needs for `rows` tokens. */
int64_t moe_scratch_floats(int64_t rows, int64_t hidden, int64_t num_experts, int64_t top_k, int64_t intermediate) {
    const int64_t a = rows * top_k; /* assignments (token, expert) */
    return rows * num_experts + a * (2 * hidden + 3 * intermediate) + 4 * a + 2 * (num_experts + 1);
}

/* out (rows, H) = the routed experts' weighted sum for each token of x (rows, H, contiguous),
 * given the router's logits (rows, E): ops.fused_moe's arithmetic with every expert local (the
 * plan runs one rank). w13 (E, H, 2I), w2 (E, I, H) float32. The sum over a token's experts is
 * taken in expert order (the eager index_add_'s order over the expert-sorted rows). `scratch`:
 * moe_scratch_floats. Experts run in parallel, one thread each, each writing its own rows. */
void moe_experts_f32(const float *x, const float *logits, int64_t rows, int64_t H, int64_t E, int64_t k,
                     int renormalize, const float *w13, const float *w2, int64_t I, float *out, float *scratch,
                     int num_threads) {
    const int64_t A = rows * k;
    float *probs = scratch, *xs = probs + rows * E, *gate_up = xs + A * H, *act = gate_up + A * 2 * I;
    float *down = act + A * I, *weights = down + A * H, *sorted_weight = weights + A;
    int32_t *ids = (int32_t *)(sorted_weight + A), *token = ids + A; /* int32 in float-sized slots */
    int32_t *start = token + A, *fill = start + (E + 1);
    for (int64_t r = 0; r < rows; r++) route(logits + r * E, E, k, renormalize, probs + r * E, ids + r * k, weights + r * k);
    /* The (token, slot) assignments sorted by expert, stably (as the eager argsort(stable=True)). */
    memset(start, 0, sizeof(int32_t) * (E + 1));
    for (int64_t a = 0; a < A; a++) start[ids[a] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, sizeof(int32_t) * (E + 1));
    for (int64_t a = 0; a < A; a++) {
        const int32_t at = fill[ids[a]]++;
        token[at] = (int32_t)(a / k);
        sorted_weight[at] = weights[a];
        memcpy(xs + at * H, x + (a / k) * H, sizeof(float) * H);
    }
#pragma omp parallel for schedule(dynamic) num_threads(num_threads)
    for (int64_t e = 0; e < E; e++) {
        const int64_t a0 = start[e], count = start[e + 1] - a0;
        if (!count) continue;
        expert_matmul_f32(xs + a0 * H, count, H, H, w13 + e * H * 2 * I, 2 * I, gate_up + a0 * 2 * I, 2 * I);
        cpu_kernels.silu_and_mul(gate_up + a0 * 2 * I, 2 * I, act + a0 * I, count, I, 1);
        expert_matmul_f32(act + a0 * I, count, I, I, w2 + e * I * H, H, down + a0 * H, H);
    }
    memset(out, 0, sizeof(float) * rows * H);
    for (int64_t a = 0; a < A; a++) {
        float *o = out + (int64_t)token[a] * H;
        const float *d = down + a * H, s = sorted_weight[a];
        for (int64_t i = 0; i < H; i++) o[i] += d[i] * s;
    }
}
