/*
 * region.h — the bottom layer's usage region: one file per container, shared by its processes
 * (tessera_region.h), plus a private one for what cannot be shared. Knows nothing of limits or of
 * the driver: callers pass the limit with each charge. All state is in struct tv_region.
 *
 * Device slots 0..TSR_MAX_DEVICES-1 live in the shared file; TSR_MAX_DEVICES..TV_MAX_SLOTS-1 in
 * the process's private region, for a device the shared table has no room for (then that
 * process alone is held to the limit).
 *
 * The region is writable by the tenant, so nothing read from it is trusted blindly:
 *  - the header (magic, version, size, process count, device count) is checked on open and every
 *    poll; under strict mode (limits from a file: the node agent prepared the region) a bad or
 *    missing region refuses every charge until it is valid again ("bad");
 *  - each process keeps what it charged itself (mine[]); a charge that finds its own slot or the
 *    device total below that repairs them first (zeroed counters cannot hide our own charges),
 *    and the poll thread re-asserts them every tick (other processes' zeroing is undone within
 *    TSR_LIMITS_POLL_MS); without a lease service it also raises each device total to what the
 *    live slots hold;
 *  - device-table entries for UUIDs that no sealed limit names and that hold nothing are
 *    reclaimed when a sealed device needs a slot;
 *  - who holds a process slot is the kernel's word: an open-file-description lock on the slot's
 *    first byte, held by its process while it lives (liveness.c, tv_slot_lock). A held slot is
 *    never reclaimed or handed out, whatever its pid or start time say;
 *  - the region's mutex is waited for in slices (tv_region_lock): a truncated region or a lock
 *    word nobody will release makes the caller refuse, never wait without end.
 */
#ifndef TV_REGION_H
#define TV_REGION_H

#include <pthread.h>
#include <stdatomic.h>
#include <sys/types.h>

#include "base.h"
#include "tessera_region.h"

#define TV_MAX_SLOTS (2 * TSR_MAX_DEVICES)

struct tv_region {
    struct tsr_region *map;   /* the shared region (a private stand-in while bad/absent) */
    struct tsr_region *priv;  /* this process's own: devices without a shared slot */
    struct tsr_region *shared; /* the one address the shared file is mapped at (guarded) */
    int fd;
    int is_private;           /* no shared file at all (standalone without a path) */
    int strict;               /* the node agent prepared the file: never initialise it */
    int kacct;                /* strict and no lease service: charges also locked (kacct.c) */
    int no_locks;             /* the file's file system has no kernel file locks (probed) */
    _Atomic int bad;          /* the shared file failed validation: refuse charges (a
                               * TV_BAD_* reason; any non-zero value is bad) */
    _Atomic(struct tsr_proc_slot *) slot;
    int slot_idx;
    int slot_locked;          /* fd holds the kernel lock on procs[slot_idx] (tv_slot_lock) */
    pid_t pid;
    uint64_t start_time;
    uint64_t mine[TV_MAX_SLOTS];          /* bytes this process charged, per slot */
    uint64_t mine_spill;                  /* host memory this process spilled (spill.c) */
    char uuid[TV_MAX_SLOTS][TSR_UUID_LEN]; /* what each slot we use is (for re-attaching) */
    char path[TSR_PATH_LEN];
    uint64_t ino, dev;        /* of the file mapped */
    pthread_mutex_t priv_mu;  /* private slots' charges */
    /* bit j: private slot TSR_MAX_DEVICES + j was handed out while the shared file was bad, as a
     * stand-in (its limit applies, its charges are refused): never kept, never charged */
    _Atomic uint32_t standin;
    _Atomic uint32_t reattached; /* times the file was made valid again after being bad */
};

/* Why the region is bad: the file failed validation (or is being re-attached), or an access
 * faulted (truncated under us: on_sigbus mapped the zero page in its place). */
enum { TV_BAD_FILE = 1, TV_BAD_FAULTED = 2 };

