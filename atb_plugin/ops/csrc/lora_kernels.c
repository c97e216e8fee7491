/* Multi-LoRA on the CPU: every row of a step through its own adapter's slot, after a linear layer
 * (Punica's bgmv: rows x their own slot). The slots are the ones atb_plugin/lora/layers.py holds
 * (LoRALinear; docs/lora.md, "How a row finds its adapter"), read in place:
 *
 *   a               (slots, slices * rank, K)   slice j's A in rows j * rank .. (zeros past its rank)
 *   b[j]            (slots, rank, widths[j])    slice j's scale * B^T
 *   row_slots[r]    row r's slot, -1 for the base model (nothing added)
 *
 *   h[r]            = x[r] . a[slot]^T                          shrink, float32 sums
 *   y[r, slice j]  += h[r, j * rank .. (j + 1) * rank] . b[j][slot]   expand, into the output slice
 *
 * Rows of one slot next to each other (the model runner orders a step's requests by slot) are
 * taken LORA_ROWS at a time, so each slot's A and B are read once per tile of rows rather than
 * once per row; a tile keeps its sums in registers (its row count a compile-time constant, as the
 * panel tiles: panel_sweep.h). In a decode step the slots come from memory (the base weights
 * streamed in between evict them: 4 rank-16 slots of SmolLM2 are 78 MB a step), so the tiles
 * prefetch what they read next: the next rows of A, and B a little ahead in each of its rank rows
 * (16 strided streams, more than the hardware prefetcher follows). Measured on the 120 layers of
 * SmolLM2 at 32 rows, 4 slots (8 rows each): 5.8 ms a step without the prefetches, 4.1 to 4.5 ms
 * with 512 bytes ahead in B (1 KiB: 4.4 to 4.6, 2 KiB: 4.9 to 5.1); 8-row tiles instead of 4 took
 * a layer with its slots in cache from 29 to 22 us and left the streamed step as it was. Called
 * by the captured decode step after each wrapped linear layer (cpu_kernels.c, decode_step_f32)
 * and by Python (`lora_apply_f32`: the eager layer and the tests). */
#include "cpu_kernels.h"
#include "float_kernels.h"

#define LORA_ROWS 8 /* rows of one slot per tile */
/* Rows of A per shrink tile and vectors of output columns per expand tile, for a tile of `rows`
 * rows: at most 16 vector sums in registers (AVX-512 has 32), the more rows the fewer columns. */
#define LORA_DOTS(rows) ((rows) <= 4 ? 4 : 2)
#define LORA_COLS(rows) ((rows) <= 4 ? 4 : 2)
#define LORA_AHEAD (2 * 4 * LANES) /* floats ahead in each row of B that an expand tile prefetches */

static inline float hsum(vf v) {
    float total = 0.f;
    for (int l = 0; l < LANES; l++) total += v[l];
    return total;
}

