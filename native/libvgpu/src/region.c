/*
 * region.c — the usage region (region.h): opening and validating it, process slots (and
 * reclaiming those of dead processes: liveness.c says which), per-device charges against a
 * limit the caller passes, and repairing what a tenant may have written into it. Its robust
 * cross-process lock is regionlock.c's.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "region.h"

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELAXED)
#define REGION_SZ sizeof(struct tsr_region)

_Atomic uint64_t tv_memory_back_ns;

static struct tsr_proc_slot overflow_slot; /* used only when all TSR_MAX_PROCS slots are live */

/* ---- processes ---------------------------------------------------------------------------- */

/* Caller holds the lock. Uncharge a slot's bytes and free it. */
static void reclaim_slot(struct tsr_region *R, struct tsr_proc_slot *s)
{
    int device_charge = 0;
    for (int d = 0; d < TSR_MAX_DEVICES; d++) {
        uint64_t u = LOAD(s->used[d]), total = LOAD(R->dev[d].used_bytes);
        if (u) STORE(R->dev[d].used_bytes, total > u ? total - u : 0);
        device_charge |= u != 0;
    }
    /* the driver frees the dead process's memory when its files close: maybe not yet */
    if (device_charge) atomic_store_explicit(&tv_memory_back_ns, tv_mono_ns(), memory_order_relaxed);
    uint64_t sp = LOAD(s->spilled_bytes), spt = LOAD(R->spilled_bytes);
    if (sp) STORE(R->spilled_bytes, spt > sp ? spt - sp : 0);
    memset(s, 0, sizeof *s);
}

int tv_region_reclaim_dead(struct tv_region *rg)
{
    int n = 0;
    uint64_t deadline = tv_mono_ns() + TV_DEAD_LOCK_WAIT_NS; /* all slots together */
    for (int i = 0; i < TSR_MAX_PROCS; i++) {
        struct tsr_proc_slot *s = &rg->map->procs[i];
        pid_t pid = LOAD(s->pid);
        if (pid == 0 || pid == rg->pid) continue;
        if (tv_slot_dead(rg, i, pid, LOAD(s->start_time), deadline)) {
            TV_LOG(TV_LOG_INFO, "reclaiming slot %d of dead process %d", i, (int)pid);
            reclaim_slot(rg->map, s);
            n++;
        }
    }
    return n;
}

/* Caller holds the lock. The device total from the live slots (never below our own). */
static uint64_t live_sum(struct tv_region *rg, int d)
{
    uint64_t sum = 0;
    for (int i = 0; i < TSR_MAX_PROCS; i++)
        if (LOAD(rg->map->procs[i].pid) && i != rg->slot_idx)
            sum += LOAD(rg->map->procs[i].used[d]);
    return sum + rg->mine[d];
}

/* Caller holds the lock. The container's spilled total from the live slots (never below ours). */
static uint64_t spill_live_sum(struct tv_region *rg)
{
    uint64_t sum = 0;
    for (int i = 0; i < TSR_MAX_PROCS; i++)
        if (LOAD(rg->map->procs[i].pid) && i != rg->slot_idx)
            sum += LOAD(rg->map->procs[i].spilled_bytes);
    return sum + rg->mine_spill;
}

/* After a lock owner died: free dead slots, then rebuild every total from the live slots (the
 * dead owner may have stopped between updating a total and its slot). */
void tv_region_recover(struct tv_region *rg)
{
    tv_region_reclaim_dead(rg);
    for (int d = 0; d < TSR_MAX_DEVICES; d++) STORE(rg->map->dev[d].used_bytes, live_sum(rg, d));
    STORE(rg->map->spilled_bytes, spill_live_sum(rg));
}

/* ---- creation and validation -------------------------------------------------------------- */

static int header_ok(const struct tsr_region *r)
{
    return __atomic_load_n(&r->magic, __ATOMIC_ACQUIRE) == TSR_REGION_MAGIC &&
           LOAD(r->major) == TSR_VERSION_MAJOR && LOAD(r->size) == REGION_SZ &&
           LOAD(r->max_procs) == TSR_MAX_PROCS && LOAD(r->num_devices) <= TSR_MAX_DEVICES;
}

static void init_fresh(struct tsr_region *r, const struct tv_region_seed *seed)
{
    memset(r, 0, sizeof *r);
    r->major = TSR_VERSION_MAJOR;
    r->minor = TSR_VERSION_MINOR;
    r->size = REGION_SZ;
    r->max_procs = TSR_MAX_PROCS;
    r->priority = seed ? seed->priority : 0;
    r->core_policy = seed ? seed->core_policy : 0;
    r->created_ns = tv_real_ns();
    tv_region_init_mutex(r);
    for (int d = 0; d < TSR_MAX_DEVICES; d++) {
        r->dev[d].achieved_sm_x100 = TSR_SM_UNKNOWN;
        r->dev[d].sm_limit_pct = 100;
    }
    __atomic_store_n(&r->magic, TSR_REGION_MAGIC, __ATOMIC_RELEASE);
}

static struct tsr_region *map_anon(void)
{
    struct tsr_region *r =
        mmap(NULL, REGION_SZ, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (r == MAP_FAILED) abort();
    init_fresh(r, NULL);
    return r;
}

/* A usable mapping of fd, or NULL: a regular file of exactly the region's size. */
static struct tsr_region *map_file(int fd, struct stat *st)
{
    if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode) || (size_t)st->st_size != REGION_SZ)
        return NULL;
    void *m = mmap(NULL, REGION_SZ, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    return m == MAP_FAILED ? NULL : m;
}

