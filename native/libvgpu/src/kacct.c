/*
 * kacct.c — where the region is the container's account (limits sealed without a lease
 * service), the part of it a tenant cannot write: every byte a process charges on a shared
 * device slot is also a byte it holds locked in the region file, through its own description of
 * it (F_OFD_SETLK, write locks), at offsets [KACCT_BASE + d * KACCT_SPAN, ... + limit). Locks
 * of different descriptions never overlap — the kernel refuses it — so the bytes a container's
 * processes hold on a device never add up to more than its limit, whatever anyone wrote into
 * the region's counters, slots or totals; and the kernel drops a process's locks when it dies,
 * as it frees its memory. The region's counters stay what is read back and the first check.
 *
 * Each process keeps the ranges it holds (fungible: a free gives back from the top). A charge
 * looks for free bytes just above its own highest range, then from the bottom: a few fcntl
 * calls. Limits: a process keeps ranges taken under a higher limit after the limit is lowered
 * (the container may then hold up to the old limit while the region's counters are tampered
 * with); a region replaced by another file (a new inode: a directory the tenant may write)
 * starts an empty account, each process's holdings locked again anywhere in the span.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <string.h>

#include "region.h"

#define KACCT_BASE (1ull << 46)
#define KACCT_SPAN (1ull << 44) /* 16 TiB a device: beyond any limit */
#define KACCT_RANGES 512        /* per device and process; more fragments: refused */
#define KACCT_STEPS 4096        /* fcntl calls one charge may make (a tenant's many locks) */

struct range {
    uint64_t start, end; /* [start, end), file offsets */
};

static struct {
    struct range r[KACCT_RANGES]; /* ours, sorted, disjoint, never adjacent */
    unsigned n;
    uint64_t held;
} acct[TSR_MAX_DEVICES];
static pthread_mutex_t acct_mu = PTHREAD_MUTEX_INITIALIZER;

static int setlk(int fd, short type, uint64_t start, uint64_t len)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = (off_t)start,
                       .l_len = (off_t)len};
    int r;
    do r = fcntl(fd, F_OFD_SETLK, &fl);
    while (r != 0 && errno == EINTR);
    return r;
}

/* Another description's lock over part of [start, start + len): 1 (its range), 0 none, -1
 * error. Which one, where several are, is the kernel's choice. */
static int getlk(int fd, uint64_t start, uint64_t len, uint64_t *cs, uint64_t *ce)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = (off_t)start,
                       .l_len = (off_t)len};
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return -1;
    if (fl.l_type == F_UNLCK) return 0;
    *cs = (uint64_t)fl.l_start;
    *ce = fl.l_len == 0 ? UINT64_MAX : (uint64_t)fl.l_start + (uint64_t)fl.l_len;
    return 1;
}

/* Caller holds acct_mu. [s, e) is ours now: into the list (merged with neighbours). */
static int add_range(unsigned d, uint64_t s, uint64_t e)
{
    struct range *r = acct[d].r;
    unsigned n = acct[d].n, k = 0;
    while (k < n && r[k].start < s) k++;
    int prev = k > 0 && r[k - 1].end == s, next = k < n && r[k].start == e;
    if (prev && next) {
        r[k - 1].end = r[k].end;
        memmove(&r[k], &r[k + 1], (n - k - 1) * sizeof *r);
        acct[d].n--;
    } else if (prev) {
        r[k - 1].end = e;
    } else if (next) {
        r[k].start = s;
    } else {
        if (n == KACCT_RANGES) return -1;
        memmove(&r[k + 1], &r[k], (n - k) * sizeof *r);
        r[k] = (struct range){s, e};
        acct[d].n++;
    }
    acct[d].held += e - s;
    return 0;
}

/* Caller holds acct_mu. Give back up to `bytes` from our highest ranges. */
static void give_locked(int fd, unsigned d, uint64_t bytes)
{
    while (bytes && acct[d].n) {
        struct range *top = &acct[d].r[acct[d].n - 1];
        uint64_t cut = top->end - top->start < bytes ? top->end - top->start : bytes;
        if (fd >= 0) setlk(fd, F_UNLCK, top->end - cut, cut);
        top->end -= cut;
        if (top->end == top->start) acct[d].n--;
        acct[d].held -= cut;
        bytes -= cut;
    }
}

/* Caller holds acct_mu. Lock [s, e) (none of it ours) and list it: 0 done, 1 another holds
 * some of it, -1 failed (the list full, an error). */
static int grab(int fd, unsigned d, uint64_t s, uint64_t e)
{
    if (setlk(fd, F_WRLCK, s, e - s) != 0) return errno == EAGAIN || errno == EACCES ? 1 : -1;
    if (add_range(d, s, e) == 0) return 0;
    setlk(fd, F_UNLCK, s, e - s);
    return -1;
}

