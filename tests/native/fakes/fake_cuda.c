/*
 * fake_cuda.c — a fake libcuda.so.1 for testing libvgpu without a GPU. Linked with
 * -Wl,-Bsymbolic so that its own pointers (cuGetProcAddress answers) are its own functions.
 *
 * What it models: devices with a physical memory size shared by all processes (fake_state.h);
 * allocations backed by lazily-touched host memory (so memsets and copies are real and a test can
 * see whether memory was scrubbed); stream-ordered pools with a release threshold; VMM handles
 * with export/import across processes; arrays; graphs with kernel and memory nodes; contexts;
 * events; and kernels that occupy the device's timeline for their duration (FAKE_KERNEL_US, or
 * the _<N>us suffix of the kernel's name), one after another, in real time.
 *
 * Graph memory nodes follow CUDA's documented lifetime (cuGraphAddMemAllocNode): the address is
 * fixed when the node is added, physical memory is taken when the graph is launched, and it
 * stays taken — after the exec and the graph are destroyed — until cuMemFree / cuMemFreeAsync of
 * the address, a launched free node, or the next launch of an exec instantiated with
 * CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH. Relaunching with the allocation still live
 * (without auto-free) fails with CUDA_ERROR_INVALID_VALUE.
 *
 * Built with -DFAKE_OMIT='"name,name"' (tests/native/Makefile, target `variant`) it is a driver
 * that lacks those entry points: not exported, and not returned by cuGetProcAddress.
 */
#define _GNU_SOURCE
#define __CUDA_API_VERSION_INTERNAL /* as the real driver is built: every entry point, no macros */
#include <cuda.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fake_mps.h"
#include "fake_state.h"

#undef cuMemAlloc /* the legacy 32-bit entry point is defined below under its own name */

#define API __attribute__((visibility("default")))
#define S fk_state()

/* ---- per-process objects ------------------------------------------------------------------ */