static int uuid_sealed(const struct tv_region_seed *seed, const char *uuid)
{
    for (unsigned i = 0; seed && i < seed->nuuid; i++)
        if (!strncmp(seed->uuids[i], uuid, TSR_UUID_LEN)) return 1;
    return 0;
}

/* Caller holds the lock. A slot for uuid in the shared table: found, added, or taken from an
 * entry that no sealed limit names and that nothing is charged to. -1 if none. */
static int shared_slot_locked(struct tv_region *rg, const char *uuid,
                              const struct tv_region_seed *seed)
{
    struct tsr_region *R = rg->map;
    uint32_t n = LOAD(R->num_devices);
    if (n > TSR_MAX_DEVICES) n = TSR_MAX_DEVICES, STORE(R->num_devices, n);
    for (uint32_t k = 0; k < n; k++)
        if (!strncmp(R->dev[k].uuid, uuid, TSR_UUID_LEN)) return (int)k;
    int k = -1;
    if (n < TSR_MAX_DEVICES) {
        k = (int)n;
        STORE(R->num_devices, n + 1);
    } else if (seed && seed->nuuid) {
        for (uint32_t j = 0; j < n && k < 0; j++) {
            char u[TSR_UUID_LEN];
            memcpy(u, R->dev[j].uuid, TSR_UUID_LEN);
            u[TSR_UUID_LEN - 1] = 0;
            if (!uuid_sealed(seed, u) && live_sum(rg, (int)j) == 0) {
                TV_LOG(TV_LOG_WARN, "region: device slot %u held '%.16s', named by no limit: "
                       "reused", j, u);
                k = (int)j;
            }
        }
    }
    if (k >= 0) {
        struct tsr_region_device *rd = &R->dev[k];
        memset(rd, 0, sizeof *rd);
        snprintf(rd->uuid, TSR_UUID_LEN, "%s", uuid);
        rd->achieved_sm_x100 = TSR_SM_UNKNOWN;
        rd->sm_limit_pct = 100;
    }
    return k;
}

/* Caller holds the lock. Every sealed device gets a slot before anyone needs one. */
static void seed_devices(struct tv_region *rg, const struct tv_region_seed *seed)
{
    for (unsigned i = 0; seed && i < seed->nuuid; i++)
        if (seed->uuids[i][0]) shared_slot_locked(rg, seed->uuids[i], seed);
}

/* ---- a truncated file ---------------------------------------------------------------------
 * A tenant may truncate the region under our mapping: the next access would raise SIGBUS. The
 * handler below turns a fault inside any region mapping of ours into a private zero page (the
 * region then reads as invalid: charges are refused until it is repaired) and passes every
 * other SIGBUS on to whoever had the signal before. */

#define TV_MAPS 8
static void *mapped[TV_MAPS]; /* every shared mapping we made (old ones stay mapped) */
static _Atomic int *bad_flag;
static struct sigaction old_bus;

static void on_sigbus(int sig, siginfo_t *si, void *ctx)
{
    uintptr_t a = (uintptr_t)si->si_addr;
    for (int i = 0; i < TV_MAPS; i++) {
        uintptr_t m = (uintptr_t)__atomic_load_n(&mapped[i], __ATOMIC_RELAXED);
        if (m && a >= m && a < m + REGION_SZ) {
            /* bad before the zero page: whoever reads the page can know what it read */
            if (bad_flag) atomic_store(bad_flag, TV_BAD_FAULTED);
            mmap((void *)m, REGION_SZ, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            return; /* the access is retried on the zero page */
        }
    }
    if (old_bus.sa_flags & SA_SIGINFO) {
        if (old_bus.sa_sigaction) old_bus.sa_sigaction(sig, si, ctx);
        return;
    }
    if (old_bus.sa_handler != SIG_DFL && old_bus.sa_handler != SIG_IGN) {
        old_bus.sa_handler(sig);
        return;
    }
    signal(SIGBUS, SIG_DFL); /* not ours: the fault repeats and takes its default course */
}

static void guard_mapping(struct tv_region *rg, void *m)
{
    for (int i = 0; i < TV_MAPS; i++)
        if (!mapped[i]) {
            __atomic_store_n(&mapped[i], m, __ATOMIC_RELAXED);
            break;
        }
    if (bad_flag) return;
    bad_flag = &rg->bad;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_RESTART | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &old_bus);
}

static void unguard_mapping(void *m)
{
    for (int i = 0; i < TV_MAPS; i++)
        if (__atomic_load_n(&mapped[i], __ATOMIC_RELAXED) == m)
            __atomic_store_n(&mapped[i], NULL, __ATOMIC_RELAXED);
}

static void set_standin(struct tv_region *rg)
{
    static struct tsr_region *standin;
    if (!standin) standin = map_anon();
    rg->map = standin;
}

