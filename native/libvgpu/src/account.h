/*
 * account.h — the accounting layer, for the allocation paths above it: the tables of what
 * libvgpu charged, the lock that guards them, and the reservation against the limit. Every path
 * that takes device memory reserves BEFORE calling the driver (tv_mem_reserve, atomic across
 * processes through the region) and rolls back if the driver fails; frees uncharge what was
 * charged. The accounting model is in README.md.
 *
 *   account.c   the tables (below), their lock, reserve / unreserve, pool refresh, fork
 *   memory.c    cuMemAlloc, cuMemAllocManaged, cuMemAllocPitch, cuMemFree
 *   mempool.c   stream-ordered allocations and pools (retained bytes)
 *   spill.c     opt-in spill to host memory (cuMemAlloc, cuMemAllocPitch, stream-ordered)
 *   vmm.c       cuMemCreate / Import / Map / Unmap / Release
 *   arrays.c    CUDA arrays and mipmapped arrays
 *   graphmem.c  graph memory nodes, graphs and their instantiations
 *   contexts.c  contexts beyond the primary one
 */
#ifndef TV_ACCOUNT_H
#define TV_ACCOUNT_H

#include "lease.h"
#include "vgpu.h"

/* ---- a small open-addressing map: 64-bit key -> record ------------------------------------ */

enum kind { K_PLAIN = 1, K_PITCH, K_MANAGED, K_ASYNC, K_CREATED, K_IMPORTED,
            K_SPILLED /* spill.c: a cuMemAlloc served from host memory */ };

/* A device slot that is deliberately no device (host pools, host VMM): never charged. Any other
 * negative slot is a device libvgpu could not identify: refused while a memory limit exists. */
#define TV_SLOT_HOST (-2)

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

/* Lookups are inline: they are on every alloc/free path. */
static inline uint64_t mix(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return k;
}

static inline struct ent *map_find(struct map *m, uint64_t key)
{
    if (!m->cap) return NULL;
    for (size_t i = mix(key) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (m->e[i].key == key) return &m->e[i];
        if (m->e[i].key == EMPTY) return NULL;
    }
}

/* 1 if it was there */
static inline int map_take(struct map *m, uint64_t key, struct ent *out)
{
    struct ent *f = map_find(m, key);
    if (!f) return 0;
    if (out) *out = *f;
    f->key = TOMB;
    m->live--;
    return 1;
}

void map_put(struct map *m, const struct ent *v) TV_HIDDEN;
void map_clear(struct map *m) TV_HIDDEN;

/* ---- tables, all under mem_mu (never held while calling the driver or the region lock) ---- */

extern pthread_mutex_t mem_mu TV_HIDDEN;
extern struct map ptrs TV_HIDDEN;    /* dptr -> size, slot, kind, pool (aux) */
extern struct map pools TV_HIDDEN;   /* pool -> slot, outstanding (aux), retained (aux2) */
extern struct map handles TV_HIDDEN; /* VMM handle -> charged size, slot, refs (aux), kind */
extern struct map vmaps TV_HIDDEN;   /* mapped va -> size, handle (aux) */
extern struct map arrays TV_HIDDEN;  /* CUarray / CUmipmappedArray -> size, slot */
extern struct map gnodes TV_HIDDEN;  /* graph allocation dptr -> size, slot, graph key (aux,
                                        0 = graph gone), live (aux2: allocated by a launch) */
extern struct map gfrees TV_HIDDEN;  /* graph free node -> dptr (size), graph key (aux) */
extern struct map graphs TV_HIDDEN;  /* graph key -> refs (aux): the graph + its instantiations */
extern struct map execs TV_HIDDEN;   /* graph exec -> graph key (aux), auto-free (kind) */
extern struct map ctxs TV_HIDDEN;    /* extra context -> charge, slot */

#define LOCK() pthread_mutex_lock(&mem_mu)
#define UNLOCK() pthread_mutex_unlock(&mem_mu)
#define OOM CUDA_ERROR_OUT_OF_MEMORY

/* Caller holds nothing (they take mem_mu). Inline: they are on every alloc/free. */
static inline void track(struct map *m, uint64_t key, uint64_t size, int dslot, uint32_t kind,
                         uint64_t aux)
{
    struct ent e = {.key = key, .size = size, .aux = aux, .dslot = dslot, .kind = kind};
    LOCK();
    map_put(m, &e);
    UNLOCK();
}

static inline int untrack(struct map *m, uint64_t key, struct ent *out)
{
    LOCK();
    int found = map_take(m, key, out);
    UNLOCK();
    return found;
}

/* Scrub-on-free: zero device memory before it is released. */
static inline int scrub(void)
{
    return (atomic_load_explicit(&tv.flags, memory_order_relaxed) & TSR_LIMITS_SCRUB_ON_FREE) != 0;
}

