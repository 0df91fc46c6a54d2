/*
 * spill.c — opt-in spill to host memory (tessera.io/gpumem-spill; sealed limits 1.3
 * `spill_bytes`; docs/elastic.md "Spilling to host memory").
 *
 * An allocation the device cannot hold — past the limit in force, refused by the node agent's
 * lease service while the card is short, or refused by the driver itself (the card is full) —
 * is served from host memory instead, when the container's limits allow a spill: managed memory
 * (cuMemAllocManaged) whose preferred location is the CPU, as CUDA documents it for data that
 * should stay in host memory and be reached by the GPU through a mapping rather than migrated
 * (cuMemAdvise CU_MEM_ADVISE_SET_PREFERRED_LOCATION, + SET_ACCESSED_BY so the GPU maps it
 * without faulting). The program gets a pointer it can use as it would device memory, slower.
 *
 * What is counted where:
 *  - not the device: a spilled allocation is charged neither to the guarantee nor to the burst
 *    limit, takes no lease, and is not in the region's used_bytes (what cuMemGetInfo and NVML
 *    report): it does not sit on the card;
 *  - the container's spill account: leased from the node agent's lease service under
 *    TSR_LEASE_SPILL_NAME when the limits are sealed with leases (the agent never leases the
 *    container more than its sealed `spill_bytes`, whatever the tenant writes into the region);
 *    and tsr_region.spilled_bytes (each process's in its slot), at most `spill_bytes` in all,
 *    for all the container's GPUs together (host memory is one) — the only account without a
 *    lease service (limits from env vars, `tessera run`), a report with one.
 *
 * The spilled pages must stay on the host: a program that asks the driver to move them to a
 * device (cuMemPrefetchAsync, cuMemAdvise on the range) gets CUDA_ERROR_INVALID_VALUE — what
 * the driver answers for memory cuMemAlloc returned, which is all the program knows it has. A
 * GPU without concurrent managed access (where managed memory is created on the device) never
 * spills. cuMemAlloc, cuMemAllocPitch and the stream-ordered allocations (cuMemAllocAsync, and
 * cuMemAllocFromPoolAsync from a pool that is neither exportable nor bounded by the program:
 * mempool.c) spill; VMM, arrays and graph memory nodes cannot (docs/elastic.md says why).
 */
#define _GNU_SOURCE
#include "account.h"

static _Atomic long spilled_live; /* spilled allocations tracked (0: nothing to look for) */

/* Managed memory on this GPU can live in host memory and be reached from the device. */
static int host_residency_possible(CUdevice dev)
{
    int v = 0;
    return REAL(cuDeviceGetAttribute)(&v, CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS, dev) ==
               CUDA_SUCCESS &&
           v != 0;
}

static CUresult advise(CUdeviceptr p, size_t n, CUmem_advise advice, CUdevice dev, int host)
{
    CUmemLocation loc = {.type = host ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_DEVICE,
                         .id = host ? 0 : dev};
    CUresult r = REAL(cuMemAdvise_v2)(p, n, advice, loc);
    if (r == CUDA_ERROR_NOT_FOUND) /* a driver before 12.2: the CUdevice form */
        r = REAL(cuMemAdvise)(p, n, advice, host ? CU_DEVICE_CPU : dev);
    return r;
}

