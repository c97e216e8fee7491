/* The AVX-512 variant (F, BW, DQ, VL: cpu_native.UNITS compiles this file with those flags): the
 * float kernels of float_kernels.h on 512-bit registers (16 floats a vector, 32 registers: the
 * linear tiles keep 6 rows x a whole 64-column panel in registers). The int8 kernels come from
 * isa_avx2.c and isa_avx512_vnni.c: no 512-bit int8 kernel is written yet. */
#include "cpu_kernels.h"
#include "float_kernels.h"

const struct cpu_variant cpu_variant_avx512 = {"avx512", FEATURE_AVX2 | FEATURE_AVX512, {FLOAT_KERNELS}};
