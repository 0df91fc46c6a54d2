/* symbols.h — everything derived from hooks.def. */
#ifndef TV_SYMBOLS_H
#define TV_SYMBOLS_H

#include <cuda.h>
#include <nvml.h>

#define TV_PUBLIC __attribute__((visibility("default")))

enum tv_sym {
#define TV_CU(name, params) TV_SYM_##name,
#define TV_NVML(name, params) TV_SYM_##name,
#define TV_CU_REAL(name, params) TV_SYM_##name,
#define TV_NVML_REAL(name, params) TV_SYM_##name,
#define TV_CU_DENY(name) TV_SYM_##name,
#include "hooks.def"
#undef TV_CU
#undef TV_NVML
#undef TV_CU_REAL
#undef TV_NVML_REAL
#undef TV_CU_DENY
    TV_SYM_COUNT
};

/* Typed pointers to the real functions: tv_pfn_<name>. */
#define TV_CU(name, params) typedef CUresult(CUDAAPI *tv_pfn_##name) params;
#define TV_CU_REAL(name, params) typedef CUresult(CUDAAPI *tv_pfn_##name) params;
#define TV_NVML(name, params) typedef nvmlReturn_t (*tv_pfn_##name) params;
#define TV_NVML_REAL(name, params) typedef nvmlReturn_t (*tv_pfn_##name) params;
#define TV_CU_DENY(name)
#include "hooks.def"
#undef TV_CU
#undef TV_NVML
#undef TV_CU_REAL
#undef TV_NVML_REAL
#undef TV_CU_DENY

/* Our implementations: C name tv_<name>, exported symbol <name> (asm label). */
#define TV_CU(name, params) CUresult CUDAAPI tv_##name params __asm__(#name) TV_PUBLIC;
#define TV_NVML(name, params) nvmlReturn_t tv_##name params __asm__(#name) TV_PUBLIC;
#define TV_CU_REAL(name, params)
#define TV_NVML_REAL(name, params)
#define TV_CU_DENY(name)
#include "hooks.def"
#undef TV_CU
#undef TV_NVML
#undef TV_CU_REAL
#undef TV_NVML_REAL
#undef TV_CU_DENY

enum tv_sym_kind {
    TV_KIND_CU = 1,
    TV_KIND_NVML = 2,
    TV_KIND_CU_REAL = 3,
    TV_KIND_NVML_REAL = 4,
    TV_KIND_CU_DENY = 5, /* never handed out: lookups get a stub returning NOT_SUPPORTED */
};

struct tv_sym_info {
    const char *name;
    void *ours;          /* our exported implementation (the stub for DENY), NULL for *_REAL */
    unsigned char kind;  /* enum tv_sym_kind */
};

extern const struct tv_sym_info tv_syms[TV_SYM_COUNT];
/* Real function pointers, filled once by tv_driver_open() (driver.h): a stub where absent. */
extern void *tv_real[TV_SYM_COUNT];

#define REAL(name) ((tv_pfn_##name)tv_real[TV_SYM_##name])

#endif
