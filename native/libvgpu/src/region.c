/*
 * region.c — the usage region shared by the container's processes: creation, the robust
 * cross-process lock, process slots (and reclaiming those of dead processes), and the atomic
 * reserve / unreserve of device memory against the limit.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "vgpu.h"

#define R (tv.region)
#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELAXED)

static struct tsr_proc_slot overflow_slot; /* used only when all TSR_MAX_PROCS slots are live */

/* ---- processes ---------------------------------------------------------------------------- */

#define TV_PF_EXITING 0x4u /* linux/sched.h: the task is exiting (robust futexes released) */

/* state (a dying process reads 'X'), and starttime from /proc/<pid>/stat; 0 ok, -1 unreadable */
static int proc_stat(pid_t pid, char *state, uint64_t *start)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ') return -1;
    p += 2;
    *state = *p;
    /* p points at field 3 (state); flags is field 9, starttime field 22 */
    for (int field = 3; field < 22 && p; field++) {
        p = strchr(p, ' ');
        if (p) p++;
        if (p && field + 1 == 9 && (strtoul(p, NULL, 10) & TV_PF_EXITING)) *state = 'X';
    }
    if (!p) return -1;
    *start = strtoull(p, NULL, 10);
    return 0;
}

static uint64_t self_start_time(void)
{
    char st;
    uint64_t t = 0;
    if (proc_stat(getpid(), &st, &t) != 0) return 0;
    return t;
}

static int proc_alive(pid_t pid, uint64_t start)
{
    if (pid <= 0) return 0;
    if (pid == tv.pid) return 1;
    if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
    char state;
    uint64_t st;
    if (proc_stat(pid, &state, &st) != 0) return kill(pid, 0) == 0 || errno != ESRCH;
    if (state == 'Z' || state == 'X' || state == 'x') return 0;
    if (start && st != start) return 0; /* the pid was reused */
    return 1;
}

/* Caller holds the lock. Uncharge a slot's bytes and free it. */
static void reclaim_slot(struct tsr_proc_slot *s)
{
    for (int d = 0; d < TSR_MAX_DEVICES; d++) {
        uint64_t u = LOAD(s->used[d]), total = LOAD(R->dev[d].used_bytes);
        if (u) STORE(R->dev[d].used_bytes, total > u ? total - u : 0);
    }
    memset(s, 0, sizeof *s);
}

int tv_region_reclaim_dead(void)
{
    int n = 0;
    for (int i = 0; i < TSR_MAX_PROCS; i++) {
        struct tsr_proc_slot *s = &R->procs[i];
        pid_t pid = LOAD(s->pid);
        if (pid == 0 || pid == tv.pid) continue;
        if (!proc_alive(pid, LOAD(s->start_time))) {
            TV_LOG(TV_LOG_INFO, "reclaiming slot %d of dead process %d", i, (int)pid);
            reclaim_slot(s);
            n++;
        }
    }
    return n;
}

/* After a lock owner died: free dead slots, then rebuild every total from the live slots (the
 * dead owner may have stopped between updating a total and its slot). */
static void recover(void)
{
    tv_region_reclaim_dead();
    for (int d = 0; d < TSR_MAX_DEVICES; d++) {
        uint64_t sum = 0;
        for (int i = 0; i < TSR_MAX_PROCS; i++)
            if (LOAD(R->procs[i].pid)) sum += LOAD(R->procs[i].used[d]);
        STORE(R->dev[d].used_bytes, sum);
    }
}

static void init_mutex(void)
{
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&R->lock.mutex, &a);
    pthread_mutexattr_destroy(&a);
}

void tv_region_lock(void)
{
    int r = pthread_mutex_lock(&R->lock.mutex);
    if (tv_likely(r == 0)) return;
    if (r == EOWNERDEAD) {
        TV_LOG(TV_LOG_WARN, "region lock: its owner died; recovering");
        recover();
        pthread_mutex_consistent(&R->lock.mutex);
        return;
    }
    if (r == ENOTRECOVERABLE) {
        TV_LOG(TV_LOG_ERROR, "region lock not recoverable: re-initialising it");
        if (tv.region_fd >= 0) flock(tv.region_fd, LOCK_EX);
        init_mutex();
        if (tv.region_fd >= 0) flock(tv.region_fd, LOCK_UN);
        tv_region_lock();
        return;
    }
    TV_LOG(TV_LOG_ERROR, "region lock: error %d", r);
}

void tv_region_unlock(void)
{
    pthread_mutex_unlock(&R->lock.mutex);
}

/* ---- creation ----------------------------------------------------------------------------- */