/* h[r][w] = x[r] . a[w] for ROWS rows and DOTS rows of a (w0 .. w0 + DOTS - 1), K long. */
static inline __attribute__((always_inline)) void shrink_tile(const float *x, int64_t x_stride, const float *a,
                                                              int64_t K, float *h, int64_t h_stride,
                                                              const int ROWS, const int DOTS) {
    vf acc[LORA_ROWS][4] = {{{0}}};
    const int64_t whole = K / LANES * LANES;
    for (int64_t k = 0; k < whole; k += LANES) {
        vf xv[LORA_ROWS];
        for (int r = 0; r < ROWS; r++) xv[r] = load(x + r * x_stride + k);
        for (int w = 0; w < DOTS; w++) {
            __builtin_prefetch(a + (w + DOTS) * K + k); /* the next rows of A (a hint: never faults) */
            const vf av = load(a + w * K + k);
            for (int r = 0; r < ROWS; r++) acc[r][w] += xv[r] * av;
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int w = 0; w < DOTS; w++) {
            float total = hsum(acc[r][w]);
            for (int64_t k = whole; k < K; k++) total += x[r * x_stride + k] * a[w * K + k];
            h[r * h_stride + w] = total;
        }
}

/* y[r][0 .. COLS * LANES) += h[r] . b (rank rows, b_stride apart) for ROWS rows. */
static inline __attribute__((always_inline)) void expand_tile(const float *h, int64_t h_stride, const float *b,
                                                              int64_t b_stride, int64_t rank, float *y,
                                                              int64_t y_stride, const int ROWS, const int COLS) {
    vf acc[LORA_ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < COLS; c++) acc[r][c] = load(y + r * y_stride + c * LANES);
    for (int64_t i = 0; i < rank; i++) {
        vf bv[4];
        for (int c = 0; c < COLS; c++) {
            bv[c] = load(b + i * b_stride + c * LANES);
            __builtin_prefetch(b + i * b_stride + LORA_AHEAD + c * LANES); /* rank rows of B: too many streams to guess */
        }
        for (int r = 0; r < ROWS; r++) {
            const float hr = h[r * h_stride + i];
            for (int c = 0; c < COLS; c++) acc[r][c] += hr * bv[c];
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < COLS; c++) store(y + r * y_stride + c * LANES, acc[r][c]);
}

/* One tile of `rows` (1 .. LORA_ROWS) rows of one slot: shrink into h (rows, slices * rank), then
 * each slice's expand into its columns of y. */
static inline __attribute__((always_inline)) void lora_tile(const lora_linear *L, const float *a, int64_t slot,
                                                            int64_t rank, const float *x, int64_t K,
                                                            int64_t x_stride, float *h, float *y, int64_t y_stride,
                                                            const int ROWS) {
    const int64_t W = L->slices * rank;
    const int DOTS = LORA_DOTS(ROWS), COLS = LORA_COLS(ROWS);
    int64_t w = 0;
    for (; w + DOTS <= W; w += DOTS) shrink_tile(x, x_stride, a + w * K, K, h + w, W, ROWS, DOTS);
    for (; w < W; w++) shrink_tile(x, x_stride, a + w * K, K, h + w, W, ROWS, 1);
    int64_t column = 0;
    for (int64_t j = 0; j < L->slices; j++) {
        const int64_t N = L->widths[j];
        const float *b = L->b[j] + slot * rank * N, *hj = h + j * rank;
        float *yj = y + column;
        int64_t n = 0;
        for (; n + COLS * LANES <= N; n += COLS * LANES) expand_tile(hj, W, b + n, N, rank, yj + n, y_stride, ROWS, COLS);
        for (; n + LANES <= N; n += LANES) expand_tile(hj, W, b + n, N, rank, yj + n, y_stride, ROWS, 1);
        for (; n < N; n++) /* the last columns of a width that is not a multiple of LANES */
            for (int r = 0; r < ROWS; r++) {
                float total = 0.f;
                for (int64_t i = 0; i < rank; i++) total += hj[r * W + i] * b[i * N + n];
                yj[r * y_stride + n] += total;
            }
        column += N;
    }
}

#define LORA_TILE(n) lora_tile(L, a, slot, rank, x + r0 * x_stride, K, x_stride, h + r0 * W, y + r0 * y_stride, \
                               y_stride, n)

/* x (rows, K) rows x_stride apart; y (rows, sum of widths) rows y_stride apart, added into; h
 * scratch of rows * slices * rank floats. The tiles (runs of one slot, LORA_ROWS rows at most),
 * found in one pass, are shared out between threads; each writes only its own rows of h and y.
 * Returns 0, or 1 when the tile list could not be allocated (nothing added). */
int lora_apply_f32(const lora_linear *L, int64_t rank, const float *x, int64_t rows, int64_t K, int64_t x_stride,
                   const int32_t *row_slots, float *h, float *y, int64_t y_stride, int num_threads) {
    const int64_t W = L->slices * rank;
    int64_t *starts = malloc(sizeof(int64_t) * (rows + 1)), tiles = 0;
    if (!starts) return 1;
    for (int64_t r = 0, run = 0; r < rows; r++) {
        run = r > 0 && row_slots[r] == row_slots[r - 1] ? run + 1 : 0;
        if (row_slots[r] >= 0 && run % LORA_ROWS == 0) starts[tiles++] = r;
    }
#pragma omp parallel for schedule(dynamic) num_threads(num_threads) if (num_threads > 1 && tiles > 1)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t r0 = starts[t];
        const int32_t slot = row_slots[r0];
        int n = 1;
        while (n < LORA_ROWS && r0 + n < rows && row_slots[r0 + n] == slot) n++;
        const float *a = L->a + (int64_t)slot * W * K;
        switch (n) {
            case 1: LORA_TILE(1); break;
            case 2: LORA_TILE(2); break;
            case 3: LORA_TILE(3); break;
            case 4: LORA_TILE(4); break;
            case 5: LORA_TILE(5); break;
            case 6: LORA_TILE(6); break;
            case 7: LORA_TILE(7); break;
            default: LORA_TILE(LORA_ROWS); break;
        }
    }
    free(starts);
    return 0;
}