CUresult tv_spill_alloc(CUdeviceptr *dptr, size_t bytes, int ds, CUresult why, int counted)
{
    uint64_t limit = atomic_load_explicit(&tv.spill_limit, memory_order_relaxed);
    if (why != CUDA_ERROR_OUT_OF_MEMORY || !limit || !dptr || !bytes || ds < 0) return why;
    CUdevice dev = ds < TV_MAX_SLOTS ? atomic_load(&tv.dev[ds].ordinal) : -1; /* the slot's card */
    if (dev < 0 && REAL(cuCtxGetDevice)(&dev) != CUDA_SUCCESS) return why;
    if (!host_residency_possible(dev)) return why;
    if (tv_lease_spill_take(bytes) != 0) {
        TV_LOG(TV_LOG_INFO, "spill of %llu bytes refused: the container's spill limit (%llu) "
               "is leased", (unsigned long long)bytes, (unsigned long long)limit);
        return why;
    }
    if (tv_region_spill_charge(&tv.rg, bytes, limit) != 0) {
        tv_lease_spill_give(bytes);
        TV_LOG(TV_LOG_INFO, "spill of %llu bytes refused: the container's spill limit (%llu)",
               (unsigned long long)bytes, (unsigned long long)limit);
        return why;
    }
    CUdeviceptr p = 0;
    CUresult r = REAL(cuMemAllocManaged)(&p, bytes, CU_MEM_ATTACH_GLOBAL);
    /* Nothing is populated before the first access (concurrent managed access), so the pages
     * are born on the host once the preferred location is set. */
    if (r == CUDA_SUCCESS &&
        advise(p, bytes, CU_MEM_ADVISE_SET_PREFERRED_LOCATION, dev, 1) != CUDA_SUCCESS) {
        REAL(cuMemFree_v2)(p); /* never hand out managed memory that may land on the device */
        r = CUDA_ERROR_NOT_SUPPORTED;
    }
    if (r != CUDA_SUCCESS) {
        tv_region_spill_uncharge(&tv.rg, bytes);
        tv_lease_spill_give(bytes);
        TV_LOG(TV_LOG_WARN, "spill of %llu bytes failed (%d)", (unsigned long long)bytes, r);
        return why;
    }
    advise(p, bytes, CU_MEM_ADVISE_SET_ACCESSED_BY, dev, 0); /* a hint: mapped, not faulted */
    track(&ptrs, p, bytes, ds, K_SPILLED, 0);
    atomic_fetch_add_explicit(&spilled_live, 1, memory_order_relaxed);
    if (counted) /* the device's refusal was counted as an OOM: the program got its memory */
        __atomic_fetch_sub(&tv_region_dev(&tv.rg, ds)->oom_count, 1, __ATOMIC_RELAXED);
    *dptr = p;
    TV_LOG(TV_LOG_DEBUG, "spilled %llu bytes to host memory", (unsigned long long)bytes);
    return CUDA_SUCCESS;
}

/* cuMemAllocPitch past the limit: the same spill, `height` rows of a pitch the program can bind
 * a texture with — the width rounded up to 512 bytes, and to the device's texture pitch
 * alignment where that is coarser (the driver's pitch "is guaranteed to match or exceed the
 * alignment requirement for texture binding", CUDA driver API). The driver validates the
 * arguments of the call it serves; a spill serves only a call it could have served. */
CUresult tv_spill_alloc_pitch(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                              unsigned elem, int ds, CUresult why, int counted)
{
    if (why != CUDA_ERROR_OUT_OF_MEMORY || !pitch || !width || !height ||
        (elem != 4 && elem != 8 && elem != 16))
        return why;
    CUdevice dev = ds >= 0 && ds < TV_MAX_SLOTS ? atomic_load(&tv.dev[ds].ordinal) : -1;
    int align = 0;
    if (dev < 0 || REAL(cuDeviceGetAttribute)(&align, CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT,
                                              dev) != CUDA_SUCCESS || align < 512)
        align = 512;
    if (align & (align - 1)) return why; /* never seen: alignments are powers of two */
    uint64_t p = ((uint64_t)width + (uint64_t)align - 1) / (uint64_t)align * (uint64_t)align;
    if (p < width || p * height / height != p) return why; /* overflow */
    CUresult r = tv_spill_alloc(dptr, p * height, ds, why, counted);
    if (r == CUDA_SUCCESS) *pitch = p;
    return r;
}

int tv_spill_release(const struct ent *e)
{
    if (e->kind != K_SPILLED) return 0;
    tv_region_spill_uncharge(&tv.rg, e->size);
    tv_lease_spill_give(e->size);
    atomic_fetch_sub_explicit(&spilled_live, 1, memory_order_relaxed);
    return 1;
}

/* cuMemFreeAsync of a spilled pointer: managed memory has no stream-ordered free; the stream's
 * work is waited for, then it is freed (the order the program asked for, synchronously). The
 * entry is already untracked; put back when the free fails. */
CUresult tv_spill_free_async(const struct ent *e, CUstream s, int ptsz)
{
    CUresult r = ptsz ? REAL(cuStreamSynchronize_ptsz)(s) : REAL(cuStreamSynchronize)(s);
    if (r == CUDA_SUCCESS) r = REAL(cuMemFree_v2)(e->key);
    if (r == CUDA_SUCCESS) tv_spill_release(e);
    else track(&ptrs, e->key, e->size, e->dslot, e->kind, e->aux);
    return r;
}

/* Does [p, p + n), rounded to CPU pages as the driver rounds it, touch a spilled allocation? */
static int touches_spill(CUdeviceptr p, size_t n)
{
    if (!atomic_load_explicit(&spilled_live, memory_order_relaxed)) return 0;
    uint64_t lo = (uint64_t)p & ~4095ull, hi = (uint64_t)p + n;
    if (hi < (uint64_t)p) hi = ~0ull; /* wrapped: to the end */
    hi = hi > ~4095ull ? ~0ull : (hi + 4095) & ~4095ull;
    int hit = 0;
    LOCK();
    for (size_t i = 0; i < ptrs.cap && !hit; i++) {
        const struct ent *e = &ptrs.e[i];
        if (e->key == EMPTY || e->key == TOMB || e->kind != K_SPILLED) continue;
        hit = e->key < hi && lo < e->key + e->size;
    }
    UNLOCK();
    return hit;
}