struct fk_ctx {
    int dev, primary, refs;
};
struct fk_stream {
    struct fk_ctx *ctx;
};
struct fk_event {
    int64_t ts;
    int recorded;
};
struct fk_func {
    char name[128];
    int64_t dur;
};
struct fk_pool {
    int dev;
    uint64_t reserved, used, threshold;
    uint64_t max; /* CUmemPoolProps.maxSize: the pool never reserves more (0: the device) */
};
struct fk_handle {
    int dev, export_id, refs;
    uint64_t size;
};
struct fk_alloc {
    uint64_t ptr, size;
    int dev;
    int graph, live; /* a graph allocation; live: launched and not freed */
    int managed;     /* cuMemAllocManaged (see "managed memory" below) */
    int pref;        /* managed: preferred location, FK_PREF_NONE, CU_DEVICE_CPU or a device */
    uint64_t on_dev; /* managed: bytes resident on device `dev` (the rest: not populated, or
                        on the host); only these take the device's physical memory */
    struct fk_pool *pool;
    struct fk_alloc *next;
};
struct fk_map {
    uint64_t va, size;
    struct fk_handle *h;
    struct fk_map *next;
};
struct fk_array {
    uint64_t bytes;
    int dev;
};
#define FK_GMEM 64
struct fk_graph {
    int64_t kernel_ns;
    int dev, nnodes, nalloc, nfree;
    void *nodes[256]; /* node handles, freed with the graph */
    struct fk_alloc *alloc[FK_GMEM]; /* its allocation nodes (records live in allocs[]) */
    uint64_t free_ptr[FK_GMEM];      /* its free nodes */
};
struct fk_module {
    int nfuncs;
    struct fk_func *funcs[64];
};
struct fk_exec {
    int64_t kernel_ns;
    int dev, nalloc, nfree, autofree;
    struct fk_alloc *alloc[FK_GMEM];
    uint64_t free_ptr[FK_GMEM];
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static struct fk_ctx *primary[FK_MAX_DEV];
static struct fk_pool *default_pool[FK_MAX_DEV], *current_pool[FK_MAX_DEV];
static struct fk_pool *pools[64];
static struct fk_alloc *allocs[4096];
static struct fk_map *maps;
static int64_t last_end[FK_MAX_DEV]; /* this process's last kernel end, per device */
static __thread struct fk_ctx *ctx_stack[16];
static __thread int ctx_depth;

/* Counters a test can read through fake_stats(). */
struct fake_stats {
    long launches, coop_launches, ex_launches, graph_launches;
    long frees_dirty, frees_clean;
    long allocs, frees;
    long stream_getctx, ctx_getdevice; /* calls, to see which path a launch took */
};
static struct fake_stats stats;
static int check_dirty = -1; /* FAKE_CHECK_SCRUB=1: count frees of memory that was not zeroed */
/* FAKE_BENCH=1: as cheap as possible, to measure what libvgpu adds: launches skip the timeline,
 * allocations get an address but no host memory behind it. */
static int bench_mode = -1;
static uint64_t bench_va = 1ull << 44;

static int bench(void)
{
    if (bench_mode < 0) bench_mode = fk_env_int("FAKE_BENCH", 0);
    return bench_mode;
}

API void fake_stats(struct fake_stats *out)
{
    pthread_mutex_lock(&mu);
    *out = stats;
    pthread_mutex_unlock(&mu);
}
API int64_t fake_now_ns(void)
{
    return fk_now();
}
API int64_t fake_busy_ns(int dev, int64_t t0, int64_t t1, int pid)
{
    fk_lock(S);
    int64_t b = fk_busy(S, dev, t0, t1, pid);
    fk_unlock(S);
    return b;
}
API uint64_t fake_physical_used(int dev)
{
    return __atomic_load_n(&S->dev[dev].used, __ATOMIC_RELAXED);
}

static struct fk_ctx *cur(void)
{
    return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL;
}

static int stream_dev(CUstream s)
{
    if (s && s != CU_STREAM_LEGACY && s != CU_STREAM_PER_THREAD) return ((struct fk_stream *)s)->ctx->dev;
    return cur() ? cur()->dev : -1;
}

/* Physical memory of a device, shared by all processes. */
static CUresult phys_take(int dev, uint64_t bytes)
{
    struct fk_state *st = S;
    if (fk_mps_take(dev, bytes)) return CUDA_ERROR_OUT_OF_MEMORY; /* the MPS server's limit */
    fk_lock(st);
    struct fk_dev *d = &st->dev[dev];
    if (bytes > d->total - d->used) fk_reap_dead(st, dev); /* the dead hold nothing */
    if (bytes > d->total - d->used) {
        fk_unlock(st);
        fk_mps_give(dev, bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    d->used += bytes;
    fk_proc_note(st, dev, getpid(), (int64_t)bytes);
    fk_unlock(st);
    return CUDA_SUCCESS;
}

static void phys_give(int dev, uint64_t bytes)
{
    struct fk_state *st = S;
    fk_mps_give(dev, bytes);
    fk_lock(st);
    st->dev[dev].used -= bytes < st->dev[dev].used ? bytes : st->dev[dev].used;
    fk_proc_note(st, dev, getpid(), -(int64_t)bytes);
    fk_unlock(st);
}

static void *va_reserve(uint64_t size, int prot)
{
    void *p = mmap(NULL, size ? size : 1, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static unsigned bucket(uint64_t p)
{
    return (unsigned)((p >> 12) ^ (p >> 24)) % 4096;
}

static struct fk_alloc *alloc_find(uint64_t ptr, int take)
{
    struct fk_alloc **pp = &allocs[bucket(ptr)];
    for (; *pp; pp = &(*pp)->next)
        if ((*pp)->ptr == ptr) {
            struct fk_alloc *a = *pp;
            if (take) *pp = a->next;
            return a;
        }
    return NULL;
}

/* Any allocation containing [p, p+n) (for copies and memsets at an offset). */
static struct fk_alloc *alloc_containing(uint64_t p, uint64_t n)
{
    for (int b = 0; b < 4096; b++)
        for (struct fk_alloc *a = allocs[b]; a; a = a->next)
            if (p >= a->ptr && p + n <= a->ptr + a->size) return a;
    return NULL;
}

static CUresult new_alloc(CUdeviceptr *dptr, uint64_t size, int dev, struct fk_pool *pool)
{
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    if (pool) { /* the pool grows by physical memory of the device, as any allocation */
        fk_lock(S);
        uint64_t need = pool->used + size > pool->reserved ? pool->used + size - pool->reserved : 0;
        struct fk_dev *d = &S->dev[dev];
        if (pool->max && pool->reserved + need > pool->max) {
            fk_unlock(S);
            return CUDA_ERROR_OUT_OF_MEMORY; /* the pool's own bound */
        }
        if (need > d->total - d->used) fk_reap_dead(S, dev); /* the dead hold nothing */
        if (need > d->total - d->used) {
            fk_unlock(S);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        d->used += need;
        if (need) fk_proc_note(S, dev, getpid(), (int64_t)need);
        pool->reserved += need;
        pool->used += size;
        fk_unlock(S);
    } else if (phys_take(dev, size) != CUDA_SUCCESS) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    void *p = bench() ? (void *)(uintptr_t)__atomic_fetch_add(&bench_va, (size + 4095) & ~4095ull,
                                                               __ATOMIC_RELAXED)
                      : va_reserve(size, PROT_READ | PROT_WRITE);
    if (!p) {
        if (pool) pool->used -= size;
        else phys_give(dev, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct fk_alloc *a = calloc(1, sizeof *a);
    a->ptr = (uint64_t)(uintptr_t)p;
    a->size = size;
    a->dev = dev;
    a->pool = pool;
    pthread_mutex_lock(&mu);
    unsigned b = bucket(a->ptr);
    a->next = allocs[b];
    allocs[b] = a;
    stats.allocs++;
    pthread_mutex_unlock(&mu);
    *dptr = a->ptr;
    return CUDA_SUCCESS;
}

static int all_zero(const unsigned char *p, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

static CUresult free_alloc(CUdeviceptr ptr)
{
    if (check_dirty < 0) check_dirty = fk_env_int("FAKE_CHECK_SCRUB", 0);
    pthread_mutex_lock(&mu);
    struct fk_alloc *g = alloc_find(ptr, 0);
    if (g && g->graph) { /* a graph allocation: its physical memory goes, its address stays */
        int live = g->live;
        g->live = 0;
        pthread_mutex_unlock(&mu);
        if (!live) return CUDA_ERROR_INVALID_VALUE;
        phys_give(g->dev, g->size);
        return CUDA_SUCCESS;
    }
    struct fk_alloc *a = alloc_find(ptr, 1);
    if (a) {
        stats.frees++;
        if (check_dirty && a->size <= (4u << 20)) {
            if (all_zero((const unsigned char *)(uintptr_t)a->ptr, a->size)) stats.frees_clean++;
            else stats.frees_dirty++;
        }
    }
    pthread_mutex_unlock(&mu);
    if (!a) return CUDA_ERROR_INVALID_VALUE;
    if (!bench()) munmap((void *)(uintptr_t)a->ptr, a->size ? a->size : 1);
    if (a->pool) {
        fk_lock(S);
        a->pool->used -= a->size;
        fk_unlock(S);
    } else {
        phys_give(a->dev, a->managed ? a->on_dev : a->size);
    }
    free(a);
    return CUDA_SUCCESS;
}

/* Pools give memory above their release threshold back at synchronisation. */
static void pools_release(void)
{
    fk_lock(S);
    for (int i = 0; i < 64; i++) {
        struct fk_pool *p = pools[i];
        if (!p) continue;
        uint64_t keep = p->used > p->threshold ? p->used : p->threshold;
        if (p->reserved > keep) {
            S->dev[p->dev].used -= p->reserved - keep;
            fk_proc_note(S, p->dev, getpid(), -(int64_t)(p->reserved - keep));
            p->reserved = keep;
        }
    }
    fk_unlock(S);
}

static int64_t func_duration(const char *name)
{
    const char *u = strstr(name, "us");
    if (u) {
        const char *p = u;
        while (p > name && p[-1] >= '0' && p[-1] <= '9') p--;
        if (p < u && p > name && p[-1] == '_') return atoll(p) * 1000;
    }
    return (int64_t)fk_env_int("FAKE_KERNEL_US", 100) * 1000;
}

static CUresult enqueue(int dev, int64_t dur)
{
    if (dev < 0) return CUDA_ERROR_INVALID_CONTEXT;
    fk_lock(S);
    int64_t end = fk_enqueue(S, dev, dur, getpid());
    fk_unlock(S);
    pthread_mutex_lock(&mu);
    if (end > last_end[dev]) last_end[dev] = end;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

static void sync_dev(int dev)
{
    if (dev < 0) return;
    pthread_mutex_lock(&mu);
    int64_t t = last_end[dev];
    pthread_mutex_unlock(&mu);
    fk_sleep_until(t);
    pools_release();
}

#define NEED_CTX()                                                                           \
    do {                                                                                     \
        if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;                                 \
        if (!cur()) return CUDA_ERROR_INVALID_CONTEXT;                                       \
    } while (0)

/* ---- init, devices -------------------------------------------------------------------------- */

API CUresult cuInit(unsigned int flags)
{
    (void)flags;
    (void)S;
    CUresult mps = fk_mps_attach(); /* a client of the MPS server when a daemon answers */
    if (mps != CUDA_SUCCESS) return mps;
    initialized = 1;
    return CUDA_SUCCESS;
}
API CUresult cuDriverGetVersion(int *v)
{
    *v = 13000;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetCount(int *n)
{
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    *n = S->ndev;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGet(CUdevice *d, int ordinal)
{
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= S->ndev) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetName(char *name, int len, CUdevice d)
{
    snprintf(name, (size_t)len, "Fake GPU %d", d);
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d)
{
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= S->ndev) return CUDA_ERROR_INVALID_DEVICE;
    memcpy(u->bytes, S->dev[d].uuid_bytes, 16);
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d)
{
    return cuDeviceGetUuid(u, d);
}
API CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice d)
{
    if (d < 0 || d >= S->ndev) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = S->dev[d].total;
    return CUDA_SUCCESS;
}
static int concurrent_managed(void); /* managed memory, below */
API CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d)
{
    (void)d;
    switch (a) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *v = 132; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: *v = concurrent_managed(); break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT: *v = 32; break; /* an H100's */
    case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: *v = 512; break;
    default: *v = 1; break;
    }
    return CUDA_SUCCESS;
}
API CUresult cuGetErrorString(CUresult e, const char **s)
{
    *s = e == CUDA_SUCCESS ? "no error" : e == CUDA_ERROR_OUT_OF_MEMORY ? "out of memory" : "error";
    return CUDA_SUCCESS;
}
API CUresult cuGetErrorName(CUresult e, const char **s)
{
    *s = e == CUDA_SUCCESS ? "CUDA_SUCCESS"
         : e == CUDA_ERROR_OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY"
                                         : "CUDA_ERROR";
    return CUDA_SUCCESS;
}

/* ---- contexts ----------------------------------------------------------------------------- */

static void push(struct fk_ctx *c)
{
    if (ctx_depth < 16) ctx_stack[ctx_depth++] = c;
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice d)
{
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= S->ndev) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    if (!primary[d]) {
        primary[d] = calloc(1, sizeof(struct fk_ctx));
        primary[d]->dev = d;
        primary[d]->primary = 1;
    }
    primary[d]->refs++;
    *pctx = (CUcontext)primary[d];
    pthread_mutex_unlock(&mu);
    fk_lock(S);
    fk_proc_note(S, d, getpid(), 0); /* a context: NVML lists the process */
    fk_unlock(S);
    return CUDA_SUCCESS;
}
API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d)
{
    (void)d;
    return CUDA_SUCCESS;
}
static CUresult ctx_create(CUcontext *pctx, CUdevice d)
{
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d < 0 || d >= S->ndev) return CUDA_ERROR_INVALID_DEVICE;
    uint64_t cost = (uint64_t)fk_env_int("FAKE_CTX_BYTES", 0);
    if (cost && phys_take(d, cost) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    struct fk_ctx *c = calloc(1, sizeof *c);
    c->dev = d;
    push(c);
    *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}
API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice d)
{
    (void)flags;
    return ctx_create(pctx, d);
}
API CUresult cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *p, int n, unsigned int flags,
                            CUdevice d)
{
    (void)p, (void)n, (void)flags;
    return ctx_create(pctx, d);
}
API CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *p, unsigned int flags, CUdevice d)
{
    (void)p, (void)flags;
    return ctx_create(pctx, d);
}
API CUresult cuCtxDestroy_v2(CUcontext ctx)
{
    struct fk_ctx *c = (struct fk_ctx *)ctx;
    if (!c || c->primary) return CUDA_ERROR_INVALID_CONTEXT;
    for (int i = 0; i < ctx_depth; i++)
        if (ctx_stack[i] == c) {
            memmove(&ctx_stack[i], &ctx_stack[i + 1], sizeof(void *) * (size_t)(ctx_depth - i - 1));
            ctx_depth--;
            break;
        }
    uint64_t cost = (uint64_t)fk_env_int("FAKE_CTX_BYTES", 0);
    if (cost) phys_give(c->dev, cost);
    free(c);
    return CUDA_SUCCESS;
}
API CUresult cuCtxSetCurrent(CUcontext ctx)
{
    if (ctx_depth) ctx_stack[ctx_depth - 1] = (struct fk_ctx *)ctx;
    else if (ctx) push((struct fk_ctx *)ctx);
    if (!ctx && ctx_depth) ctx_depth--;
    return CUDA_SUCCESS;
}
API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    *pctx = (CUcontext)cur();
    return CUDA_SUCCESS;
}
API CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    push((struct fk_ctx *)ctx);
    return CUDA_SUCCESS;
}
API CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    if (!ctx_depth) return CUDA_ERROR_INVALID_CONTEXT;
    struct fk_ctx *c = ctx_stack[--ctx_depth];
    if (pctx) *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}
