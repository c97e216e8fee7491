/* Native CPU kernels: the functions Python calls (atb_plugin/ops/cpu_native.py binds them with
 * ctypes) and the captured decode step. Why they exist, how they are built, what they are checked
 * against: docs/architecture.md, "Native CPU kernels", which also maps the files (cpu_kernels.h
 * lists them). Each kernel with instruction-set variants is called through the dispatch table
 * (`cpu_kernels`, dispatch.c); the int8 linear layers are in int8_driver.c. */
#include "cpu_kernels.h"

/* Decode attention over a float32 paged cache (float_kernels.h: layouts and method). Returns 0,
 * or 1 when a scratch allocation failed (the output is then incomplete). */
int paged_decode_f32(const float *query, const float *key_cache, const float *value_cache,
                     const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                     float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     int64_t block_size, float scale, int num_threads) {
    return cpu_kernels.paged_decode(query, key_cache, value_cache, 0, block_tables, table_stride, seq_lens, out, batch,
                                    heads, kv_heads, head_dim, block_size, scale, num_threads);
}

/* ---- elementwise ops, one call where torch dispatches 4 to 8 ops (float_kernels.h) ---------- */

void rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out, int64_t rows, int64_t width,
                  float eps, int num_threads) {
    cpu_kernels.rms_norm(x, x_stride, weight, out, rows, width, eps, num_threads);
}

void rotary_f32(const float *x, int64_t token_stride, int64_t head_stride, const float *cos, const float *sin,
                float *out, int64_t tokens, int64_t heads, int64_t head_dim, int num_threads) {
    cpu_kernels.rotary(x, token_stride, head_stride, cos, sin, out, tokens, heads, head_dim, num_threads);
}

void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t width, int num_threads) {
    cpu_kernels.silu_and_mul(x, x_stride, out, rows, width, num_threads);
}

void argmax_f32(const float *x, int64_t x_stride, int64_t rows, int64_t width, int64_t *out, int num_threads) {
    cpu_kernels.argmax(x, x_stride, rows, width, out, num_threads);
}

/* ---- linear layers over column panels (float_kernels.h draws the layouts) ------------------- */

void linear_f32(const float *x, int64_t M, int64_t K, int64_t x_stride, const float *panels, int64_t N,
                const float *bias, float *y, int64_t y_stride, int num_threads) {
    cpu_kernels.linear_panels(x, M, K, x_stride, (const char *)panels, 0, N, bias, y, y_stride, num_threads);
}

/* x as the dot-product kernel takes it (linear_bf16_dot_fn): pairs of bfloat16, and for a float32
 * x of fewer than DOT_SPLIT_ROWS rows the remainders x - bfloat16(x) rounded to bfloat16 (x_lo); a
 * bfloat16 x of even K whose rows start on a pair is read in place. Returns the scratch to free
 * (NULL: none, or *failed). */
static uint16_t *dot_operands(const void *x, int x_bf16, int64_t M, int64_t K, int64_t x_stride,
                              const uint32_t **pairs, const uint32_t **pairs_lo, int64_t *pairs_stride, int *failed) {
    const int64_t steps = (K + 1) / 2, width = 2 * steps;
    *pairs_lo = NULL;
    if (x_bf16 && K % 2 == 0 && x_stride % 2 == 0 && (uintptr_t)x % 4 == 0) {
        *pairs = x;
        *pairs_stride = x_stride / 2;
        return NULL;
    }
    const int split = !x_bf16 && M < DOT_SPLIT_ROWS;
    uint16_t *hi = malloc(sizeof(uint16_t) * M * width * (split ? 2 : 1));
    if (!hi) { *failed = 1; return NULL; }
    uint16_t *lo = split ? hi + M * width : NULL;
    for (int64_t r = 0; r < M; r++) {
        uint16_t *h = hi + r * width;
        if (x_bf16) {
            memcpy(h, (const uint16_t *)x + r * x_stride, sizeof(uint16_t) * K);
        } else {
            const float *row = (const float *)x + r * x_stride;
            for (int64_t k = 0; k < K; k++) h[k] = float_to_bf16(row[k]);
            if (lo) {
                uint16_t *l = lo + r * width;
                for (int64_t k = 0; k < K; k++) {
                    const float rest = row[k] - bf16_to_float(h[k]); /* exact; NaN where row[k] is infinite */
                    l[k] = rest == rest ? float_to_bf16(rest) : 0;
                }
                if (K % 2) l[K] = 0;
            }
        }
        if (K % 2) h[K] = 0;
    }
    *pairs = (const uint32_t *)hi;
    *pairs_lo = (const uint32_t *)lo;
    *pairs_stride = steps;
    return hi;
}

