/*
 * hooks.c — how calls reach us: exported versioned symbols (symbols.h), a dlsym hook, and the
 * cuGetProcAddress swap. Also: lazy initialisation, the real driver, CUDA device -> region slot.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "vgpu.h"

struct tv_state tv = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .region_fd = -1,
    .slot_idx = -1,
};

void *tv_real[TV_SYM_COUNT];

const struct tv_sym_info tv_syms[TV_SYM_COUNT] = {
#define TV_CU(name, params) [TV_SYM_##name] = {#name, (void *)tv_##name, TV_KIND_CU},
#define TV_NVML(name, params) [TV_SYM_##name] = {#name, (void *)tv_##name, TV_KIND_NVML},
#define TV_CU_REAL(name, params) [TV_SYM_##name] = {#name, NULL, TV_KIND_CU_REAL},
#define TV_NVML_REAL(name, params) [TV_SYM_##name] = {#name, NULL, TV_KIND_NVML_REAL},
#include "hooks.def"
#undef TV_CU
#undef TV_NVML
#undef TV_CU_REAL
#undef TV_NVML_REAL
};

/* Hooked names, sorted, for dlsym. */
static int sorted[TV_SYM_COUNT];
static int nsorted;
static void *(*real_dlsym_fn)(void *, const char *);

static int cmp_sym(const void *a, const void *b)
{
    return strcmp(tv_syms[*(const int *)a].name, tv_syms[*(const int *)b].name);
}

/* dlsym is called by sanitizer runtimes before anything is initialised: what runs on that path
 * must not be instrumented. */
#define TV_EARLY __attribute__((no_sanitize_address))

static int constructed;

TV_EARLY static void resolve_real_dlsym(void)
{
    if (real_dlsym_fn) return;
    static const char *versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.4",
                                     "GLIBC_2.0"};
    for (size_t i = 0; i < sizeof versions / sizeof *versions && !real_dlsym_fn; i++)
        real_dlsym_fn = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", versions[i]);
}

TV_EARLY void *tv_real_dlsym(void *handle, const char *name)
{
    resolve_real_dlsym();
    return real_dlsym_fn ? real_dlsym_fn(handle, name) : NULL;
}

TV_EARLY static int lookup_hooked(const char *name)
{
    int lo = 0, hi = nsorted - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        int c = strcmp(name, tv_syms[sorted[mid]].name);
        if (c == 0) return sorted[mid];
        if (c < 0) hi = mid - 1;
        else lo = mid + 1;
    }
    return -1;
}

static void after_fork_child(void)
{
    pthread_mutex_init(&tv.mu, NULL);
    tv.pid = getpid();
    tv_region_after_fork_child();
    tv_memory_after_fork_child();
    tv_compute_after_fork_child();
}

__attribute__((constructor)) static void tv_constructor(void)
{
    resolve_real_dlsym();
    for (int i = 0; i < TV_SYM_COUNT; i++)
        if (tv_syms[i].ours) sorted[nsorted++] = i;
    qsort(sorted, (size_t)nsorted, sizeof *sorted, cmp_sym);
    for (int i = 0; i < TV_MAX_CUDA_DEVS; i++) atomic_store(&tv.cuda_slot[i], -1);
    for (int i = 0; i < TSR_MAX_DEVICES; i++) atomic_store(&tv.dev[i].ordinal, -1);
    tv.pid = getpid();
    pthread_atfork(NULL, NULL, after_fork_child);
    __atomic_store_n(&constructed, 1, __ATOMIC_RELEASE);
}

/* The dlsym hook: libcudart, ctypes, pynvml and cuda-bindings all find the driver this way. */
TV_EARLY TV_PUBLIC void *dlsym(void *handle, const char *name)
{
    resolve_real_dlsym();
    void *r = real_dlsym_fn ? real_dlsym_fn(handle, name) : NULL;
    if (!r || (name[0] != 'c' && name[0] != 'n')) return r;
    /* Before our constructor (a runtime loaded ahead of us resolving its own symbols) there is
     * nothing to hand out yet: CUDA cannot have been loaded by then. */
    if (tv_unlikely(!__atomic_load_n(&constructed, __ATOMIC_ACQUIRE))) return r;
    int i = lookup_hooked(name);
    return i < 0 ? r : tv_syms[i].ours;
}

