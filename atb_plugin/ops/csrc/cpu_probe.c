/* Which instruction sets this process may actually execute (docs/architecture.md, "Native CPU
 * kernels"). Built and run by atb_plugin/ops/cpu_native.py before the kernels are built.
 *
 * A CPUID bit (what /proc/cpuinfo and -march=native read) is not proof: a hypervisor or the OS
 * may leave a register state disabled in XCR0 (AVX-512's opmask / ZMM state), and AMX tiles
 * need a per-process permission from the kernel (arch_prctl ARCH_REQ_XCOMP_PERM) before the
 * first tile instruction. So each feature is tried for real, in a forked child: the child runs
 * one instruction of the set and exits 0; SIGILL (or any other death) in the child means "no".
 * The parent prints one line "name 0|1" per feature and exits 0.
 *
 * Compiled without -march: every test function names its own target, so the probe itself runs
 * on any x86-64 CPU. On other architectures it prints nothing. The names are cpu_native.FEATURES,
 * in the order of the library's FEATURE_* bits (cpu_kernels.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cpu_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

static volatile float sink_f;
static volatile int sink_i;

__attribute__((target("avx2,fma,f16c"))) static int try_avx2(void) {
    volatile float in[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    __m256 a = _mm256_loadu_ps((const float *)in);
    a = _mm256_fmadd_ps(a, a, a);
    __m256i b = _mm256_add_epi32(_mm256_castps_si256(a), _mm256_set1_epi32(1)); /* an AVX2 integer op */
    __m128 h = _mm_cvtph_ps(_mm256_cvtps_ph(_mm256_castsi256_ps(b), 0));
    sink_f = _mm_cvtss_f32(h);
    return 0;
}

__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))) static int try_avx512(void) {
    volatile int in[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    __m512i a = _mm512_loadu_si512((const void *)in);
    __m512i b = _mm512_add_epi8(a, a);                 /* BW */
    __mmask16 m = _mm512_cmpgt_epi32_mask(b, a);       /* opmask state */
    __m256i c = _mm256_maskz_add_epi32((__mmask8)m, _mm512_castsi512_si256(a), _mm512_castsi512_si256(b)); /* VL */
    __m512i d = _mm512_mullo_epi64(a, b);              /* DQ */
    sink_i = _mm256_extract_epi32(c, 1) + _mm512_reduce_add_epi32(d);
    return 0;
}

__attribute__((target("avx512f,avx512bf16"))) static int try_avx512_bf16(void) {
    __m512 a = _mm512_set1_ps(1.5f);
    __m512bh b = _mm512_cvtne2ps_pbh(a, a);
    __m512 c = _mm512_dpbf16_ps(a, b, b);
    sink_f = _mm512_reduce_add_ps(c);
    return 0;
}

__attribute__((target("avx512f,avx512vnni"))) static int try_avx512_vnni(void) {
    __m512i a = _mm512_set1_epi8(3);
    __m512i c = _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, a);
    sink_i = _mm512_reduce_add_epi32(c);
    return 0;
}

__attribute__((target("avx2,avxvnni"))) static int try_avx_vnni(void) {
    __m256i a = _mm256_set1_epi8(3);
    __m256i c = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, a);
    sink_i = _mm256_extract_epi32(c, 0);
    return 0;
}

/* The tile code is isa_amx.c's (compiled into this program beside this file). */
static int try_amx_bf16(void) { return amx_try_dot(AMX_DOT_BF16); }
static int try_amx_int8(void) { return amx_try_dot(AMX_DOT_INT8); }

static const struct { const char *name; int (*run)(void); } FEATURES[] = {
    {"avx2", try_avx2},               /* with FMA and F16C */
    {"avx512", try_avx512},           /* F, BW, DQ, VL */
    {"avx512_bf16", try_avx512_bf16},
    {"avx512_vnni", try_avx512_vnni},
    {"avx_vnni", try_avx_vnni},
    {"amx_bf16", try_amx_bf16},
    {"amx_int8", try_amx_int8},
};

int main(void) {
    for (size_t i = 0; i < sizeof FEATURES / sizeof FEATURES[0]; i++) {
        fflush(stdout);
        const pid_t child = fork();
        if (child == 0) {
            /* no core files or messages from an expected SIGILL */
            _exit(FEATURES[i].run());
        }
        int status = 0, ok = 0;
        if (child > 0 && waitpid(child, &status, 0) == child) ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        printf("%s %d\n", FEATURES[i].name, ok);
    }
    return 0;
}
#else
int main(void) { return 0; }
#endif
