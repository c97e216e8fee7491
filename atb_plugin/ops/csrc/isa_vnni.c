/* The VNNI variants of the W8A8 block: vpdpbusd (u8 x s8, four products into each int32 lane, no
 * saturation) in place of AVX2's maddubs + madd + add, on the same 256-bit tiles (int8_tiles.h).
 * Compiled with the AVX2 flags (cpu_native.UNITS); each block adds its set with a target
 * attribute, so this one file holds both: AVX-VNNI (VEX encoded, e.g. Alder Lake, Zen 5) and
 * AVX-512 VNNI on 256-bit registers (EVEX, AVX-512VL). AVX-512 BF16 has no kernel: its probe bit (and
 * AMX BF16's) only sends bfloat16 layers to oneDNN instead of the native panels
 * (packed_linear.native_bf16_preferred). */
#include "int8_tiles.h"

#define DOT_AVX_VNNI(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#define DOT_AVX512_VNNI(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)
W8A8_BLOCK(w8a8_block_avx_vnni, __attribute__((target("avx2,fma,avxvnni"))), DOT_AVX_VNNI)
W8A8_BLOCK(w8a8_block_avx512_vnni, __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni"))),
           DOT_AVX512_VNNI)

const struct cpu_variant cpu_variant_avx_vnni = {
    "avx_vnni", FEATURE_AVX2 | FEATURE_AVX_VNNI, {.w8a8_block = w8a8_block_avx_vnni}};
const struct cpu_variant cpu_variant_avx512_vnni = {
    "avx512_vnni", FEATURE_AVX2 | FEATURE_AVX512 | FEATURE_AVX512_VNNI, {.w8a8_block = w8a8_block_avx512_vnni}};
