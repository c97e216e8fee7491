/* The native CPU kernels' common header (docs/architecture.md, "Native CPU kernels": the kernel
 * map). Every file of the library includes it: the feature bits the probe reports, the structs
 * Python passes (cpu_native.py's ctypes Structures mirror them; tests/test_cpu_kernel_map.py
 * compares the layouts), the helpers the files share, and the dispatch table: one slot per kernel
 * that has instruction-set variants, filled by dispatch.c from the probe's answer.
 *
 * Where each kernel lives:
 *   cpu_kernels.c   the functions Python calls (ctypes), each a thin call through the table, and
 *                   the captured decode step
 *   lora_kernels.c  the adapters' grouped shrink / expand (multi-LoRA rows, bgmv)
 *   moe_kernels.c   the captured step's sparse MoE layer: routing and the grouped expert GEMMs
 *   tp_allreduce.c  the captured step's all-reduce over the tensor-parallel ranks' shared-memory
 *                   exchange (shm/exchange.py's protocol, from C)
 *   int8_driver.c   the one int8 linear driver (W8A16 and W8A8): blocks of weight rows, threads,
 *                   scratch, scales; its inner kernel comes from the table
 *   dispatch.c      the table and the variants, best first
 *   isa_*.c         the variants, one file per instruction set, each compiled with its own flags
 *                   (cpu_native.UNITS): portable C, AVX2, AVX-512, AVX-VNNI, AVX-512 VNNI,
 *                   AVX-512 BF16, AMX
 *   float_kernels.h the float kernels (GCC vector types), compiled into each of isa_portable.c,
 *                   isa_avx2.c and isa_avx512.c
 *   panel_sweep.h   the sweep of the linear kernels over the weight panels (threads, row tiles,
 *                   prefetch), for float_kernels.h and isa_avx512_bf16.c
 *   int8_tiles.h    the int8 tiles on 256-bit registers, for isa_avx2.c and the two VNNI files */
#ifndef ATB_CPU_KERNELS_H
#define ATB_CPU_KERNELS_H
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

/* What cpu_probe.c reports, one bit per name of cpu_native.FEATURES, in that order. */
enum {
    FEATURE_AVX2 = 1,        /* with FMA and F16C */
    FEATURE_AVX512 = 2,      /* F, BW, DQ, VL */
    FEATURE_AVX512_BF16 = 4,
    FEATURE_AVX512_VNNI = 8,
    FEATURE_AVX_VNNI = 16,
    FEATURE_AMX_BF16 = 32,
    FEATURE_AMX_INT8 = 64,
};

/* Columns per weight panel of the linear kernels (float_kernels.h draws the layout; cpu_native.PANEL). */
#define PANEL 64

/* The bfloat16 dot-product kernel (linear_bf16_dot_fn) splits a float32 x into a bfloat16 part and
 * a bfloat16 remainder below this many rows, where the product is bound by the weights' bandwidth
 * and the remainder's products are free; from this many rows on, where the arithmetic counts, it
 * rounds x to bfloat16, as the eager bfloat16 model's and oneDNN's bfloat16 products take it
 * (cpu_native.DOT_SPLIT_ROWS; docs/architecture.md, "Chosen by measurement"). */
#define DOT_SPLIT_ROWS 8

/* The int8 kernels work on blocks of OT weight rows (a thread's unit of work); sums land in
 * sums[m * OT + o]. */
#define OT 8
#define STACK_ROWS 64 /* rows of x whose int8 scratch may live on the stack */

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

/* ---- the structs of the captured decode step (cpu_native.DecodeLinear / DecodeLayer /
 * DecodeModel; what each field means: cpu_kernels.c, decode_step_f32) ---------------------- */
enum { LINEAR_F32 = 0, LINEAR_BF16 = 1, LINEAR_W8A16 = 2, LINEAR_W8A8_DYNAMIC = 3 };