/* Map path: 0 ok (rg->map set), -1 not usable. Strict: never create or initialise it. */
static int attach(struct tv_region *rg, const char *path, int strict,
                  const struct tv_region_seed *seed)
{
    int flags = O_RDWR | O_CLOEXEC | O_NOFOLLOW | (strict ? 0 : O_CREAT);
    int fd = open(path, flags, 0666);
    if (fd < 0) return -1;
    struct stat st;
    struct tsr_region *r = map_file(fd, &st);
    if (!r && !strict) { /* standalone: the first process creates it */
        flock(fd, LOCK_EX);
        if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (size_t)st.st_size < REGION_SZ &&
            ftruncate(fd, (off_t)REGION_SZ) != 0)
            TV_LOG(TV_LOG_ERROR, "region %s: cannot grow: %s", path, strerror(errno));
        r = map_file(fd, &st);
        flock(fd, LOCK_UN);
    }
    if (!r) {
        close(fd);
        return -1;
    }
    guard_mapping(rg, r); /* truncated while we read the header: a zero page, not a crash */
    flock(fd, LOCK_EX);
    int ok = header_ok(r);
    if (!ok && !strict) {
        init_fresh(r, seed);
        ok = 1;
    }
    if (ok && __atomic_load_n(&r->lock_ready, __ATOMIC_ACQUIRE) != TSR_LOCK_READY) tv_region_init_mutex(r);
    flock(fd, LOCK_UN);
    if (!ok) {
        TV_LOG(TV_LOG_ERROR, "region %s: bad header: refusing device memory until it is "
               "repaired", path);
        unguard_mapping(r);
        munmap(r, REGION_SZ);
        close(fd);
        return -1;
    }
    if (rg->shared) {
        /* Attached before: map the file again at the same address, so that other threads'
         * pointers stay valid and re-attaching (however often a tenant truncates and rewrites
         * the file) never adds a mapping. */
        void *m = mmap(rg->shared, REGION_SZ, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                       fd, 0);
        unguard_mapping(r);
        munmap(r, REGION_SZ);
        if (m == MAP_FAILED) {
            close(fd);
            return -1;
        }
        r = m;
    }
    int kept = 0;
    if (rg->fd >= 0) {
        struct stat old;
        if (fstat(rg->fd, &old) == 0 && old.st_ino == st.st_ino && old.st_dev == st.st_dev) {
            /* the same file (rewritten in place): our description stays, and with it our
             * locks (our slot's, our account's) */
            close(fd);
            fd = rg->fd;
            kept = 1;
        } else {
            close(rg->fd); /* another file: our locks go with the old one */
            rg->slot_locked = 0;
        }
    }
    rg->fd = fd;
    rg->ino = st.st_ino;
    rg->dev = st.st_dev;
    rg->shared = r;
    rg->map = r;
    if (!kept) {
        /* kernel locks on this file system? (a file system without them: a FUSE or network
         * one) Without them slots are judged as before, and the region alone is the account */
        struct flock probe = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_len = 1};
        rg->no_locks = fcntl(fd, F_OFD_GETLK, &probe) != 0;
        if (rg->no_locks)
            TV_LOG(TV_LOG_ERROR, "region %s: no file locks here (%s): process slots judged by "
                   "/proc, the region's counters the only account", path, strerror(errno));
        if (rg->kacct && !rg->no_locks) tv_kacct_relock(rg);
    }
    if (seed && seed->nuuid) {
        pthread_mutex_t *mu = tv_region_lock(rg);
        if (mu) {
            seed_devices(rg, seed);
            tv_region_unlock(mu);
        }
    }
    return 0;
}

void tv_region_open(struct tv_region *rg, const char *path, int strict,
                    const struct tv_region_seed *seed)
{
    rg->fd = -1;
    rg->slot_idx = -1;
    rg->pid = getpid();
    rg->strict = strict;
    rg->kacct = strict && seed && seed->region_is_account;
    pthread_mutex_init(&rg->priv_mu, NULL);
    rg->priv = map_anon();
    snprintf(rg->path, sizeof rg->path, "%s", path ? path : "");
    if (path && path[0] && attach(rg, path, strict, seed) == 0) {
        /* shared */
    } else if (strict) {
        TV_LOG(TV_LOG_ERROR, "region %s unusable: refusing device memory until it is repaired",
               rg->path);
        set_standin(rg);
        atomic_store(&rg->bad, TV_BAD_FILE);
    } else {
        TV_LOG(TV_LOG_WARN, "region %s unusable (%s): accounting is per process", rg->path,
               strerror(errno));
        rg->map = map_anon();
        rg->is_private = 1;
    }
    rg->start_time = tv_self_start_time();
}

/* ---- process slots ------------------------------------------------------------------------ */

/* Caller holds the lock. Write what this process holds into its slot and the totals. */
static void assert_mine(struct tv_region *rg, struct tsr_proc_slot *s)
{
    for (int d = 0; d < TSR_MAX_DEVICES; d++) {
        uint64_t had = LOAD(s->used[d]), m = rg->mine[d];
        if (had == m) continue;
        STORE(s->used[d], m);
        uint64_t t = LOAD(rg->map->dev[d].used_bytes) - had + m;
        STORE(rg->map->dev[d].used_bytes, t);
    }
    uint64_t had = LOAD(s->spilled_bytes);
    if (had != rg->mine_spill) {
        STORE(s->spilled_bytes, rg->mine_spill);
        STORE(rg->map->spilled_bytes, LOAD(rg->map->spilled_bytes) - had + rg->mine_spill);
    }
}

/* Caller holds the lock. The slot i of a previous process with our pid (it is dead), or a free
 * one, if this process gets its kernel lock (tv_slot_lock): a slot another live process holds is
 * never taken, whatever its pid field says. -1: none. */
