/*
 * common.h — how the test programs reach the driver. TV_TEST_MODE selects the route a real
 * program would take, so every test runs against each interception path:
 *   direct    the program is linked with -lcuda (libvgpu's exported symbols interpose)
 *   dlsym     dlopen("libcuda.so.1") + dlsym (libcudart, ctypes, pynvml)
 *   procaddr  cuGetProcAddress_v2 for everything (cudart 12+, cuda-bindings)
 */
#ifndef TV_TEST_COMMON_H
#define TV_TEST_COMMON_H

#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Declared by cuda.h only for per-thread-stream builds. */
CUresult CUDAAPI cuLaunchKernel_ptsz(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                                     unsigned, unsigned, CUstream, void **, void **);

#define API_LIST(X)                                                                            \
    X(cuInit, cuInit, (unsigned))                                                              \
    X(cuDeviceGet, cuDeviceGet, (CUdevice *, int))                                             \
    X(cuDeviceGetCount, cuDeviceGetCount, (int *))                                             \
    X(cuDeviceTotalMem, cuDeviceTotalMem_v2, (size_t *, CUdevice))                             \
    X(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, (CUcontext *, CUdevice))             \
    X(cuCtxSetCurrent, cuCtxSetCurrent, (CUcontext))                                           \
    X(cuCtxGetCurrent, cuCtxGetCurrent, (CUcontext *))                                         \
    X(cuCtxCreate, cuCtxCreate_v4, (CUcontext *, CUctxCreateParams *, unsigned, CUdevice))     \
    X(cuCtxDestroy, cuCtxDestroy_v2, (CUcontext))                                              \
    X(cuCtxSynchronize, cuCtxSynchronize, (void))                                              \
    X(cuMemGetInfo, cuMemGetInfo_v2, (size_t *, size_t *))                                     \
    X(cuMemAlloc, cuMemAlloc_v2, (CUdeviceptr *, size_t))                                      \
    X(cuMemAllocPitch, cuMemAllocPitch_v2, (CUdeviceptr *, size_t *, size_t, size_t, unsigned))\
    X(cuMemAllocManaged, cuMemAllocManaged, (CUdeviceptr *, size_t, unsigned))                 \
    X(cuMemFree, cuMemFree_v2, (CUdeviceptr))                                                  \
    X(cuMemAllocAsync, cuMemAllocAsync, (CUdeviceptr *, size_t, CUstream))                     \
    X(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync,                                        \
      (CUdeviceptr *, size_t, CUmemoryPool, CUstream))                                         \
    X(cuMemFreeAsync, cuMemFreeAsync, (CUdeviceptr, CUstream))                                 \
    X(cuMemPoolCreate, cuMemPoolCreate, (CUmemoryPool *, const CUmemPoolProps *))              \
    X(cuMemPoolDestroy, cuMemPoolDestroy, (CUmemoryPool))                                      \
    X(cuMemPoolTrimTo, cuMemPoolTrimTo, (CUmemoryPool, size_t))                                \
    X(cuMemPoolSetAttribute, cuMemPoolSetAttribute, (CUmemoryPool, CUmemPool_attribute, void *))\
    X(cuMemCreate, cuMemCreate,                                                                \
      (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long))\
    X(cuMemRelease, cuMemRelease, (CUmemGenericAllocationHandle))                              \
    X(cuMemAddressReserve, cuMemAddressReserve,                                                \
      (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))                        \
    X(cuMemAddressFree, cuMemAddressFree, (CUdeviceptr, size_t))                               \
    X(cuMemMap, cuMemMap,                                                                      \
      (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))         \
    X(cuMemUnmap, cuMemUnmap, (CUdeviceptr, size_t))                                           \
    X(cuMemExportToShareableHandle, cuMemExportToShareableHandle,                              \
      (void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long))   \
    X(cuMemImportFromShareableHandle, cuMemImportFromShareableHandle,                          \
      (CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType))                     \
    X(cuArrayCreate, cuArrayCreate_v2, (CUarray *, const CUDA_ARRAY_DESCRIPTOR *))             \
    X(cuArray3DCreate, cuArray3DCreate_v2, (CUarray *, const CUDA_ARRAY3D_DESCRIPTOR *))       \
    X(cuArrayDestroy, cuArrayDestroy, (CUarray))                                               \
    X(cuMipmappedArrayCreate, cuMipmappedArrayCreate,                                          \
      (CUmipmappedArray *, const CUDA_ARRAY3D_DESCRIPTOR *, unsigned))                         \
    X(cuMipmappedArrayDestroy, cuMipmappedArrayDestroy, (CUmipmappedArray))                    \
    X(cuGraphCreate, cuGraphCreate, (CUgraph *, unsigned))                                     \
    X(cuGraphAddMemAllocNode, cuGraphAddMemAllocNode,                                          \
      (CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *))     \
    X(cuGraphAddNode, cuGraphAddNode_v2,                                                       \
      (CUgraphNode *, CUgraph, const CUgraphNode *, const CUgraphEdgeData *, size_t,           \
       CUgraphNodeParams *))                                                                   \
    X(cuGraphAddKernelNode, cuGraphAddKernelNode_v2,                                           \
      (CUgraphNode *, CUgraph, const CUgraphNode *, size_t, const CUDA_KERNEL_NODE_PARAMS *))  \
    X(cuGraphAddMemFreeNode, cuGraphAddMemFreeNode,                                            \
      (CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUdeviceptr))                      \
    X(cuGraphInstantiate, cuGraphInstantiateWithFlags, (CUgraphExec *, CUgraph, unsigned long long))\
    X(cuGraphLaunch, cuGraphLaunch, (CUgraphExec, CUstream))                                   \
    X(cuGraphExecDestroy, cuGraphExecDestroy, (CUgraphExec))                                   \
    X(cuGraphDestroy, cuGraphDestroy, (CUgraph))                                               \
    X(cuModuleLoadData, cuModuleLoadData, (CUmodule *, const void *))                          \
    X(cuModuleGetFunction, cuModuleGetFunction, (CUfunction *, CUmodule, const char *))        \
    X(cuModuleUnload, cuModuleUnload, (CUmodule))                                              \
    X(cuLaunchKernel, cuLaunchKernel,                                                          \
      (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,       \
       CUstream, void **, void **))                                                            \
    X(cuLaunchKernel_ptsz, cuLaunchKernel_ptsz,                                                \
      (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,       \
       CUstream, void **, void **))                                                            \
    X(cuLaunchKernelEx, cuLaunchKernelEx, (const CUlaunchConfig *, CUfunction, void **, void **))\
    X(cuLaunchCooperativeKernel, cuLaunchCooperativeKernel,                                    \
      (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,       \
       CUstream, void **))                                                                     \
    X(cuStreamCreate, cuStreamCreate, (CUstream *, unsigned))                                  \
    X(cuStreamSynchronize, cuStreamSynchronize, (CUstream))                                    \
    X(cuMemsetD8, cuMemsetD8_v2, (CUdeviceptr, unsigned char, size_t))                         \
    X(cuMemcpyHtoD, cuMemcpyHtoD_v2, (CUdeviceptr, const void *, size_t))                     \
    X(cuMemcpyDtoH, cuMemcpyDtoH_v2, (void *, CUdeviceptr, size_t))                           \
    X(cuMemAdvise, cuMemAdvise_v2, (CUdeviceptr, size_t, CUmem_advise, CUmemLocation))         \
    X(cuMemPrefetchAsync, cuMemPrefetchAsync_v2,                                               \
      (CUdeviceptr, size_t, CUmemLocation, unsigned, CUstream))                                \
    X(cuMemPrefetchBatchAsync, cuMemPrefetchBatchAsync,                                        \
      (CUdeviceptr *, size_t *, size_t, CUmemLocation *, size_t *, size_t, unsigned long long, \
       CUstream))