API CUresult cuCtxGetDevice(CUdevice *d)
{
    __atomic_fetch_add(&stats.ctx_getdevice, 1, __ATOMIC_RELAXED);
    if (!cur()) return CUDA_ERROR_INVALID_CONTEXT;
    *d = cur()->dev;
    return CUDA_SUCCESS;
}
API CUresult cuCtxGetDevice_v2(CUdevice *d, CUcontext ctx)
{
    struct fk_ctx *c = ctx ? (struct fk_ctx *)ctx : cur();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    *d = c->dev;
    return CUDA_SUCCESS;
}
API CUresult cuCtxSynchronize(void)
{
    NEED_CTX();
    sync_dev(cur()->dev);
    return CUDA_SUCCESS;
}

/* ---- memory --------------------------------------------------------------------------------- */

API CUresult cuMemGetInfo_v2(size_t *free_, size_t *total)
{
    NEED_CTX();
    struct fk_dev *d = &S->dev[cur()->dev];
    uint64_t used = __atomic_load_n(&d->used, __ATOMIC_RELAXED);
    *total = d->total;
    *free_ = d->total - used;
    return CUDA_SUCCESS;
}
API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size)
{
    NEED_CTX();
    if (!size) return CUDA_ERROR_INVALID_VALUE;
    return new_alloc(dptr, size, cur()->dev, NULL);
}
/* An allocation that does not go through libvgpu (tests: freeing an untracked pointer). */
/* The CUDA 2.x ABI (32-bit pointer and size); libvgpu must never hand it out. */
API CUresult cuMemAlloc(unsigned int *dptr, unsigned int size)
{
    NEED_CTX();
    CUdeviceptr p = 0;
    CUresult r = new_alloc(&p, size, cur()->dev, NULL);
    if (dptr) *dptr = (unsigned int)p;
    return r;
}
API CUresult fake_raw_alloc(CUdeviceptr *dptr, size_t size)
{
    NEED_CTX();
    return new_alloc(dptr, size, cur()->dev, NULL);
}
/* ---- managed memory, as CUDA documents it for a GPU with concurrent managed access (Linux,
 * Pascal and later; FAKE_CONCURRENT_MANAGED=0 models one without, where the storage is made on
 * the device at allocation). Pages are populated on first access, not at cuMemAllocManaged: a
 * device access (memset, a copy to it) populates them on that device unless their preferred
 * location is the CPU (then the device maps host memory: no migration); cuMemPrefetchAsync
 * migrates to where it is asked (the device only while it has room: the real driver may evict
 * other managed pages, the fake leaves them on the host). Kernels are not seen touching memory.
 * Granularity: a whole allocation. */