static int take_slot(struct tv_region *rg)
{
    struct tsr_region *R = rg->map;
    for (int want_ours = 1; want_ours >= 0; want_ours--)
        for (int i = 0; i < TSR_MAX_PROCS; i++) {
            pid_t pid = LOAD(R->procs[i].pid);
            if (pid != (want_ours ? rg->pid : 0)) continue;
            if (tv_slot_locking(rg) && tv_slot_lock(rg, i) != 0) continue;
            if (want_ours) reclaim_slot(R, &R->procs[i]);
            return i;
        }
    return -1;
}

/* Caller holds the lock. Take a slot (a dead process's if none is free; the overflow slot if
 * none at all) and write what this process holds into it and the totals. */
static struct tsr_proc_slot *register_locked(struct tv_region *rg)
{
    int idx = take_slot(rg);
    if (idx < 0 && tv_region_reclaim_dead(rg)) idx = take_slot(rg);
    if (rg->slot_locked && rg->slot_idx >= 0 && rg->slot_idx != idx)
        tv_slot_unlock(rg, rg->slot_idx); /* a slot we held before (never two) */
    struct tsr_proc_slot *s;
    if (idx >= 0) {
        s = &rg->map->procs[idx];
        memset(s, 0, sizeof *s);
        STORE(s->start_time, rg->start_time);
        STORE(s->pid, (int32_t)rg->pid);
    } else {
        TV_LOG(TV_LOG_ERROR, "region full (%d processes): this process is not tracked",
               TSR_MAX_PROCS);
        s = &overflow_slot;
    }
    rg->slot_idx = idx;
    rg->slot_locked = idx >= 0 && tv_slot_locking(rg);
    assert_mine(rg, s);
    atomic_store_explicit(&rg->slot, s, memory_order_release);
    return s;
}

struct tsr_proc_slot *tv_region_register(struct tv_region *rg)
{
    struct tsr_proc_slot *s = atomic_load_explicit(&rg->slot, memory_order_acquire);
    if (tv_likely(s != NULL)) return s;
    if (!rg->start_time) rg->start_time = tv_self_start_time();
    pthread_mutex_t *mu = tv_region_lock(rg);
    if (!mu) return NULL; /* the caller refuses its charge */
    s = atomic_load(&rg->slot);
    if (!s) s = register_locked(rg);
    tv_region_unlock(mu);
    return s;
}

void tv_region_release(struct tv_region *rg)
{
    struct tsr_proc_slot *s = atomic_load(&rg->slot);
    if (!s || !rg->map || atomic_load(&rg->bad)) return;
    pthread_mutex_t *mu = tv_region_lock(rg);
    if (!mu) return; /* our slot's kernel lock goes at exit: a sweep reclaims it */
    if (s == &overflow_slot) {
        for (int d = 0; d < TSR_MAX_DEVICES; d++) {
            uint64_t u = s->used[d], total = LOAD(rg->map->dev[d].used_bytes);
            STORE(rg->map->dev[d].used_bytes, total > u ? total - u : 0);
        }
        uint64_t sp = s->spilled_bytes, spt = LOAD(rg->map->spilled_bytes);
        STORE(rg->map->spilled_bytes, spt > sp ? spt - sp : 0);
        memset(s, 0, sizeof *s);
    } else if (rg->slot_locked || LOAD(s->pid) == (int32_t)rg->pid) {
        reclaim_slot(rg->map, s); /* ours (its kernel lock), whatever its pid field says */
    }
    if (rg->slot_locked) tv_slot_unlock(rg, rg->slot_idx);
    rg->slot_locked = 0;
    atomic_store(&rg->slot, NULL);
    tv_region_unlock(mu);
}

void tv_region_after_fork_child(struct tv_region *rg)
{
    atomic_store(&rg->slot, NULL);
    rg->slot_idx = -1;
    rg->start_time = 0;
    rg->pid = getpid();
    memset(rg->mine, 0, sizeof rg->mine); /* the child holds none of its parent's memory */
    rg->mine_spill = 0;
    /* nor its parent's overflow slot: registering there, the child would "correct" the copy of
     * its parent's charges to its own, taking them off the totals */
    memset(&overflow_slot, 0, sizeof overflow_slot);
    pthread_mutex_init(&rg->priv_mu, NULL);
    tv_kacct_after_fork_child();
    /* A description of the file of its own: the one inherited is the parent's, with the
     * parent's slot lock on it (tv_slot_lock). Same inode, same fd number. Only async-signal-safe
     * calls here (a child of a multithreaded parent). */
    rg->slot_locked = 0;
    if (rg->fd >= 0) {
        char path[32] = "/proc/self/fd/", digits[12];
        int n = 0, len = 14;
        for (unsigned v = (unsigned)rg->fd; n == 0 || v; v /= 10) digits[n++] = (char)('0' + v % 10);
        while (n) path[len++] = digits[--n];
        path[len] = 0;
        int fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd >= 0 && dup3(fd, rg->fd, O_CLOEXEC) >= 0) {
            close(fd);
        } else { /* refused until the poll thread re-attaches by path (a new description) */
            if (fd >= 0) close(fd);
            close(rg->fd);
            rg->fd = -1;
            atomic_store(&rg->bad, TV_BAD_FILE);
        }
    }
}

/* ---- the poll thread's share --------------------------------------------------------------- */