static void init_region(struct tsr_region *r)
{
    memset(r, 0, sizeof *r);
    r->major = TSR_VERSION_MAJOR;
    r->minor = TSR_VERSION_MINOR;
    r->size = sizeof *r;
    r->max_procs = TSR_MAX_PROCS;
    r->priority = tv.lim.priority;
    r->core_policy = tv.lim.core_policy;
    r->created_ns = tv_real_ns();
    struct tsr_region *saved = R;
    R = r;
    init_mutex();
    R = saved;
    uint32_t n = 0;
    for (uint32_t i = 0; i < tv.lim.num_devices && i < TSR_MAX_DEVICES; i++)
        if (tv.lim.dev[i].uuid[0])
            memcpy(r->dev[n++].uuid, tv.lim.dev[i].uuid, TSR_UUID_LEN);
    for (int d = 0; d < TSR_MAX_DEVICES; d++) {
        r->dev[d].achieved_sm_x100 = TSR_SM_UNKNOWN;
        r->dev[d].sm_limit_pct = 100;
    }
    r->num_devices = n;
    __atomic_store_n(&r->magic, TSR_REGION_MAGIC, __ATOMIC_RELEASE);
}

static int region_ok(const struct tsr_region *r)
{
    return __atomic_load_n(&r->magic, __ATOMIC_ACQUIRE) == TSR_REGION_MAGIC;
}

void tv_region_open(const char *path)
{
    const size_t sz = sizeof(struct tsr_region);
    struct tsr_region *r = NULL;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd >= 0) {
        struct stat st;
        if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sz) {
            r = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (r == MAP_FAILED) r = NULL;
        }
        if (!r || !region_ok(r)) {
            flock(fd, LOCK_EX); /* only the first process of the container gets here */
            if (fstat(fd, &st) == 0 && (size_t)st.st_size < sz && ftruncate(fd, (off_t)sz) != 0)
                TV_LOG(TV_LOG_ERROR, "region %s: cannot grow: %s", path, strerror(errno));
            if (!r) {
                r = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
                if (r == MAP_FAILED) r = NULL;
            }
            if (r && !region_ok(r)) init_region(r);
            flock(fd, LOCK_UN);
        }
        if (r && r->major != TSR_VERSION_MAJOR) {
            TV_LOG(TV_LOG_ERROR, "region %s has version %u.%u, this libvgpu %u.%u", path,
                   r->major, r->minor, TSR_VERSION_MAJOR, TSR_VERSION_MINOR);
            munmap(r, sz);
            r = NULL;
        }
        if (r) {
            tv.region_fd = fd;
        } else {
            close(fd);
        }
    }
    if (!r) {
        TV_LOG(TV_LOG_WARN, "region %s unusable (%s): accounting is per process", path,
               strerror(errno));
        r = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (r == MAP_FAILED) abort();
        init_region(r);
        tv.region_private = 1;
    }
    R = r;
    tv.start_time = self_start_time();
}

/* ---- process slots ------------------------------------------------------------------------ */

struct tsr_proc_slot *tv_slot(void)
{
    struct tsr_proc_slot *s = atomic_load_explicit(&tv.slot, memory_order_acquire);
    if (tv_likely(s != NULL)) return s;
    tv_core_init();
    if (!tv.start_time) tv.start_time = self_start_time();
    tv_region_lock();
    s = atomic_load(&tv.slot);
    if (!s) {
        int idx = -1;
        for (int pass = 0; pass < 2 && idx < 0; pass++) {
            for (int i = 0; i < TSR_MAX_PROCS; i++) {
                pid_t pid = LOAD(R->procs[i].pid);
                if (pid == tv.pid) { /* a previous process with our pid: it is dead */
                    reclaim_slot(&R->procs[i]);
                    idx = i;
                    break;
                }
                if (pid == 0 && idx < 0) idx = i;
            }
            if (idx < 0) tv_region_reclaim_dead();
        }
        if (idx >= 0) {
            s = &R->procs[idx];
            memset(s, 0, sizeof *s);
            STORE(s->start_time, tv.start_time);
            STORE(s->pid, (int32_t)tv.pid);
        } else {
            TV_LOG(TV_LOG_ERROR, "region full (%d processes): this process is not tracked",
                   TSR_MAX_PROCS);
            s = &overflow_slot;
        }
        tv.slot_idx = idx;
        atomic_store_explicit(&tv.slot, s, memory_order_release);
    }
    tv_region_unlock();
    tv_poll_thread_start();
    return s;
}

void tv_region_release_slot(void)
{
    struct tsr_proc_slot *s = atomic_load(&tv.slot);
    if (!s || !R) return;
    tv_region_lock();
    if (s == &overflow_slot) {
        for (int d = 0; d < TSR_MAX_DEVICES; d++) {
            uint64_t u = s->used[d], total = LOAD(R->dev[d].used_bytes);
            STORE(R->dev[d].used_bytes, total > u ? total - u : 0);
        }
        memset(s, 0, sizeof *s);
    } else if (LOAD(s->pid) == (int32_t)tv.pid) {
        reclaim_slot(s);
    }
    atomic_store(&tv.slot, NULL);
    tv_region_unlock();
}

