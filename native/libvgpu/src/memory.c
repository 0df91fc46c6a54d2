/*
 * memory.c — every path that takes device memory. Each one reserves against the container's
 * limit BEFORE calling the driver (tv_mem_reserve, atomic across processes) and rolls back if the
 * driver fails; frees uncharge what was charged. The accounting model is in README.md.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "vgpu.h"

/* ---- a small open-addressing map: 64-bit key -> record ------------------------------------ */

enum kind { K_PLAIN = 1, K_PITCH, K_MANAGED, K_ASYNC, K_CREATED, K_IMPORTED };

struct ent {
    uint64_t key;
    uint64_t size;
    uint64_t aux;  /* pool / refs / handle / graph key, by table */
    uint64_t aux2; /* pool: retained bytes */
    int32_t dslot;
    uint32_t kind;
};

struct map {
    struct ent *e;
    size_t cap, used, live;
};

#define EMPTY 0ull
#define TOMB (~0ull)

static uint64_t mix(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return k;
}

static struct ent *map_find(struct map *m, uint64_t key)
{
    if (!m->cap) return NULL;
    for (size_t i = mix(key) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (m->e[i].key == key) return &m->e[i];
        if (m->e[i].key == EMPTY) return NULL;
    }
}

static void map_put(struct map *m, const struct ent *v);

static void map_grow(struct map *m)
{
    struct map old = *m;
    size_t cap = old.cap ? old.cap * 2 : 64;
    if (old.live * 4 < old.cap) cap = old.cap; /* mostly tombstones: rehash in place */
    struct ent *e = calloc(cap, sizeof *e);
    if (!e) return; /* keep going with the old table */
    m->e = e;
    m->cap = cap;
    m->used = m->live = 0;
    for (size_t i = 0; i < old.cap; i++)
        if (old.e[i].key != EMPTY && old.e[i].key != TOMB) map_put(m, &old.e[i]);
    free(old.e);
}

static void map_put(struct map *m, const struct ent *v)
{
    struct ent *f = map_find(m, v->key);
    if (f) {
        *f = *v;
        return;
    }
    if ((m->used + 1) * 2 > m->cap) map_grow(m);
    if (!m->cap) return;
    for (size_t i = mix(v->key) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (m->e[i].key == EMPTY || m->e[i].key == TOMB) {
            if (m->e[i].key == EMPTY) m->used++;
            m->e[i] = *v;
            m->live++;
            return;
        }
    }
}

static int map_take(struct map *m, uint64_t key, struct ent *out)
{
    struct ent *f = map_find(m, key);
    if (!f) return 0;
    if (out) *out = *f;
    f->key = TOMB;
    m->live--;
    return 1;
}

static void map_clear(struct map *m)
{
    free(m->e);
    memset(m, 0, sizeof *m);
}

/* ---- tables, all under mem_mu (never held while calling the driver or the region lock) ---- */

static pthread_mutex_t mem_mu = PTHREAD_MUTEX_INITIALIZER;
static struct map ptrs;    /* dptr -> size, slot, kind, pool (aux) */
static struct map pools;   /* pool -> slot, outstanding (aux), retained (aux2) */
static struct map handles; /* VMM handle -> charged size, slot, refs (aux), created/imported */
static struct map vmaps;   /* mapped va -> size, handle (aux) */
static struct map arrays;  /* CUarray / CUmipmappedArray -> size, slot */
static struct map gnodes;  /* graph mem-alloc node -> size, slot, graph key (aux) */
static struct map graphs;  /* graph key -> refs (aux): the graph + its instantiations */
static struct map execs;   /* graph exec -> graph key (aux) */
static struct map ctxs;    /* extra context -> charge, slot */
static uint64_t graph_keys = 1ull << 62;

#define LOCK() pthread_mutex_lock(&mem_mu)
#define UNLOCK() pthread_mutex_unlock(&mem_mu)
#define OOM CUDA_ERROR_OUT_OF_MEMORY

static int scrub(void)
{
    return (atomic_load_explicit(&tv.flags, memory_order_relaxed) & TSR_LIMITS_SCRUB_ON_FREE) != 0;
}

