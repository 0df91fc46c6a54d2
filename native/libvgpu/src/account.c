/*
 * account.c — the accounting layer (account.h): the tables of what libvgpu charged, their lock,
 * the reservation against the limit in force (through the region), what pools give back, fork.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "account.h"

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

void map_put(struct map *m, const struct ent *v)
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

void map_clear(struct map *m)
{
    free(m->e);
    memset(m, 0, sizeof *m);
}

pthread_mutex_t mem_mu = PTHREAD_MUTEX_INITIALIZER;
struct map ptrs, pools, handles, vmaps, arrays, gnodes, gfrees, graphs, execs, ctxs;

void tv_account_after_fork_child(void)
{
    pthread_mutex_init(&mem_mu, NULL);
    map_clear(&ptrs);
    map_clear(&pools);
    map_clear(&handles);
    map_clear(&vmaps);
    map_clear(&arrays);
    map_clear(&gnodes);
    map_clear(&gfrees);
    map_clear(&graphs);
    map_clear(&execs);
    map_clear(&ctxs);
}

/* ---- reserve / unreserve -------------------------------------------------------------------- */

int tv_mem_reserve_slow(int d, uint64_t bytes)
{
    if (bytes == 0 || d == TV_SLOT_HOST) return 0;
    if (d < 0 || d >= TV_MAX_SLOTS) {
        /* a device we cannot identify: charged nowhere, so refused while limits exist */
        if (!tv_limits_any_mem()) return 0;
        TV_LOG(TV_LOG_WARN, "allocation of %llu bytes on an unidentified device refused",
               (unsigned long long)bytes);
        return -1;
    }
    uint64_t limit = tv_mem_cap(d);
    /* the inline attempt failed: pools may have given memory back since */
    if (tv_mem_refresh_pools() > 0 && tv_lease_take(d, bytes, limit) == 0) {
        if (tv_region_charge(&tv.rg, d, bytes, limit) == 0) return 0;
        tv_lease_give(d, bytes);
    }
    tv_region_count_oom(&tv.rg, d);
    TV_LOG(TV_LOG_INFO, "out of memory on slot %d: %llu + %llu > %llu%s", d,
           (unsigned long long)tv_region_used(&tv.rg, d), (unsigned long long)bytes,
           (unsigned long long)limit, atomic_load(&tv.rg.bad) ? " (region unusable)" : "");
    return -1;
}

/* ---- pools: what the driver took back ------------------------------------------------------ */

/* A freed allocation's bytes stay charged to its pool ("retained") until the driver says the
 * pool gave them back. Returns the bytes uncharged. Caller holds nothing. */
uint64_t tv_pool_refresh(CUmemoryPool pool)
{
    cuuint64_t reserved = 0;
    if (REAL(cuMemPoolGetAttribute)(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) !=
        CUDA_SUCCESS)
        return 0; /* a driver that cannot say keeps the bytes charged */
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
    if (!atomic_load_explicit(&tv.cuda_ready, memory_order_acquire)) return 0;
    CUmemoryPool list[64];
    int n = 0;
    LOCK();
    for (size_t i = 0; i < pools.cap && n < 64; i++)
        if (pools.e[i].key != EMPTY && pools.e[i].key != TOMB && pools.e[i].aux2 > 0)
            list[n++] = (CUmemoryPool)(uintptr_t)pools.e[i].key;
    UNLOCK();
    uint64_t freed = 0;
    for (int i = 0; i < n; i++) freed += tv_pool_refresh(list[i]);
    return freed > 0;
}

/* The bytes of a freed allocation: back to its pool (still charged) or uncharged. */
void release_ptr(const struct ent *e)
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