typedef struct {
    int64_t format;      /* LINEAR_*: what `weight` holds */
    const void *weight;  /* float32 / bfloat16 panels, or int8 (out, in) rows */
    const float *bias;   /* NULL; padded to whole panels for panels, (out) for int8 rows */
    const float *scale;  /* int8: (out) per output channel */
    const float *offset; /* W8A16: (out) */
    int64_t dot_rows;    /* bfloat16 panels: from this many rows on, the dot-product kernel (0: never) */
} decode_linear;

/* A sparse mixture-of-experts MLP (Qwen3-MoE; Qwen2-MoE adds the shared expert): what
 * moe_kernels.c runs in place of a dense layer's gate_up / down. */
typedef struct {
    int64_t num_experts, top_k, intermediate, renormalize;
    decode_linear router;               /* hidden -> num_experts logits */
    const float *w13, *w2;              /* (E, H, 2I), (E, I, H) float32, models/moe.py's layout */
    int64_t shared_intermediate;        /* the shared expert's features; 0: none (and no linears below) */
    decode_linear shared_gate_up, shared_down;
    decode_linear shared_gate;          /* hidden -> 1: sigmoid of it scales the shared expert */
} decode_moe;

typedef struct {
    const float *input_norm, *post_norm; /* (hidden), float32 */
    decode_linear qkv, o, gate_up, down;
    void *key_cache, *value_cache;       /* (num_blocks, block_size, kv_heads, head_dim) */
    const float *q_norm, *k_norm;        /* (head_dim) RMSNorm weights over each query / key head (Qwen3); NULL: none */
    const decode_moe *moe;               /* the sparse MLP in place of gate_up / down; NULL: dense */
} decode_layer;

/* One LoRA-wrapped linear layer's adapter slots as atb_plugin/lora/layers.py holds them, read in
 * place (lora_kernels.c: layouts and what is computed; cpu_native.LoRASlots). */
#define LORA_MAX_SLICES 3
typedef struct {
    const float *a;                  /* (slots, slices * rank, in) */
    const float *b[LORA_MAX_SLICES]; /* slice j: (slots, rank, widths[j]), scale * B^T */
    int64_t widths[LORA_MAX_SLICES];
    int64_t slices;
} lora_linear;

/* The adapters of a captured decode step (cpu_native.DecodeLoRA): 4 lora_linear per decoder
 * layer (qkv, o, gate_up, down), each row's slot (written every step), the shrink's scratch
 * (rows * LORA_MAX_SLICES * rank floats). */
typedef struct {
    int64_t rank;
    const int32_t *row_slots;
    float *h;
    const lora_linear *linears;
} decode_lora;

/* This rank's place in a tensor-parallel group's shared-memory exchange (cpu_native.DecodeTP;
 * the segment's layout: shm/exchange.py). `failed_peer`: written by tp_all_reduce_f32 when it
 * returns an error, the rank it was waiting for. */
typedef struct {
    void *segment;
    int64_t rank, size, slot_bytes;
    double timeout_s;
    int64_t failed_peer;
} decode_tp;

/* tp_all_reduce_f32's answers past 0 (and decode_step_f32's: 1 is a kernel's failed scratch). */
enum { TP_PEER_EXITED = 2, TP_TIMED_OUT = 3, TP_PEER_ABORTED = 4 };

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, kv_bf16;
    float eps, scale;
    const decode_layer *layers;
    const float *final_norm;
    const decode_lora *lora; /* NULL: no row of this step is adapted */
    decode_tp *tp;           /* NULL: one rank; else the row-parallel outputs are summed over the group */
} decode_model;

/* ---- the dispatch table ----------------------------------------------------------------------
 *
 * One slot per kernel with variants. What each computes: float_kernels.h (the float slots),
 * int8_driver.c (the int8 blocks and the quantisation). */
typedef int paged_decode_fn(const float *query, const void *key_cache, const void *value_cache, int kv_bf16,
                            const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, float *out,
                            int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                            float scale, int num_threads);