/* Caller holds acct_mu. Lock up to `need` free bytes in [from, end) (ours skipped) and list
 * them; stops early when the list or the step budget runs out. */
static void take_from(int fd, unsigned d, uint64_t from, uint64_t end, uint64_t need,
                      unsigned *steps)
{
    uint64_t got = 0, pos = from;
    while (got < need && pos < end) {
        if (++*steps > KACCT_STEPS) return;
        uint64_t qend = pos + (need - got) < end ? pos + (need - got) : end;
        int inside = 0; /* ours: skipped; stop the range at our next one */
        for (unsigned k = 0; k < acct[d].n && !inside; k++) {
            const struct range *r = &acct[d].r[k];
            if (pos >= r->start && pos < r->end) pos = r->end, inside = 1;
            else if (r->start > pos && r->start < qend) qend = r->start;
        }
        if (inside) continue;
        /* if the kernel lets us lock it, nobody else held any of it: one call in the common
         * case (right above our own highest range) */
        int g = grab(fd, d, pos, qend);
        if (g == 1) {
            /* the kernel names one lock over a range, not the lowest: narrow down to a range
             * none is over, or one over its start */
            uint64_t cs = 0, ce = 0;
            int c;
            while ((c = getlk(fd, pos, qend - pos, &cs, &ce)) == 1 && cs > pos) {
                if (++*steps > KACCT_STEPS) return;
                qend = cs;
            }
            if (c < 0) return;
            if (c == 1) {
                pos = ce; /* another's: past it */
                continue;
            }
            g = grab(fd, d, pos, qend);
            if (g == 1) continue; /* taken meanwhile: look again */
        }
        if (g < 0) return;
        got += qend - pos;
        pos = qend;
    }
}

int tv_kacct_take(struct tv_region *rg, int d, uint64_t bytes, uint64_t limit)
{
    if (d < 0 || d >= TSR_MAX_DEVICES || !bytes) return 0;
    int fd = rg->fd;
    if (fd < 0) return -1;
    uint64_t base = KACCT_BASE + (uint64_t)d * KACCT_SPAN;
    uint64_t end = base + (limit && limit < KACCT_SPAN ? limit : KACCT_SPAN);
    pthread_mutex_lock(&acct_mu);
    uint64_t before = acct[d].held;
    unsigned steps = 0;
    /* just above our highest range first (it grows in place), then from the bottom */
    uint64_t top = acct[d].n ? acct[d].r[acct[d].n - 1].end : base;
    take_from(fd, (unsigned)d, top, end, bytes, &steps);
    if (acct[d].held - before < bytes)
        take_from(fd, (unsigned)d, base, end, bytes - (acct[d].held - before), &steps);
    int ok = acct[d].held - before == bytes;
    if (!ok) give_locked(fd, (unsigned)d, acct[d].held - before); /* fungible: from the top */
    pthread_mutex_unlock(&acct_mu);
    if (!ok)
        TV_LOG(TV_LOG_INFO, "device slot %d: %llu bytes beyond what the container's account "
               "holds for it (limit %llu)", d, (unsigned long long)bytes,
               (unsigned long long)limit);
    return ok ? 0 : -1;
}

void tv_kacct_give(struct tv_region *rg, int d, uint64_t bytes)
{
    if (d < 0 || d >= TSR_MAX_DEVICES || !bytes) return;
    pthread_mutex_lock(&acct_mu);
    give_locked(rg->fd, (unsigned)d, bytes);
    pthread_mutex_unlock(&acct_mu);
}

/* A description of another file (the region replaced): what this process holds, locked again
 * in it, anywhere in each device's span (the limit is not known here). What cannot be had is
 * logged: the container's account then misses it. */
void tv_kacct_relock(struct tv_region *rg)
{
    pthread_mutex_lock(&acct_mu);
    for (unsigned d = 0; d < TSR_MAX_DEVICES; d++) {
        uint64_t held = acct[d].held;
        acct[d].n = 0;
        acct[d].held = 0;
        if (!held || rg->fd < 0) continue;
        unsigned steps = 0;
        uint64_t base = KACCT_BASE + (uint64_t)d * KACCT_SPAN;
        take_from(rg->fd, d, base, base + KACCT_SPAN, held, &steps);
        if (acct[d].held != held)
            TV_LOG(TV_LOG_ERROR, "device slot %u: %llu of %llu bytes not locked again in the "
                   "replaced region", d, (unsigned long long)(held - acct[d].held),
                   (unsigned long long)held);
    }
    pthread_mutex_unlock(&acct_mu);
}

/* The child of a fork holds nothing (its description of the file is its own: region.c). */
void tv_kacct_after_fork_child(void)
{
    memset(acct, 0, sizeof acct);
    pthread_mutex_init(&acct_mu, NULL);
}
