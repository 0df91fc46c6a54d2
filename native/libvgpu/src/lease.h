/*
 * lease.h — device memory leased from the node agent (the accounting layer's authority when the
 * sealed limits carry TSR_LIMITS_LEASE). The container's account lives in the agent, on the
 * host, out of the tenant's reach: a process may charge only what it holds on lease, and the
 * agent never leases a container more than its limit, whatever the tenant writes into the
 * region. The protocol is in tessera_region.h.
 *
 * Per device slot this process keeps `leased` (held from the agent) and `avail` (leased, not yet
 * charged). The fast path is one compare-and-swap on `avail`: no system call, no round trip.
 * Only when `avail` runs short does an allocation ask the agent (for at least a chunk), and only
 * when more than two chunks lie unused does a free give some back. Without a connection nothing
 * beyond what is already leased can be charged (fail closed).
 */
#ifndef TV_LEASE_H
#define TV_LEASE_H

#include <stdatomic.h>
#include <stdint.h>

#include "base.h"
#include "region.h"

struct tv_lease_slot {
    _Atomic uint64_t leased; /* held from the agent (changed under the lease lock) */
    _Atomic uint64_t avail;  /* leased and not charged: the fast path takes from it */
};

/* tv_lease[0 .. TV_MAX_SLOTS-1]: device slots; tv_lease[TV_LEASE_SPILL]: the container's spill
 * (host memory, sealed spill_bytes), leased under TSR_LEASE_SPILL_NAME, exactly, never chunked. */
#define TV_LEASE_SPILL TV_MAX_SLOTS
#define TV_LEASE_SLOTS (TV_MAX_SLOTS + 1)

extern _Atomic int tv_lease_on TV_HIDDEN;
extern struct tv_lease_slot tv_lease[TV_LEASE_SLOTS] TV_HIDDEN;

void tv_lease_init(const char *limits_file, uint32_t limits_flags) TV_HIDDEN; /* at start-up */
void tv_lease_attach(void) TV_HIDDEN;           /* at CUDA start-up: connect (the attestation) */
void tv_lease_wait(uint64_t ns) TV_HIDDEN; /* the poll thread's sleep: recalls, reconnects */
void tv_lease_after_fork_child(void) TV_HIDDEN; /* the child holds nothing */
int tv_lease_take_slow(int d, uint64_t bytes) TV_HIDDEN;
void tv_lease_trim(int d) TV_HIDDEN;

/* Spill (spill.c): 0 when `bytes` of host memory are leased to this process's spill (or no
 * lease service is sealed: the region is the account), -1 refused. Given back on free, at once
 * (the agent's account is what bounds the container's spill, whatever the region says). */
int tv_lease_spill_take(uint64_t bytes) TV_HIDDEN;
void tv_lease_spill_give(uint64_t bytes) TV_HIDDEN;

/* 0: `bytes` charged against this process's lease on slot d (0 <= d < TV_MAX_SLOTS); -1: the
 * agent would not lease them. Devices without a memory limit need no lease. */
static inline int tv_lease_take(int d, uint64_t bytes, uint64_t limit)
{
    if (tv_likely(!atomic_load_explicit(&tv_lease_on, memory_order_relaxed)) || !limit) return 0;
    struct tv_lease_slot *l = &tv_lease[d];
    uint64_t a = atomic_load_explicit(&l->avail, memory_order_relaxed);
    while (a >= bytes)
        if (atomic_compare_exchange_weak_explicit(&l->avail, &a, a - bytes, memory_order_relaxed,
                                                  memory_order_relaxed))
            return 0;
    return tv_lease_take_slow(d, bytes);
}

/* Bytes charged against the lease are free again (never more than is leased). */
static inline void tv_lease_give(int d, uint64_t bytes)
{
    if (tv_likely(!atomic_load_explicit(&tv_lease_on, memory_order_relaxed))) return;
    struct tv_lease_slot *l = &tv_lease[d];
    uint64_t a = atomic_load_explicit(&l->avail, memory_order_relaxed), n;
    do {
        uint64_t held = atomic_load_explicit(&l->leased, memory_order_relaxed);
        n = a + bytes;
        if (n > held || n < a) n = held;
    } while (!atomic_compare_exchange_weak_explicit(&l->avail, &a, n, memory_order_relaxed,
                                                    memory_order_relaxed));
    if (tv_unlikely(n > 2 * TSR_LEASE_CHUNK)) tv_lease_trim(d);
}

/* The driver's out-of-memory for memory the container is owed (charged within its guarantee or
 * under a granted lease): a reclaimed process's memory may still be held by the driver for a
 * moment after its lease socket closed (a dying process's files close in fd order; its device
 * memory goes when the driver's files close). The caller retries while tv_owed_oom_wait says so:
 * it logs, sleeps the next backoff step (2 ms doubling to 64 ms) and returns 1 until
 * TESSERA_RECLAIM_RETRY_MS (default 1000, at most 10000, 0 = no retry) have passed; then 0.
 *
 * The whole bound is waited only when memory is known to be on its way back (a reason, below).
 * Without one the card is full with memory nobody is giving back (a process outside Tessera, a
 * neighbour's live allocations): the retry stops once the card's free memory (the driver's
 * cuMemGetInfo) has not risen for TV_OWED_QUIET_MS, instead of holding the program the whole
 * bound. The reasons, all known in this process for nothing (stamped in tv_memory_back_ns):
 *  - the node agent's lease service granted it a lease (memory the service counts as the
 *    container's: a borrower reclaimed for it may still be freeing it) — lease.c;
 *  - it reclaimed the device charge of a dead process of the container (region.c) — the
 *    driver frees that process's memory when its files close, maybe a moment later;
 *  - the card's free memory rose since the last look (memory is being freed).
 * Only ever called after a failure: the allocation fast path makes no system call for it. */
#define TV_OWED_QUIET_MS 50
struct tv_oom_retry {
    uint64_t start_ns, step_ns, quiet_from_ns, free_seen;
    unsigned tries;
    int reason; /* 0 none seen yet; else why the whole bound is waited (lease.c) */
};
int tv_owed_oom_wait(struct tv_oom_retry *t, int d, uint64_t bytes) TV_HIDDEN;
void tv_owed_oom_done(const struct tv_oom_retry *t, int d, uint64_t bytes, int ok) TV_HIDDEN;

#endif
