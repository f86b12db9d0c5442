/* Which instruction-set paths this CPU can run, detected at run time. */
#include <pthread.h>
#include <string.h>

#include "kernels.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif
#if defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

static const char *const NAMES[ISA_COUNT] = {"scalar", "avx2",      "avx2vnni", "avx512",
                                             "avx512vnni", "neon", "neondot"};

const char *isa_name(int isa) { return isa >= 0 && isa < ISA_COUNT ? NAMES[isa] : "?"; }

int cpu_has(const char *f) {
#ifdef INFER_X86
    /* libgcc's checks include the OS's XSAVE support (XCR0) for AVX and AVX-512 state. */
    __builtin_cpu_init();
    if (!strcmp(f, "avx2")) return __builtin_cpu_supports("avx2");
    if (!strcmp(f, "fma")) return __builtin_cpu_supports("fma");
    if (!strcmp(f, "f16c")) {
        /* __builtin_cpu_supports has no "f16c" before gcc 13: CPUID.1:ECX bit 29, and
         * AVX (which F16C's encoding needs) enabled by the OS. */
        unsigned a, b, c, d;
        __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
        return ((c >> 29) & 1) && __builtin_cpu_supports("avx");
    }
    if (!strcmp(f, "avx512f")) return __builtin_cpu_supports("avx512f");
    if (!strcmp(f, "avx512bw")) return __builtin_cpu_supports("avx512bw");
    if (!strcmp(f, "avx512vl")) return __builtin_cpu_supports("avx512vl");
    if (!strcmp(f, "avx512dq")) return __builtin_cpu_supports("avx512dq");
    if (!strcmp(f, "avx512vnni")) return __builtin_cpu_supports("avx512vnni");
    if (!strcmp(f, "avxvnni")) {
        /* CPUID.(7,1):EAX bit 4, and AVX enabled. */
        unsigned a, b, c, d;
        __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
        return ((a >> 4) & 1) && __builtin_cpu_supports("avx");
    }
#elif defined(__aarch64__)
    if (!strcmp(f, "neon")) return 1; /* Advanced SIMD is mandatory on AArch64 */
    if (!strcmp(f, "dotprod")) {
#if defined(__linux__)
        return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__APPLE__)
        int v = 0;
        size_t n = sizeof v;
        return sysctlbyname("hw.optional.arm.FEAT_DotProd", &v, &n, NULL, 0) == 0 && v;
#else
        return 0;
#endif
    }
#endif
    (void)f;
    return 0;
}

/* CPUID traps to the hypervisor in a virtual machine (microseconds each): detect once. */
static int detect(int isa);
static int supported[ISA_COUNT];
static pthread_once_t once = PTHREAD_ONCE_INIT;
static void detect_all(void) {
    for (int i = 0; i < ISA_COUNT; i++) supported[i] = detect(i);
}

int isa_supported(int isa) {
    if (isa < 0 || isa >= ISA_COUNT) return 0;
    pthread_once(&once, detect_all);
    return supported[isa];
}

static int detect(int isa) {
    switch (isa) {
    case ISA_SCALAR:
        return 1;
#ifdef INFER_X86
    case ISA_AVX2:
        return cpu_has("avx2") && cpu_has("fma") && cpu_has("f16c");
    case ISA_AVX2_VNNI:
        return detect(ISA_AVX2) && cpu_has("avxvnni");
    case ISA_AVX512:
        return cpu_has("avx512f") && cpu_has("avx512bw") && cpu_has("avx512vl") &&
               cpu_has("avx512dq") && detect(ISA_AVX2);
    case ISA_AVX512_VNNI:
        return detect(ISA_AVX512) && cpu_has("avx512vnni");
#endif
#if defined(__aarch64__)
    case ISA_NEON:
        return 1;
    case ISA_NEON_DOT:
        return cpu_has("dotprod");
#endif
    default:
        return 0;
    }
}

int isa_best(void) {
    static const int order[] = {ISA_AVX512_VNNI, ISA_AVX512, ISA_AVX2_VNNI, ISA_AVX2,
                                ISA_NEON_DOT,    ISA_NEON};
    for (size_t i = 0; i < sizeof order / sizeof *order; i++)
        if (isa_supported(order[i])) return order[i];
    return ISA_SCALAR;
}

const kernel_table *kernels_for(int isa) {
    switch (isa) {
    case ISA_SCALAR:
        return &kernels_scalar;
#ifdef INFER_X86
    case ISA_AVX2:
        return &kernels_avx2;
    case ISA_AVX2_VNNI:
        return &kernels_avx2_vnni;
    case ISA_AVX512:
        return &kernels_avx512;
    case ISA_AVX512_VNNI:
        return &kernels_avx512_vnni;
#endif
#if defined(__aarch64__)
    case ISA_NEON:
        return &kernels_neon;
    case ISA_NEON_DOT:
        return &kernels_neon_dot;
#endif
    default:
        return NULL;
    }
}