/* bfloat16 panels (K padded to even), float32 sums. x (M, K) float32 or bfloat16 (x_bf16), rows
 * x_stride elements apart; y (M, N) float32 or bfloat16 (y_bf16, rounded to nearest even), rows
 * y_stride apart. From `dot_rows` rows on (0: never) the bfloat16 dot-product kernel
 * (linear_bf16_dot_fn: x as bfloat16 pairs; a float32 x split in two below DOT_SPLIT_ROWS rows,
 * rounded from there on), else the widening kernel:
 * bfloat16 or odd-K input is first widened into a float32 copy (even width, the pad column zero).
 * A bfloat16 output is computed into float32 and rounded at the end. Returns 0, or 1 when a
 * scratch allocation failed (nothing written). */
int linear_bf16w(const void *x, int x_bf16, int64_t M, int64_t K, int64_t x_stride, const uint16_t *panels,
                 int64_t N, const float *bias, void *y, int y_bf16, int64_t y_stride, int64_t dot_rows,
                 int num_threads) {
    const int64_t steps = (K + 1) / 2, width = 2 * steps;
    const int dot = dot_rows > 0 && M >= dot_rows;
    float *xs = NULL, *ys = NULL;
    float *yf = y;
    int64_t yf_stride = y_stride;
    if (y_bf16) {
        ys = malloc(sizeof(float) * M * N);
        if (!ys) return 1;
        yf = ys;
        yf_stride = N;
    }
    if (dot) {
        const uint32_t *pairs, *pairs_lo;
        int64_t pairs_stride;
        int failed = 0;
        uint16_t *scratch = dot_operands(x, x_bf16, M, K, x_stride, &pairs, &pairs_lo, &pairs_stride, &failed);
        if (failed) { free(ys); return 1; }
        cpu_kernels.linear_bf16_dot(pairs, pairs_lo, M, steps, pairs_stride, (const char *)panels, N, bias, yf,
                                    yf_stride, num_threads);
        free(scratch);
    } else {
        const float *xf = x;
        int64_t xf_stride = x_stride;
        if (x_bf16 || K % 2) {
            xs = malloc(sizeof(float) * M * width);
            if (!xs) { free(ys); return 1; }
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
        cpu_kernels.linear_panels(xf, M, steps, xf_stride, (const char *)panels, 1, N, bias, yf, yf_stride,
                                  num_threads);
    }
    if (y_bf16)
        for (int64_t r = 0; r < M; r++)
            for (int64_t n = 0; n < N; n++) ((uint16_t *)y)[r * y_stride + n] = float_to_bf16(ys[r * N + n]);
    free(xs);
    free(ys);
    return 0;
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
 * Under tensor parallelism (m->tp set) the sizes are this rank's shard (its heads, KV heads and
 * intermediate features), and each `residual += linear(...)` adds the linear's output summed over
 * the ranks (tp_allreduce.c), as the eager layers all-reduce it.
 *
 * With LoRA adapters (m->lora set for a step with adapted rows), each of the four linear layers'
 * outputs gets each adapted row's adapter added right after the layer, as the eager LoRALinear
 * adds it (lora_kernels.c). A step without adapted rows has m->lora NULL: the base step as it was.
 *
 * Qwen3 adds an RMSNorm over each query and key head before rotary (q_norm / k_norm); a sparse
 * layer (Qwen3-MoE) replaces gate_up / down by its router and grouped experts (decode_moe_rows,
 * moe_kernels.c), whose GEMMs are not the eager path's (torch._grouped_mm): that layer's output
 * agrees with eager to float32 rounding, not bit for bit (tests/test_native_decode_moe.py).
 *
 * Activations are float32 whatever the weights: a float32 model's step is bit-identical to its
 * eager path; so is one whose linear layers are int8 (the eager layers call the same kernels).
 * A bfloat16 model keeps its weights (bfloat16 panels) and its KV cache (rows rounded to nearest
 * even as they are written) in bfloat16, but not its activations: its eager path rounds every
 * op's output to bfloat16, this step does not (closer to float32, not bit-identical to eager).
 *
 * Scratch (floats), rows * each of: hidden (x), qkv_n (qkv), q_size (q), kv_size (k), q_size (a),
 * hidden (proj), 2 * intermediate (gate_up), intermediate (act), hidden (the residual stream),
 * then the largest sparse layer's moe_layer_floats: decode_scratch_floats. The structs are in cpu_kernels.h. */

/* A sparse layer's floats past the dense ones: its router logits, the grouped experts' scratch
 * (moe_kernels.c), and the shared expert's gate_up, activation and output. */
static int64_t moe_layer_floats(const decode_moe *e, int64_t rows, int64_t hidden) {
    return rows * e->num_experts + moe_scratch_floats(rows, hidden, e->num_experts, e->top_k, e->intermediate) +
           rows * (3 * e->shared_intermediate + hidden + 1);
}

int64_t decode_scratch_floats(const decode_model *m, int64_t rows) {
    const int64_t q_size = m->heads * m->head_dim, kv_size = m->kv_heads * m->head_dim;
    int64_t moe = 0;
    for (int64_t l = 0; l < m->num_layers; l++)
        if (m->layers[l].moe) {
            const int64_t need = moe_layer_floats(m->layers[l].moe, rows, m->hidden);
            moe = need > moe ? need : moe;
        }
    return rows * (3 * m->hidden + (q_size + 2 * kv_size) + 2 * q_size + kv_size + 3 * m->intermediate) + moe;
}

/* y (rows, N) = x (rows, K) through L, both contiguous. Returns 0, or 1 when scratch failed. */
static int decode_linear_rows(const decode_linear *L, const float *x, int64_t rows, int64_t K, float *y, int64_t N,
                              int num_threads) {
    switch (L->format) {
        case LINEAR_BF16: /* float32 rows: no widening copy unless K is odd */
            return linear_bf16w(x, 0, rows, K, K, L->weight, N, L->bias, y, 0, N, L->dot_rows, num_threads);
        case LINEAR_W8A16:
            return w8a16_linear_f32(x, rows, K, K, L->weight, N, L->scale, L->offset, L->bias, y, N, num_threads);
        case LINEAR_W8A8_DYNAMIC:
            return w8a8_dynamic_linear_f32(x, rows, K, K, L->weight, N, L->scale, L->bias, y, N, num_threads);
        default:
            linear_f32(x, rows, K, K, L->weight, N, L->bias, y, N, num_threads);
            return 0;
    }
}

/* y (rows, N) += each adapted row's adapter for linear `which` (0 qkv, 1 o, 2 gate_up, 3 down) of
 * layer l, when the step has adapted rows (lora_kernels.c). Returns 0, or 1 when scratch failed. */
static int decode_lora_rows(const decode_model *m, int64_t l, int which, const float *x, int64_t rows, int64_t K,
                            float *y, int64_t N, int num_threads) {
    const decode_lora *lora = m->lora;
    if (!lora) return 0;
    return lora_apply_f32(lora->linears + 4 * l + which, lora->rank, x, rows, K, K, lora->row_slots, lora->h, y, N,
                          num_threads);
}

static void add_rows(float *residual, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) residual[i] += x[i];
}

