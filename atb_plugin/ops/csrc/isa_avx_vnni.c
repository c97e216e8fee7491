/* The AVX-VNNI variant of the W8A8 block (VEX-encoded vpdpbusd on 256-bit registers: e.g. Alder
 * Lake, Zen 5), compiled with the AVX2 flags and -mavxvnni (cpu_native.UNITS): the AVX2 tile of
 * int8_tiles.h with one instruction for AVX2's maddubs + madd + add. */
#include "int8_tiles.h"

#define DOT_AVX_VNNI(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
INT8_BLOCK(w8a8_block, W8A8, DOT_AVX_VNNI)

const struct cpu_variant cpu_variant_avx_vnni = {
    "avx_vnni", FEATURE_AVX2 | FEATURE_AVX_VNNI, {.w8a8_block = w8a8_block}};