static void reclaim_periodic(struct tv_region *rg)
{
    struct tsr_region *R = rg->map;
    uint64_t now = tv_mono_ns();
    uint64_t last = LOAD(R->reclaim_ns);
    if (now - last < 1000000000ull && last <= now) return;
    if (!__atomic_compare_exchange_n(&R->reclaim_ns, &last, now, 0, __ATOMIC_RELAXED,
                                     __ATOMIC_RELAXED))
        return; /* another process of the container sweeps this second */
    static int idx[TSR_MAX_PROCS];
    static int32_t pids[TSR_MAX_PROCS];
    static uint64_t starts[TSR_MAX_PROCS];
    int n = 0;
    for (int i = 0; i < TSR_MAX_PROCS; i++) { /* liveness checked outside the lock */
        int32_t pid = LOAD(R->procs[i].pid);
        uint64_t st = LOAD(R->procs[i].start_time);
        if (pid && pid != rg->pid && tv_slot_dead(rg, i, pid, st, 0)) {
            idx[n] = i;
            pids[n] = pid;
            starts[n++] = st;
        }
    }
    if (!n) return;
    pthread_mutex_t *mu = tv_region_lock(rg);
    if (!mu) return;
    for (int k = 0; k < n; k++) {
        struct tsr_proc_slot *s = &R->procs[idx[k]];
        /* the same process, and still nobody's lock: a process registering meanwhile took it */
        if (LOAD(s->pid) == pids[k] && LOAD(s->start_time) == starts[k] &&
            !tv_slot_held(rg, idx[k])) {
            TV_LOG(TV_LOG_INFO, "reclaiming slot %d of dead process %d", idx[k], (int)pids[k]);
            reclaim_slot(R, s);
        }
    }
    tv_region_unlock(mu);
}

/* Is our slot, or a total, below what this process holds? (read without the lock) */
static int tampered(struct tv_region *rg, struct tsr_proc_slot *s)
{
    if (s != &overflow_slot &&
        (LOAD(s->pid) != (int32_t)rg->pid || LOAD(s->start_time) != rg->start_time))
        return 1;
    for (int d = 0; d < TSR_MAX_DEVICES; d++)
        if (LOAD(s->used[d]) != rg->mine[d] || LOAD(rg->map->dev[d].used_bytes) < rg->mine[d])
            return 1;
    return LOAD(s->spilled_bytes) != rg->mine_spill || LOAD(rg->map->spilled_bytes) < rg->mine_spill;
}

/* Is a device's total below what the live slots hold? A tenant lowered it by another process's
 * share (no lower than any process's own): that process puts its own slot back, and this puts
 * the total back. Read without the lock: a charge of another process in flight may look like
 * it; repair() decides under the lock. */
static int total_below_slots(struct tv_region *rg)
{
    uint32_t n = LOAD(rg->map->num_devices);
    if (n > TSR_MAX_DEVICES) n = TSR_MAX_DEVICES;
    uint64_t sum[TSR_MAX_DEVICES] = {0};
    for (int i = 0; i < TSR_MAX_PROCS; i++) {
        const struct tsr_proc_slot *p = &rg->map->procs[i];
        if (!LOAD(p->pid)) continue;
        for (uint32_t d = 0; d < n; d++) sum[d] += LOAD(p->used[d]);
    }
    for (uint32_t d = 0; d < n; d++)
        if (LOAD(rg->map->dev[d].used_bytes) < sum[d]) return 1;
    return 0;
}

/* The same, for the one device a charge is about (the hot path: three loads). */
static inline int tampered_dev(struct tv_region *rg, struct tsr_proc_slot *s, int d)
{
    return (s != &overflow_slot && LOAD(s->pid) != (int32_t)rg->pid) ||
           LOAD(s->used[d]) != rg->mine[d] || LOAD(rg->map->dev[d].used_bytes) < rg->mine[d];
}

/* Caller holds the lock. Put back what a tenant took out: our slot, our share of each total.
 * The slot may be another one afterwards (rg->slot). */
static void repair(struct tv_region *rg, struct tsr_proc_slot *s)
{
    if (s != &overflow_slot &&
        (LOAD(s->pid) != (int32_t)rg->pid || LOAD(s->start_time) != rg->start_time)) {
        /* Ours while we hold its kernel lock, whatever its pid says (no other process could
         * take it); without one (no file), ours again only if freed */
        if (rg->slot_locked ? tv_slot_lock(rg, rg->slot_idx) == 0 : LOAD(s->pid) == 0) {
            /* rewritten, or freed as if reclaimed (its charges taken off the totals): what is
             * not in the slot any more goes back into the totals, as when a slot is taken */
            STORE(s->start_time, rg->start_time);
            STORE(s->pid, (int32_t)rg->pid);
            assert_mine(rg, s);
        } else { /* someone else holds it now: take a new one */
            register_locked(rg);
            return;
        }
    }
    for (int d = 0; d < TSR_MAX_DEVICES; d++) {
        if (LOAD(s->used[d]) != rg->mine[d]) STORE(s->used[d], rg->mine[d]);
        uint64_t live = live_sum(rg, d); /* never below what the live slots hold */
        if (LOAD(rg->map->dev[d].used_bytes) < live) STORE(rg->map->dev[d].used_bytes, live);
    }
    if (LOAD(s->spilled_bytes) != rg->mine_spill) STORE(s->spilled_bytes, rg->mine_spill);
    if (LOAD(rg->map->spilled_bytes) < rg->mine_spill)
        STORE(rg->map->spilled_bytes, spill_live_sum(rg));
}

