/*
 * regionlock.c — the region's robust cross-process mutex (region.h): made, and waited for in
 * slices so that no thread waits for ever on it (a truncated or replaced region, a lock word
 * the tenant forged or made unusable, a holder that keeps it past TV_REGION_LOCK_WAIT_MS), and
 * a dead owner's region recovered (region.c, tv_region_recover).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>

#include "region.h"

void tv_region_init_mutex(struct tsr_region *r)
{
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&r->lock.mutex, &a);
    pthread_mutexattr_destroy(&a);
    __atomic_store_n(&r->lock_ready, TSR_LOCK_READY, __ATOMIC_RELEASE);
}

/* Waited for in slices: a holder whose mapping was truncated releases a zero page's mutex and
 * wakes nobody (the waiter sleeps on the file's futex), so a waiter that only slept would sleep
 * for ever; between slices it looks whether the region went bad (on_sigbus, the poll thread). */
#define LOCK_SLICE_NS 10000000ull

/* Who holds m (glibc: a robust mutex's word is its owner's thread id and two flag bits). */
static int lock_owner(pthread_mutex_t *m)
{
    return __atomic_load_n(&m->__data.__lock, __ATOMIC_RELAXED) & 0x3fffffff;
}

/* `bad_ok`: a value of rg->bad to wait through (the poll thread's own TV_BAD_FILE while it
 * re-attaches), 0 none. */
pthread_mutex_t *tv_region_lock_wait(struct tv_region *rg, pthread_mutex_t *m, int r, int bad_ok)
{
    /* the bound runs while one owner keeps it: a lock passing from holder to holder (many
     * threads charging) is waited for as long as it takes */
    uint64_t since = tv_mono_ns();
    int owner = lock_owner(m);
    for (int reinit = 0;;) {
        if (r == EOWNERDEAD) {
            TV_LOG(TV_LOG_WARN, "region lock: its owner died; recovering");
            tv_region_recover(rg);
            pthread_mutex_consistent(m);
            r = 0;
        }
        int bad = atomic_load(&rg->bad);
        if (bad == bad_ok) bad = 0;
        if (r == 0) {
            if (!bad) return m;
            pthread_mutex_unlock(m); /* a zero page's (on_sigbus): nothing to decide on */
            return NULL;
        }
        if (r != EBUSY && r != ETIMEDOUT && r != EINTR) {
            /* a lock word the tenant made unusable: made again under the file's flock, once */
            if (reinit++ || m != &rg->map->lock.mutex) return NULL;
            TV_LOG(TV_LOG_ERROR, "region lock: error %d: re-initialising it", r);
            if (rg->fd >= 0) flock(rg->fd, LOCK_EX);
            tv_region_init_mutex(rg->map);
            if (rg->fd >= 0) flock(rg->fd, LOCK_UN);
            r = pthread_mutex_trylock(m);
            continue;
        }
        if (r == ETIMEDOUT && rg->fd >= 0 && m == &rg->shared->lock.mutex) {
            /* truncated while we wait (our poll thread may be the waiter): say so ourselves */
            struct stat st;
            if (fstat(rg->fd, &st) == 0 && (size_t)st.st_size != sizeof(struct tsr_region)) {
                atomic_store(&rg->bad, TV_BAD_FAULTED);
                bad = TV_BAD_FAULTED;
            }
        }
        if (bad) return NULL; /* truncated or replaced: nobody will wake us */
        int now_owner = lock_owner(m);
        if (now_owner != owner) {
            owner = now_owner;
            since = tv_mono_ns();
        } else if (tv_mono_ns() - since >= TV_REGION_LOCK_WAIT_MS * 1000000ull) {
            TV_LOG(TV_LOG_ERROR, "region lock held by thread %d for %d ms: giving up "
                   "(refusing)", owner, TV_REGION_LOCK_WAIT_MS);
            return NULL;
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t ns = (uint64_t)ts.tv_nsec + LOCK_SLICE_NS;
        ts.tv_sec += (time_t)(ns / 1000000000ull);
        ts.tv_nsec = (long)(ns % 1000000000ull);
        r = pthread_mutex_clocklock(m, CLOCK_MONOTONIC, &ts);
    }
}

pthread_mutex_t *tv_region_lock_slow(struct tv_region *rg, pthread_mutex_t *m, int r)
{
    return tv_region_lock_wait(rg, m, r, 0);
}