#define FK_PREF_NONE (-3)
static int concurrent_managed(void)
{
    return fk_env_int("FAKE_CONCURRENT_MANAGED", 1) != 0;
}
API CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t size, unsigned int flags)
{
    NEED_CTX();
    if (!size || !dptr || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST))
        return CUDA_ERROR_INVALID_VALUE;
    int dev = cur()->dev, eager = !concurrent_managed();
    if (eager && phys_take(dev, size) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    void *p = va_reserve(size, PROT_READ | PROT_WRITE);
    if (!p) {
        if (eager) phys_give(dev, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct fk_alloc *a = calloc(1, sizeof *a);
    a->ptr = (uint64_t)(uintptr_t)p;
    a->size = size;
    a->dev = dev;
    a->managed = 1;
    a->pref = FK_PREF_NONE;
    a->on_dev = eager ? size : 0;
    pthread_mutex_lock(&mu);
    unsigned b = bucket(a->ptr);
    a->next = allocs[b];
    allocs[b] = a;
    stats.allocs++;
    pthread_mutex_unlock(&mu);
    *dptr = a->ptr;
    return CUDA_SUCCESS;
}
/* Move managed allocation `a` onto its device (to_dev) or off it. */
static void managed_move(struct fk_alloc *a, int to_dev)
{
    if (to_dev && !a->on_dev && phys_take(a->dev, a->size) == CUDA_SUCCESS) a->on_dev = a->size;
    if (!to_dev && a->on_dev && concurrent_managed()) {
        phys_give(a->dev, a->on_dev);
        a->on_dev = 0;
    }
}
/* A device accessed [p, p+n): a managed allocation is populated on the device unless it
 * prefers the CPU (mapped there instead). */
static void device_touch(uint64_t p, uint64_t n)
{
    pthread_mutex_lock(&mu);
    struct fk_alloc *a = alloc_containing(p, n);
    int move = a && a->managed && !a->on_dev && a->pref != CU_DEVICE_CPU;
    pthread_mutex_unlock(&mu);
    if (move) managed_move(a, 1);
}
/* The managed allocation holding [p, p+n) (rounded to pages), or NULL. */
static struct fk_alloc *managed_range(uint64_t p, uint64_t n)
{
    uint64_t lo = p & ~4095ull;
    pthread_mutex_lock(&mu);
    struct fk_alloc *a = n ? alloc_containing(p, n) : NULL;
    if (!a || !a->managed) a = alloc_containing(lo, n + (p - lo));
    pthread_mutex_unlock(&mu);
    return a && a->managed ? a : NULL;
}
static int location_device(CUmemLocation loc, int *dev)
{
    switch (loc.type) {
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: *dev = CU_DEVICE_CPU; return 0;
    case CU_MEM_LOCATION_TYPE_DEVICE: *dev = loc.id; return loc.id >= 0 && loc.id < S->ndev ? 0 : -1;
    default: return -1;
    }
}
#undef cuMemAdvise
#undef cuMemPrefetchAsync
#undef cuMemPrefetchAsync_ptsz
API CUresult cuMemAdvise_v2(CUdeviceptr p, size_t n, CUmem_advise advice, CUmemLocation loc)
{
    struct fk_alloc *a = managed_range(p, n);
    if (!a) return CUDA_ERROR_INVALID_VALUE; /* "must refer to managed memory" */
    int dev = CU_DEVICE_CPU;
    int needs_loc = advice == CU_MEM_ADVISE_SET_PREFERRED_LOCATION ||
                    advice == CU_MEM_ADVISE_SET_ACCESSED_BY || advice == CU_MEM_ADVISE_UNSET_ACCESSED_BY;
    if (needs_loc && location_device(loc, &dev) != 0) return CUDA_ERROR_INVALID_DEVICE;
    switch (advice) {
    case CU_MEM_ADVISE_SET_PREFERRED_LOCATION: a->pref = dev; return CUDA_SUCCESS;
    case CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION: a->pref = FK_PREF_NONE; return CUDA_SUCCESS;
    case CU_MEM_ADVISE_SET_READ_MOSTLY:
    case CU_MEM_ADVISE_UNSET_READ_MOSTLY:
    case CU_MEM_ADVISE_SET_ACCESSED_BY:
    case CU_MEM_ADVISE_UNSET_ACCESSED_BY: return CUDA_SUCCESS; /* mappings: no residency change */
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}
API CUresult cuMemAdvise(CUdeviceptr p, size_t n, CUmem_advise advice, CUdevice dev)
{
    CUmemLocation loc = {.type = dev == CU_DEVICE_CPU ? CU_MEM_LOCATION_TYPE_HOST
                                                      : CU_MEM_LOCATION_TYPE_DEVICE,
                         .id = dev};
    return cuMemAdvise_v2(p, n, advice, loc);
}
API CUresult cuMemPrefetchAsync_v2(CUdeviceptr p, size_t n, CUmemLocation loc, unsigned flags,
                                   CUstream s)
{
    (void)s;
    struct fk_alloc *a = managed_range(p, n);
    int dev;
    if (!a || flags) return CUDA_ERROR_INVALID_VALUE;
    if (location_device(loc, &dev) != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (dev != CU_DEVICE_CPU && dev != a->dev) return CUDA_ERROR_INVALID_DEVICE; /* one GPU each */
    managed_move(a, dev != CU_DEVICE_CPU);
    return CUDA_SUCCESS;
}
API CUresult cuMemPrefetchAsync_v2_ptsz(CUdeviceptr p, size_t n, CUmemLocation loc,
                                        unsigned flags, CUstream s)
{
    return cuMemPrefetchAsync_v2(p, n, loc, flags, s);
}
API CUresult cuMemPrefetchAsync(CUdeviceptr p, size_t n, CUdevice dev, CUstream s)
{
    CUmemLocation loc = {.type = dev == CU_DEVICE_CPU ? CU_MEM_LOCATION_TYPE_HOST
                                                      : CU_MEM_LOCATION_TYPE_DEVICE,
                         .id = dev};
    return cuMemPrefetchAsync_v2(p, n, loc, 0, s);
}
API CUresult cuMemPrefetchAsync_ptsz(CUdeviceptr p, size_t n, CUdevice dev, CUstream s)
{
    return cuMemPrefetchAsync(p, n, dev, s);
}
/* Tests: where a managed allocation lives now (bytes on its device, -1 when not managed). */
API int64_t fake_managed_on_device(CUdeviceptr p)
{
    pthread_mutex_lock(&mu);
    struct fk_alloc *a = alloc_find(p, 0);
    int64_t v = a && a->managed ? (int64_t)a->on_dev : -1;
    pthread_mutex_unlock(&mu);
    return v;
}
API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h,
                                unsigned int elem)
{
    (void)elem;
    NEED_CTX();
    *pitch = (w + 511) / 512 * 512;
    return new_alloc(dptr, *pitch * h, cur()->dev, NULL);
}
API CUresult cuMemFree_v2(CUdeviceptr p)
{
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!p) return CUDA_SUCCESS;
    return free_alloc(p);
}
API CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p)
{
    pthread_mutex_lock(&mu);
    struct fk_alloc *a = alloc_containing(p, 1);
    if (a) {
        if (base) *base = a->ptr;
        if (size) *size = a->size;
    }
    pthread_mutex_unlock(&mu);
    return a ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}
static void device_touch(uint64_t p, uint64_t n);
static CUresult memset8(CUdeviceptr p, unsigned char v, size_t n)
{
    device_touch(p, n);
    pthread_mutex_lock(&mu);
    struct fk_alloc *a = alloc_containing(p, n);
    pthread_mutex_unlock(&mu);
    if (!a) return CUDA_SUCCESS; /* e.g. a VMM range: nothing backs it here */
    unsigned char *q = (unsigned char *)(uintptr_t)p;
    if (v == 0 && n > (1u << 20)) { /* zero large ranges by dropping their pages */
        uintptr_t lo = ((uintptr_t)q + 4095) & ~(uintptr_t)4095, hi = ((uintptr_t)q + n) & ~(uintptr_t)4095;
        if (hi > lo) {
            memset(q, 0, lo - (uintptr_t)q);
            madvise((void *)lo, hi - lo, MADV_DONTNEED);
            memset((void *)hi, 0, (uintptr_t)q + n - hi);
            return CUDA_SUCCESS;
        }
    }
    memset(q, v, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n)
{
    return memset8(p, v, n);
}
API CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream s)
{
    (void)s;
    return memset8(p, v, n);
}
API CUresult cuMemsetD8Async_ptsz(CUdeviceptr p, unsigned char v, size_t n, CUstream s)
{
    (void)s;
    return memset8(p, v, n);
}
API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    device_touch(dst, n);
    pthread_mutex_lock(&mu);
    struct fk_alloc *a = alloc_containing(dst, n);
    pthread_mutex_unlock(&mu);
    if (!a) return CUDA_ERROR_INVALID_VALUE;
    memcpy((void *)(uintptr_t)dst, src, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    pthread_mutex_lock(&mu);
    struct fk_alloc *a = alloc_containing(src, n);
    pthread_mutex_unlock(&mu);
    if (!a) return CUDA_ERROR_INVALID_VALUE;
    memcpy(dst, (void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

/* ---- pools and stream-ordered allocation ---------------------------------------------------- */

static struct fk_pool *pool_new(int dev)
{
    struct fk_pool *p = calloc(1, sizeof *p);
    p->dev = dev;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < 64; i++)
        if (!pools[i]) {
            pools[i] = p;
            break;
        }
    pthread_mutex_unlock(&mu);
    return p;
}
static struct fk_pool *dev_pool(int dev)
{
    pthread_mutex_lock(&mu);
    struct fk_pool *p = current_pool[dev];
    pthread_mutex_unlock(&mu);
    if (p) return p;
    p = pool_new(dev);
    pthread_mutex_lock(&mu);
    if (!default_pool[dev]) default_pool[dev] = current_pool[dev] = p;
    p = current_pool[dev];
    pthread_mutex_unlock(&mu);
    return p;
}
API CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *out, CUdevice d)
{
    if (d < 0 || d >= S->ndev) return CUDA_ERROR_INVALID_DEVICE;
    dev_pool(d);
    *out = (CUmemoryPool)default_pool[d];
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetMemPool(CUmemoryPool *out, CUdevice d)
{
    if (d < 0 || d >= S->ndev) return CUDA_ERROR_INVALID_DEVICE;
    *out = (CUmemoryPool)dev_pool(d);
    return CUDA_SUCCESS;
}
API CUresult cuMemPoolCreate(CUmemoryPool *out, const CUmemPoolProps *props)
{
    if (!props || props->location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_NOT_SUPPORTED;
    struct fk_pool *p = pool_new(props->location.id);
    p->max = props->maxSize;
    *out = (CUmemoryPool)p;
    return CUDA_SUCCESS;
}
API CUresult cuMemPoolDestroy(CUmemoryPool pool)
{
    struct fk_pool *p = (struct fk_pool *)pool;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < 64; i++)
        if (pools[i] == p) pools[i] = NULL;
    pthread_mutex_unlock(&mu);
    fk_lock(S);
    S->dev[p->dev].used -= p->reserved - p->used;
    fk_proc_note(S, p->dev, getpid(), -(int64_t)(p->reserved - p->used));
    p->reserved = p->used;
    fk_unlock(S);
    return CUDA_SUCCESS; /* outstanding allocations keep p alive (leaked in this fake) */
}
API CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep)
{
    struct fk_pool *p = (struct fk_pool *)pool;
    fk_lock(S);
    uint64_t target = p->reserved < keep ? p->reserved : keep;
    if (target < p->used) target = p->used;
    S->dev[p->dev].used -= p->reserved - target;
    fk_proc_note(S, p->dev, getpid(), -(int64_t)(p->reserved - target));
    p->reserved = target;
    fk_unlock(S);
    return CUDA_SUCCESS;
}
API CUresult cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute a, void *v)
{
    struct fk_pool *p = (struct fk_pool *)pool;
    fk_lock(S);
    cuuint64_t x = a == CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT ? p->reserved
                   : a == CU_MEMPOOL_ATTR_USED_MEM_CURRENT   ? p->used
                   : a == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD  ? p->threshold
                                                             : 0;
    fk_unlock(S);
    *(cuuint64_t *)v = x;
    return CUDA_SUCCESS;
}
API CUresult cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute a, void *v)
{
    if (a == CU_MEMPOOL_ATTR_RELEASE_THRESHOLD) ((struct fk_pool *)pool)->threshold = *(cuuint64_t *)v;
    return CUDA_SUCCESS;
}
static CUresult alloc_async(CUdeviceptr *dptr, size_t size, struct fk_pool *pool, CUstream s)
{
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    int dev = pool ? pool->dev : stream_dev(s);
    if (dev < 0) return CUDA_ERROR_INVALID_CONTEXT;
    return new_alloc(dptr, size, dev, pool ? pool : dev_pool(dev));
}
API CUresult cuMemAllocAsync(CUdeviceptr *d, size_t n, CUstream s)
{
    return alloc_async(d, n, NULL, s);
}
API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *d, size_t n, CUstream s)
{
    return alloc_async(d, n, NULL, s);
}
API CUresult cuMemAllocFromPoolAsync(CUdeviceptr *d, size_t n, CUmemoryPool p, CUstream s)
{
    return alloc_async(d, n, (struct fk_pool *)p, s);
}
API CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *d, size_t n, CUmemoryPool p, CUstream s)
{
    return alloc_async(d, n, (struct fk_pool *)p, s);
}
API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s)
{
    (void)s;
    return free_alloc(p);
}
API CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s)
{
    (void)s;
    return free_alloc(p);
}