static void track(struct map *m, uint64_t key, uint64_t size, int dslot, uint32_t kind,
                  uint64_t aux)
{
    struct ent e = {.key = key, .size = size, .aux = aux, .dslot = dslot, .kind = kind};
    LOCK();
    map_put(m, &e);
    UNLOCK();
}

static int untrack(struct map *m, uint64_t key, struct ent *out)
{
    LOCK();
    int found = map_take(m, key, out);
    UNLOCK();
    return found;
}

void tv_memory_after_fork_child(void)
{
    pthread_mutex_init(&mem_mu, NULL);
    map_clear(&ptrs);
    map_clear(&pools);
    map_clear(&handles);
    map_clear(&vmaps);
    map_clear(&arrays);
    map_clear(&gnodes);
    map_clear(&graphs);
    map_clear(&execs);
    map_clear(&ctxs);
}

/* ---- plain, pitch, managed ---------------------------------------------------------------- */

static CUresult charged_alloc(int ds, uint64_t bytes)
{
    return tv_mem_reserve(ds, bytes) == 0 ? CUDA_SUCCESS : OOM;
}

CUresult CUDAAPI tv_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    TV_CUDA_ENTER();
    int ds = tv_ctx_dev_slot();
    if (charged_alloc(ds, bytesize) != CUDA_SUCCESS) return OOM;
    CUresult r = REAL(cuMemAlloc_v2)(dptr, bytesize);
    if (r != CUDA_SUCCESS) tv_mem_unreserve(ds, bytesize);
    else if (ds >= 0) track(&ptrs, *dptr, bytesize, ds, K_PLAIN, 0);
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
    if (charged_alloc(ds, est) != CUDA_SUCCESS) return OOM;
    CUresult r = REAL(cuMemAllocPitch_v2)(dptr, pPitch, WidthInBytes, Height, ElementSizeBytes);
    if (r != CUDA_SUCCESS) {
        tv_mem_unreserve(ds, est);
        return r;
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

/* ---- stream-ordered allocations and pools ---------------------------------------------------- */

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

/* A freed allocation's bytes stay charged to its pool ("retained") until the driver says the
 * pool gave them back. Returns the bytes uncharged. Caller holds nothing. */
static uint64_t refresh_pool(CUmemoryPool pool)
{
    cuuint64_t reserved = 0;
    if (!REAL(cuMemPoolGetAttribute) ||
        REAL(cuMemPoolGetAttribute)(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) !=
            CUDA_SUCCESS)
        return 0;
    LOCK();
    struct ent *p = map_find(&pools, (uint64_t)(uintptr_t)pool);
    uint64_t drop = 0;
    int ds = -1;
    if (p) {
        uint64_t keep = reserved > p->aux ? reserved - p->aux : 0;
        if (keep < p->aux2) {
            drop = p->aux2 - keep;
            p->aux2 = keep;
        }
        ds = p->dslot;
    }
    UNLOCK();
    tv_mem_unreserve(ds, drop);
    return drop;
}

int tv_mem_refresh_pools(void)
{
    CUmemoryPool list[64];
    int n = 0;
    LOCK();
    for (size_t i = 0; i < pools.cap && n < 64; i++)
        if (pools.e[i].key != EMPTY && pools.e[i].key != TOMB && pools.e[i].aux2 > 0)
            list[n++] = (CUmemoryPool)(uintptr_t)pools.e[i].key;
    UNLOCK();
    uint64_t freed = 0;
    for (int i = 0; i < n; i++) freed += refresh_pool(list[i]);
    return freed > 0;
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
        if (ord >= 0 && REAL(cuDeviceGetMemPool)) REAL(cuDeviceGetMemPool)(&pool, ord);
    }
    uint64_t reuse = 0;
    if (pool && ds >= 0) {
        LOCK();
        struct ent *p = pool_rec(pool, ds);
        if (p) {
            reuse = p->aux2 < bytes ? p->aux2 : bytes;
            p->aux2 -= reuse;
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
        return OOM;
    }
    CUresult r;
    if (from_pool)
        r = ptsz ? REAL(cuMemAllocFromPoolAsync_ptsz)(dptr, bytes, pool, s)
                 : REAL(cuMemAllocFromPoolAsync)(dptr, bytes, pool, s);
    else
        r = ptsz ? REAL(cuMemAllocAsync_ptsz)(dptr, bytes, s) : REAL(cuMemAllocAsync)(dptr, bytes, s);
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
    if (r != CUDA_SUCCESS) tv_mem_unreserve(ds, need);
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

/* The bytes of a freed allocation: back to its pool (still charged) or uncharged. */
static void release_ptr(const struct ent *e)
{
    if (e->kind == K_ASYNC && e->aux) {
        LOCK();
        struct ent *p = map_find(&pools, e->aux);
        if (p) {
            p->aux = p->aux > e->size ? p->aux - e->size : 0;
            p->aux2 += e->size;
        }
        UNLOCK();
        if (p) return;
    }
    tv_mem_unreserve(e->dslot, e->size);
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
        if (r == CUDA_SUCCESS) release_ptr(&e);
        else track(&ptrs, e.key, e.size, e.dslot, e.kind, e.aux);
    }
    return r;
}

static CUresult free_async(CUdeviceptr dptr, CUstream s, int ptsz)
{
    TV_CUDA_ENTER();
    struct ent e;
    int found = dptr && untrack(&ptrs, dptr, &e);
    if (found && scrub())
        REAL(cuMemsetD8Async)(dptr, 0, e.size, ptsz && !s ? CU_STREAM_PER_THREAD : s);
    CUresult r = ptsz ? REAL(cuMemFreeAsync_ptsz)(dptr, s) : REAL(cuMemFreeAsync)(dptr, s);
    if (found) {
        if (r == CUDA_SUCCESS) release_ptr(&e);
        else track(&ptrs, e.key, e.size, e.dslot, e.kind, e.aux);
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
                     : -1; /* host pools take no device memory */
        LOCK();
        struct ent e = {.key = (uint64_t)(uintptr_t)*pool, .dslot = ds};
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
    if (r == CUDA_SUCCESS) refresh_pool(pool);
    return r;
}

/* ---- virtual memory management ---------------------------------------------------------- */

CUresult CUDAAPI tv_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                                const CUmemAllocationProp *prop, unsigned long long flags)
{
    TV_CUDA_ENTER();
    int ds = prop && prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE
                 ? tv_dev_slot(prop->location.id)
                 : -1;
    if (charged_alloc(ds, size) != CUDA_SUCCESS) return OOM;
    CUresult r = REAL(cuMemCreate)(handle, size, prop, flags);
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
        if (ds < 0 && REAL(cuMemGetAllocationPropertiesFromHandle) &&
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
    uint64_t found[64];
    int n = 0;
    LOCK();
    for (size_t i = 0; i < vmaps.cap && n < 64; i++) {
        struct ent *m = &vmaps.e[i];
        if (m->key != EMPTY && m->key != TOMB && m->key >= ptr && m->key < ptr + size)
            found[n++] = m->key;
    }
    UNLOCK();
    if (n && scrub()) {
        REAL(cuMemsetD8_v2)(ptr, 0, size);
        REAL(cuCtxSynchronize)();
    }
    CUresult r = REAL(cuMemUnmap)(ptr, size);
    if (r == CUDA_SUCCESS)
        for (int i = 0; i < n; i++) {
            struct ent m;
            if (untrack(&vmaps, found[i], &m)) handle_unref(m.aux);
        }
    return r;
}

/* ---- arrays -------------------------------------------------------------------------------- */

static uint64_t elem_bytes(CUarray_format f, unsigned channels)
{
    uint64_t b;
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: b = 1; break;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: b = 2; break;
    default: b = 4; break; /* 32-bit and packed formats: an upper bound per channel */
    }
    return b * (channels ? channels : 1);
}

static uint64_t array_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels)
{
    uint64_t w = d->Width, h = d->Height, z = d->Depth, total = 0;
    int layered = (d->Flags & CUDA_ARRAY3D_LAYERED) || (d->Flags & CUDA_ARRAY3D_CUBEMAP);
    uint64_t eb = elem_bytes(d->Format, d->NumChannels);
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        uint64_t lw = w >> l ? w >> l : 1;
        uint64_t lh = h ? (h >> l ? h >> l : 1) : 1;
        uint64_t lz = z ? (layered ? z : (z >> l ? z >> l : 1)) : 1;
        total += lw * lh * lz * eb;
    }
    return total;
}