/* Bad: is the file usable again? Then map it, take a slot, put back our devices and charges. */
static void try_reattach(struct tv_region *rg, const struct tv_region_seed *seed)
{
    /* a fault from here on (truncated again while we map it, take a slot, put our charges
     * back) sets TV_BAD_FAULTED: the zero page is then mapped where the file was, and charges
     * must not resume on it */
    atomic_store(&rg->bad, TV_BAD_FILE);
    if (attach(rg, rg->path, rg->strict, seed) != 0) return;
    atomic_store(&rg->slot, NULL); /* register_locked gives up the old slot's lock if it moves */
    pthread_mutex_t *mu = &rg->map->lock.mutex;
    int r = pthread_mutex_trylock(mu);
    if (r != 0 && !(mu = tv_region_lock_wait(rg, mu, r, TV_BAD_FILE))) return; /* again next tick */
    for (int d = 0; d < TSR_MAX_DEVICES; d++) {
        if (!rg->uuid[d][0]) continue;
        struct tsr_region_device *rd = &rg->map->dev[d];
        if (strncmp(rd->uuid, rg->uuid[d], TSR_UUID_LEN) && !rd->uuid[0]) {
            snprintf(rd->uuid, TSR_UUID_LEN, "%s", rg->uuid[d]);
            if (LOAD(rg->map->num_devices) <= (uint32_t)d) STORE(rg->map->num_devices, d + 1);
        }
    }
    register_locked(rg); /* writes mine[] into the slot and the totals */
    tv_region_unlock(mu);
    atomic_fetch_add(&rg->reattached, 1);
    int was = TV_BAD_FILE;
    if (!atomic_compare_exchange_strong(&rg->bad, &was, 0)) {
        TV_LOG(TV_LOG_ERROR, "region %s truncated again while it was re-attached: refusing "
               "device memory until it is valid again", rg->path);
        return;
    }
    TV_LOG(TV_LOG_WARN, "region %s valid again: charges resume", rg->path);
}

void tv_region_poll(struct tv_region *rg, int reclaim, const struct tv_region_seed *seed)
{
    if (rg->is_private) return;
    if (atomic_load(&rg->bad)) {
        try_reattach(rg, seed);
        return;
    }
    struct stat st, pst;
    int gone = fstat(rg->fd, &st) != 0 || (size_t)st.st_size != REGION_SZ ||
               stat(rg->path, &pst) != 0 || pst.st_ino != rg->ino || pst.st_dev != rg->dev;
    if (gone || !header_ok(rg->map)) {
        TV_LOG(TV_LOG_ERROR, "region %s was truncated, replaced or overwritten: refusing device "
               "memory until it is valid again", rg->path);
        atomic_store(&rg->bad, TV_BAD_FILE);
        set_standin(rg); /* never touch a truncated mapping again (SIGBUS) */
        return;
    }
    struct tsr_proc_slot *s = atomic_load(&rg->slot);
    if (s && tampered(rg, s)) {
        TV_LOG(TV_LOG_WARN, "region %s: this process's charges were changed: restored", rg->path);
        pthread_mutex_t *mu = tv_region_lock(rg);
        if (mu) {
            /* read again under the lock: the process may have given its slot up meanwhile
             * (its exit handler, tv_region_release): then there is nothing of ours to repair */
            s = atomic_load(&rg->slot);
            if (s) repair(rg, s);
            tv_region_unlock(mu);
        }
    } else if (s && seed && seed->region_is_account && total_below_slots(rg)) {
        /* the region is the account (no lease service): every device total, not only ours. A
         * free in flight looks like a lowered total without the lock: decided under it. */
        pthread_mutex_t *mu = tv_region_lock(rg);
        if (!mu) return;
        int raised = 0;
        uint32_t n = LOAD(rg->map->num_devices);
        for (uint32_t d = 0; d < n && d < TSR_MAX_DEVICES; d++) {
            uint64_t live = live_sum(rg, (int)d);
            if (LOAD(rg->map->dev[d].used_bytes) < live) {
                STORE(rg->map->dev[d].used_bytes, live);
                raised = 1;
            }
        }
        tv_region_unlock(mu);
        if (raised)
            TV_LOG(TV_LOG_WARN, "region %s: a device total was below what the processes hold: "
                   "restored", rg->path);
    }
    if (reclaim) reclaim_periodic(rg);
}

/* ---- devices ------------------------------------------------------------------------------ */

int tv_region_find_dev(struct tv_region *rg, const char *uuid)
{
    if (!uuid[0]) return -1;
    struct tsr_region *R = rg->map;
    uint32_t n = __atomic_load_n(&R->num_devices, __ATOMIC_ACQUIRE);
    for (uint32_t k = 0; k < n && k < TSR_MAX_DEVICES; k++)
        if (!strncmp(R->dev[k].uuid, uuid, TSR_UUID_LEN)) return (int)k;
    R = rg->priv;
    n = __atomic_load_n(&R->num_devices, __ATOMIC_ACQUIRE);
    for (uint32_t k = 0; k < n && k < TSR_MAX_DEVICES; k++)
        if (!strncmp(R->dev[k].uuid, uuid, TSR_UUID_LEN)) return TSR_MAX_DEVICES + (int)k;
    return -1;
}