/* ---- virtual memory management ---------------------------------------------------------------- */

API CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p,
                                           CUmemAllocationGranularity_flags f)
{
    (void)p, (void)f;
    *g = 2u << 20;
    return CUDA_SUCCESS;
}
API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                                 unsigned long long flags)
{
    (void)align, (void)addr, (void)flags;
    void *p = va_reserve(size, PROT_NONE);
    if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}
API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    munmap((void *)(uintptr_t)ptr, size);
    return CUDA_SUCCESS;
}
API CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop,
                         unsigned long long flags)
{
    (void)flags;
    if (!prop || prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE) return CUDA_ERROR_INVALID_VALUE;
    int dev = prop->location.id;
    if (phys_take(dev, size) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    struct fk_handle *x = calloc(1, sizeof *x);
    x->dev = dev;
    x->size = size;
    x->refs = 1;
    x->export_id = -1;
    *h = (CUmemGenericAllocationHandle)(uintptr_t)x;
    return CUDA_SUCCESS;
}
static void handle_unref(struct fk_handle *x)
{
    if (--x->refs > 0) return;
    if (x->export_id >= 0) {
        fk_lock(S);
        struct fk_export *e = &S->exports[x->export_id];
        if (--e->refs == 0) {
            S->dev[e->dev].used -= e->size;
            e->in_use = 0;
        }
        fk_unlock(S);
    } else {
        phys_give(x->dev, x->size);
    }
    free(x);
}
API CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
    handle_unref((struct fk_handle *)(uintptr_t)h);
    return CUDA_SUCCESS;
}
API CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h,
                                          CUmemAllocationHandleType type, unsigned long long flags)
{
    (void)type, (void)flags;
    struct fk_handle *x = (struct fk_handle *)(uintptr_t)h;
    if (x->export_id < 0) {
        fk_lock(S);
        for (int i = 0; i < FK_MAX_EXPORTS; i++)
            if (!S->exports[i].in_use) {
                S->exports[i] = (struct fk_export){.in_use = 1, .dev = x->dev, .refs = 1, .size = x->size};
                x->export_id = i;
                break;
            }
        fk_unlock(S);
        if (x->export_id < 0) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *(int *)out = 1000 + x->export_id;
    return CUDA_SUCCESS;
}
API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os,
                                            CUmemAllocationHandleType type)
{
    (void)type;
    int id = (int)(intptr_t)os - 1000;
    if (id < 0 || id >= FK_MAX_EXPORTS) return CUDA_ERROR_INVALID_VALUE;
    fk_lock(S);
    struct fk_export *e = &S->exports[id];
    if (!e->in_use) {
        fk_unlock(S);
        return CUDA_ERROR_INVALID_VALUE;
    }
    e->refs++;
    struct fk_handle *x = calloc(1, sizeof *x);
    x->dev = e->dev;
    x->size = e->size;
    x->refs = 1;
    x->export_id = id;
    fk_unlock(S);
    *h = (CUmemGenericAllocationHandle)(uintptr_t)x;
    return CUDA_SUCCESS;
}
API CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h)
{
    struct fk_handle *x = (struct fk_handle *)(uintptr_t)h;
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = x->dev;
    return CUDA_SUCCESS;
}
API CUresult cuMemMap(CUdeviceptr va, size_t size, size_t off, CUmemGenericAllocationHandle h,
                      unsigned long long flags)
{
    (void)off, (void)flags;
    struct fk_handle *x = (struct fk_handle *)(uintptr_t)h;
    struct fk_map *m = calloc(1, sizeof *m);
    m->va = va;
    m->size = size;
    m->h = x;
    pthread_mutex_lock(&mu);
    x->refs++;
    m->next = maps;
    maps = m;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}
API CUresult cuMemUnmap(CUdeviceptr va, size_t size)
{
    pthread_mutex_lock(&mu);
    struct fk_map **pp = &maps, *gone = NULL;
    while (*pp) {
        if ((*pp)->va >= va && (*pp)->va < va + size) {
            struct fk_map *m = *pp;
            *pp = m->next;
            m->next = gone;
            gone = m;
        } else {
            pp = &(*pp)->next;
        }
    }
    pthread_mutex_unlock(&mu);
    while (gone) {
        struct fk_map *m = gone;
        gone = m->next;
        handle_unref(m->h);
        free(m);
    }
    return CUDA_SUCCESS;
}
API CUresult cuMemSetAccess(CUdeviceptr p, size_t n, const CUmemAccessDesc *d, size_t c)
{
    (void)p, (void)n, (void)d, (void)c;
    return CUDA_SUCCESS;
}

