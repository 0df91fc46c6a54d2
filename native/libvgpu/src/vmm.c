/* vmm.c — virtual memory management: created handles charged at creation, imported ones at
 * map; uncharged when the handle is released and every mapping of it unmapped. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "account.h"

CUresult CUDAAPI tv_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                const CUmemAllocationProp *prop, unsigned long long flags)
{
    TV_CUDA_ENTER();
    int ds = prop && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE
                 ? tv_dev_slot(prop->location.id)
                 : TV_SLOT_HOST;
    if (charged_alloc(ds, size) != CUDA_SUCCESS) return OOM;
    CUresult r = REAL(cuMemCreate)(handle, size, prop, flags);
    /* owed: retried (lease.h); no spill: a handle is physical memory of its place */
    TV_RETRY_OWED_OOM(r, ds, size, REAL(cuMemCreate)(handle, size, prop, flags));
    if (r != CUDA_SUCCESS) tv_mem_unreserve(ds, size);
    else track(&handles, *handle, ds >= 0 ? size : 0, ds, K_CREATED, 1);
    return r;
}

CUresult CUDAAPI tv_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                                   void *osHandle,
                                                   CUmemAllocationHandleType type)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuMemImportFromShareableHandle)(handle, osHandle, type);
    if (r == CUDA_SUCCESS) track(&handles, *handle, 0, -1, K_IMPORTED, 1); /* charged at map */
    return r;
}

/* Drop one reference (the handle itself or a mapping); uncharge at the last. */
static void handle_unref(uint64_t handle)
{
    int ds = -1;
    uint64_t size = 0;
    LOCK();
    struct ent *h = map_find(&handles, handle);
    if (h && --h->aux == 0) {
        ds = h->dslot;
        size = h->size;
        map_take(&handles, handle, NULL);
    }
    UNLOCK();
    tv_mem_unreserve(ds, size);
}

CUresult CUDAAPI tv_cuMemRelease(CUmemGenericAllocationHandle handle)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuMemRelease)(handle);
    if (r == CUDA_SUCCESS) handle_unref(handle);
    return r;
}

CUresult CUDAAPI tv_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                             CUmemGenericAllocationHandle handle, unsigned long long flags)
{
    TV_CUDA_ENTER();
    LOCK();
    struct ent *h = map_find(&handles, handle);
    int tracked = h != NULL, imported = h && h->kind == K_IMPORTED;
    uint64_t charged = h ? h->size : 0;
    int ds = h ? h->dslot : -1;
    UNLOCK();
    uint64_t extra = 0;
    if (imported && size > charged) {
        /* Memory exported by another process (maybe another container) is charged to whoever
         * maps it: it stays alive while mapped here, whatever its exporter does. */
        CUmemAllocationProp prop;
        memset(&prop, 0, sizeof prop);
        if (ds < 0 &&
            REAL(cuMemGetAllocationPropertiesFromHandle)(&prop, handle) == CUDA_SUCCESS &&
            prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE)
            ds = tv_dev_slot(prop.location.id);
        if (ds < 0) ds = tv_ctx_dev_slot();
        extra = size - charged;
        if (charged_alloc(ds, extra) != CUDA_SUCCESS) return OOM;
    }
    CUresult r = REAL(cuMemMap)(ptr, size, offset, handle, flags);
    if (r != CUDA_SUCCESS) {
        tv_mem_unreserve(ds, extra);
        return r;
    }
    if (tracked) {
        LOCK();
        h = map_find(&handles, handle);
        if (h) {
            h->aux++;
            h->size += extra;
            h->dslot = ds;
            struct ent m = {.key = ptr, .size = size, .aux = handle};
            map_put(&vmaps, &m);
        }
        UNLOCK();
    }
    return r;
}

CUresult CUDAAPI tv_cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    TV_CUDA_ENTER();
    /* Every mapping inside the range, however many: each one's handle loses a reference. */
    uint64_t small[64], *found = small;
    size_t n = 0, cap = 64;
    LOCK();
    for (size_t i = 0; i < vmaps.cap; i++) {
        struct ent *m = &vmaps.e[i];
        if (m->key == EMPTY || m->key == TOMB || m->key < ptr || m->key - ptr >= size) continue;
        if (n == cap) {
            uint64_t *bigger = malloc(2 * cap * sizeof *bigger);
            if (!bigger) break; /* the rest stay charged: never less than the driver holds */
            memcpy(bigger, found, n * sizeof *found);
            if (found != small) free(found);
            found = bigger;
            cap *= 2;
        }
        found[n++] = m->key;
    }
    UNLOCK();
    if (n && scrub()) {
        REAL(cuMemsetD8_v2)(ptr, 0, size);
        REAL(cuCtxSynchronize)();
    }
    CUresult r = REAL(cuMemUnmap)(ptr, size);
    if (r == CUDA_SUCCESS)
        for (size_t i = 0; i < n; i++) {
            struct ent m;
            if (untrack(&vmaps, found[i], &m)) handle_unref(m.aux);
        }
    if (found != small) free(found);
    return r;
}