/* What the region needs to know of the limits, passed in (the region never reads them). */
struct tv_region_seed {
    int32_t priority;
    uint32_t core_policy;
    unsigned nuuid;
    char uuids[TSR_MAX_DEVICES][TSR_UUID_LEN]; /* sealed devices: always get a slot */
    int region_is_account; /* no lease service: the region is the container's account */
};

void tv_region_open(struct tv_region *rg, const char *path, int strict,
                    const struct tv_region_seed *seed) TV_HIDDEN;
/* The region's lock: the mutex locked, to be passed to tv_region_unlock (the poll thread may
 * swap rg->map meanwhile: the mutex unlocked must be the one locked), or NULL when it could not
 * be had: the region went bad while this thread waited (truncated or replaced: whoever held the
 * lock then released a zero page's, and nothing would ever wake the waiter), or one owner kept
 * it TV_REGION_LOCK_WAIT_MS (a lock word the tenant forged, a holder it stopped; a lock passing
 * from holder to holder is waited for as long as it takes). A caller given
 * NULL refuses what it was doing (a charge) or does it in this process alone (a free, mine[]):
 * never a wait without end. */
#define TV_REGION_LOCK_WAIT_MS 1000
pthread_mutex_t *tv_region_lock_slow(struct tv_region *rg, pthread_mutex_t *m, int err) TV_HIDDEN;
static inline pthread_mutex_t *tv_region_lock(struct tv_region *rg)
{
    pthread_mutex_t *m = &rg->map->lock.mutex;
    int r = pthread_mutex_trylock(m);
    return tv_likely(r == 0) ? m : tv_region_lock_slow(rg, m, r);
}
static inline void tv_region_unlock(pthread_mutex_t *m)
{
    pthread_mutex_unlock(m);
}
struct tsr_proc_slot *tv_region_register(struct tv_region *rg) TV_HIDDEN;
void tv_region_release(struct tv_region *rg) TV_HIDDEN;
int tv_region_reclaim_dead(struct tv_region *rg) TV_HIDDEN; /* caller holds the lock */
/* The poll thread's share: dead slots (once a second), validation, repair, re-attach. */
void tv_region_poll(struct tv_region *rg, int reclaim, const struct tv_region_seed *seed) TV_HIDDEN;
void tv_region_after_fork_child(struct tv_region *rg) TV_HIDDEN;

/* Devices: find, or find-or-add (falling back to a private slot); -1 when impossible. While the
 * shared file is bad, find-or-add gives a stand-in (tv_region_standin): the caller must not keep
 * it, and charges to it are refused, even after the file is repaired. */
int tv_region_find_dev(struct tv_region *rg, const char *uuid) TV_HIDDEN;
int tv_region_dev_slot(struct tv_region *rg, const char *uuid,
                       const struct tv_region_seed *seed) TV_HIDDEN;
/* A slot resolved while this did not change, with the region good before and after, may be kept:
 * one resolved across a truncation or a repair is resolved again next time. */
static inline uint32_t tv_region_epoch(struct tv_region *rg)
{
    return atomic_load_explicit(&rg->reattached, memory_order_acquire);
}
static inline int tv_region_standin(struct tv_region *rg, int d)
{
    return d >= TSR_MAX_DEVICES && d < TV_MAX_SLOTS &&
           (atomic_load_explicit(&rg->standin, memory_order_acquire) >> (d - TSR_MAX_DEVICES) & 1u);
}

/* Memory: 0 charged, -1 over `limit` (0 = none) or refused (bad region). Charge: 0 <= d <
 * TV_MAX_SLOTS and bytes > 0 (the caller checked). */
int tv_region_charge(struct tv_region *rg, int d, uint64_t bytes, uint64_t limit) TV_HIDDEN;
void tv_region_uncharge(struct tv_region *rg, int d, uint64_t bytes) TV_HIDDEN;
void tv_region_count_oom(struct tv_region *rg, int d) TV_HIDDEN;
/* Spill (spill.c): host memory the container's device allocations took through managed memory,
 * one account for the container (tsr_region.spilled_bytes, each process's in its slot). 0
 * charged, -1 over `limit` (0 = no spill allowed) or refused (bad region). */