/* Does any range of a batch touch a spilled allocation? */
static int batch_touches_spill(const CUdeviceptr *dptrs, const size_t *sizes, size_t count)
{
    if (!atomic_load_explicit(&spilled_live, memory_order_relaxed) || !dptrs || !sizes) return 0;
    for (size_t i = 0; i < count; i++)
        if (touches_spill(dptrs[i], sizes[i])) return 1;
    return 0;
}

#define REFUSE_ON_SPILL(p, n)                                                                  \
    do {                                                                                       \
        TV_CUDA_ENTER();                                                                       \
        if (touches_spill((p), (n))) return CUDA_ERROR_INVALID_VALUE;                          \
    } while (0)

CUresult CUDAAPI tv_cuMemAdvise(CUdeviceptr p, size_t n, CUmem_advise advice, CUdevice dev)
{
    REFUSE_ON_SPILL(p, n);
    return REAL(cuMemAdvise)(p, n, advice, dev);
}
CUresult CUDAAPI tv_cuMemAdvise_v2(CUdeviceptr p, size_t n, CUmem_advise advice,
                                   CUmemLocation loc)
{
    REFUSE_ON_SPILL(p, n);
    return REAL(cuMemAdvise_v2)(p, n, advice, loc);
}
CUresult CUDAAPI tv_cuMemPrefetchAsync(CUdeviceptr p, size_t n, CUdevice dev, CUstream s)
{
    REFUSE_ON_SPILL(p, n);
    return REAL(cuMemPrefetchAsync)(p, n, dev, s);
}
CUresult CUDAAPI tv_cuMemPrefetchAsync_ptsz(CUdeviceptr p, size_t n, CUdevice dev, CUstream s)
{
    REFUSE_ON_SPILL(p, n);
    return REAL(cuMemPrefetchAsync_ptsz)(p, n, dev, s);
}
CUresult CUDAAPI tv_cuMemPrefetchAsync_v2(CUdeviceptr p, size_t n, CUmemLocation loc,
                                          unsigned int flags, CUstream s)
{
    REFUSE_ON_SPILL(p, n);
    return REAL(cuMemPrefetchAsync_v2)(p, n, loc, flags, s);
}
CUresult CUDAAPI tv_cuMemPrefetchAsync_v2_ptsz(CUdeviceptr p, size_t n, CUmemLocation loc,
                                               unsigned int flags, CUstream s)
{
    REFUSE_ON_SPILL(p, n);
    return REAL(cuMemPrefetchAsync_v2_ptsz)(p, n, loc, flags, s);
}

/* The batches of CUDA 13 (prefetch; discard and prefetch): refused when any range is spilled. */
#define BATCH_PARAMS                                                                           \
    CUdeviceptr *dptrs, size_t *sizes, size_t count, CUmemLocation *locs, size_t *loc_idxs,    \
        size_t nlocs, unsigned long long flags, CUstream s
#define REFUSE_BATCH_ON_SPILL()                                                                \
    do {                                                                                       \
        TV_CUDA_ENTER();                                                                       \
        if (batch_touches_spill(dptrs, sizes, count)) return CUDA_ERROR_INVALID_VALUE;         \
    } while (0)

CUresult CUDAAPI tv_cuMemPrefetchBatchAsync(BATCH_PARAMS)
{
    REFUSE_BATCH_ON_SPILL();
    return REAL(cuMemPrefetchBatchAsync)(dptrs, sizes, count, locs, loc_idxs, nlocs, flags, s);
}
CUresult CUDAAPI tv_cuMemPrefetchBatchAsync_ptsz(BATCH_PARAMS)
{
    REFUSE_BATCH_ON_SPILL();
    return REAL(cuMemPrefetchBatchAsync_ptsz)(dptrs, sizes, count, locs, loc_idxs, nlocs, flags,
                                              s);
}
CUresult CUDAAPI tv_cuMemDiscardAndPrefetchBatchAsync(BATCH_PARAMS)
{
    REFUSE_BATCH_ON_SPILL();
    return REAL(cuMemDiscardAndPrefetchBatchAsync)(dptrs, sizes, count, locs, loc_idxs, nlocs,
                                                   flags, s);
}
CUresult CUDAAPI tv_cuMemDiscardAndPrefetchBatchAsync_ptsz(BATCH_PARAMS)
{
    REFUSE_BATCH_ON_SPILL();
    return REAL(cuMemDiscardAndPrefetchBatchAsync_ptsz)(dptrs, sizes, count, locs, loc_idxs,
                                                        nlocs, flags, s);
}