int tv_region_dev_slot(struct tv_region *rg, const char *uuid,
                       const struct tv_region_seed *seed)
{
    if (!uuid[0]) return -1;
    int k = -1;
    /* read once: a repair between two reads would let a stand-in pass for a real slot */
    int bad = atomic_load(&rg->bad);
    if (!bad) {
        pthread_mutex_t *mu = tv_region_lock(rg);
        if (mu) {
            k = shared_slot_locked(rg, uuid, seed);
            tv_region_unlock(mu);
        } else {
            bad = TV_BAD_FILE; /* the lock not to be had: a stand-in, never kept */
        }
    }
    if (k >= 0) {
        snprintf(rg->uuid[k], TSR_UUID_LEN, "%s", uuid);
        return k;
    }
    /* no room we may take (this process alone is held to the limit), or a stand-in while bad */
    pthread_mutex_lock(&rg->priv_mu);
    struct tsr_region *P = rg->priv;
    uint32_t n = P->num_devices;
    int j = -1;
    for (uint32_t i = 0; i < n && j < 0; i++)
        if (!strncmp(P->dev[i].uuid, uuid, TSR_UUID_LEN)) j = (int)i;
    if (j < 0 && n < TSR_MAX_DEVICES) {
        snprintf(P->dev[n].uuid, TSR_UUID_LEN, "%s", uuid);
        __atomic_store_n(&P->num_devices, n + 1, __ATOMIC_RELEASE);
        j = (int)n;
        if (bad) atomic_fetch_or(&rg->standin, 1u << j);
    } else if (j >= 0 && !bad) {
        atomic_fetch_and(&rg->standin, ~(1u << j)); /* the shared table had no room: a real one */
    }
    pthread_mutex_unlock(&rg->priv_mu);
    if (j < 0) return -1;
    k = TSR_MAX_DEVICES + j;
    snprintf(rg->uuid[k], TSR_UUID_LEN, "%s", uuid);
    if (tv_region_standin(rg, k))
        TV_LOG(TV_LOG_ERROR, "region unusable: %s has a stand-in slot; its memory is refused "
               "until the region is repaired", uuid);
    else
        TV_LOG(TV_LOG_ERROR, "region: no device slot for %s: held to its limit by this "
               "process's own allocations", uuid);
    return k;
}

/* ---- memory ------------------------------------------------------------------------------- */

/* Caller holds the lock and has read what it decides on. The file was truncated since the
 * caller checked `bad` (on_sigbus sets it before it maps the zero page in the file's place): what
 * was read may be zeros, so nothing may be decided on it. */
static inline int faulted(struct tv_region *rg)
{
    return tv_unlikely(atomic_load_explicit(&rg->bad, memory_order_acquire) != 0);
}

static int fits(uint64_t used, uint64_t limit, uint64_t bytes)
{
    return !limit || (bytes <= limit && used <= limit - bytes);
}

/* What this process holds on a slot changes under the region's lock (charges and frees on
 * shared slots) or under priv_mu (private slots, and frees while the region is bad): the region
 * can go bad between two of them, so each change is one atomic read-modify-write and neither
 * lock's change is lost to the other (a charge used to store what it read before looking for
 * dead slots or repairing, where a repair drops the lock a moment). */
static inline uint64_t mine_add(struct tv_region *rg, int d, uint64_t bytes)
{
    return __atomic_add_fetch(&rg->mine[d], bytes, __ATOMIC_RELAXED);
}

static inline uint64_t mine_sub(struct tv_region *rg, int d, uint64_t bytes)
{
    uint64_t m = __atomic_load_n(&rg->mine[d], __ATOMIC_RELAXED), n;
    do n = m > bytes ? m - bytes : 0;
    while (!__atomic_compare_exchange_n(&rg->mine[d], &m, n, 1, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED));
    return n;
}

static int charge_private(struct tv_region *rg, int d, uint64_t bytes, uint64_t limit)
{
    if (tv_region_standin(rg, d)) return -1; /* resolved while bad, charged after the repair */
    struct tsr_region_device *rd = tv_region_dev(rg, d);
    pthread_mutex_lock(&rg->priv_mu);
    int ok = fits(rg->mine[d], limit, bytes);
    if (ok) {
        rg->mine[d] += bytes;
        STORE(rd->used_bytes, rg->mine[d]);
        if (rg->mine[d] > rd->peak_bytes) rd->peak_bytes = rg->mine[d];
    }
    pthread_mutex_unlock(&rg->priv_mu);
    return ok ? 0 : -1;
}

int tv_region_charge(struct tv_region *rg, int d, uint64_t bytes, uint64_t limit)
{
    if (atomic_load_explicit(&rg->bad, memory_order_relaxed)) return -1; /* until repaired */
    if (d >= TSR_MAX_DEVICES) return charge_private(rg, d, bytes, limit);
    struct tsr_proc_slot *s = tv_region_slot(rg);
    if (tv_unlikely(!s)) return -1; /* the region's lock not to be had */
    struct tsr_region_device *rd = &rg->map->dev[d];
    pthread_mutex_t *mu = tv_region_lock(rg);
    if (tv_unlikely(!mu)) return -1;
    if (tv_unlikely(atomic_load_explicit(&rg->bad, memory_order_relaxed))) {
        tv_region_unlock(mu); /* truncated under us: the lock itself faulted (on_sigbus) */
        return -1;
    }
    uint64_t used = LOAD(rd->used_bytes);
    if (tv_unlikely(tampered_dev(rg, s, d))) {
        repair(rg, s);
        s = atomic_load(&rg->slot);
        used = LOAD(rd->used_bytes);
    }
    if (!fits(used, limit, bytes)) {
        tv_region_reclaim_dead(rg);
        used = LOAD(rd->used_bytes);
    }
    /* truncated since the check above: what was read may be the zero page (on_sigbus) */
    int ok = !faulted(rg) && fits(used, limit, bytes);
    /* where the region is the account, the bytes are locked in the file too: counters the
     * tenant lowered cannot make room the container's processes still hold (kacct.c) */
    if (ok && rg->kacct && !rg->no_locks && tv_kacct_take(rg, d, bytes, limit) != 0) ok = 0;
    if (ok) {
        used += bytes;
        STORE(rd->used_bytes, used);
        STORE(s->used[d], mine_add(rg, d, bytes));
        if (used > LOAD(rd->peak_bytes)) STORE(rd->peak_bytes, used);
    }
    tv_region_unlock(mu);
    return ok ? 0 : -1;
}

