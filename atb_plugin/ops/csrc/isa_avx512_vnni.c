/* The AVX-512 VNNI variant of the W8A8 block: the AVX2 tile of int8_tiles.h with EVEX vpdpbusd
 * (AVX-512VL, on 256-bit registers) for AVX2's maddubs + madd + add. Compiled with the AVX-512 flags
 * and -mavx512vnni (cpu_native.UNITS).
 *
 * AVX-512 BF16 has no kernel: its probe bit (and AMX BF16's) only sends bfloat16 layers to oneDNN
 * instead of the native panels (packed_linear.native_bf16_preferred). */
#include "int8_tiles.h"

#define DOT_AVX512_VNNI(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)
INT8_BLOCK(w8a8_block, W8A8, DOT_AVX512_VNNI)

const struct cpu_variant cpu_variant_avx512_vnni = {
    "avx512_vnni", FEATURE_AVX2 | FEATURE_AVX512 | FEATURE_AVX512_VNNI, {.w8a8_block = w8a8_block}};
