/*
 * driver.c — the bottom layer's driver table (driver.h): the real libcuda / libnvidia-ml, loaded
 * with our own dlopen and resolved with glibc's own dlsym, and the stubs for what they lack.
 *
 * glibc's dlsym, dlvsym and dlmopen are found by reading libc's dynamic symbol table (versions
 * included) rather than by a lookup: libvgpu exports hooks of those very names, and every lookup
 * that goes through the dynamic linker (dlsym(RTLD_NEXT, ...), dlvsym(..., "GLIBC_2.34"), a
 * versioned reference) can be answered by them.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <string.h>

#include "driver.h"

struct tv_libc tv_libc;
void *tv_real[TV_SYM_COUNT];
unsigned char tv_present[TV_SYM_COUNT];

/* ---- stubs for what a driver lacks, and for denied entry points ---------------------------- */

static CUresult CUDAAPI cu_missing(void)
{
    return CUDA_ERROR_NOT_FOUND;
}
static nvmlReturn_t nvml_missing(void)
{
    return NVML_ERROR_FUNCTION_NOT_FOUND;
}
static CUresult CUDAAPI cu_denied(void)
{
    return CUDA_ERROR_NOT_SUPPORTED;
}

const struct tv_sym_info tv_syms[TV_SYM_COUNT] = {
#define TV_CU(name, params) [TV_SYM_##name] = {#name, (void *)tv_##name, TV_KIND_CU},
#define TV_NVML(name, params) [TV_SYM_##name] = {#name, (void *)tv_##name, TV_KIND_NVML},
#define TV_CU_REAL(name, params) [TV_SYM_##name] = {#name, NULL, TV_KIND_CU_REAL},
#define TV_NVML_REAL(name, params) [TV_SYM_##name] = {#name, NULL, TV_KIND_NVML_REAL},
#define TV_CU_DENY(name) [TV_SYM_##name] = {#name, (void *)cu_denied, TV_KIND_CU_DENY},
#include "hooks.def"
#undef TV_CU
#undef TV_NVML
#undef TV_CU_REAL
#undef TV_NVML_REAL
#undef TV_CU_DENY
};

/* ---- glibc's own lookup functions ---------------------------------------------------------- */

#define TV_EARLY __attribute__((no_sanitize_address)) /* runs before sanitizer runtimes are up */

struct find {
    const char *names[3];
    void *found[3];
};

TV_EARLY static uintptr_t dyn_ptr(uintptr_t base, ElfW(Addr) p)
{
    return p < base ? base + p : p; /* ld.so relocates d_ptr in place on most targets */
}

TV_EARLY static size_t gnu_hash_count(const uint32_t *gh)
{
    uint32_t nbuckets = gh[0], symoffset = gh[1], bloom_size = gh[2];
    const ElfW(Addr) *bloom = (const ElfW(Addr) *)(const void *)&gh[4];
    const uint32_t *buckets = (const uint32_t *)(const void *)&bloom[bloom_size];
    const uint32_t *chain = &buckets[nbuckets];
    uint32_t last = 0;
    for (uint32_t i = 0; i < nbuckets; i++)
        if (buckets[i] > last) last = buckets[i];
    if (last < symoffset) return symoffset;
    while (!(chain[last - symoffset] & 1)) last++;
    return (size_t)last + 1;
}

/* Nothing here may call a function a sanitizer intercepts: it runs inside their start-up. */
TV_EARLY static int eq(const char *a, const char *b)
{
    while (*a && *a == *b) a++, b++;
    return *a == *b;
}

TV_EARLY static int contains(const char *s, const char *sub)
{
    for (; *s; s++) {
        const char *a = s, *b = sub;
        while (*b && *a == *b) a++, b++;
        if (!*b) return 1;
    }
    return 0;
}