/* ---- arrays --------------------------------------------------------------------------------- */

static uint64_t fk_array_bytes(unsigned w, unsigned h, unsigned d, CUarray_format f, unsigned ch,
                               unsigned levels, int layered)
{
    uint64_t e = (f == CU_AD_FORMAT_UNSIGNED_INT8 || f == CU_AD_FORMAT_SIGNED_INT8) ? 1
                 : (f == CU_AD_FORMAT_UNSIGNED_INT16 || f == CU_AD_FORMAT_SIGNED_INT16 ||
                    f == CU_AD_FORMAT_HALF)
                     ? 2
                     : 4;
    uint64_t total = 0;
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        uint64_t lw = w >> l ? w >> l : 1, lh = h ? (h >> l ? h >> l : 1) : 1;
        uint64_t ld = d ? (layered ? d : (d >> l ? d >> l : 1)) : 1;
        total += lw * lh * ld * e * (ch ? ch : 1);
    }
    return total;
}
static CUresult array_new(void **out, uint64_t bytes)
{
    if (!cur()) return CUDA_ERROR_INVALID_CONTEXT;
    if (phys_take(cur()->dev, bytes) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
    struct fk_array *a = calloc(1, sizeof *a);
    a->bytes = bytes;
    a->dev = cur()->dev;
    *out = a;
    return CUDA_SUCCESS;
}
API CUresult cuArrayCreate_v2(CUarray *h, const CUDA_ARRAY_DESCRIPTOR *d)
{
    return array_new((void **)h, fk_array_bytes((unsigned)d->Width, (unsigned)d->Height, 0, d->Format,
                                                d->NumChannels, 1, 0));
}
API CUresult cuArray3DCreate_v2(CUarray *h, const CUDA_ARRAY3D_DESCRIPTOR *d)
{
    return array_new((void **)h, fk_array_bytes((unsigned)d->Width, (unsigned)d->Height, (unsigned)d->Depth,
                                                d->Format, d->NumChannels, 1, 0));
}
API CUresult cuMipmappedArrayCreate(CUmipmappedArray *h, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int n)
{
    return array_new((void **)h, fk_array_bytes((unsigned)d->Width, (unsigned)d->Height, (unsigned)d->Depth,
                                                d->Format, d->NumChannels, n,
                                                (d->Flags & CUDA_ARRAY3D_LAYERED) != 0));
}
static CUresult array_free(void *h)
{
    struct fk_array *a = h;
    if (!a) return CUDA_ERROR_INVALID_HANDLE;
    phys_give(a->dev, a->bytes);
    free(a);
    return CUDA_SUCCESS;
}
API CUresult cuArrayDestroy(CUarray h)
{
    return array_free(h);
}
API CUresult cuMipmappedArrayDestroy(CUmipmappedArray h)
{
    return array_free(h);
}

/* ---- modules, streams, events ----------------------------------------------------------------- */

API CUresult cuModuleLoadData(CUmodule *m, const void *image)
{
    (void)image;
    *m = (CUmodule)calloc(1, sizeof(struct fk_module));
    return CUDA_SUCCESS;
}
API CUresult cuModuleUnload(CUmodule m)
{
    struct fk_module *x = (struct fk_module *)m;
    for (int i = 0; i < x->nfuncs; i++) free(x->funcs[i]);
    free(x);
    return CUDA_SUCCESS;
}
API CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name)
{
    struct fk_module *mod = (struct fk_module *)m;
    if (mod->nfuncs >= 64) return CUDA_ERROR_OUT_OF_MEMORY;
    struct fk_func *x = calloc(1, sizeof *x);
    snprintf(x->name, sizeof x->name, "%s", name);
    x->dur = func_duration(name);
    mod->funcs[mod->nfuncs++] = x;
    *f = (CUfunction)x;
    return CUDA_SUCCESS;
}
API CUresult cuStreamCreate(CUstream *s, unsigned int flags)
{
    (void)flags;
    NEED_CTX();
    struct fk_stream *x = calloc(1, sizeof *x);
    x->ctx = cur();
    *s = (CUstream)x;
    return CUDA_SUCCESS;
}
API CUresult cuStreamDestroy_v2(CUstream s)
{
    free(s);
    return CUDA_SUCCESS;
}
API CUresult cuStreamGetCtx(CUstream s, CUcontext *c)
{
    __atomic_fetch_add(&stats.stream_getctx, 1, __ATOMIC_RELAXED);
    if (!s || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) *c = (CUcontext)cur();
    else *c = (CUcontext)((struct fk_stream *)s)->ctx;
    return CUDA_SUCCESS;
}
API CUresult cuStreamGetCtx_ptsz(CUstream s, CUcontext *c)
{
    return cuStreamGetCtx(s, c);
}
API CUresult cuStreamSynchronize(CUstream s)
{
    sync_dev(stream_dev(s));
    return CUDA_SUCCESS;
}
API CUresult cuStreamSynchronize_ptsz(CUstream s)
{
    return cuStreamSynchronize(s);
}
API CUresult cuEventCreate(CUevent *e, unsigned int flags)
{
    (void)flags;
    *e = (CUevent)calloc(1, sizeof(struct fk_event));
    return CUDA_SUCCESS;
}
API CUresult cuEventDestroy_v2(CUevent e)
{
    free(e);
    return CUDA_SUCCESS;
}
API CUresult cuEventRecord(CUevent e, CUstream s)
{
    struct fk_event *x = (struct fk_event *)e;
    int dev = stream_dev(s);
    if (dev < 0) return CUDA_ERROR_INVALID_CONTEXT;
    /* Stream order, as CUDA: the event completes once the work this process submitted to the
     * device before it is done, not the other processes' work (a process's streams on a device
     * are one queue here). So an event pair around a kernel also spans whatever other processes
     * queued on the device ahead of that kernel, as on a real time-sliced GPU. */
    pthread_mutex_lock(&mu);
    int64_t now = fk_now(), b = last_end[dev];
    pthread_mutex_unlock(&mu);
    x->ts = b > now ? b : now;
    x->recorded = 1;
    return CUDA_SUCCESS;
}
API CUresult cuEventRecord_ptsz(CUevent e, CUstream s)
{
    return cuEventRecord(e, s);
}
API CUresult cuEventQuery(CUevent e)
{
    struct fk_event *x = (struct fk_event *)e;
    return !x->recorded || fk_now() >= x->ts ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
API CUresult cuEventSynchronize(CUevent e)
{
    fk_sleep_until(((struct fk_event *)e)->ts);
    return CUDA_SUCCESS;
}
API CUresult cuEventElapsedTime(float *ms, CUevent a, CUevent b)
{
    struct fk_event *x = (struct fk_event *)a, *y = (struct fk_event *)b;
    if (!x->recorded || !y->recorded) return CUDA_ERROR_INVALID_HANDLE;
    if (fk_now() < x->ts || fk_now() < y->ts) return CUDA_ERROR_NOT_READY;
    *ms = (float)((double)(y->ts - x->ts) / 1e6);
    return CUDA_SUCCESS;
}
API CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b)
{
    return cuEventElapsedTime(ms, a, b);
}

/* ---- launches ---------------------------------------------------------------------------------- */