static CUresult array_create(void *out, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels,
                             int which, const void *orig)
{
    TV_CUDA_ENTER();
    int ds = tv_ctx_dev_slot();
    uint64_t bytes = array_bytes(d, levels);
    if (charged_alloc(ds, bytes) != CUDA_SUCCESS) return OOM;
    CUresult r;
    if (which == 1) r = REAL(cuArrayCreate_v2)((CUarray *)out, orig);
    else if (which == 3) r = REAL(cuArray3DCreate_v2)((CUarray *)out, orig);
    else r = REAL(cuMipmappedArrayCreate)((CUmipmappedArray *)out, orig, levels);
    if (r != CUDA_SUCCESS) tv_mem_unreserve(ds, bytes);
    else if (ds >= 0) track(&arrays, (uint64_t)(uintptr_t)*(void **)out, bytes, ds, K_PLAIN, 0);
    return r;
}

CUresult CUDAAPI tv_cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc)
{
    if (!desc) return REAL(cuArrayCreate_v2) ? REAL(cuArrayCreate_v2)(pHandle, desc)
                                             : CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR d = {.Width = desc->Width, .Height = desc->Height, .Depth = 0,
                                 .Format = desc->Format, .NumChannels = desc->NumChannels};
    return array_create(pHandle, &d, 1, 1, desc);
}