/* Weak references: a driver that lacks one of them still loads the program (the tests run
 * drivers lacking optional entry points); a missing one is NULL, then api_missing. */
#define X(field, sym, params) extern __typeof__(sym) sym __attribute__((weak));
API_LIST(X)
#undef X

struct api {
#define X(field, sym, params) CUresult(CUDAAPI *field) params;
    API_LIST(X)
#undef X
};

/* Base names for cuGetProcAddress (what cudart asks for) and per-thread flags. */
static inline const char *proc_base(const char *sym, cuuint64_t *flags)
{
    static char buf[128];
    *flags = CU_GET_PROC_ADDRESS_DEFAULT;
    snprintf(buf, sizeof buf, "%s", sym);
    char *p = strstr(buf, "_ptsz");
    if (p) {
        *p = 0;
        *flags = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    }
    static const char *sfx[] = {"_v2", "_v3", "_v4"};
    for (int i = 0; i < 3; i++) {
        size_t n = strlen(buf), m = strlen(sfx[i]);
        if (n > m && !strcmp(buf + n - m, sfx[i])) buf[n - m] = 0;
    }
    if (!strcmp(buf, "cuGraphInstantiateWithFlags")) return "cuGraphInstantiateWithFlags";
    return buf;
}

/* What an entry point the driver lacks is replaced with, so that the program can go on (a
 * real program checks the pointer; the tests run drivers that lack optional entry points). */
static CUresult CUDAAPI api_missing(void)
{
    return CUDA_ERROR_NOT_FOUND;
}

static inline void api_fill_missing(struct api *a)
{
    void **p = (void **)a;
    for (size_t i = 0; i < sizeof *a / sizeof(void *); i++)
        if (!p[i]) p[i] = (void *)api_missing;
}

static inline int api_load_mode(struct api *a);
static inline int api_load(struct api *a)
{
    int r = api_load_mode(a);
    api_fill_missing(a);
    return r;
}

static inline int api_load_mode(struct api *a)
{
    const char *mode = getenv("TV_TEST_MODE");
    if (!mode || !strcmp(mode, "direct")) {
#define X(field, sym, params) a->field = sym;
        API_LIST(X)
#undef X
        return 0;
    }
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) {
        fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
        return -1;
    }
    if (!strcmp(mode, "dlsym")) {
#define X(field, sym, params) *(void **)&a->field = dlsym(h, #sym);
        API_LIST(X)
#undef X
        return 0;
    }
    CUresult (*gpa)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
    *(void **)&gpa = dlsym(h, "cuGetProcAddress_v2");
    if (!gpa) {
        fprintf(stderr, "no cuGetProcAddress_v2\n");
        return -1;
    }
    CUdriverProcAddressQueryResult st;
    cuuint64_t fl;
    const char *base;
#define X(field, sym, params)                                                                 \
    base = proc_base(#sym, &fl);                                                              \
    if (gpa(base, (void **)&a->field, 13000, fl, &st) != CUDA_SUCCESS) a->field = NULL;
    API_LIST(X)
#undef X
    return 0;
}

#endif
