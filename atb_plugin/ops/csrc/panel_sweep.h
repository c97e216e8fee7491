/* The sweep over a linear layer's column panels (float_kernels.h draws the layouts), shared by
 * every kernel that reads them: the float kernels of float_kernels.h (float32 panels, and bfloat16
 * panels widened in registers) and the bfloat16 dot-product kernel of isa_avx512_bf16.c. Threads
 * share out the panels; each panel is computed in tiles of at most MR rows of x, which also
 * prefetch into L2 what the next tile reads:
 *
 * One row (decode of a single stream) streams the panels once, front to back; with more rows,
 * the panel (K x 256 bytes) stays in L2 for all its row tiles, which share out prefetching the
 * next panel into L2 while they compute, so reading the weights from DRAM overlaps the
 * arithmetic instead of alternating with it (benchmarks/RESULTS.md, bench_engine "Fourth round"). */
#ifndef ATB_PANEL_SWEEP_H
#define ATB_PANEL_SWEEP_H
#include "cpu_kernels.h"

#define MR 6
#define PREFETCH_AHEAD 8 /* steps (of 256 bytes) a tile streaming its own panel prefetches ahead */
#define STEP_BYTES 256   /* one step of a panel, either format */

/* TILE(n) for the tile's row count `rows` (1 .. MR), n a constant in each case: a tile keeps its
 * sums in registers only when its row count is known at compile time (a loop over a variable row
 * count keeps them in memory: benchmarks/RESULTS.md, bench_engine "Fourth round"). */
#define PANEL_TILE_ROWS(TILE)         \
    switch (rows) {                   \
    case 1: TILE(1); break;           \
    case 2: TILE(2); break;           \
    case 3: TILE(3); break;           \
    case 4: TILE(4); break;           \
    case 5: TILE(5); break;           \
    default: TILE(MR); break;         \
    }
/* PANEL_TILE_ROWS with the int NAME a constant too, 1 where FLAG holds, else 0. */
#define PANEL_TILE_ROWS_BY(FLAG, NAME, TILE) \
    if (FLAG) {                              \
        const int NAME = 1;                  \
        PANEL_TILE_ROWS(TILE)                \
    } else {                                 \
        const int NAME = 0;                  \
        PANEL_TILE_ROWS(TILE)                \
    }

/* One tile: rows m0 .. m0 + rows - 1 (rows <= MR) of x times panel p (its first `cols` columns
 * real), prefetching `lines` cache lines from `prefetch` spread over its steps. `ctx` is the
 * caller's (its x, y, bias). */
typedef void panel_tile_fn(const void *ctx, int64_t m0, int rows, int64_t p, const char *panel, int64_t cols,
                           const char *prefetch, int64_t lines);

/* M rows times the ceil(N / PANEL) panels of `steps` steps each, a tile at a time (one call of
 * `tile` per tile of up to MR rows x 64 columns x K: its cost is nothing beside the tile's). */
static void sweep_panels(int64_t M, int64_t N, int64_t steps, const char *panels, int num_threads,
                         panel_tile_fn *tile, const void *ctx) {
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
            tile(ctx, m0, rows, p, panel, cols, prefetch, lines);
        }
    }
}

#endif