CUresult CUDAAPI tv_cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
    if (!desc) return REAL(cuArray3DCreate_v2) ? REAL(cuArray3DCreate_v2)(pHandle, desc)
                                               : CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, desc, 1, 3, desc);
}

CUresult CUDAAPI tv_cuMipmappedArrayCreate(CUmipmappedArray *pHandle,
                                           const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                           unsigned int numMipmapLevels)
{
    if (!desc) return REAL(cuMipmappedArrayCreate)
                          ? REAL(cuMipmappedArrayCreate)(pHandle, desc, numMipmapLevels)
                          : CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, desc, numMipmapLevels, 2, desc);
}

static CUresult array_destroy(uint64_t key, int mip)
{
    TV_CUDA_ENTER();
    CUresult r = mip ? REAL(cuMipmappedArrayDestroy)((CUmipmappedArray)(uintptr_t)key)
                     : REAL(cuArrayDestroy)((CUarray)(uintptr_t)key);
    struct ent e;
    if (r == CUDA_SUCCESS && untrack(&arrays, key, &e)) tv_mem_unreserve(e.dslot, e.size);
    return r;
}

CUresult CUDAAPI tv_cuArrayDestroy(CUarray hArray)
{
    return array_destroy((uint64_t)(uintptr_t)hArray, 0);
}
CUresult CUDAAPI tv_cuMipmappedArrayDestroy(CUmipmappedArray h)
{
    return array_destroy((uint64_t)(uintptr_t)h, 1);
}

/* ---- graph memory nodes ----------------------------------------------------------------- */

/* Caller holds mem_mu. The key of a graph's record (graphs can die before their execs). */
static uint64_t graph_key(CUgraph g, int create)
{
    uint64_t k = (uint64_t)(uintptr_t)g;
    if (map_find(&graphs, k) || !create) return k;
    struct ent e = {.key = k, .aux = 1};
    map_put(&graphs, &e);
    return k;
}