/* Qwen3's per-head RMSNorm of the query and key heads, in place in the fused QKV rows (before
 * rotary, as the eager Attention.forward): `heads` heads of D from `offset` in each row. */
static void head_norms(float *qkv, int64_t rows, int64_t qkv_n, int64_t offset, int64_t heads, int64_t D,
                       const float *weight, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        float *h = qkv + r * qkv_n + offset;
        cpu_kernels.rms_norm(h, D, weight, h, heads, D, eps, 1);
    }
}

/* proj (rows, H) = the sparse MLP of x (rows, H): the routed experts' weighted sum, plus
 * sigmoid(shared_gate(x)) times the shared expert where there is one, as models/moe.py's
 * SparseMoeBlock adds them. `extra`: moe_layer_floats. */
static int decode_moe_rows(const decode_moe *e, const float *x, int64_t rows, int64_t H, float *proj, float *extra,
                           int num_threads) {
    const int64_t E = e->num_experts, SI = e->shared_intermediate;
    float *logits = extra, *shared_gate_up = logits + rows * E, *shared_act = shared_gate_up + rows * 2 * SI;
    float *shared_out = shared_act + rows * SI, *shared_scale = shared_out + rows * H, *experts = shared_scale + rows;
    if (decode_linear_rows(&e->router, x, rows, H, logits, E, num_threads)) return 1;
    moe_experts_f32(x, logits, rows, H, E, e->top_k, (int)e->renormalize, e->w13, e->w2, e->intermediate, proj,
                    experts, num_threads);
    if (!SI) return 0;
    if (decode_linear_rows(&e->shared_gate_up, x, rows, H, shared_gate_up, 2 * SI, num_threads)) return 1;
    cpu_kernels.silu_and_mul(shared_gate_up, 2 * SI, shared_act, rows, SI, num_threads);
    if (decode_linear_rows(&e->shared_down, shared_act, rows, SI, shared_out, H, num_threads)) return 1;
    if (decode_linear_rows(&e->shared_gate, x, rows, H, shared_scale, 1, num_threads)) return 1;
    for (int64_t r = 0; r < rows; r++) {
        const float scale = 1.f / (1.f + expf(-shared_scale[r]));
        for (int64_t i = 0; i < H; i++) proj[r * H + i] += scale * shared_out[r * H + i];
    }
    return 0;
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

/* proj (rows * hidden) = its sum over the tensor-parallel group, where the step has one (the
 * eager layers' all_reduce after o_proj and after the MLP). Returns 0 or TP_*. */
static int reduce_rows(const decode_model *m, float *proj, int64_t n) {
    return m->tp ? tp_all_reduce_f32(m->tp, proj, n) : 0;
}

static int decode_layers(const decode_model *m, const float *embeds, float *out, int64_t rows, const float *cos,
                         const float *sin, const int64_t *slots, const int32_t *block_tables, int64_t table_stride,
                         const int32_t *seq_lens, float *scratch, int num_threads) {
    const int64_t H = m->hidden, D = m->head_dim, I = m->intermediate;
    const int64_t q_size = m->heads * D, kv_size = m->kv_heads * D, qkv_n = q_size + 2 * kv_size;
    float *x = scratch, *qkv = x + rows * H, *q = qkv + rows * qkv_n, *k = q + rows * q_size;
    float *a = k + rows * kv_size, *proj = a + rows * q_size, *gate_up = proj + rows * H, *act = gate_up + rows * 2 * I;
    float *stream = act + rows * I; /* (rows, hidden): the residual stream */
    int failed;
    memcpy(stream, embeds, sizeof(float) * rows * H);
    for (int64_t l = 0; l < m->num_layers; l++) {
        const decode_layer *L = m->layers + l;
        cpu_kernels.rms_norm(stream, H, L->input_norm, x, rows, H, m->eps, num_threads);
        if (decode_linear_rows(&L->qkv, x, rows, H, qkv, qkv_n, num_threads) ||
            decode_lora_rows(m, l, 0, x, rows, H, qkv, qkv_n, num_threads)) return 1;
        if (L->q_norm) {
            head_norms(qkv, rows, qkv_n, 0, m->heads, D, L->q_norm, m->eps);
            head_norms(qkv, rows, qkv_n, q_size, m->kv_heads, D, L->k_norm, m->eps);
        }
        cpu_kernels.rotary(qkv, qkv_n, D, cos, sin, q, rows, m->heads, D, num_threads);
        cpu_kernels.rotary(qkv + q_size, qkv_n, D, cos, sin, k, rows, m->kv_heads, D, num_threads);
        for (int64_t r = 0; r < rows; r++) {
            if (slots[r] < 0) continue;
            write_kv(L->key_cache, slots[r] * kv_size, k + r * kv_size, kv_size, (int)m->kv_bf16);
            write_kv(L->value_cache, slots[r] * kv_size, qkv + r * qkv_n + q_size + kv_size, kv_size, (int)m->kv_bf16);
        }
        if (cpu_kernels.paged_decode(q, L->key_cache, L->value_cache, (int)m->kv_bf16, block_tables, table_stride,
                                     seq_lens, a, rows, m->heads, m->kv_heads, D, m->block_size, m->scale, num_threads))
            return 1;
        if (decode_linear_rows(&L->o, a, rows, q_size, proj, H, num_threads) ||
            decode_lora_rows(m, l, 1, a, rows, q_size, proj, H, num_threads)) return 1;
        if ((failed = reduce_rows(m, proj, rows * H))) return failed;
        add_rows(stream, proj, rows * H);
        cpu_kernels.rms_norm(stream, H, L->post_norm, x, rows, H, m->eps, num_threads);
        if (L->moe) {
            if (decode_moe_rows(L->moe, x, rows, H, proj, stream + rows * H, num_threads)) return 1;
        } else {
            if (decode_linear_rows(&L->gate_up, x, rows, H, gate_up, 2 * I, num_threads) ||
                decode_lora_rows(m, l, 2, x, rows, H, gate_up, 2 * I, num_threads)) return 1;
            cpu_kernels.silu_and_mul(gate_up, 2 * I, act, rows, I, num_threads);
            if (decode_linear_rows(&L->down, act, rows, I, proj, H, num_threads) ||
                decode_lora_rows(m, l, 3, act, rows, I, proj, H, num_threads)) return 1;
        }
        if ((failed = reduce_rows(m, proj, rows * H))) return failed;
        add_rows(stream, proj, rows * H);
    }
    cpu_kernels.rms_norm(stream, H, m->final_norm, out, rows, H, m->eps, num_threads);
    return 0;
}

/* embeds, out (rows, hidden); cos, sin (rows, head_dim); slots (rows) int64, -1 = do not write;
 * block_tables, seq_lens as paged_decode_f32 takes them. The caller has checked every slot and
 * block id against the caches. Returns 0, 1 when a kernel's scratch allocation failed, or TP_*
 * when the tensor-parallel group failed (m->tp->failed_peer: which rank). A rank whose step
 * fails marks it in the exchange (tp_abort), so that no other rank waits for it. */
int decode_step_f32(const decode_model *m, const float *embeds, float *out, int64_t rows, const float *cos,
                    const float *sin, const int64_t *slots, const int32_t *block_tables, int64_t table_stride,
                    const int32_t *seq_lens, float *scratch, int num_threads) {
    const int failed = decode_layers(m, embeds, out, rows, cos, sin, slots, block_tables, table_stride, seq_lens,
                                     scratch, num_threads);
    if (failed && m->tp) tp_abort(m->tp);
    return failed;
}