typedef void rms_norm_fn(const float *x, int64_t x_stride, const float *weight, float *out, int64_t rows,
                         int64_t width, float eps, int num_threads);
typedef void rotary_fn(const float *x, int64_t token_stride, int64_t head_stride, const float *cos, const float *sin,
                       float *out, int64_t tokens, int64_t heads, int64_t head_dim, int num_threads);
typedef void silu_and_mul_fn(const float *x, int64_t x_stride, float *out, int64_t rows, int64_t width,
                             int num_threads);
typedef void argmax_fn(const float *x, int64_t x_stride, int64_t rows, int64_t width, int64_t *out, int num_threads);
typedef void linear_panels_fn(const float *x, int64_t M, int64_t steps, int64_t x_stride, const char *panels,
                              int weights_bf16, int64_t N, const float *bias, float *y, int64_t y_stride,
                              int num_threads);
/* y (M, N) = x W^T (+ bias) over bfloat16 panels with bfloat16 dot products: x as M rows of
 * `steps` pairs of bfloat16 (rows x_stride pairs apart, K padded to even with a zero), x_lo NULL
 * or the same layout holding x's rounding remainder (a float32 x split in two: linear_bf16w). */
typedef void linear_bf16_dot_fn(const uint32_t *x, const uint32_t *x_lo, int64_t M, int64_t steps, int64_t x_stride,
                                const char *panels, int64_t N, const float *bias, float *y, int64_t y_stride,
                                int num_threads);
typedef void quantize_rows_fn(const float *x, int64_t M, int64_t K, int64_t x_stride, int8_t *q, int64_t q_stride,
                              float *s);
/* An int8 inner kernel: sums[m * OT + o] = sum_k a[m][k] * w[o][k] for M rows of `a` (a_stride
 * elements apart) and `count` <= OT weight rows (K apart); float32 x and sums for W8A16, int8 q
 * and exact int32 sums for W8A8. */
typedef void int8_block_fn(const void *a, int64_t M, int64_t K, int64_t a_stride, const int8_t *w, int count,
                           void *sums);
typedef int8_block_fn w8a16_block_fn, w8a8_block_fn;

/* The slots, in the order cpu_kernel_slot() names them. */
#define CPU_KERNEL_SLOTS(X)                                                                                 \
    X(paged_decode) X(rms_norm) X(rotary) X(silu_and_mul) X(argmax) X(linear_panels) X(quantize_rows)      \
    X(w8a16_block) X(w8a8_block) X(linear_bf16_dot)

struct cpu_kernels {
#define CPU_KERNEL_MEMBER(slot) slot##_fn *slot;
    CPU_KERNEL_SLOTS(CPU_KERNEL_MEMBER)
#undef CPU_KERNEL_MEMBER
};

/* One file's kernels: the slots it fills (NULL where it has none) and the probe's bits it needs,
 * every one of them (a file compiled for AVX-512 VNNI needs AVX2, AVX-512 and AVX-512 VNNI). */
struct cpu_variant {
    const char *name;
    int needs;
    struct cpu_kernels kernels;
};

extern const struct cpu_variant cpu_variant_portable;
#if defined(__x86_64__)
extern const struct cpu_variant cpu_variant_avx2, cpu_variant_avx512, cpu_variant_avx_vnni, cpu_variant_avx512_vnni,
    cpu_variant_avx512_bf16, cpu_variant_amx;
#endif

/* The table every call goes through: the best variant of each slot that the features allow
 * (dispatch.c; cpu_set_features fills it). */
extern struct cpu_kernels cpu_kernels;

/* ---- the functions Python calls, and the ones the files call each other by name ------------ */
int w8a16_linear_f32(const float *x, int64_t M, int64_t K, int64_t x_stride, const int8_t *w, int64_t N,
                     const float *scale, const float *offset, const float *bias, float *y, int64_t y_stride,
                     int num_threads);