static void uncharge_mine(struct tv_region *rg, int d, uint64_t bytes)
{
    pthread_mutex_lock(&rg->priv_mu);
    uint64_t m = mine_sub(rg, d, bytes);
    if (d >= TSR_MAX_DEVICES) STORE(tv_region_dev(rg, d)->used_bytes, m);
    pthread_mutex_unlock(&rg->priv_mu);
}

void tv_region_uncharge(struct tv_region *rg, int d, uint64_t bytes)
{
    if (d < 0 || d >= TV_MAX_SLOTS || bytes == 0) return;
    if (rg->kacct && !rg->no_locks && d < TSR_MAX_DEVICES) tv_kacct_give(rg, d, bytes);
    if (d >= TSR_MAX_DEVICES || atomic_load_explicit(&rg->bad, memory_order_relaxed)) {
        uncharge_mine(rg, d, bytes);
        return;
    }
    struct tsr_proc_slot *s = tv_region_slot(rg);
    pthread_mutex_t *mu = s ? tv_region_lock(rg) : NULL;
    if (tv_unlikely(!mu)) {
        /* the region's lock not to be had: this process's own account only; its slot then
         * reads more than it holds (counted high, never low) until it is written again */
        uncharge_mine(rg, d, bytes);
        return;
    }
    /* Our slot as it is now, before writing to it: a slot pointer kept across a tenant's
     * rewrite (a free used to write our count into whatever the slot had become) */
    if (tv_unlikely(tampered_dev(rg, s, d))) {
        repair(rg, s);
        s = atomic_load(&rg->slot);
    }
    struct tsr_region_device *rd = &rg->map->dev[d];
    uint64_t used = LOAD(rd->used_bytes);
    STORE(rd->used_bytes, used > bytes ? used - bytes : 0);
    STORE(s->used[d], mine_sub(rg, d, bytes));
    tv_region_unlock(mu);
}

void tv_region_count_oom(struct tv_region *rg, int d)
{
    if (d >= 0 && d < TV_MAX_SLOTS)
        __atomic_fetch_add(&tv_region_dev(rg, d)->oom_count, 1, __ATOMIC_RELAXED);
}

/* ---- spill: host memory through managed memory (spill.c) ------------------------------------ */

int tv_region_spill_charge(struct tv_region *rg, uint64_t bytes, uint64_t limit)
{
    if (atomic_load_explicit(&rg->bad, memory_order_relaxed) || !limit) return -1;
    struct tsr_proc_slot *s = tv_region_slot(rg);
    pthread_mutex_t *mu = s ? tv_region_lock(rg) : NULL;
    if (!mu) return -1;
    if (atomic_load_explicit(&rg->bad, memory_order_relaxed)) {
        tv_region_unlock(mu);
        return -1;
    }
    if (tampered(rg, s)) {
        repair(rg, s);
        s = atomic_load(&rg->slot);
    }
    STORE(rg->map->spill_limit_bytes, limit);
    uint64_t used = LOAD(rg->map->spilled_bytes);
    if (!fits(used, limit, bytes)) {
        tv_region_reclaim_dead(rg);
        used = LOAD(rg->map->spilled_bytes);
    }
    int ok = !faulted(rg) && fits(used, limit, bytes); /* as in tv_region_charge */
    if (ok) {
        rg->mine_spill += bytes;
        STORE(rg->map->spilled_bytes, used + bytes);
        if (used + bytes > LOAD(rg->map->spilled_peak_bytes))
            STORE(rg->map->spilled_peak_bytes, used + bytes);
        STORE(s->spilled_bytes, rg->mine_spill);
    }
    tv_region_unlock(mu);
    return ok ? 0 : -1;
}

void tv_region_spill_uncharge(struct tv_region *rg, uint64_t bytes)
{
    if (!bytes) return;
    struct tsr_proc_slot *s = NULL;
    pthread_mutex_t *mu = NULL;
    if (!atomic_load_explicit(&rg->bad, memory_order_relaxed) && (s = tv_region_slot(rg)))
        mu = tv_region_lock(rg);
    if (!mu) { /* bad, or its lock not to be had: this process's own account only */
        pthread_mutex_lock(&rg->priv_mu);
        rg->mine_spill = rg->mine_spill > bytes ? rg->mine_spill - bytes : 0;
        pthread_mutex_unlock(&rg->priv_mu);
        return;
    }
    uint64_t used = LOAD(rg->map->spilled_bytes);
    rg->mine_spill = rg->mine_spill > bytes ? rg->mine_spill - bytes : 0;
    STORE(rg->map->spilled_bytes, used > bytes ? used - bytes : 0);
    STORE(s->spilled_bytes, rg->mine_spill);
    tv_region_unlock(mu);
}
