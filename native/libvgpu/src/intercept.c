/*
 * intercept.c — the top layer: every route by which a program can find a driver function ends
 * here.
 *
 *  - linked symbols: we export the hooked entry points (symbols.h), preloaded, they win;
 *  - dlsym(handle, name), on any handle: a handle of libcuda opened by soname or by path, a
 *    second copy of it, RTLD_DEFAULT / RTLD_NEXT: a hooked name answers our function, a denied
 *    name a stub, whatever object the real lookup found it in;
 *  - dlvsym(handle, name, version): the same (so dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.34")
 *    answers our dlsym, not glibc's);
 *  - the lookup functions themselves ("dlsym", "dlvsym", "dlmopen") through either: ours;
 *  - dlmopen into another namespace: refused (a namespace has no preloaded libvgpu: whatever
 *    loads the driver there would reach it unhooked); LM_ID_BASE is a plain dlopen;
 *  - cuGetProcAddress / _v2: the address the driver returns is swapped for ours when it is the
 *    real address of a hooked (or denied) entry point, keeping the driver's choice of version.
 *
 * What is NOT closed in-process (README, "threat model"): reading the driver's symbol table
 * from memory or from its file, or running a copy of the dynamic loader that ignores
 * /etc/ld.so.preload. The node agent's watchdog sees what such a process holds.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "vgpu.h"

/* Hooked and denied names, sorted, for the lookup hooks. */
static int sorted[TV_SYM_COUNT];
static int nsorted;
static int constructed;

/* dlsym is called by sanitizer runtimes before anything is initialised: what runs on that path
 * must not be instrumented. */
#define TV_EARLY __attribute__((no_sanitize_address))

static int cmp_sym(const void *a, const void *b)
{
    return strcmp(tv_syms[*(const int *)a].name, tv_syms[*(const int *)b].name);
}

void tv_intercept_init(void)
{
    for (int i = 0; i < TV_SYM_COUNT; i++)
        if (tv_syms[i].ours) sorted[nsorted++] = i;
    qsort(sorted, (size_t)nsorted, sizeof *sorted, cmp_sym);
    __atomic_store_n(&constructed, 1, __ATOMIC_RELEASE);
}

TV_EARLY static int cmp(const char *a, const char *b)
{
    while (*a && *a == *b) a++, b++;
    return (unsigned char)*a - (unsigned char)*b;
}

TV_EARLY static int lookup_hooked(const char *name)
{
    int lo = 0, hi = nsorted - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        int c = cmp(name, tv_syms[sorted[mid]].name);
        if (c == 0) return sorted[mid];
        if (c < 0) hi = mid - 1;
        else lo = mid + 1;
    }
    return -1;
}

TV_PUBLIC void *dlsym(void *handle, const char *name);
TV_PUBLIC void *dlvsym(void *handle, const char *name, const char *version);
TV_PUBLIC void *dlmopen(Lmid_t lmid, const char *file, int flags);

/* What a lookup that found r for name hands out. */
TV_EARLY static void *answer(const char *name, void *r)
{
    if (!r || !name) return r;
    if (name[0] == 'd') {
        if (!cmp(name, "dlsym")) return (void *)dlsym;
        if (!cmp(name, "dlvsym")) return (void *)dlvsym;
        if (!cmp(name, "dlmopen")) return (void *)dlmopen;
        return r;
    }
    if (name[0] != 'c' && name[0] != 'n') return r;
    /* Before our constructor (a runtime loaded ahead of us resolving its own symbols) there is
     * nothing to hand out yet: CUDA cannot have been loaded by then. */
    if (tv_unlikely(!__atomic_load_n(&constructed, __ATOMIC_ACQUIRE))) return r;
    int i = lookup_hooked(name);
    return i < 0 ? r : tv_syms[i].ours;
}

TV_EARLY TV_PUBLIC void *dlsym(void *handle, const char *name)
{
    return answer(name, tv_real_dlsym(handle, name));
}

TV_EARLY TV_PUBLIC void *dlvsym(void *handle, const char *name, const char *version)
{
    tv_libc_resolve();
    return answer(name, tv_libc.dlvsym ? tv_libc.dlvsym(handle, name, version) : NULL);
}

TV_PUBLIC void *dlmopen(Lmid_t lmid, const char *file, int flags)
{
    if (lmid == LM_ID_BASE) return dlopen(file, flags);
    TV_LOG(TV_LOG_WARN, "dlmopen(%s) into another namespace refused", file ? file : "NULL");
    /* leave a message for dlerror(): a name no search can find */
    dlopen("libvgpu: dlmopen into another link-map namespace is refused in a GPU container",
           RTLD_LAZY | RTLD_NOLOAD);
    return NULL;
}

/* ---- cuGetProcAddress: hand out our functions for the symbols we hook or deny -------------- */

static void *swap_proc(const char *symbol, void *p)
{
    int i = tv_driver_sym_of(p);
    if (i >= 0) return tv_syms[i].ours;
    if (tv_log_level >= TV_LOG_DEBUG) TV_LOG(TV_LOG_DEBUG, "cuGetProcAddress(%s): passed", symbol);
    return p;
}

CUresult CUDAAPI tv_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                        cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    TV_CUDA_ENTER();
    CUresult r;
    if (TV_HAS(cuGetProcAddress_v2)) {
        r = REAL(cuGetProcAddress_v2)(symbol, pfn, cudaVersion, flags, status);
    } else if (TV_HAS(cuGetProcAddress)) {
        r = REAL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags);
        if (status) *status = r == CUDA_SUCCESS ? CU_GET_PROC_ADDRESS_SUCCESS
                                                : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    } else {
        if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
        return CUDA_ERROR_NOT_FOUND;
    }
    if (r == CUDA_SUCCESS && pfn) *pfn = swap_proc(symbol, *pfn);
    return r;
}

CUresult CUDAAPI tv_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                     cuuint64_t flags)
{
    TV_CUDA_ENTER();
    CUresult r;
    if (TV_HAS(cuGetProcAddress)) r = REAL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags);
    else if (TV_HAS(cuGetProcAddress_v2))
        r = REAL(cuGetProcAddress_v2)(symbol, pfn, cudaVersion, flags, NULL);
    else return CUDA_ERROR_NOT_FOUND;
    if (r == CUDA_SUCCESS && pfn) *pfn = swap_proc(symbol, *pfn);
    return r;
}