TV_EARLY static void find_in_object(const struct link_map *m, struct find *f)
{
    if (!m->l_name || !(contains(m->l_name, "libc.so") || contains(m->l_name, "libdl.so")))
        return;
    uintptr_t base = m->l_addr;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const uint32_t *hash = NULL, *gnu = NULL;
    const ElfW(Half) *versym = NULL;
    for (const ElfW(Dyn) *dyn = m->l_ld; dyn && dyn->d_tag != DT_NULL; dyn++) {
        switch (dyn->d_tag) {
        case DT_SYMTAB: symtab = (const ElfW(Sym) *)dyn_ptr(base, dyn->d_un.d_ptr); break;
        case DT_STRTAB: strtab = (const char *)dyn_ptr(base, dyn->d_un.d_ptr); break;
        case DT_HASH: hash = (const uint32_t *)dyn_ptr(base, dyn->d_un.d_ptr); break;
        case DT_GNU_HASH: gnu = (const uint32_t *)dyn_ptr(base, dyn->d_un.d_ptr); break;
        case DT_VERSYM: versym = (const ElfW(Half) *)dyn_ptr(base, dyn->d_un.d_ptr); break;
        }
    }
    if (!symtab || !strtab || (!hash && !gnu)) return;
    size_t n = hash ? hash[1] : gnu_hash_count(gnu);
    for (size_t i = 1; i < n; i++) {
        const ElfW(Sym) *s = &symtab[i];
        if (s->st_shndx == SHN_UNDEF || ELF64_ST_TYPE(s->st_info) != STT_FUNC) continue;
        if (versym && (versym[i] & 0x8000)) continue; /* a hidden (non-default) version */
        for (int k = 0; k < 3; k++)
            if (!f->found[k] && eq(strtab + s->st_name, f->names[k]))
                f->found[k] = (void *)(base + s->st_value);
    }
}

TV_EARLY void tv_libc_resolve(void)
{
    if (__atomic_load_n(&tv_libc.dlsym, __ATOMIC_ACQUIRE)) return;
    struct find f = {.names = {"dlsym", "dlvsym", "dlmopen"}};
    /* the dynamic linker's list of loaded objects (the base namespace) */
    for (const struct link_map *m = _r_debug.r_map; m; m = m->l_next) find_in_object(m, &f);
    __atomic_store_n(&tv_libc.dlvsym, (void *(*)(void *, const char *, const char *))f.found[1],
                     __ATOMIC_RELEASE);
    __atomic_store_n(&tv_libc.dlmopen, (void *(*)(long, const char *, int))f.found[2],
                     __ATOMIC_RELEASE);
    __atomic_store_n(&tv_libc.dlsym, (void *(*)(void *, const char *))f.found[0],
                     __ATOMIC_RELEASE);
}

TV_EARLY void *tv_real_dlsym(void *handle, const char *name)
{
    tv_libc_resolve();
    return tv_libc.dlsym ? tv_libc.dlsym(handle, name) : NULL;
}

/* ---- the driver libraries ------------------------------------------------------------------ */

void *tv_driver_open(enum tv_lib which)
{
    const char *soname = which == TV_LIB_CUDA ? "libcuda.so.1" : "libnvidia-ml.so.1";
    void *h = dlopen(soname, RTLD_NOW | RTLD_NOLOAD);
    if (!h) h = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        TV_LOG(TV_LOG_ERROR, "cannot load %s: %s", soname, dlerror());
        return NULL;
    }
    for (int i = 0; i < TV_SYM_COUNT; i++) {
        int k = tv_syms[i].kind;
        int cuda = k == TV_KIND_CU || k == TV_KIND_CU_REAL || k == TV_KIND_CU_DENY;
        if (cuda != (which == TV_LIB_CUDA)) continue;
        void *p = tv_real_dlsym(h, tv_syms[i].name);
        tv_present[i] = p != NULL;
        tv_real[i] = p ? p : cuda ? (void *)cu_missing : (void *)nvml_missing;
        if (!p) TV_LOG(TV_LOG_DEBUG, "%s lacks %s", soname, tv_syms[i].name);
    }
    return h;
}

int tv_driver_sym_of(const void *p)
{
    if (!p) return -1;
    for (int i = 0; i < TV_SYM_COUNT; i++)
        if (tv_present[i] && tv_real[i] == p &&
            (tv_syms[i].kind == TV_KIND_CU || tv_syms[i].kind == TV_KIND_CU_DENY))
            return i;
    return -1;
}
