/* AMX: the home of the tile code. Linux grants the tile data state per process
 * (arch_prctl(ARCH_REQ_XCOMP_PERM)), and every tile instruction runs under a tile configuration
 * loaded first; both helpers are here, for the probe (cpu_probe.c runs amx_try_dot in a child to
 * see AMX execute) and for the AMX kernels to come. No kernel is written yet, so the variant below
 * fills no slot of the dispatch table ("Adding an ISA variant" in docs/architecture.md: an AMX
 * kernel calls amx_request_permission once before its first tile instruction). Compiled without
 * instruction-set flags: each function names its own target. */
#include "cpu_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static volatile int32_t sink; /* keeps the probe's tile product from being optimised away */

/* 0 once the kernel lets this process use tile data, else nonzero (no AMX, or an old kernel). */
int amx_request_permission(void) { return (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); }

/* A palette-1 configuration of `tiles` tiles (0 .. tiles-1) of `rows` rows by `colsb` bytes. */
void amx_configure(struct amx_tile_config *cfg, int tiles, int rows, int colsb) {
    memset(cfg, 0, sizeof *cfg);
    cfg->palette = 1;
    for (int t = 0; t < tiles; t++) {
        cfg->colsb[t] = (unsigned short)colsb;
        cfg->rows[t] = (unsigned char)rows;
    }
}

/* One tile dot product of `kind` (AMX_DOT_BF16: tdpbf16ps, AMX_DOT_INT8: tdpbssd) on three 16 x
 * 64-byte tiles: 0 when it ran, 1 without the permission. SIGILL where the set does not execute:
 * only the probe calls it, in a child process. */
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) int amx_try_dot(int kind) {
    static struct amx_tile_config cfg __attribute__((aligned(64)));
    static unsigned char a[16 * 64] __attribute__((aligned(64)));
    static int32_t c[16 * 16] __attribute__((aligned(64)));
    if (amx_request_permission() != 0) return 1;
    amx_configure(&cfg, 3, 16, 64);
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, a, 64);
    if (kind == AMX_DOT_BF16) _tile_dpbf16ps(0, 1, 2);
    else _tile_dpbssd(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
    sink = c[0];
    return 0;
}

const struct cpu_variant cpu_variant_amx = {"amx", FEATURE_AMX_BF16 | FEATURE_AMX_INT8, {0}};
#endif
