/*
 * memory.c — linear allocations: cuMemAlloc, cuMemAllocManaged, cuMemAllocPitch, and cuMemFree
 * (of these and of stream-ordered allocations). Reserve first, roll back if the driver fails;
 * the other allocation paths are listed in account.h. cuMemAlloc and cuMemAllocPitch retry the
 * driver's OOM for memory the container is owed (lease.h) and spill when it may (spill.c).
 */
#define _GNU_SOURCE
#include "account.h"

CUresult CUDAAPI tv_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    TV_CUDA_ENTER();
    int ds = tv_ctx_dev_slot();
    if (charged_alloc(ds, bytesize) != CUDA_SUCCESS) /* past the limit: spill, if it may */
        return tv_spill_alloc(dptr, bytesize, ds, OOM, 1);
    CUresult r = REAL(cuMemAlloc_v2)(dptr, bytesize);
    TV_RETRY_OWED_OOM(r, ds, bytesize, REAL(cuMemAlloc_v2)(dptr, bytesize));
    if (r != CUDA_SUCCESS) {
        tv_mem_unreserve(ds, bytesize);
        return tv_spill_alloc(dptr, bytesize, ds, r, 0); /* the card itself is full */
    }
    if (ds >= 0) track(&ptrs, *dptr, bytesize, ds, K_PLAIN, 0);
    return r;
}

CUresult CUDAAPI tv_cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags)
{
    TV_CUDA_ENTER();
    int ds = tv_ctx_dev_slot();
    if (charged_alloc(ds, bytesize) != CUDA_SUCCESS) return OOM;
    CUresult r = REAL(cuMemAllocManaged)(dptr, bytesize, flags);
    if (r != CUDA_SUCCESS) tv_mem_unreserve(ds, bytesize);
    else if (ds >= 0) track(&ptrs, *dptr, bytesize, ds, K_MANAGED, 0);
    return r;
}

CUresult CUDAAPI tv_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                       size_t Height, unsigned int ElementSizeBytes)
{
    TV_CUDA_ENTER();
    int ds = tv_ctx_dev_slot();
    uint64_t est = ((uint64_t)WidthInBytes + 511) / 512 * 512 * (uint64_t)Height;
    if (Height && est / Height < WidthInBytes) return OOM; /* overflow */
    if (charged_alloc(ds, est) != CUDA_SUCCESS) /* past the limit: spill, if it may */
        return tv_spill_alloc_pitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes, ds, OOM,
                                    1);
    CUresult r = REAL(cuMemAllocPitch_v2)(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    TV_RETRY_OWED_OOM(r, ds, est, REAL(cuMemAllocPitch_v2)(dptr, pPitch, WidthInBytes, Height,
                                                           ElementSizeBytes));
    if (r != CUDA_SUCCESS) {
        tv_mem_unreserve(ds, est);
        return tv_spill_alloc_pitch(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes, ds, r,
                                    0); /* the card itself is full */
    }
    uint64_t actual = (uint64_t)*pPitch * Height;
    if (actual > est && tv_mem_reserve(ds, actual - est) != 0) {
        REAL(cuMemFree_v2)(*dptr);
        tv_mem_unreserve(ds, est);
        return OOM;
    }
    if (actual < est) tv_mem_unreserve(ds, est - actual);
    if (ds >= 0) track(&ptrs, *dptr, actual, ds, K_PITCH, 0);
    return r;
}

CUresult CUDAAPI tv_cuMemFree_v2(CUdeviceptr dptr)
{
    TV_CUDA_ENTER();
    struct ent e;
    int found = dptr && untrack(&ptrs, dptr, &e);
    if (found && scrub()) {
        REAL(cuMemsetD8_v2)(dptr, 0, e.size);
        REAL(cuCtxSynchronize)();
    }
    CUresult r = REAL(cuMemFree_v2)(dptr); /* untracked pointers go to the driver as they are */
    if (found) {
        if (r == CUDA_SUCCESS) {
            if (!tv_spill_release(&e)) release_ptr(&e);
        } else {
            track(&ptrs, e.key, e.size, e.dslot, e.kind, e.aux);
        }
    } else if (r == CUDA_SUCCESS && atomic_load_explicit(&tv_graphmem_nodes, memory_order_relaxed)) {
        tv_graphmem_freed(dptr); /* a graph allocation: no graph holds it any more? */
    }
    return r;
}