/* Caller holds nothing. Drop a reference to a graph record; at zero, uncharge its nodes. */
static void graph_unref(uint64_t key, int graph_destroyed)
{
    uint64_t per_slot[TSR_MAX_DEVICES] = {0};
    int release = 0;
    LOCK();
    struct ent *g = map_find(&graphs, key);
    if (g && --g->aux == 0) {
        release = 1;
        map_take(&graphs, key, NULL);
    } else if (g && graph_destroyed) {
        /* Execs keep the memory; re-key so that a new graph at the same address is distinct. */
        uint64_t nk = graph_keys++;
        struct ent moved = *g;
        moved.key = nk;
        map_take(&graphs, key, NULL);
        map_put(&graphs, &moved);
        for (size_t i = 0; i < gnodes.cap; i++)
            if (gnodes.e[i].key != EMPTY && gnodes.e[i].key != TOMB && gnodes.e[i].aux == key)
                gnodes.e[i].aux = nk;
        for (size_t i = 0; i < execs.cap; i++)
            if (execs.e[i].key != EMPTY && execs.e[i].key != TOMB && execs.e[i].aux == key)
                execs.e[i].aux = nk;
    }
    if (release)
        for (size_t i = 0; i < gnodes.cap; i++) {
            struct ent *n = &gnodes.e[i];
            if (n->key != EMPTY && n->key != TOMB && n->aux == key) {
                if (n->dslot >= 0 && n->dslot < TSR_MAX_DEVICES) per_slot[n->dslot] += n->size;
                n->key = TOMB;
                gnodes.live--;
            }
        }
    UNLOCK();
    for (int d = 0; d < TSR_MAX_DEVICES; d++) tv_mem_unreserve(d, per_slot[d]);
}

static int mem_node_slot(const CUmemPoolProps *pp)
{
    return pp->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? tv_dev_slot(pp->location.id)
                                                            : tv_ctx_dev_slot();
}

static void track_mem_node(CUgraphNode node, CUgraph graph, uint64_t size, int ds)
{
    LOCK();
    uint64_t gk = graph_key(graph, 1);
    struct ent e = {.key = (uint64_t)(uintptr_t)node, .size = size, .aux = gk, .dslot = ds};
    map_put(&gnodes, &e);
    UNLOCK();
}

CUresult CUDAAPI tv_cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                           const CUgraphNode *deps, size_t n,
                                           CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    TV_CUDA_ENTER();
    if (!p) return REAL(cuGraphAddMemAllocNode)(phGraphNode, hGraph, deps, n, p);
    int ds = mem_node_slot(&p->poolProps);
    if (charged_alloc(ds, p->bytesize) != CUDA_SUCCESS) return OOM;
    CUresult r = REAL(cuGraphAddMemAllocNode)(phGraphNode, hGraph, deps, n, p);
    if (r != CUDA_SUCCESS) tv_mem_unreserve(ds, p->bytesize);
    else if (ds >= 0) track_mem_node(*phGraphNode, hGraph, p->bytesize, ds);
    return r;
}

static CUresult add_node(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps,
                         const CUgraphEdgeData *edges, size_t n, CUgraphNodeParams *p, int v2)
{
    TV_CUDA_ENTER();
    int mem = p && p->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC;
    int ds = mem ? mem_node_slot(&p->alloc.poolProps) : -1;
    uint64_t bytes = mem ? p->alloc.bytesize : 0;
    if (mem && charged_alloc(ds, bytes) != CUDA_SUCCESS) return OOM;
    CUresult r = v2 ? REAL(cuGraphAddNode_v2)(ph, g, deps, edges, n, p)
                    : REAL(cuGraphAddNode)(ph, g, deps, n, p);
    if (r != CUDA_SUCCESS) tv_mem_unreserve(ds, bytes);
    else if (mem && ds >= 0) track_mem_node(*ph, g, bytes, ds);
    return r;
}

CUresult CUDAAPI tv_cuGraphAddNode(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t n,
                                   CUgraphNodeParams *p)
{
    return add_node(ph, g, deps, NULL, n, p, 0);
}
CUresult CUDAAPI tv_cuGraphAddNode_v2(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps,
                                      const CUgraphEdgeData *edges, size_t n,
                                      CUgraphNodeParams *p)
{
    return add_node(ph, g, deps, edges, n, p, 1);
}