/* ---- initialisation ---------------------------------------------------------------------- */

static void at_exit(void)
{
    tv_compute_shutdown();
    tv_region_release_slot();
}

void tv_core_init(void)
{
    if (atomic_load_explicit(&tv.core_ready, memory_order_acquire)) return;
    pthread_mutex_lock(&tv.mu);
    if (!atomic_load_explicit(&tv.core_ready, memory_order_relaxed)) {
        tv_log_init();
        tv_limits_load();
        tv_region_open(tv_limits_region_path());
        atexit(at_exit);
        atomic_store_explicit(&tv.core_ready, 1, memory_order_release);
        tv_poll_thread_start();
    }
    pthread_mutex_unlock(&tv.mu);
}

/* A hooked entry point the installed driver lacks: calling it reports so (never a NULL call). */
static CUresult CUDAAPI missing_entry_point(void)
{
    return CUDA_ERROR_NOT_FOUND;
}

static void *open_lib(const char *soname)
{
    void *h = dlopen(soname, RTLD_NOW | RTLD_NOLOAD);
    if (!h) h = dlopen(soname, RTLD_NOW | RTLD_LOCAL);
    return h;
}

int tv_cuda_init(void)
{
    tv_core_init();
    if (atomic_load_explicit(&tv.cuda_ready, memory_order_acquire)) return 0;
    pthread_mutex_lock(&tv.mu);
    int rc = 0;
    if (!atomic_load_explicit(&tv.cuda_ready, memory_order_relaxed)) {
        tv.cuda_handle = open_lib("libcuda.so.1");
        if (!tv.cuda_handle) {
            TV_LOG(TV_LOG_ERROR, "cannot load libcuda.so.1: %s", dlerror());
            rc = -1;
        } else {
            for (int i = 0; i < TV_SYM_COUNT; i++)
                if (tv_syms[i].kind == TV_KIND_CU || tv_syms[i].kind == TV_KIND_CU_REAL)
                    tv_real[i] = tv_real_dlsym(tv.cuda_handle, tv_syms[i].name);
            if (!tv_real[TV_SYM_cuDeviceGetUuid_v2])
                tv_real[TV_SYM_cuDeviceGetUuid_v2] = tv_real[TV_SYM_cuDeviceGetUuid];
            for (int i = 0; i < TV_SYM_COUNT; i++)
                if (tv_syms[i].kind == TV_KIND_CU && !tv_real[i] && i != TV_SYM_cuGetProcAddress &&
                    i != TV_SYM_cuGetProcAddress_v2)
                    tv_real[i] = (void *)missing_entry_point;
            atomic_store_explicit(&tv.cuda_ready, 1, memory_order_release);
        }
    }
    pthread_mutex_unlock(&tv.mu);
    return rc;
}

int tv_nvml_init(void)
{
    tv_core_init();
    if (atomic_load_explicit(&tv.nvml_ready, memory_order_acquire)) return 0;
    pthread_mutex_lock(&tv.mu);
    int rc = 0;
    if (!atomic_load_explicit(&tv.nvml_ready, memory_order_relaxed)) {
        tv.nvml_handle = open_lib("libnvidia-ml.so.1");
        if (!tv.nvml_handle) {
            TV_LOG(TV_LOG_ERROR, "cannot load libnvidia-ml.so.1: %s", dlerror());
            rc = -1;
        } else {
            for (int i = 0; i < TV_SYM_COUNT; i++)
                if (tv_syms[i].kind == TV_KIND_NVML || tv_syms[i].kind == TV_KIND_NVML_REAL)
                    tv_real[i] = tv_real_dlsym(tv.nvml_handle, tv_syms[i].name);
            atomic_store_explicit(&tv.nvml_ready, 1, memory_order_release);
        }
    }
    pthread_mutex_unlock(&tv.mu);
    return rc;
}