/* The most the container may hold on slot d (0 = unlimited). An elastic slice (limits 1.2:
 * a burst above the guarantee) may hold up to its burst limit when the node agent's lease
 * service is its account: the service lends beyond the guarantee only what the card can spare
 * and takes it back for a neighbour's guarantee (services/node-agent/leases.py). Without the
 * service nobody arbitrates the card: the guarantee is the limit. */
static inline uint64_t tv_mem_cap(int d)
{
    uint64_t burst = atomic_load_explicit(&tv.dev[d].mem_burst, memory_order_relaxed);
    if (burst && atomic_load_explicit(&tv_lease_on, memory_order_relaxed)) return burst;
    return atomic_load_explicit(&tv.dev[d].mem_limit, memory_order_relaxed);
}

/* 0 ok, -1 over the limit. Inline: the common case (a known device, room left) is one call into
 * the region; everything else (host memory, an unknown device, pools to ask, OOM) is slow. */
int tv_mem_reserve_slow(int dslot, uint64_t bytes) TV_HIDDEN;
static inline int tv_mem_reserve(int d, uint64_t bytes)
{
    if (tv_likely(d >= 0 && d < TV_MAX_SLOTS && bytes != 0)) {
        uint64_t limit = tv_mem_cap(d);
        /* the lease (the agent's account) first, then the region (the container's view) */
        if (tv_likely(tv_lease_take(d, bytes, limit) == 0)) {
            if (tv_likely(tv_region_charge(&tv.rg, d, bytes, limit) == 0)) return 0;
            tv_lease_give(d, bytes);
        }
    }
    return tv_mem_reserve_slow(d, bytes);
}
static inline void tv_mem_unreserve(int d, uint64_t bytes)
{
    if (d >= 0 && d < TV_MAX_SLOTS && bytes != 0) {
        tv_region_uncharge(&tv.rg, d, bytes);
        tv_lease_give(d, bytes);
    }
}

/* The reservation, before the driver is called. */
static inline CUresult charged_alloc(int ds, uint64_t bytes)
{
    return tv_mem_reserve(ds, bytes) == 0 ? CUDA_SUCCESS : OOM;
}

/* The driver's OOM for bytes charged on a limited slot is for memory the container is owed (its
 * guarantee, or a granted lease): worth retrying a moment (lease.h). Unlimited slots, host
 * memory, unknown devices and oversubscribed limits (memory scaling above 1: the limits add up
 * to more than the card) were promised nothing: their OOM is final at once. */
static inline int tv_mem_owed(int ds)
{
    return ds >= 0 && ds < TV_MAX_SLOTS && tv_mem_cap(ds) != 0 &&
           !(atomic_load_explicit(&tv.flags, memory_order_relaxed) & TSR_LIMITS_OVERSUBSCRIBE);
}

/* After `r = call` failed: while the driver's OOM is for memory the container is owed, wait and
 * call again (tv_owed_oom_wait: the backoff and its bound, lease.h), then log how it ended.
 * `call` is evaluated again on each retry. Every allocation path that retries uses this. */
#define TV_RETRY_OWED_OOM(r, ds, bytes, call)                                                  \
    do {                                                                                       \
        if (tv_unlikely((r) == OOM) && tv_mem_owed(ds)) {                                      \
            struct tv_oom_retry tv_retry_ = {0};                                               \
            while ((r) == OOM && tv_owed_oom_wait(&tv_retry_, (ds), (bytes))) (r) = (call);    \
            tv_owed_oom_done(&tv_retry_, (ds), (bytes), (r) == CUDA_SUCCESS);                  \
        }                                                                                      \
    } while (0)

/* spill.c: a cuMemAlloc the device could not hold (`why`: the error it got; `counted`: the
 * refusal was counted in the region's oom_count), served from host memory when the container
 * may spill — or `why` unchanged. Frees of spilled pointers. */
CUresult tv_spill_alloc(CUdeviceptr *dptr, size_t bytes, int dslot, CUresult why,
                        int counted) TV_HIDDEN;
CUresult tv_spill_alloc_pitch(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                              unsigned elem, int dslot, CUresult why, int counted) TV_HIDDEN;
int tv_spill_release(const struct ent *e) TV_HIDDEN; /* 1: it was spilled (now uncharged) */
CUresult tv_spill_free_async(const struct ent *e, CUstream s, int ptsz) TV_HIDDEN;

/* account.c: the bytes of a freed allocation, back to its pool (still charged) or uncharged. */
void release_ptr(const struct ent *e) TV_HIDDEN;
uint64_t tv_pool_refresh(CUmemoryPool pool) TV_HIDDEN; /* bytes uncharged */

#endif