int tv_region_spill_charge(struct tv_region *rg, uint64_t bytes, uint64_t limit) TV_HIDDEN;
void tv_region_spill_uncharge(struct tv_region *rg, uint64_t bytes) TV_HIDDEN;

/* This process's slot, registering on first use. */
static inline struct tsr_proc_slot *tv_region_slot(struct tv_region *rg)
{
    struct tsr_proc_slot *s = atomic_load_explicit(&rg->slot, memory_order_acquire);
    return tv_likely(s != NULL) ? s : tv_region_register(rg);
}

static inline struct tsr_region_device *tv_region_dev(struct tv_region *rg, int d)
{
    return d < TSR_MAX_DEVICES ? &rg->map->dev[d] : &rg->priv->dev[d - TSR_MAX_DEVICES];
}
/* The container's usage of a slot, never below what this process itself holds there. */
static inline uint64_t tv_region_used(struct tv_region *rg, int d)
{
    if (d < 0 || d >= TV_MAX_SLOTS) return 0;
    uint64_t u = __atomic_load_n(&tv_region_dev(rg, d)->used_bytes, __ATOMIC_RELAXED);
    return u < rg->mine[d] ? rg->mine[d] : u;
}

/* kacct.c: the account in kernel file locks, where the region is the account and its limits
 * sealed (rg->kacct). 0 taken (0 <= d < TSR_MAX_DEVICES; limit 0: unlimited), -1 refused. */
int tv_kacct_take(struct tv_region *rg, int d, uint64_t bytes, uint64_t limit) TV_HIDDEN;
void tv_kacct_give(struct tv_region *rg, int d, uint64_t bytes) TV_HIDDEN;
void tv_kacct_relock(struct tv_region *rg) TV_HIDDEN;
void tv_kacct_after_fork_child(void) TV_HIDDEN;

/* liveness.c: is the process in a slot (pid, start time from /proc/<pid>/stat, 0 = unknown)
 * alive, as seen from process `self`? This process's own start time (0 if unreadable). */
int tv_proc_alive(pid_t self, pid_t pid, uint64_t start) TV_HIDDEN;
uint64_t tv_self_start_time(void) TV_HIDDEN;
/* liveness.c, the slots' kernel locks: whether this region's slots are held by them; slot i's
 * lock taken by this process (0) or another's (-1), given back; held by another description;
 * its process gone (never while its lock is held; a held lock of a process /proc says is ending
 * waited for until `deadline`, tv_mono_ns, 0 = not at all). */
#define TV_DEAD_LOCK_WAIT_NS 200000000ull
int tv_slot_locking(const struct tv_region *rg) TV_HIDDEN;
int tv_slot_lock(struct tv_region *rg, int i) TV_HIDDEN;
void tv_slot_unlock(struct tv_region *rg, int i) TV_HIDDEN;
int tv_slot_held(struct tv_region *rg, int i) TV_HIDDEN;
int tv_slot_dead(struct tv_region *rg, int i, pid_t pid, uint64_t start,
                 uint64_t deadline) TV_HIDDEN;

/* regionlock.c: the region's mutex made (`lock_ready` set); waited for (`r`: the first try's
 * answer; `bad_ok`: a value of rg->bad to wait through, 0 none): the mutex locked, or NULL
 * (refused). region.c: a dead lock owner's region put right (dead slots freed, totals from the
 * live slots). */
void tv_region_init_mutex(struct tsr_region *r) TV_HIDDEN;
pthread_mutex_t *tv_region_lock_wait(struct tv_region *rg, pthread_mutex_t *m, int r,
                                     int bad_ok) TV_HIDDEN;
void tv_region_recover(struct tv_region *rg) TV_HIDDEN;

/* When this process last saw device memory given back for it (tv_mono_ns; 0 never): a dead
 * process's device charge reclaimed here (region.c), a lease the node agent's service held
 * before granting (lease.c). The owed-OOM retry reads it (lease.h). */
extern _Atomic uint64_t tv_memory_back_ns TV_HIDDEN;

#endif