/* ---- cuGetProcAddress: hand out our functions for the symbols we hook ---------------------- */

static void *swap_proc(const char *symbol, void *p)
{
    if (!p) return p;
    for (int i = 0; i < TV_SYM_COUNT; i++)
        if (tv_syms[i].kind == TV_KIND_CU && tv_real[i] == p) return tv_syms[i].ours;
    if (tv_log_level >= TV_LOG_DEBUG) TV_LOG(TV_LOG_DEBUG, "cuGetProcAddress(%s): passed", symbol);
    return p;
}

CUresult CUDAAPI tv_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                        cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    TV_CUDA_ENTER();
    CUresult r;
    if (REAL(cuGetProcAddress_v2)) {
        r = REAL(cuGetProcAddress_v2)(symbol, pfn, cudaVersion, flags, status);
    } else if (REAL(cuGetProcAddress)) {
        r = REAL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags);
        if (status) *status = r == CUDA_SUCCESS ? CU_GET_PROC_ADDRESS_SUCCESS
                                                : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    } else {
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
    if (REAL(cuGetProcAddress)) r = REAL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags);
    else if (REAL(cuGetProcAddress_v2))
        r = REAL(cuGetProcAddress_v2)(symbol, pfn, cudaVersion, flags, NULL);
    else return CUDA_ERROR_NOT_FOUND;
    if (r == CUDA_SUCCESS && pfn) *pfn = swap_proc(symbol, *pfn);
    return r;
}

/* ---- devices ------------------------------------------------------------------------------ */

void tv_format_uuid(const CUuuid *u, char out[TSR_UUID_LEN])
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, TSR_UUID_LEN,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

int tv_dev_slot(CUdevice dev)
{
    if (dev < 0 || dev >= TV_MAX_CUDA_DEVS) return -1;
    int s = atomic_load_explicit(&tv.cuda_slot[dev], memory_order_acquire);
    if (tv_likely(s >= 0)) return s;
    if (!REAL(cuDeviceGetUuid_v2)) return -1;
    CUuuid u;
    if (REAL(cuDeviceGetUuid_v2)(&u, dev) != CUDA_SUCCESS) return -1;
    char uuid[TSR_UUID_LEN];
    tv_format_uuid(&u, uuid);
    pthread_mutex_lock(&tv.mu);
    s = atomic_load(&tv.cuda_slot[dev]);
    if (s < 0) {
        s = tv_region_dev_slot(uuid);
        if (s >= 0) {
            atomic_store(&tv.dev[s].ordinal, (int)dev);
            tv_limits_apply_slot(s);
            atomic_store_explicit(&tv.cuda_slot[dev], s, memory_order_release);
            TV_LOG(TV_LOG_INFO, "device %d = %s -> slot %d, limit %llu bytes, sm %u", (int)dev,
                   uuid, s, (unsigned long long)atomic_load(&tv.dev[s].mem_limit),
                   atomic_load(&tv.dev[s].sm_eff));
        }
    }
    pthread_mutex_unlock(&tv.mu);
    return s;
}

int tv_ctx_dev_slot(void)
{
    CUdevice d;
    if (REAL(cuCtxGetDevice)(&d) != CUDA_SUCCESS) return -1;
    return tv_dev_slot(d);
}

int tv_stream_dev_slot(CUstream s)
{
    if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) return tv_ctx_dev_slot();
    CUcontext sc = NULL, cur = NULL;
    if (REAL(cuStreamGetCtx)(s, &sc) != CUDA_SUCCESS || sc == NULL) return tv_ctx_dev_slot();
    REAL(cuCtxGetCurrent)(&cur);
    if (sc == cur) return tv_ctx_dev_slot();
    if (REAL(cuCtxPushCurrent_v2)(sc) != CUDA_SUCCESS) return tv_ctx_dev_slot();
    int slot = tv_ctx_dev_slot();
    CUcontext popped;
    REAL(cuCtxPopCurrent_v2)(&popped);
    return slot;
}
