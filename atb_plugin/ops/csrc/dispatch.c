/* The dispatch table: for each kernel slot (CPU_KERNEL_SLOTS in cpu_kernels.h), the best variant
 * whose instruction sets the probe saw execute (csrc/cpu_probe.c; cpu_native.py passes its
 * answer to cpu_set_features when the library loads). One table for the whole library: every
 * call goes through it, the captured decode step too, so eager and captured steps run the same
 * variant. Variants are the isa_*.c files, each compiled with its own flags; a variant's code
 * runs only once the table holds it, so one library serves every CPU the probe can describe. */
#include "cpu_kernels.h"

/* Best first: a slot takes the first variant that fills it and whose needs the features cover. */
static const struct cpu_variant *const VARIANTS[] = {
#if defined(__x86_64__)
    &cpu_variant_amx, &cpu_variant_avx512_bf16, &cpu_variant_avx512_vnni, &cpu_variant_avx_vnni, &cpu_variant_avx512, &cpu_variant_avx2,
#endif
    &cpu_variant_portable,
};
#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

enum {
#define CPU_KERNEL_INDEX(slot) SLOT_##slot,
    CPU_KERNEL_SLOTS(CPU_KERNEL_INDEX)
#undef CPU_KERNEL_INDEX
    SLOTS
};
static const char *const SLOT_NAMES[SLOTS] = {
#define CPU_KERNEL_NAME(slot) #slot,
    CPU_KERNEL_SLOTS(CPU_KERNEL_NAME)
#undef CPU_KERNEL_NAME
};

struct cpu_kernels cpu_kernels;
static const char *chosen[SLOTS]; /* the variant in each slot */

/* Fill every slot from the variants `mask` (FEATURE_* bits) allows: the probe's answer, or fewer
 * (ATB_PLUGIN_CPU_ISA; the tests and benchmarks take each variant in turn). Returns the mask. The
 * portable variant fills every slot, so no slot stays empty. */
int cpu_set_features(int mask) {
#define CPU_KERNEL_FILL(slot)                                                                               \
    for (size_t v = 0; v < COUNT(VARIANTS); v++)                                                            \
        if (VARIANTS[v]->kernels.slot && (VARIANTS[v]->needs & ~mask) == 0) {                              \
            cpu_kernels.slot = VARIANTS[v]->kernels.slot;                                                   \
            chosen[SLOT_##slot] = VARIANTS[v]->name;                                                        \
            break;                                                                                          \
        }
    CPU_KERNEL_SLOTS(CPU_KERNEL_FILL)
#undef CPU_KERNEL_FILL
    return mask;
}

/* Portable until cpu_native.py passes the probe's answer: a call before that runs, slowly. */
__attribute__((constructor)) static void fill_portable(void) { cpu_set_features(0); }

/* Slot `slot`'s name and the variant it holds, NULL past the last slot (cpu_native.kernel_map). */
const char *cpu_kernel_slot(int slot) { return slot >= 0 && slot < SLOTS ? SLOT_NAMES[slot] : NULL; }
const char *cpu_kernel_variant(int slot) { return slot >= 0 && slot < SLOTS ? chosen[slot] : NULL; }

/* The W8A8 block's variant as a number (0 = portable C, 1 = AVX2, 2 = AVX-VNNI, 3 = AVX-512
 * VNNI), for the benchmarks to report. */
int w8a8_variant(void) {
    static const char *const ORDER[] = {"portable", "avx2", "avx_vnni", "avx512_vnni"};
    for (int i = 0; i < (int)COUNT(ORDER); i++)
        if (strcmp(chosen[SLOT_w8a8_block], ORDER[i]) == 0) return i;
    return -1;
}
