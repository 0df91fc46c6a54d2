/*
 * cuctl — a driver-API program the tests steer line by line on stdin; one JSON line per command
 * on stdout. Every allocation path, the views programs read back, launches on every path, and a
 * few tools (hold the region lock, read fake counters).
 *
 *   init [dev]                       cuInit + the device's primary context, made current
 *   alloc KIND BYTES                 KIND: plain pitch managed async pool vmm array array3d
 *                                    mipmap graphnode graphnode2 ctx raw -> {"ok","rc","id"}
 *   free ID                          the matching free/destroy/release
 *   info | total | nvml [IDX] | nvml2 [IDX] | procs [IDX] [VER]  (NVML, no CUDA needed)
 *   pool_create [export | max BYTES] | pool_threshold BYTES | pool_trim BYTES | pool_destroy
 *   export ID -> {"fd"} | import FD -> {"id"} | map ID BYTES -> {"id"} | unmap ID | release ID
 *   write ID BYTE | stats | sync | sleep MS | lockhold REGION | exit
 *   burn SECONDS KERNEL PATH         PATH: kernel ptsz ex coop graph -> {"launches","t0","t1"}
 *   burnq SECONDS KERNEL DEPTH       cuLaunchKernel, at most DEPTH in flight (event ring)
 *   phys                             the fake device's physical memory in use
 *   mapmany ID N BYTES               N mappings of handle ID side by side -> {"id"} (one unmap)
 *   graphmem BYTES [autofree [N]]    a graph with one allocation node (no free node): create,
 *                                    instantiate, launch (N times), destroy exec and graph; the
 *                                    allocation outlives them -> {"id"} (free ID = cuMemFree)
 *   graphfree ID                     a graph with a free node for graph allocation ID, launched
 *   route HOW BYTES                  find cuMemAlloc through HOW and allocate BYTES with it ->
 *                                    {"ok","rc","ours"} (ours: the function is libvgpu's)
 *   check ID BYTE                    copy ID back (cuMemcpyDtoH): every byte BYTE? -> {"ok"}
 *   where ID                         the fake: bytes of managed allocation ID on the device
 *                                    -> {"on_dev"} (-1: not managed memory)
 *   prefetch ID dev|cpu              cuMemPrefetchAsync(_v2) of ID -> {"ok","rc"}
 *   advise ID prefer|accessed dev|cpu  cuMemAdvise(_v2) SET_PREFERRED_LOCATION / SET_ACCESSED_BY
 *   freeasync ID                     cuMemFreeAsync of ID on the stream, then synchronise
 *   prefetchbatch ID                 cuMemPrefetchBatchAsync (CUDA 13) of ID to the device
 */
#define _GNU_SOURCE
#include <nvml.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "tessera_region.h"

struct fake_stats {
    long launches, coop_launches, ex_launches, graph_launches;
    long frees_dirty, frees_clean;
    long allocs, frees;
    long stream_getctx, ctx_getdevice;
};

enum { O_PTR, O_ASYNC, O_POOLPTR, O_HANDLE, O_ARRAY, O_MIPMAP, O_GRAPH, O_CTX, O_MAP };

struct obj {
    int kind, used;
    uint64_t v, size, extra;
};

static struct api A;
static struct obj objs[4096];
static int nobj;
static CUdevice dev;
static CUcontext primary;
static CUmemoryPool pool;
static CUstream stream;