void tv_region_after_fork_child(void)
{
    atomic_store(&tv.slot, NULL);
    tv.slot_idx = -1;
    tv.start_time = 0;
    tv_limits_after_fork_child();
}

void tv_region_periodic_reclaim(void)
{
    if (!R || tv.region_private) return;
    uint64_t now = tv_mono_ns();
    uint64_t last = __atomic_load_n(&R->reclaim_ns, __ATOMIC_RELAXED);
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
        if (pid && pid != tv.pid && !proc_alive(pid, st)) {
            idx[n] = i;
            pids[n] = pid;
            starts[n++] = st;
        }
    }
    if (!n) return;
    tv_region_lock();
    for (int k = 0; k < n; k++) {
        struct tsr_proc_slot *s = &R->procs[idx[k]];
        if (LOAD(s->pid) == pids[k] && LOAD(s->start_time) == starts[k]) {
            TV_LOG(TV_LOG_INFO, "reclaiming slot %d of dead process %d", idx[k], (int)pids[k]);
            reclaim_slot(s);
        }
    }
    tv_region_unlock();
}

/* ---- devices ------------------------------------------------------------------------------ */

int tv_region_find_dev(const char *uuid)
{
    if (!R || !uuid[0]) return -1;
    uint32_t n = __atomic_load_n(&R->num_devices, __ATOMIC_ACQUIRE);
    for (uint32_t k = 0; k < n && k < TSR_MAX_DEVICES; k++)
        if (!strncmp(R->dev[k].uuid, uuid, TSR_UUID_LEN)) return (int)k;
    return -1;
}

int tv_region_dev_slot(const char *uuid)
{
    int k = tv_region_find_dev(uuid);
    if (k >= 0) return k;
    tv_region_lock();
    k = tv_region_find_dev(uuid);
    if (k < 0) {
        uint32_t n = R->num_devices;
        if (n < TSR_MAX_DEVICES) {
            snprintf(R->dev[n].uuid, TSR_UUID_LEN, "%s", uuid);
            __atomic_store_n(&R->num_devices, n + 1, __ATOMIC_RELEASE);
            k = (int)n;
        } else {
            TV_LOG(TV_LOG_ERROR, "region: more than %d devices", TSR_MAX_DEVICES);
        }
    }
    tv_region_unlock();
    return k;
}

/* ---- memory accounting -------------------------------------------------------------------- */

static int fits(int d, uint64_t limit, uint64_t bytes)
{
    uint64_t used = LOAD(R->dev[d].used_bytes);
    return !limit || (bytes <= limit && used <= limit - bytes);
}

int tv_mem_reserve(int d, uint64_t bytes)
{
    if (d < 0 || d >= TSR_MAX_DEVICES || bytes == 0) return 0;
    struct tsr_proc_slot *s = tv_slot();
    for (int attempt = 0;; attempt++) {
        uint64_t limit = atomic_load_explicit(&tv.dev[d].mem_limit, memory_order_relaxed);
        tv_region_lock();
        if (!fits(d, limit, bytes) && attempt == 0) tv_region_reclaim_dead();
        if (fits(d, limit, bytes)) {
            struct tsr_region_device *rd = &R->dev[d];
            uint64_t used = LOAD(rd->used_bytes) + bytes;
            STORE(rd->used_bytes, used);
            STORE(s->used[d], LOAD(s->used[d]) + bytes);
            if (used > LOAD(rd->peak_bytes)) STORE(rd->peak_bytes, used);
            tv_region_unlock();
            return 0;
        }
        tv_region_unlock();
        if (attempt == 0 && tv_mem_refresh_pools() > 0) continue; /* pools gave memory back */
        __atomic_fetch_add(&R->dev[d].oom_count, 1, __ATOMIC_RELAXED);
        TV_LOG(TV_LOG_INFO, "out of memory on slot %d: %llu + %llu > %llu", d,
               (unsigned long long)LOAD(R->dev[d].used_bytes), (unsigned long long)bytes,
               (unsigned long long)limit);
        return -1;
    }
}

void tv_mem_unreserve(int d, uint64_t bytes)
{
    if (d < 0 || d >= TSR_MAX_DEVICES || bytes == 0) return;
    struct tsr_proc_slot *s = tv_slot();
    tv_region_lock();
    struct tsr_region_device *rd = &R->dev[d];
    uint64_t used = LOAD(rd->used_bytes), mine = LOAD(s->used[d]);
    STORE(rd->used_bytes, used > bytes ? used - bytes : 0);
    STORE(s->used[d], mine > bytes ? mine - bytes : 0);
    tv_region_unlock();
}