CUresult CUDAAPI tv_cuGraphDestroy(CUgraph hGraph)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphDestroy)(hGraph);
    if (r == CUDA_SUCCESS) {
        LOCK();
        int has = map_find(&graphs, (uint64_t)(uintptr_t)hGraph) != NULL;
        UNLOCK();
        if (has) graph_unref((uint64_t)(uintptr_t)hGraph, 1);
    }
    return r;
}

static void track_exec(CUgraphExec exec, CUgraph graph)
{
    LOCK();
    uint64_t gk = graph_key(graph, 0);
    struct ent *g = map_find(&graphs, gk);
    if (g) {
        g->aux++;
        struct ent e = {.key = (uint64_t)(uintptr_t)exec, .aux = gk};
        map_put(&execs, &e);
    }
    UNLOCK();
}

CUresult CUDAAPI tv_cuGraphInstantiateWithFlags(CUgraphExec *ph, CUgraph g,
                                                unsigned long long flags)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphInstantiateWithFlags)(ph, g, flags);
    if (r == CUDA_SUCCESS) track_exec(*ph, g);
    return r;
}

CUresult CUDAAPI tv_cuGraphInstantiateWithParams(CUgraphExec *ph, CUgraph g,
                                                 CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphInstantiateWithParams)(ph, g, p);
    if (r == CUDA_SUCCESS) track_exec(*ph, g);
    return r;
}

CUresult CUDAAPI tv_cuGraphInstantiateWithParams_ptsz(CUgraphExec *ph, CUgraph g,
                                                      CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphInstantiateWithParams_ptsz)(ph, g, p);
    if (r == CUDA_SUCCESS) track_exec(*ph, g);
    return r;
}

CUresult CUDAAPI tv_cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphExecDestroy)(hGraphExec);
    struct ent e;
    if (r == CUDA_SUCCESS && untrack(&execs, (uint64_t)(uintptr_t)hGraphExec, &e))
        graph_unref(e.aux, 0);
    return r;
}

/* ---- contexts beyond the primary one ------------------------------------------------------ */

static CUresult ctx_create(CUcontext *pctx, CUdevice dev, int v, unsigned flags,
                           CUexecAffinityParam *aff, int naff, CUctxCreateParams *params)
{
    TV_CUDA_ENTER();
    int ds = tv_dev_slot(dev);
    uint64_t charge = tv.ctx_charge;
    if (charged_alloc(ds, charge) != CUDA_SUCCESS) return OOM;
    CUresult r = v == 2   ? REAL(cuCtxCreate_v2)(pctx, flags, dev)
                 : v == 3 ? REAL(cuCtxCreate_v3)(pctx, aff, naff, flags, dev)
                          : REAL(cuCtxCreate_v4)(pctx, params, flags, dev);
    if (r != CUDA_SUCCESS) tv_mem_unreserve(ds, charge);
    else if (ds >= 0) track(&ctxs, (uint64_t)(uintptr_t)*pctx, charge, ds, K_PLAIN, 0);
    return r;
}

CUresult CUDAAPI tv_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    return ctx_create(pctx, dev, 2, flags, NULL, 0, NULL);
}
CUresult CUDAAPI tv_cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *aff, int n,
                                   unsigned int flags, CUdevice dev)
{
    return ctx_create(pctx, dev, 3, flags, aff, n, NULL);
}
CUresult CUDAAPI tv_cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *p, unsigned int flags,
                                   CUdevice dev)
{
    return ctx_create(pctx, dev, 4, flags, NULL, 0, p);
}

CUresult CUDAAPI tv_cuCtxDestroy_v2(CUcontext ctx)
{
    TV_CUDA_ENTER();
    tv_compute_forget_ctx(ctx);
    CUresult r = REAL(cuCtxDestroy_v2)(ctx);
    struct ent e;
    if (r == CUDA_SUCCESS && untrack(&ctxs, (uint64_t)(uintptr_t)ctx, &e))
        tv_mem_unreserve(e.dslot, e.size);
    return r;
}