static CUresult launch(CUfunction f, CUstream s, long *counter)
{
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!f) return CUDA_ERROR_INVALID_HANDLE;
    if (bench()) return CUDA_SUCCESS;
    pthread_mutex_lock(&mu);
    (*counter)++;
    pthread_mutex_unlock(&mu);
    return enqueue(stream_dev(s), ((struct fk_func *)f)->dur);
}
#define KPARAMS CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, \
                unsigned bz, unsigned sh, CUstream s, void **params
#define UNUSED_K (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)sh, (void)params
API CUresult cuLaunchKernel(KPARAMS, void **extra)
{
    UNUSED_K, (void)extra;
    return launch(f, s, &stats.launches);
}
API CUresult cuLaunchKernel_ptsz(KPARAMS, void **extra)
{
    UNUSED_K, (void)extra;
    return launch(f, s, &stats.launches);
}
API CUresult cuLaunchCooperativeKernel(KPARAMS)
{
    UNUSED_K;
    return launch(f, s, &stats.coop_launches);
}
API CUresult cuLaunchCooperativeKernel_ptsz(KPARAMS)
{
    UNUSED_K;
    return launch(f, s, &stats.coop_launches);
}
API CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra)
{
    (void)params, (void)extra;
    return launch(f, c ? c->hStream : NULL, &stats.ex_launches);
}
API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *c, CUfunction f, void **params, void **extra)
{
    return cuLaunchKernelEx(c, f, params, extra);
}
API CUresult cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *l, unsigned n, unsigned flags)
{
    (void)flags;
    for (unsigned i = 0; i < n; i++) {
        CUresult r = launch(l[i].function, l[i].hStream, &stats.coop_launches);
        if (r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
}

/* ---- graphs ------------------------------------------------------------------------------------ */

API CUresult cuGraphCreate(CUgraph *g, unsigned int flags)
{
    (void)flags;
    struct fk_graph *x = calloc(1, sizeof *x);
    x->dev = cur() ? cur()->dev : 0;
    *g = (CUgraph)x;
    return CUDA_SUCCESS;
}
static CUgraphNode new_node(CUgraph g)
{
    struct fk_graph *x = (struct fk_graph *)g;
    void *n = calloc(1, 8);
    if (x->nnodes < 256) x->nodes[x->nnodes++] = n;
    return (CUgraphNode)n;
}
API CUresult cuGraphAddKernelNode_v2(CUgraphNode *n, CUgraph g, const CUgraphNode *deps, size_t nd,
                                     const CUDA_KERNEL_NODE_PARAMS *p)
{
    (void)deps, (void)nd;
    ((struct fk_graph *)g)->kernel_ns += ((struct fk_func *)p->func)->dur;
    *n = new_node(g);
    return CUDA_SUCCESS;
}
static CUresult mem_node(CUgraphNode *n, CUgraph g, const CUmemPoolProps *pp, size_t bytes, CUdeviceptr *out)
{
    struct fk_graph *x = (struct fk_graph *)g;
    if (x->nalloc >= FK_GMEM) return CUDA_ERROR_NOT_SUPPORTED;
    int dev = pp->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? pp->location.id : x->dev;
    void *va = va_reserve(bytes, PROT_NONE); /* the address only: memory comes at launch */
    if (!va) return CUDA_ERROR_OUT_OF_MEMORY;
    struct fk_alloc *a = calloc(1, sizeof *a);
    a->ptr = (uint64_t)(uintptr_t)va;
    a->size = bytes;
    a->dev = dev;
    a->graph = 1;
    pthread_mutex_lock(&mu);
    unsigned b = bucket(a->ptr);
    a->next = allocs[b];
    allocs[b] = a;
    pthread_mutex_unlock(&mu);
    x->alloc[x->nalloc++] = a;
    x->dev = dev;
    *out = a->ptr;
    *n = new_node(g);
    return CUDA_SUCCESS;
}
static CUresult free_node(CUgraphNode *n, CUgraph g, CUdeviceptr p)
{
    struct fk_graph *x = (struct fk_graph *)g;
    pthread_mutex_lock(&mu);
    struct fk_alloc *a = alloc_find(p, 0);
    pthread_mutex_unlock(&mu);
    if (!a || !a->graph || x->nfree >= FK_GMEM) return CUDA_ERROR_INVALID_VALUE;
    x->free_ptr[x->nfree++] = p;
    *n = new_node(g);
    return CUDA_SUCCESS;
}
API CUresult cuGraphAddMemAllocNode(CUgraphNode *n, CUgraph g, const CUgraphNode *deps, size_t nd,
                                    CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    (void)deps, (void)nd;
    return mem_node(n, g, &p->poolProps, p->bytesize, &p->dptr);
}
API CUresult cuGraphAddMemFreeNode(CUgraphNode *n, CUgraph g, const CUgraphNode *deps, size_t nd, CUdeviceptr p)
{
    (void)deps, (void)nd;
    return free_node(n, g, p);
}
static CUresult add_node(CUgraphNode *n, CUgraph g, CUgraphNodeParams *p)
{
    if (p->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC)
        return mem_node(n, g, &p->alloc.poolProps, p->alloc.bytesize, &p->alloc.dptr);
    if (p->type == CU_GRAPH_NODE_TYPE_MEM_FREE) return free_node(n, g, p->free.dptr);
    if (p->type == CU_GRAPH_NODE_TYPE_KERNEL)
        ((struct fk_graph *)g)->kernel_ns += ((struct fk_func *)p->kernel.func)->dur;
    *n = new_node(g);
    return CUDA_SUCCESS;
}
API CUresult cuGraphAddNode(CUgraphNode *n, CUgraph g, const CUgraphNode *deps, size_t nd, CUgraphNodeParams *p)
{
    (void)deps, (void)nd;
    return add_node(n, g, p);
}
API CUresult cuGraphAddNode_v2(CUgraphNode *n, CUgraph g, const CUgraphNode *deps,
                               const CUgraphEdgeData *e, size_t nd, CUgraphNodeParams *p)
{
    (void)deps, (void)e, (void)nd;
    return add_node(n, g, p);
}
/* Destroying a graph (or its exec) frees nothing that a launch allocated: those allocations
 * live until freed. The records stay in allocs[] (the address stays reserved). */
API CUresult cuGraphDestroy(CUgraph g)
{
    struct fk_graph *x = (struct fk_graph *)g;
    for (int i = 0; i < x->nnodes; i++) free(x->nodes[i]);
    free(x);
    return CUDA_SUCCESS;
}
static CUresult instantiate(CUgraphExec *e, CUgraph g, unsigned long long flags)
{
    struct fk_graph *x = (struct fk_graph *)g;
    struct fk_exec *y = calloc(1, sizeof *y);
    y->kernel_ns = x->kernel_ns;
    y->dev = x->dev;
    y->nalloc = x->nalloc;
    y->nfree = x->nfree;
    memcpy(y->alloc, x->alloc, sizeof y->alloc);
    memcpy(y->free_ptr, x->free_ptr, sizeof y->free_ptr);
    y->autofree = (flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) != 0;
    *e = (CUgraphExec)y;
    return CUDA_SUCCESS;
}
API CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long flags)
{
    return instantiate(e, g, flags);
}
API CUresult cuGraphInstantiateWithParams(CUgraphExec *e, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    return instantiate(e, g, p ? p->flags : 0);
}
API CUresult cuGraphInstantiateWithParams_ptsz(CUgraphExec *e, CUgraph g, CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    return instantiate(e, g, p ? p->flags : 0);
}
API CUresult cuGraphExecDestroy(CUgraphExec e)
{
    free(e);
    return CUDA_SUCCESS;
}
/* Launch: allocation nodes take their memory, then free nodes give theirs back. */
static CUresult graph_memory(struct fk_exec *y)
{
    for (int i = 0; i < y->nalloc; i++) {
        struct fk_alloc *a = y->alloc[i];
        if (a->live) {
            if (!y->autofree) return CUDA_ERROR_INVALID_VALUE;
            phys_give(a->dev, a->size);
            a->live = 0;
        }
        if (phys_take(a->dev, a->size) != CUDA_SUCCESS) return CUDA_ERROR_OUT_OF_MEMORY;
        a->live = 1;
    }
    for (int i = 0; i < y->nfree; i++) {
        pthread_mutex_lock(&mu);
        struct fk_alloc *a = alloc_find(y->free_ptr[i], 0);
        int live = a && a->graph && a->live;
        if (live) a->live = 0;
        pthread_mutex_unlock(&mu);
        if (live) phys_give(a->dev, a->size);
    }
    return CUDA_SUCCESS;
}
API CUresult cuGraphLaunch(CUgraphExec e, CUstream s)
{
    struct fk_exec *y = (struct fk_exec *)e;
    CUresult r = graph_memory(y);
    if (r != CUDA_SUCCESS) return r;
    pthread_mutex_lock(&mu);
    stats.graph_launches++;
    pthread_mutex_unlock(&mu);
    int dev = stream_dev(s);
    return enqueue(dev >= 0 ? dev : y->dev, y->kernel_ns);
}
API CUresult cuGraphLaunch_ptsz(CUgraphExec e, CUstream s)
{
    return cuGraphLaunch(e, s);
}

/* ---- cuGetProcAddress ------------------------------------------------------------------------ */

#define E(name) {#name, (void *)name}
static const struct {
    const char *name;
    void *fn;
} table[] = {
    E(cuInit), E(cuDriverGetVersion), E(cuDeviceGetCount), E(cuDeviceGet), E(cuDeviceGetName),
    E(cuDeviceGetUuid), E(cuDeviceGetUuid_v2), E(cuDeviceTotalMem_v2), E(cuDeviceGetAttribute),
    E(cuGetErrorString), E(cuGetErrorName), E(cuDevicePrimaryCtxRetain),
    E(cuDevicePrimaryCtxRelease_v2), E(cuCtxCreate_v2), E(cuCtxCreate_v3), E(cuCtxCreate_v4),
    E(cuCtxDestroy_v2), E(cuCtxSetCurrent), E(cuCtxGetCurrent), E(cuCtxPushCurrent_v2),
    E(cuCtxPopCurrent_v2), E(cuCtxGetDevice), E(cuCtxGetDevice_v2), E(cuCtxSynchronize),
    E(cuMemGetInfo_v2), E(cuMemAlloc_v2), E(cuMemAllocManaged), E(cuMemAllocPitch_v2),
    E(cuMemFree_v2), E(cuMemAlloc), E(cuMemAdvise), E(cuMemAdvise_v2), E(cuMemPrefetchAsync),
    E(cuMemPrefetchAsync_ptsz), E(cuMemPrefetchAsync_v2), E(cuMemPrefetchAsync_v2_ptsz), E(cuMemGetAddressRange_v2), E(cuMemsetD8_v2), E(cuMemsetD8Async),
    E(cuMemsetD8Async_ptsz), E(cuMemcpyHtoD_v2), E(cuMemcpyDtoH_v2), E(cuDeviceGetDefaultMemPool),
    E(cuDeviceGetMemPool), E(cuMemPoolCreate), E(cuMemPoolDestroy), E(cuMemPoolTrimTo),
    E(cuMemPoolGetAttribute), E(cuMemPoolSetAttribute), E(cuMemAllocAsync), E(cuMemAllocAsync_ptsz),
    E(cuMemAllocFromPoolAsync), E(cuMemAllocFromPoolAsync_ptsz), E(cuMemFreeAsync),
    E(cuMemFreeAsync_ptsz), E(cuMemGetAllocationGranularity), E(cuMemAddressReserve),
    E(cuMemAddressFree), E(cuMemCreate), E(cuMemRelease), E(cuMemExportToShareableHandle),
    E(cuMemImportFromShareableHandle), E(cuMemGetAllocationPropertiesFromHandle), E(cuMemMap),
    E(cuMemUnmap), E(cuMemSetAccess), E(cuArrayCreate_v2), E(cuArray3DCreate_v2),
    E(cuMipmappedArrayCreate), E(cuArrayDestroy), E(cuMipmappedArrayDestroy), E(cuModuleLoadData),
    E(cuModuleUnload), E(cuModuleGetFunction), E(cuStreamCreate), E(cuStreamDestroy_v2),
    E(cuStreamGetCtx), E(cuStreamGetCtx_ptsz), E(cuStreamSynchronize), E(cuStreamSynchronize_ptsz),
    E(cuEventCreate), E(cuEventDestroy_v2), E(cuEventRecord), E(cuEventRecord_ptsz),
    E(cuEventQuery), E(cuEventSynchronize), E(cuEventElapsedTime), E(cuEventElapsedTime_v2),
    E(cuLaunchKernel), E(cuLaunchKernel_ptsz), E(cuLaunchCooperativeKernel),
    E(cuLaunchCooperativeKernel_ptsz), E(cuLaunchKernelEx), E(cuLaunchKernelEx_ptsz),
    E(cuLaunchCooperativeKernelMultiDevice), E(cuGraphCreate), E(cuGraphAddKernelNode_v2),
    E(cuGraphAddMemAllocNode), E(cuGraphAddMemFreeNode), E(cuGraphAddNode), E(cuGraphAddNode_v2),
    E(cuGraphDestroy), E(cuGraphInstantiateWithFlags), E(cuGraphInstantiateWithParams),
    E(cuGraphInstantiateWithParams_ptsz), E(cuGraphExecDestroy), E(cuGraphLaunch),
    E(cuGraphLaunch_ptsz), {"cuGetProcAddress", NULL}, {"cuGetProcAddress_v2", NULL},
};

/* -DFAKE_OMIT='"a,b"': a driver without these entry points. */
static int omitted(const char *name)
{
#ifdef FAKE_OMIT
    const char *list = FAKE_OMIT;
    size_t n = strlen(name);
    for (const char *p = list; (p = strstr(p, name)) != NULL; p += n)
        if ((p == list || p[-1] == ',') && (p[n] == ',' || p[n] == 0)) return 1;
#endif
    (void)name;
    return 0;
}

static void *find(const char *name)
{
    if (omitted(name)) return NULL;
    for (size_t i = 0; i < sizeof table / sizeof *table; i++)
        if (!strcmp(table[i].name, name)) return table[i].fn;
    return NULL;
}

API CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags,
                                 CUdriverProcAddressQueryResult *st);

static void *lookup(const char *sym, int ver, cuuint64_t flags)
{
    char buf[160];
    if (ver < 3020 && find(sym)) return find(sym); /* before 3.2: the unsuffixed (v1) ABI */
    if (!strcmp(sym, "cuGetProcAddress"))
        return omitted("cuGetProcAddress_v2") ? NULL : (void *)cuGetProcAddress_v2;
    if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) {
        snprintf(buf, sizeof buf, "%s_ptsz", sym);
        if (find(buf)) return find(buf);
        snprintf(buf, sizeof buf, "%s_ptds", sym);
        if (find(buf)) return find(buf);
    }
    static const char *sfx[] = {"_v4", "_v3", "_v2", ""};
    for (int i = 0; i < 4; i++) {
        snprintf(buf, sizeof buf, "%s%s", sym, sfx[i]);
        void *f = find(buf);
        if (f) return f;
    }
    return NULL;
}

API CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, cuuint64_t flags,
                                 CUdriverProcAddressQueryResult *st)
{
    void *f = lookup(sym, ver, flags);
    if (st) *st = f ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    *pfn = f;
    return f ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

API CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, cuuint64_t flags)
{
    return cuGetProcAddress_v2(sym, pfn, ver, flags, NULL);
}