static int add(int kind, uint64_t v, uint64_t size, uint64_t extra)
{
    objs[nobj] = (struct obj){kind, 1, v, size, extra};
    return nobj++;
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void reply_rc(CUresult r, int id)
{
    printf("{\"ok\": %s, \"rc\": %d, \"id\": %d}\n", r == CUDA_SUCCESS ? "true" : "false", (int)r,
           r == CUDA_SUCCESS ? id : -1);
}

static CUmemAllocationProp vmm_prop(void)
{
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    return p;
}

static CUmemPoolProps pool_props(void)
{
    CUmemPoolProps p;
    memset(&p, 0, sizeof p);
    p.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    return p;
}

static void do_alloc(const char *kind, uint64_t bytes)
{
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    int id = -1;
    if (!strcmp(kind, "plain") || !strcmp(kind, "managed")) {
        CUdeviceptr p = 0;
        r = !strcmp(kind, "plain") ? A.cuMemAlloc(&p, bytes) : A.cuMemAllocManaged(&p, bytes, 1);
        if (!r) id = add(O_PTR, p, bytes, 0);
    } else if (!strcmp(kind, "raw")) { /* behind libvgpu's back: an untracked pointer */
        CUresult (*raw)(CUdeviceptr *, size_t);
        *(void **)&raw = dlsym(RTLD_DEFAULT, "fake_raw_alloc");
        CUdeviceptr p = 0;
        r = raw ? raw(&p, bytes) : CUDA_ERROR_NOT_FOUND;
        if (!r) id = add(O_PTR, p, bytes, 0);
    } else if (!strcmp(kind, "pitch")) {
        CUdeviceptr p = 0;
        size_t pitch = 0, width = 300 * 1024, height = bytes / width;
        r = A.cuMemAllocPitch(&p, &pitch, width, height, 4);
        if (!r) id = add(O_PTR, p, (uint64_t)pitch * height, 0);
    } else if (!strcmp(kind, "async") || !strcmp(kind, "pool")) {
        CUdeviceptr p = 0;
        int from_pool = !strcmp(kind, "pool");
        r = from_pool ? A.cuMemAllocFromPoolAsync(&p, bytes, pool, stream)
                      : A.cuMemAllocAsync(&p, bytes, stream);
        if (!r) id = add(from_pool ? O_POOLPTR : O_ASYNC, p, bytes, 0);
    } else if (!strcmp(kind, "vmm")) {
        CUmemGenericAllocationHandle h = 0;
        CUmemAllocationProp prop = vmm_prop();
        r = A.cuMemCreate(&h, bytes, &prop, 0);
        if (!r) id = add(O_HANDLE, h, bytes, 0);
    } else if (!strcmp(kind, "array")) {
        CUDA_ARRAY_DESCRIPTOR d = {.Width = 16384, .Height = bytes / 16384 / 4,
                                   .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
        CUarray a = NULL;
        r = A.cuArrayCreate(&a, &d);
        if (!r) id = add(O_ARRAY, (uint64_t)(uintptr_t)a, bytes, 0);
    } else if (!strcmp(kind, "array3d")) {
        CUDA_ARRAY3D_DESCRIPTOR d = {.Width = 1024, .Height = 1024, .Depth = bytes / (4u << 20),
                                     .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
        CUarray a = NULL;
        r = A.cuArray3DCreate(&a, &d);
        if (!r) id = add(O_ARRAY, (uint64_t)(uintptr_t)a, bytes, 0);
    } else if (!strcmp(kind, "mipmap")) {
        /* a 2D float array of BYTES at level 0, plus its mip chain (BYTES/4 + BYTES/16 + ...) */
        unsigned side = 1;
        while ((uint64_t)side * side * 4 < bytes) side *= 2;
        CUDA_ARRAY3D_DESCRIPTOR d = {.Width = side, .Height = side, .Depth = 0,
                                     .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
        CUmipmappedArray m = NULL;
        r = A.cuMipmappedArrayCreate(&m, &d, 3);
        uint64_t total = (uint64_t)side * side * 4 + (uint64_t)(side / 2) * (side / 2) * 4 +
                         (uint64_t)(side / 4) * (side / 4) * 4;
        if (!r) id = add(O_MIPMAP, (uint64_t)(uintptr_t)m, total, 0);
    } else if (!strcmp(kind, "graphnode") || !strcmp(kind, "graphnode2")) {
        CUgraph g = NULL;
        CUgraphNode n = NULL;
        A.cuGraphCreate(&g, 0);
        if (!strcmp(kind, "graphnode")) {
            CUDA_MEM_ALLOC_NODE_PARAMS p;
            memset(&p, 0, sizeof p);
            p.poolProps = pool_props();
            p.bytesize = bytes;
            r = A.cuGraphAddMemAllocNode(&n, g, NULL, 0, &p);
        } else {
            CUgraphNodeParams p;
            memset(&p, 0, sizeof p);
            p.type = CU_GRAPH_NODE_TYPE_MEM_ALLOC;
            p.alloc.poolProps = pool_props();
            p.alloc.bytesize = bytes;
            r = A.cuGraphAddNode(&n, g, NULL, NULL, 0, &p);
        }
        if (!r) id = add(O_GRAPH, (uint64_t)(uintptr_t)g, bytes, 0);
        else A.cuGraphDestroy(g);
    } else if (!strcmp(kind, "ctx")) {
        CUcontext c = NULL;
        r = A.cuCtxCreate(&c, NULL, 0, dev);
        if (!r) {
            id = add(O_CTX, (uint64_t)(uintptr_t)c, bytes, 0);
            A.cuCtxSetCurrent(primary);
        }
    }
    reply_rc(r, id);
}

static void do_free(int id)
{
    struct obj *o = &objs[id];
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    if (id < 0 || id >= nobj || !o->used) {
        reply_rc(r, -1);
        return;
    }
    switch (o->kind) {
    case O_PTR: r = A.cuMemFree(o->v); break;
    case O_ASYNC:
    case O_POOLPTR:
        r = A.cuMemFreeAsync(o->v, stream);
        A.cuStreamSynchronize(stream);
        break;
    case O_HANDLE: r = A.cuMemRelease(o->v); break;
    case O_ARRAY: r = A.cuArrayDestroy((CUarray)(uintptr_t)o->v); break;
    case O_MIPMAP: r = A.cuMipmappedArrayDestroy((CUmipmappedArray)(uintptr_t)o->v); break;
    case O_GRAPH: r = A.cuGraphDestroy((CUgraph)(uintptr_t)o->v); break;
    case O_CTX: r = A.cuCtxDestroy((CUcontext)(uintptr_t)o->v); break;
    case O_MAP:
        r = A.cuMemUnmap(o->v, o->size);
        A.cuMemAddressFree(o->v, o->size);
        break;
    }
    if (!r) o->used = 0;
    reply_rc(r, id);
}

static void do_nvml(int idx, int v2)
{
    static void *h;
    static nvmlReturn_t (*get)(unsigned, void **);
    if (!h) {
        h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
        nvmlReturn_t (*init)(void);
        *(void **)&init = dlsym(h, "nvmlInit_v2");
        init();
        *(void **)&get = dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    }
    void *d = NULL;
    get((unsigned)idx, &d);
    char uuid[96] = "";
    nvmlReturn_t (*uuidf)(void *, char *, unsigned);
    *(void **)&uuidf = dlsym(h, "nvmlDeviceGetUUID");
    uuidf(d, uuid, sizeof uuid);
    if (v2) {
        nvmlMemory_v2_t m = {.version = nvmlMemory_v2};
        nvmlReturn_t (*f)(void *, nvmlMemory_v2_t *);
        *(void **)&f = dlsym(h, "nvmlDeviceGetMemoryInfo_v2");
        nvmlReturn_t r = f(d, &m);
        printf("{\"rc\": %d, \"uuid\": \"%s\", \"total\": %llu, \"used\": %llu, \"free\": %llu, "
               "\"reserved\": %llu}\n",
               (int)r, uuid, m.total, m.used, m.free, m.reserved);
    } else {
        nvmlMemory_t m;
        nvmlReturn_t (*f)(void *, nvmlMemory_t *);
        *(void **)&f = dlsym(h, "nvmlDeviceGetMemoryInfo");
        nvmlReturn_t r = f(d, &m);
        printf("{\"rc\": %d, \"uuid\": \"%s\", \"total\": %llu, \"used\": %llu, \"free\": %llu}\n",
               (int)r, uuid, m.total, m.used, m.free);
    }
}

/* NVML's running compute processes of device IDX through the entry point of version VER
 * (3, 2 or 1), as nvidia-smi lists them -> {"rc", "procs": [[pid, used], ...]} */
static void do_procs(int idx, int ver)
{
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    nvmlReturn_t (*init)(void), (*get)(unsigned, void **), (*f)(void *, unsigned *, void *);
    *(void **)&init = dlsym(h, "nvmlInit_v2");
    *(void **)&get = dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    *(void **)&f = dlsym(h, ver == 3   ? "nvmlDeviceGetComputeRunningProcesses_v3"
                            : ver == 2 ? "nvmlDeviceGetComputeRunningProcesses_v2"
                                       : "nvmlDeviceGetComputeRunningProcesses");
    init();
    void *d = NULL;
    get((unsigned)idx, &d);
    unsigned n = 0;
    nvmlReturn_t r = f(d, &n, NULL); /* how many */
    unsigned cap = n + 4;
    nvmlProcessInfo_v2_t v2[64];
    nvmlProcessInfo_v1_t v1[64];
    if (cap > 64) cap = 64;
    n = cap;
    if (r == NVML_SUCCESS || r == NVML_ERROR_INSUFFICIENT_SIZE) r = f(d, &n, ver == 1 ? (void *)v1 : (void *)v2);
    printf("{\"rc\": %d, \"procs\": [", (int)r);
    for (unsigned i = 0; r == NVML_SUCCESS && i < n; i++)
        printf("%s[%u, %llu]", i ? ", " : "", ver == 1 ? v1[i].pid : v2[i].pid,
               ver == 1 ? v1[i].usedGpuMemory : v2[i].usedGpuMemory);
    printf("]}\n");
    dlclose(h);
}

/* The graph-memory pattern of issue 19: the allocation outlives the exec and the graph. */
static void graphmem(uint64_t bytes, int autofree, int launches)
{
    CUgraph g = NULL;
    CUgraphNode n = NULL;
    CUgraphExec e = NULL;
    CUDA_MEM_ALLOC_NODE_PARAMS p;
    memset(&p, 0, sizeof p);
    p.poolProps = pool_props();
    p.bytesize = bytes;
    CUresult r = A.cuGraphCreate(&g, 0);
    if (!r) r = A.cuGraphAddMemAllocNode(&n, g, NULL, 0, &p);
    if (!r) r = A.cuGraphInstantiate(&e, g, autofree ? CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH : 0);
    for (int i = 0; i < launches && !r; i++) r = A.cuGraphLaunch(e, stream);
    if (!r) r = A.cuStreamSynchronize(stream);
    if (e) A.cuGraphExecDestroy(e);
    if (g) A.cuGraphDestroy(g);
    reply_rc(r, r ? -1 : add(O_PTR, p.dptr, bytes, 0));
}

static void graphfree(int id)
{
    CUgraph g = NULL;
    CUgraphNode n = NULL;
    CUgraphExec e = NULL;
    CUresult r = A.cuGraphCreate(&g, 0);
    if (!r) r = A.cuGraphAddMemFreeNode(&n, g, NULL, 0, objs[id].v);
    if (!r) r = A.cuGraphInstantiate(&e, g, 0);
    if (!r) r = A.cuGraphLaunch(e, stream);
    if (!r) r = A.cuStreamSynchronize(stream);
    if (e) A.cuGraphExecDestroy(e);
    if (g) A.cuGraphDestroy(g);
    if (!r) objs[id].used = 0;
    reply_rc(r, id);
}

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);
typedef void *(*dlsym_fn)(void *, const char *);

/* A second instance of the driver: a copy of its file, dlopen'ed (its own state). */
static void *driver_copy(void)
{
    Dl_info info;
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    void *f = h ? dlsym(h, "cuInit") : NULL;
    if (!f || !dladdr(f, &info)) return NULL;
    char path[] = "/tmp/cuctl-libcuda-XXXXXX";
    int out = mkstemp(path);
    FILE *in = fopen(info.dli_fname, "rb");
    char buf[65536];
    size_t n;
    while (in && out >= 0 && (n = fread(buf, 1, sizeof buf, in)) > 0)
        if (write(out, buf, n) != (ssize_t)n) break;
    if (in) fclose(in);
    if (out >= 0) close(out);
    void *copy = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    unlink(path);
    if (!copy) return NULL;
    CUresult (*init)(unsigned) = (CUresult(*)(unsigned))dlsym(copy, "cuInit");
    CUresult (*retain)(CUcontext *, CUdevice) =
        (CUresult(*)(CUcontext *, CUdevice))dlsym(copy, "cuDevicePrimaryCtxRetain");
    CUresult (*set)(CUcontext) = (CUresult(*)(CUcontext))dlsym(copy, "cuCtxSetCurrent");
    CUcontext c;
    if (init) init(0);
    if (retain && set && !retain(&c, dev)) set(c);
    return copy;
}

static void route(const char *how, uint64_t bytes)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    alloc_fn f = NULL;
    const char *err = "";
    if (!strcmp(how, "dlsym")) {
        f = (alloc_fn)dlsym(h, "cuMemAlloc_v2");
    } else if (!strcmp(how, "dlsym_default")) {
        f = (alloc_fn)dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    } else if (!strcmp(how, "dlsym_next")) {
        f = (alloc_fn)dlsym(RTLD_NEXT, "cuMemAlloc_v2");
    } else if (!strcmp(how, "dlvsym_dlsym") || !strcmp(how, "dlvsym_dlsym_old")) {
        /* glibc's own dlsym, by version: the route of issue 19 */
        dlsym_fn ds = (dlsym_fn)dlvsym(RTLD_DEFAULT, "dlsym",
                                       how[12] ? "GLIBC_2.2.5" : "GLIBC_2.34");
        f = ds ? (alloc_fn)ds(h, "cuMemAlloc_v2") : NULL;
    } else if (!strcmp(how, "dlvsym_next_dlsym")) {
        dlsym_fn ds = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
        f = ds ? (alloc_fn)ds(h, "cuMemAlloc_v2") : NULL;
    } else if (!strcmp(how, "dlsym_dlsym")) {
        void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
        dlsym_fn ds = (dlsym_fn)dlsym(libc, "dlsym");
        f = ds ? (alloc_fn)ds(h, "cuMemAlloc_v2") : NULL;
    } else if (!strcmp(how, "dlvsym")) {
        f = (alloc_fn)dlvsym(h, "cuMemAlloc_v2", "libcuda.so.1");
    } else if (!strcmp(how, "path")) {
        Dl_info info;
        void *any = dlsym(h, "cuInit");
        void *hp = any && dladdr(any, &info) ? dlopen(info.dli_fname, RTLD_NOW) : NULL;
        f = hp ? (alloc_fn)dlsym(hp, "cuMemAlloc_v2") : NULL;
    } else if (!strcmp(how, "copy")) {
        void *copy = driver_copy();
        f = copy ? (alloc_fn)dlsym(copy, "cuMemAlloc_v2") : NULL;
    } else if (!strcmp(how, "legacy")) {
        f = (alloc_fn)dlsym(h, "cuMemAlloc"); /* the 32-bit v1 entry point */
    } else if (!strcmp(how, "procaddr_legacy")) {
        CUresult (*gpa)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
        *(void **)&gpa = dlsym(h, "cuGetProcAddress_v2");
        if (gpa) gpa("cuMemAlloc", (void **)&f, 3000, 0, NULL);
    } else if (!strcmp(how, "dlmopen")) {
        void *hn = dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW);
        if (!hn) err = dlerror();
        f = hn ? (alloc_fn)dlsym(hn, "cuMemAlloc_v2") : NULL;
    }
    Dl_info info;
    int ours = f && dladdr((void *)f, &info) && info.dli_fname && strstr(info.dli_fname, "libvgpu");
    CUdeviceptr p = 0;
    CUresult r = f ? f(&p, bytes) : CUDA_ERROR_NOT_FOUND;
    int id = r ? -1 : add(O_PTR, p, bytes, 0);
    printf("{\"ok\": %s, \"rc\": %d, \"id\": %d, \"found\": %s, \"ours\": %s, \"err\": \"%.80s\"}\n",
           r ? "false" : "true", (int)r, id, f ? "true" : "false", ours ? "true" : "false",
           err ? err : "");
}

static void burn(double seconds, const char *kernel, const char *path)
{
    CUmodule mod;
    CUfunction f;
    A.cuModuleLoadData(&mod, "fake");
    A.cuModuleGetFunction(&f, mod, kernel);
    CUgraphExec exec = NULL;
    CUgraph g = NULL;
    if (!strcmp(path, "graph")) {
        CUgraphNode n;
        A.cuGraphCreate(&g, 0);
        CUDA_KERNEL_NODE_PARAMS kp;
        memset(&kp, 0, sizeof kp);
        kp.func = f;
        kp.gridDimX = kp.gridDimY = kp.gridDimZ = kp.blockDimX = kp.blockDimY = kp.blockDimZ = 1;
        A.cuGraphAddKernelNode(&n, g, NULL, 0, &kp);
        A.cuGraphInstantiate(&exec, g, 0);
    }
    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = cfg.blockDimX = cfg.blockDimY = cfg.blockDimZ = 1;
    cfg.hStream = stream;
    long n = 0;
    int64_t t0 = now_ns(), end = t0 + (int64_t)(seconds * 1e9);
    CUresult r = CUDA_SUCCESS;
    while (now_ns() < end && r == CUDA_SUCCESS) {
        if (!strcmp(path, "kernel")) r = A.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
        else if (!strcmp(path, "ptsz")) r = A.cuLaunchKernel_ptsz(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        else if (!strcmp(path, "ex")) r = A.cuLaunchKernelEx(&cfg, f, NULL, NULL);
        else if (!strcmp(path, "coop")) r = A.cuLaunchCooperativeKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, NULL);
        else if (!strcmp(path, "graph")) r = A.cuGraphLaunch(exec, stream);
        if (++n % 8 == 0) A.cuCtxSynchronize(); /* like a real program: bounded queue */
    }
    A.cuCtxSynchronize();
    if (exec) A.cuGraphExecDestroy(exec);
    if (g) A.cuGraphDestroy(g);
    A.cuModuleUnload(mod);
    printf("{\"rc\": %d, \"launches\": %ld, \"t0\": %lld, \"t1\": %lld}\n", (int)r, n, (long long)t0,
           (long long)now_ns());
}

/* Launches on one stream, never more than `depth` in flight (a program that keeps the GPU fed
 * across its own CPU hiccups): waits on an event recorded `depth` launches earlier. Events are
 * not hooked, so they are called directly whatever TV_TEST_MODE is. */
static void burnq(double seconds, const char *kernel, int depth)
{
    enum { MAXQ = 256 };
    if (depth < 1) depth = 1;
    if (depth > MAXQ) depth = MAXQ;
    CUmodule mod;
    CUfunction f;
    CUevent ev[MAXQ];
    A.cuModuleLoadData(&mod, "fake");
    A.cuModuleGetFunction(&f, mod, kernel);
    for (int i = 0; i < depth; i++) cuEventCreate(&ev[i], CU_EVENT_DEFAULT);
    long n = 0;
    int64_t t0 = now_ns(), end = t0 + (int64_t)(seconds * 1e9);
    CUresult r = CUDA_SUCCESS;
    while (now_ns() < end && r == CUDA_SUCCESS) {
        CUevent e = ev[n % depth];
        if (n >= depth) cuEventSynchronize(e);
        r = A.cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
        cuEventRecord(e, stream);
        n++;
    }
    A.cuCtxSynchronize();
    for (int i = 0; i < depth; i++) cuEventDestroy(ev[i]);
    A.cuModuleUnload(mod);
    printf("{\"rc\": %d, \"launches\": %ld, \"t0\": %lld, \"t1\": %lld}\n", (int)r, n, (long long)t0,
           (long long)now_ns());
}

/* "exitwait": work done at exit after libvgpu's own exit handler (as a runtime's teardown):
 * says so on stdout, then waits for a line on stdin before the process exits. */
static void exit_wait(void)
{
    char line[64];
    printf("{\"exiting\": true}\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return;
}

/* The command loop: the main thread's, or after "mainexit" another thread's (arg: non-NULL,
 * the context is made current in it first). */
static void *serve(void *arg)
{
    if (arg && primary) A.cuCtxSetCurrent(primary);
    char line[512], cmd[64], a1[256], a2[256], a3[256];
    while (fgets(line, sizeof line, stdin)) {
        a1[0] = a2[0] = a3[0] = 0;
        if (sscanf(line, "%63s %255s %255s %255s", cmd, a1, a2, a3) < 1) continue;
        if (!strcmp(cmd, "init")) {
            CUresult r = A.cuInit(0);
            if (!r) r = A.cuDeviceGet(&dev, a1[0] ? atoi(a1) : 0);
            if (!r) r = A.cuDevicePrimaryCtxRetain(&primary, dev);
            if (!r) r = A.cuCtxSetCurrent(primary);
            if (!r) r = A.cuStreamCreate(&stream, 0);
            reply_rc(r, 0);
        } else if (!strcmp(cmd, "alloc")) {
            do_alloc(a1, strtoull(a2, NULL, 10));
        } else if (!strcmp(cmd, "free")) {
            do_free(atoi(a1));
        } else if (!strcmp(cmd, "info")) {
            size_t f = 0, t = 0;
            CUresult r = A.cuMemGetInfo(&f, &t);
            printf("{\"rc\": %d, \"free\": %zu, \"total\": %zu}\n", (int)r, f, t);
        } else if (!strcmp(cmd, "total")) {
            size_t t = 0;
            CUresult r = A.cuDeviceTotalMem(&t, a1[0] ? atoi(a1) : dev);
            printf("{\"rc\": %d, \"total\": %zu}\n", (int)r, t);
        } else if (!strcmp(cmd, "procs")) {
            do_procs(a1[0] ? atoi(a1) : 0, a2[0] ? atoi(a2) : 3);
        } else if (!strcmp(cmd, "nvml") || !strcmp(cmd, "nvml2")) {
            do_nvml(a1[0] ? atoi(a1) : 0, !strcmp(cmd, "nvml2"));
        } else if (!strcmp(cmd, "pool_create")) { /* [export | max BYTES] */
            CUmemPoolProps p = pool_props();
            if (!strcmp(a1, "export")) p.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            if (!strcmp(a1, "max")) p.maxSize = strtoull(a2, NULL, 10);
            reply_rc(A.cuMemPoolCreate(&pool, &p), 0);
        } else if (!strcmp(cmd, "pool_threshold")) {
            cuuint64_t v = strtoull(a1, NULL, 10);
            reply_rc(A.cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &v), 0);
        } else if (!strcmp(cmd, "pool_trim")) {
            reply_rc(A.cuMemPoolTrimTo(pool, strtoull(a1, NULL, 10)), 0);
        } else if (!strcmp(cmd, "pool_destroy")) {
            reply_rc(A.cuMemPoolDestroy(pool), 0);
        } else if (!strcmp(cmd, "export")) {
            int fd = -1;
            CUresult r = A.cuMemExportToShareableHandle(&fd, objs[atoi(a1)].v,
                                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
            printf("{\"rc\": %d, \"fd\": %d}\n", (int)r, fd);
        } else if (!strcmp(cmd, "import")) {
            CUmemGenericAllocationHandle h = 0;
            CUresult r = A.cuMemImportFromShareableHandle(&h, (void *)(intptr_t)atoi(a1),
                                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
            reply_rc(r, r ? -1 : add(O_HANDLE, h, 0, 0));
        } else if (!strcmp(cmd, "map")) {
            uint64_t size = strtoull(a2, NULL, 10);
            CUdeviceptr va = 0;
            CUresult r = A.cuMemAddressReserve(&va, size, 0, 0, 0);
            if (!r) r = A.cuMemMap(va, size, 0, objs[atoi(a1)].v, 0);
            if (r && va) A.cuMemAddressFree(va, size);
            reply_rc(r, r ? -1 : add(O_MAP, va, size, 0));
        } else if (!strcmp(cmd, "mapmany")) { /* N mappings of handle ID in one range */
            int n = atoi(a2);
            uint64_t size = strtoull(a3, NULL, 10);
            CUdeviceptr va = 0;
            CUresult r = A.cuMemAddressReserve(&va, size * (uint64_t)n, 0, 0, 0);
            for (int i = 0; i < n && !r; i++) r = A.cuMemMap(va + i * size, size, 0, objs[atoi(a1)].v, 0);
            reply_rc(r, r ? -1 : add(O_MAP, va, size * (uint64_t)n, 0));
        } else if (!strcmp(cmd, "write")) {
            struct obj *o = &objs[atoi(a1)];
            unsigned char *buf = malloc(o->size);
            memset(buf, atoi(a2), o->size);
            CUresult r = A.cuMemcpyHtoD(o->v, buf, o->size);
            free(buf);
            reply_rc(r, atoi(a1));
        } else if (!strcmp(cmd, "stats")) {
            struct fake_stats s;
            void (*f)(struct fake_stats *);
            *(void **)&f = dlsym(RTLD_DEFAULT, "fake_stats");
            f(&s);
            printf("{\"launches\": %ld, \"coop\": %ld, \"ex\": %ld, \"graph\": %ld, \"frees_dirty\": "
                   "%ld, \"frees_clean\": %ld, \"allocs\": %ld, \"frees\": %ld, "
                   "\"stream_getctx\": %ld, \"ctx_getdevice\": %ld}\n",
                   s.launches, s.coop_launches, s.ex_launches, s.graph_launches, s.frees_dirty,
                   s.frees_clean, s.allocs, s.frees, s.stream_getctx, s.ctx_getdevice);
        } else if (!strcmp(cmd, "sync")) {
            reply_rc(A.cuCtxSynchronize(), 0);
        } else if (!strcmp(cmd, "sleep")) {
            usleep((useconds_t)atoi(a1) * 1000);
            reply_rc(CUDA_SUCCESS, 0);
        } else if (!strcmp(cmd, "lockhold")) {
            /* Take the region's lock directly and never give it back (the SIGKILL test). */
            FILE *f = fopen(a1, "r+");
            struct tsr_region *r = NULL;
            if (f) {
                void *m = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE, MAP_SHARED, fileno(f), 0);
                r = m == MAP_FAILED ? NULL : m;
            }
            if (!r) {
                printf("{\"ok\": false}\n");
                continue;
            }
            pthread_mutex_lock(&r->lock.mutex);
            printf("{\"ok\": true, \"locked\": true}\n");
            for (;;) pause();
        } else if (!strcmp(cmd, "burnq")) {
            burnq(atof(a1), a2, a3[0] ? atoi(a3) : 16);
        } else if (!strcmp(cmd, "phys")) {
            uint64_t (*f)(int);
            *(void **)&f = dlsym(RTLD_DEFAULT, "fake_physical_used");
            printf("{\"phys\": %llu}\n", f ? (unsigned long long)f((int)dev) : 0ull);
        } else if (!strcmp(cmd, "graphmem")) {
            graphmem(strtoull(a1, NULL, 10), !strcmp(a2, "autofree"), a3[0] ? atoi(a3) : 1);
        } else if (!strcmp(cmd, "graphfree")) {
            graphfree(atoi(a1));
        } else if (!strcmp(cmd, "route")) {
            route(a1, strtoull(a2, NULL, 10));
        } else if (!strcmp(cmd, "burn")) {
            burn(atof(a1), a2, a3[0] ? a3 : "kernel");
        } else if (!strcmp(cmd, "check")) {
            struct obj *o = &objs[atoi(a1)];
            unsigned char *buf = malloc(o->size);
            CUresult r = A.cuMemcpyDtoH(buf, o->v, o->size);
            for (uint64_t i = 0; !r && i < o->size; i++)
                if (buf[i] != (unsigned char)atoi(a2)) r = CUDA_ERROR_INVALID_VALUE;
            free(buf);
            reply_rc(r, atoi(a1));
        } else if (!strcmp(cmd, "prefetchbatch")) {
            CUdeviceptr p = objs[atoi(a1)].v;
            size_t n = objs[atoi(a1)].size, at = 0;
            CUmemLocation loc = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev};
            reply_rc(A.cuMemPrefetchBatchAsync(&p, &n, 1, &loc, &at, 1, 0, stream), atoi(a1));
        } else if (!strcmp(cmd, "freeasync")) {
            struct obj *o = &objs[atoi(a1)];
            CUresult r = A.cuMemFreeAsync(o->v, stream);
            if (!r) r = A.cuStreamSynchronize(stream);
            if (!r) o->used = 0;
            reply_rc(r, atoi(a1));
        } else if (!strcmp(cmd, "where")) {
            int64_t (*f)(CUdeviceptr);
            *(void **)&f = dlsym(RTLD_DEFAULT, "fake_managed_on_device");
            printf("{\"on_dev\": %lld}\n", f ? (long long)f(objs[atoi(a1)].v) : -2ll);
        } else if (!strcmp(cmd, "prefetch") || !strcmp(cmd, "advise")) {
            struct obj *o = &objs[atoi(a1)];
            const char *where = !strcmp(cmd, "prefetch") ? a2 : a3;
            CUmemLocation loc = {.type = !strcmp(where, "cpu") ? CU_MEM_LOCATION_TYPE_HOST
                                                               : CU_MEM_LOCATION_TYPE_DEVICE,
                                 .id = dev};
            CUresult r = !strcmp(cmd, "prefetch")
                ? A.cuMemPrefetchAsync(o->v, o->size, loc, 0, stream)
                : A.cuMemAdvise(o->v, o->size, !strcmp(a2, "prefer")
                                ? CU_MEM_ADVISE_SET_PREFERRED_LOCATION
                                : CU_MEM_ADVISE_SET_ACCESSED_BY, loc);
            reply_rc(r, atoi(a1));
        } else if (!strcmp(cmd, "forkinfo")) {
            /* A child asks the driver how much memory there is (a worker process of a data
             * loader, say) and exits: libvgpu registers it in the region at that first call. */
            pid_t child = fork();
            if (child == 0) {
                size_t f = 0, t = 0;
                A.cuMemGetInfo(&f, &t);
                _exit(0);
            }
            int status = 0;
            int ok = child > 0 && waitpid(child, &status, 0) == child && WIFEXITED(status);
            reply_rc(ok ? CUDA_SUCCESS : CUDA_ERROR_OPERATING_SYSTEM, 0);
        } else if (!strcmp(cmd, "exitwait")) { /* before "init": runs after libvgpu's */
            reply_rc(atexit(exit_wait) ? CUDA_ERROR_OPERATING_SYSTEM : CUDA_SUCCESS, 0);
        } else if (!strcmp(cmd, "mainexit")) {
            /* The main thread ends (pthread_exit), another goes on serving: the process lives
             * on, its thread group leader a zombie in /proc (state Z) until it exits. */
            pthread_t t;
            int r = pthread_create(&t, NULL, serve, &primary);
            reply_rc(r ? CUDA_ERROR_OPERATING_SYSTEM : CUDA_SUCCESS, 0);
            if (!r) pthread_exit(NULL);
        } else if (!strcmp(cmd, "exit")) {
            break;
        } else {
            printf("{\"error\": \"unknown command %s\"}\n", cmd);
        }
    }
    exit(0);
}

int main(void)
{
    if (api_load(&A) != 0) return 3;
    setvbuf(stdout, NULL, _IOLBF, 0);
    serve(NULL);
}
