/* mempool.c — stream-ordered allocations and pools: what a pool retains stays charged. The
 * driver's OOM for memory the container is owed is retried (lease.h); an allocation the device
 * cannot hold spills to host memory when the container may (spill.c) — from the device's
 * current pool, or from a pool the program made that it may not export nor bounded itself
 * (POOL_NO_SPILL below): a spilled pointer is managed memory, no pool's. */
#define _GNU_SOURCE
#include "account.h"

/* A pool record's kind: its pointers must be the pool's (it is exportable to other processes:
 * cuMemPoolExportPointer), or the program bounded the pool (maxSize: its OOM is the program's
 * own cap) — never spilled. */
#define POOL_NO_SPILL 1u

/* Caller holds mem_mu. */
static struct ent *pool_rec(CUmemoryPool pool, int ds)
{
    struct ent *p = map_find(&pools, (uint64_t)(uintptr_t)pool);
    if (!p) {
        struct ent e = {.key = (uint64_t)(uintptr_t)pool, .dslot = ds};
        map_put(&pools, &e);
        p = map_find(&pools, (uint64_t)(uintptr_t)pool);
    }
    return p;
}

static CUresult driver_alloc_async(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                                   CUstream s, int from_pool, int ptsz)
{
    if (from_pool)
        return ptsz ? REAL(cuMemAllocFromPoolAsync_ptsz)(dptr, bytes, pool, s)
                    : REAL(cuMemAllocFromPoolAsync)(dptr, bytes, pool, s);
    return ptsz ? REAL(cuMemAllocAsync_ptsz)(dptr, bytes, s) : REAL(cuMemAllocAsync)(dptr, bytes, s);
}

static CUresult alloc_async(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream s,
                            int from_pool, int ptsz)
{
    TV_CUDA_ENTER();
    int ds = -1;
    if (from_pool) {
        LOCK();
        struct ent *p = map_find(&pools, (uint64_t)(uintptr_t)pool);
        int known = p != NULL;
        if (p) ds = p->dslot;
        UNLOCK();
        if (!known) ds = tv_stream_dev_slot(s);
    } else {
        ds = tv_stream_dev_slot(s);
        int ord = ds >= 0 ? atomic_load(&tv.dev[ds].ordinal) : -1;
        pool = NULL;
        if (ord >= 0 && REAL(cuDeviceGetMemPool)(&pool, ord) != CUDA_SUCCESS) pool = NULL;
    }
    uint64_t reuse = 0;
    int may_spill = 1;
    if (pool && ds >= 0) {
        LOCK();
        struct ent *p = pool_rec(pool, ds);
        if (p) {
            reuse = p->aux2 < bytes ? p->aux2 : bytes;
            p->aux2 -= reuse;
            may_spill = !(p->kind & POOL_NO_SPILL);
        }
        UNLOCK();
    }
    uint64_t need = bytes - reuse;
    if (charged_alloc(ds, need) != CUDA_SUCCESS) {
        if (reuse) {
            LOCK();
            struct ent *p = pool_rec(pool, ds);
            if (p) p->aux2 += reuse;
            UNLOCK();
        }
        return may_spill ? tv_spill_alloc(dptr, bytes, ds, OOM, 1) : OOM; /* past the limit */
    }
    CUresult r = driver_alloc_async(dptr, bytes, pool, s, from_pool, ptsz);
    TV_RETRY_OWED_OOM(r, ds, bytes, driver_alloc_async(dptr, bytes, pool, s, from_pool, ptsz));
    LOCK();
    struct ent *p = pool && ds >= 0 ? pool_rec(pool, ds) : NULL;
    if (r != CUDA_SUCCESS) {
        if (p) p->aux2 += reuse;
    } else if (ds >= 0) {
        if (p) p->aux += bytes;
        struct ent e = {.key = *dptr, .size = bytes, .aux = (uint64_t)(uintptr_t)pool,
                        .dslot = ds, .kind = K_ASYNC};
        map_put(&ptrs, &e);
    }
    UNLOCK();
    if (r != CUDA_SUCCESS) {
        tv_mem_unreserve(ds, need);
        if (may_spill) return tv_spill_alloc(dptr, bytes, ds, r, 0); /* the card itself is full */
    }
    return r;
}

CUresult CUDAAPI tv_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return alloc_async(dptr, bytesize, NULL, hStream, 0, 0);
}
CUresult CUDAAPI tv_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
    return alloc_async(dptr, bytesize, NULL, hStream, 0, 1);
}
CUresult CUDAAPI tv_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize,
                                            CUmemoryPool pool, CUstream hStream)
{
    return alloc_async(dptr, bytesize, pool, hStream, 1, 0);
}
CUresult CUDAAPI tv_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize,
                                                 CUmemoryPool pool, CUstream hStream)
{
    return alloc_async(dptr, bytesize, pool, hStream, 1, 1);
}

static CUresult free_async(CUdeviceptr dptr, CUstream s, int ptsz)
{
    TV_CUDA_ENTER();
    struct ent e;
    int found = dptr && untrack(&ptrs, dptr, &e);
    if (found && e.kind == K_SPILLED) return tv_spill_free_async(&e, s, ptsz);
    if (found && scrub())
        REAL(cuMemsetD8Async)(dptr, 0, e.size, ptsz && !s ? CU_STREAM_PER_THREAD : s);
    CUresult r = ptsz ? REAL(cuMemFreeAsync_ptsz)(dptr, s) : REAL(cuMemFreeAsync)(dptr, s);
    if (found) {
        if (r == CUDA_SUCCESS) release_ptr(&e);
        else track(&ptrs, e.key, e.size, e.dslot, e.kind, e.aux);
    } else if (r == CUDA_SUCCESS && atomic_load_explicit(&tv_graphmem_nodes, memory_order_relaxed)) {
        tv_graphmem_freed(dptr);
    }
    return r;
}

CUresult CUDAAPI tv_cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    return free_async(dptr, hStream, 0);
}
CUresult CUDAAPI tv_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    return free_async(dptr, hStream, 1);
}

CUresult CUDAAPI tv_cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuMemPoolCreate)(pool, props);
    if (r == CUDA_SUCCESS && props) {
        int ds = props->location.type == CU_MEM_LOCATION_TYPE_DEVICE
                     ? tv_dev_slot(props->location.id)
                     : TV_SLOT_HOST; /* host pools take no device memory */
        LOCK();
        struct ent e = {.key = (uint64_t)(uintptr_t)*pool, .dslot = ds,
                        .kind = props->handleTypes != CU_MEM_HANDLE_TYPE_NONE || props->maxSize
                                    ? POOL_NO_SPILL
                                    : 0};
        map_put(&pools, &e);
        UNLOCK();
    }
    return r;
}

CUresult CUDAAPI tv_cuMemPoolDestroy(CUmemoryPool pool)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuMemPoolDestroy)(pool);
    if (r == CUDA_SUCCESS) {
        struct ent p;
        /* Outstanding allocations stay charged until freed (release_ptr finds no pool). */
        if (untrack(&pools, (uint64_t)(uintptr_t)pool, &p)) tv_mem_unreserve(p.dslot, p.aux2);
    }
    return r;
}

CUresult CUDAAPI tv_cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuMemPoolTrimTo)(pool, minBytesToKeep);
    if (r == CUDA_SUCCESS) tv_pool_refresh(pool);
    return r;
}