int w8a8_dynamic_linear_f32(const float *x, int64_t M, int64_t K, int64_t x_stride, const int8_t *w, int64_t N,
                            const float *w_scale, const float *bias, float *y, int64_t y_stride, int num_threads);
int linear_bf16w(const void *x, int x_bf16, int64_t M, int64_t K, int64_t x_stride, const uint16_t *panels,
                 int64_t N, const float *bias, void *y, int y_bf16, int64_t y_stride, int64_t dot_rows,
                 int num_threads);
void linear_f32(const float *x, int64_t M, int64_t K, int64_t x_stride, const float *panels, int64_t N,
                const float *bias, float *y, int64_t y_stride, int num_threads);
int lora_apply_f32(const lora_linear *L, int64_t rank, const float *x, int64_t rows, int64_t K, int64_t x_stride,
                   const int32_t *row_slots, float *h, float *y, int64_t y_stride, int num_threads);
/* tp_allreduce.c: x (n floats) = its sum over the group, in rank order (0 or TP_*); tp_abort
 * marks this rank's step as failed, so that the others stop waiting for it. */
int tp_all_reduce_f32(decode_tp *tp, float *x, int64_t n);
void tp_abort(const decode_tp *tp);

/* moe_kernels.c: the grouped experts of a sparse layer, and the plain (K, N) GEMM they run per expert. */
int64_t moe_scratch_floats(int64_t rows, int64_t hidden, int64_t num_experts, int64_t top_k, int64_t intermediate);
void moe_experts_f32(const float *x, const float *logits, int64_t rows, int64_t H, int64_t E, int64_t k,
                     int renormalize, const float *w13, const float *w2, int64_t I, float *out, float *scratch,
                     int num_threads);
void expert_matmul_f32(const float *x, int64_t M, int64_t K, int64_t x_stride, const float *w, int64_t N,
                       float *y, int64_t y_stride);

/* Per-token symmetric int8 (what quantize_rows computes; each variant vectorises a prefix of the
 * row and leaves the rest to these): s[m] = max|x[m]| / 127 (0 for a row of zeros, whose q are
 * 0), q = x / s rounded to nearest even (torch.round's rule, the current rounding mode's default),
 * clamped to -128..127. `top_from` returns how many leading columns it took into *top, `round_from`
 * how many it quantised. */
typedef int64_t quantize_top_fn(const float *row, int64_t K, float *top);
typedef int64_t quantize_round_fn(const float *row, int64_t K, float scale, int8_t *q);
static inline __attribute__((always_inline)) void quantize_rows_with(
        const float *x, int64_t M, int64_t K, int64_t x_stride, int8_t *q, int64_t q_stride, float *s,
        quantize_top_fn *top_from, quantize_round_fn *round_from) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * x_stride;
        int8_t *qr = q + m * q_stride;
        float top = 0.f;
        int64_t k = top_from ? top_from(xr, K, &top) : 0;
        for (; k < K; k++) top = fmaxf(top, fabsf(xr[k]));
        const float scale = top / 127.f;
        s[m] = scale;
        if (scale == 0.f) {
            memset(qr, 0, K);
            continue;
        }
        for (k = round_from ? round_from(xr, K, scale, qr) : 0; k < K; k++) {
            const float f = nearbyintf(xr[k] / scale);
            qr[k] = (int8_t)(f < -128.f ? -128.f : f > 127.f ? 127.f : f);
        }
    }
}

#if defined(__x86_64__)
/* AMX (isa_amx.c): the kernel's permission for tile data and a palette-1 tile configuration.
 * Also what cpu_probe.c runs to see AMX execute (amx_try_dot). */
struct amx_tile_config {
    unsigned char palette, start_row, reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
};
int amx_request_permission(void);
void amx_configure(struct amx_tile_config *cfg, int tiles, int rows, int colsb);
enum { AMX_DOT_BF16, AMX_DOT_INT8 };
int amx_try_dot(int kind);
#endif

#endif
