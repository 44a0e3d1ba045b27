/* cpu_features.c — which kernel variants this CPU and OS can run, from CPUID and XGETBV.
 * A variant needs every instruction-set feature its translation unit is compiled for, and the OS
 * must save the vector registers it uses (XCR0), or its first instruction would fault. */
#include <string.h>

#include "helm_kernels.h"

long helm_prefetch_bytes[HELM_NUM_DTYPES] = {1024, 2048, 2048}; /* f32, bf16, f16 */

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static unsigned long long xgetbv0(void) {
    unsigned int lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

typedef struct { int avx2, fma, f16c, avx512, avx512bf16; } features;

static features detect(void) {
    features f = {0, 0, 0, 0, 0};
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1;
    f.fma = (c >> 12) & 1;
    f.f16c = (c >> 29) & 1;
    if (!osxsave || !avx) return (features){0, 0, 0, 0, 0};
    const unsigned long long xcr0 = xgetbv0();
    const int os_ymm = (xcr0 & 0x6) == 0x6;     /* SSE + AVX state */
    const int os_zmm = (xcr0 & 0xe6) == 0xe6;   /* + opmask, ZMM_Hi256, Hi16_ZMM */
    if (!os_ymm) return (features){0, 0, 0, 0, 0};
    unsigned int max_leaf = __get_cpuid_max(0, NULL);
    if (max_leaf < 7) return f;
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = (b >> 5) & 1;
    const int avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1, avx512bw = (b >> 30) & 1,
              avx512vl = (b >> 31) & 1;
    f.avx512 = os_zmm && avx512f && avx512dq && avx512bw && avx512vl && f.avx2 && f.fma && f.f16c;
    const unsigned int max_sub = a;
    if (f.avx512 && max_sub >= 1) {
        __cpuid_count(7, 1, a, b, c, d);
        f.avx512bf16 = (a >> 5) & 1;
    }
    return f;
}

int helm_cpu_supports(const char *isa) {
    const features f = detect();
    if (strcmp(isa, "portable") == 0) return 1;
    if (strcmp(isa, "avx2") == 0) return f.avx2 && f.fma && f.f16c && helm_table_avx2.isa != NULL;
    if (strcmp(isa, "avx512") == 0) return f.avx512 && helm_table_avx512.isa != NULL;
    if (strcmp(isa, "avx512bf16") == 0)
        return f.avx512 && f.avx512bf16 && helm_table_avx512bf16.isa != NULL;
    return 0;
}
#else
int helm_cpu_supports(const char *isa) { return strcmp(isa, "portable") == 0; }
#endif
