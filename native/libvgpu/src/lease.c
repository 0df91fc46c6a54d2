/*
 * lease.c — the lease client (lease.h): one unix stream connection per process to the node
 * agent's lease service, opened at CUDA start-up (an open connection is also the process's
 * attestation to the watchdog), asked only when the local lease runs short, and closed by the
 * kernel when the process dies (the agent then takes its leases back).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "lease.h"
#include "vgpu.h"

_Atomic int tv_lease_on;
struct tv_lease_slot tv_lease[TV_LEASE_SLOTS];

static pthread_mutex_t lease_mu = PTHREAD_MUTEX_INITIALIZER; /* the socket and `leased` */
static int sock = -1;
static char sock_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
static char rbuf[512]; /* what was read and not yet parsed */
static size_t rlen;
static unsigned ticks;
static int connected_once; /* this process reached the service at least once */

#define REPLY_TIMEOUT_S 5 /* the agent waits at most a few hundred ms for recalls */

/* The name a slot is leased under: its GPU's uuid, or the spill account's; "" = none. */
static const char *lease_name(int d)
{
    return d == TV_LEASE_SPILL ? TSR_LEASE_SPILL_NAME : tv.rg.uuid[d];
}

void tv_lease_init(const char *limits_file, uint32_t limits_flags)
{
    if (!(limits_flags & TSR_LIMITS_LEASE) || !limits_file[0]) return;
    const char *slash = strrchr(limits_file, '/');
    int dir_len = slash ? (int)(slash - limits_file) : 1;
    int n = snprintf(sock_path, sizeof sock_path, "%.*s/%s", dir_len,
                     slash ? limits_file : ".", TSR_LEASE_SOCKET_NAME);
    if (n <= 0 || (size_t)n >= sizeof sock_path) {
        TV_LOG(TV_LOG_ERROR, "lease socket path too long: allocations on limited devices "
               "will be refused");
        sock_path[0] = 0;
    }
    atomic_store(&tv_lease_on, 1); /* once on, never off: the sealed file asked for it */
}

/* ---- the connection (caller holds lease_mu) ------------------------------------------------ */

static int send_line(const char *line)
{
    size_t len = strlen(line), off = 0;
    while (off < len) {
        ssize_t n = send(sock, line + off, len - off, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        off += (size_t)n;
    }
    return 0;
}

/* The connection is gone: the agent took back every lease of it, including what this process
 * has charged. Keep what is charged as `leased` (to be declared again on reconnect), drop the
 * unused rest. */
static void drop_connection(void)
{
    if (sock >= 0) close(sock);
    sock = -1;
    rlen = 0;
    for (int d = 0; d < TV_LEASE_SLOTS; d++) {
        uint64_t a = atomic_exchange(&tv_lease[d].avail, 0);
        atomic_fetch_sub(&tv_lease[d].leased, a);
    }
}

static int connect_locked(void)
{
    if (sock >= 0) return 0;
    if (!sock_path[0]) return -1;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    struct timeval tmo = {.tv_sec = REPLY_TIMEOUT_S};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tmo, sizeof tmo);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tmo, sizeof tmo);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    memcpy(a.sun_path, sock_path, sizeof a.sun_path);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        TV_LOG(TV_LOG_INFO, "lease service %s: %s", sock_path, strerror(errno));
        close(fd);
        return -1;
    }
    sock = fd;
    connected_once = 1;
    /* declare what this process already holds (after the agent restarted) */
    char line[TSR_UUID_LEN + 48];
    for (int d = 0; d < TV_LEASE_SLOTS; d++) {
        uint64_t held = atomic_load(&tv_lease[d].leased);
        if (!held || !lease_name(d)[0]) continue;
        snprintf(line, sizeof line, "H %s %llu\n", lease_name(d), (unsigned long long)held);
        if (send_line(line) != 0) {
            drop_connection();
            return -1;
        }
    }
    TV_LOG(TV_LOG_INFO, "lease service %s: connected", sock_path);
    return 0;
}

/* connect_locked, but a process that never reached the service waits for it up to
 * FIRST_CONNECT_WAIT_MS (its container may start a moment before the agent serves its socket). */
#define FIRST_CONNECT_WAIT_MS 1000
static int connect_first(void)
{
    for (int waited = 0;; waited += 50) {
        if (connect_locked() == 0) return 0;
        if (connected_once || waited >= FIRST_CONNECT_WAIT_MS) return -1;
        tv_sleep_ns(50ull * 1000000ull);
    }
}

/* Give back every unused byte of every slot (the agent asked: another process needs them),
 * then say so ("D"): the agent stops waiting for this process. */
static void give_back_unused(void)
{
    char line[TSR_UUID_LEN + 48];
    for (int d = 0; d < TV_LEASE_SLOTS && sock >= 0; d++) {
        uint64_t a = atomic_exchange(&tv_lease[d].avail, 0);
        if (!a) continue;
        atomic_fetch_sub(&tv_lease[d].leased, a);
        snprintf(line, sizeof line, "R %s %llu\n", lease_name(d), (unsigned long long)a);
        if (send_line(line) != 0) drop_connection();
    }
    if (sock >= 0 && send_line("D\n") != 0) drop_connection();
}

/* One complete line out of rbuf into out (without the newline); 0 if none yet. */
static int next_line(char *out, size_t cap)
{
    char *nl = memchr(rbuf, '\n', rlen);
    if (!nl) {
        if (rlen == sizeof rbuf) rlen = 0; /* garbage: never a valid line */
        return 0;
    }
    size_t len = (size_t)(nl - rbuf);
    size_t keep = len < cap - 1 ? len : cap - 1;
    memcpy(out, rbuf, keep);
    out[keep] = 0;
    rlen -= len + 1;
    memmove(rbuf, nl + 1, rlen);
    return 1;
}

static int fill(int flags)
{
    if (rlen == sizeof rbuf) rlen = 0; /* no line that long is ours: drop it */
    ssize_t n;
    do n = recv(sock, rbuf + rlen, sizeof rbuf - rlen, flags);
    while (n < 0 && errno == EINTR);
    if (n > 0) rlen += (size_t)n;
    return (int)n;
}

/* The answer to a request: granted bytes, 0 refused, -1 the connection failed. */
static int64_t read_answer(void)
{
    char line[64];
    for (;;) {
        while (next_line(line, sizeof line)) {
            if (line[0] == 'C') give_back_unused(); /* at once: the other may be waiting */
            else if (line[0] == 'N') return 0;
            else if (line[0] == 'G' && line[1] == ' ') return (int64_t)strtoull(line + 2, NULL, 10);
        }
        if (sock < 0 || fill(0) <= 0) return -1;
    }
}

/* ---- taking, trimming ----------------------------------------------------------------------- */

static int take_local(int d, uint64_t bytes)
{
    struct tv_lease_slot *l = &tv_lease[d];
    uint64_t a = atomic_load(&l->avail);
    while (a >= bytes)
        if (atomic_compare_exchange_weak(&l->avail, &a, a - bytes)) return 0;
    return -1;
}

int tv_lease_take_slow(int d, uint64_t bytes)
{
    if (d < 0 || d >= TV_LEASE_SLOTS) return -1;
    int ok = -1;
    pthread_mutex_lock(&lease_mu);
    for (int tries = 0; tries < 4 && ok != 0; tries++) {
        if (take_local(d, bytes) == 0) {
            ok = 0;
            break;
        }
        if (!lease_name(d)[0] || connect_first() != 0) break;
        uint64_t have = atomic_load(&tv_lease[d].avail);
        uint64_t need = bytes > have ? bytes - have : 0;
        uint64_t want = (need + TSR_LEASE_CHUNK - 1) / TSR_LEASE_CHUNK * TSR_LEASE_CHUNK;
        if (want < need || d == TV_LEASE_SPILL) want = need; /* overflow; spill: exactly */
        char line[TSR_UUID_LEN + 64];
        snprintf(line, sizeof line, "A %s %llu %llu\n", lease_name(d), (unsigned long long)need,
                 (unsigned long long)want);
        int64_t got = send_line(line) == 0 ? read_answer() : -1;
        /* A grant is memory the lease service counts as ours: if the driver still says the card
         * is full, a borrower it reclaimed is still giving it back (killed, its memory freed as
         * its files close). Not judged by how long the answer took: a reclaim on a quiet node
         * can be answered in well under a millisecond. */
        if (got > 0 && d != TV_LEASE_SPILL)
            atomic_store_explicit(&tv_memory_back_ns, tv_mono_ns(), memory_order_relaxed);
        if (got < 0) {
            TV_LOG(TV_LOG_WARN, "lease service: connection lost");
            drop_connection();
            continue; /* reconnect once more, declaring what we hold */
        }
        if (got == 0) break; /* refused: the container's limit is leased */
        atomic_fetch_add(&tv_lease[d].leased, (uint64_t)got); /* whatever came: it is ours */
        atomic_fetch_add(&tv_lease[d].avail, (uint64_t)got);
        if ((uint64_t)got < need) break;
    }
    pthread_mutex_unlock(&lease_mu);
    if (ok != 0)
        TV_LOG(TV_LOG_INFO, "lease of %llu bytes on slot %d refused", (unsigned long long)bytes,
               d);
    return ok;
}

void tv_lease_trim(int d)
{
    /* never wait on a free: a request of another thread may be waiting on a recall; the next
     * free trims instead */
    if (pthread_mutex_trylock(&lease_mu) != 0) return;
    struct tv_lease_slot *l = &tv_lease[d];
    uint64_t keep = d == TV_LEASE_SPILL ? 0 : TSR_LEASE_CHUNK; /* spill keeps nothing unused */
    uint64_t a = atomic_load(&l->avail);
    while (a > keep && !atomic_compare_exchange_weak(&l->avail, &a, keep)) {
    }
    if (a > keep) {
        uint64_t back = a - keep;
        atomic_fetch_sub(&l->leased, back);
        char line[TSR_UUID_LEN + 48];
        snprintf(line, sizeof line, "R %s %llu\n", lease_name(d), (unsigned long long)back);
        if (sock >= 0 && send_line(line) != 0) drop_connection();
    }
    pthread_mutex_unlock(&lease_mu);
}

/* ---- spill (spill.c): host memory leased exactly, given back at once ---------------------- */

int tv_lease_spill_take(uint64_t bytes)
{
    if (!atomic_load_explicit(&tv_lease_on, memory_order_relaxed)) return 0;
    return tv_lease_take_slow(TV_LEASE_SPILL, bytes);
}

void tv_lease_spill_give(uint64_t bytes)
{
    if (!atomic_load_explicit(&tv_lease_on, memory_order_relaxed)) return;
    struct tv_lease_slot *l = &tv_lease[TV_LEASE_SPILL];
    uint64_t a = atomic_load(&l->avail), n;
    do {
        uint64_t held = atomic_load(&l->leased);
        n = a + bytes;
        if (n > held || n < a) n = held;
    } while (!atomic_compare_exchange_weak(&l->avail, &a, n));
    tv_lease_trim(TV_LEASE_SPILL); /* (a request in flight: the next take uses it, or a recall) */
}

/* ---- start-up, the poll thread, fork -------------------------------------------------------- */

void tv_lease_attach(void)
{
    if (!atomic_load(&tv_lease_on)) return;
    pthread_mutex_lock(&lease_mu);
    if (connect_locked() != 0)
        TV_LOG(TV_LOG_ERROR, "no lease service at %s: allocations on limited devices will be "
               "refused until it answers", sock_path);
    pthread_mutex_unlock(&lease_mu);
}

/* Caller holds lease_mu: read what arrived unasked (recalls), notice a closed connection. */
static void drain_locked(void)
{
    int n;
    while ((n = fill(MSG_DONTWAIT)) > 0) {
    }
    if (n == 0) {
        TV_LOG(TV_LOG_WARN, "lease service closed the connection");
        drop_connection();
        return;
    }
    char line[64];
    int recall = 0;
    while (next_line(line, sizeof line))
        if (line[0] == 'C') recall = 1;
    if (recall) give_back_unused();
}

void tv_lease_wait(uint64_t ns)
{
    if (!atomic_load_explicit(&tv_lease_on, memory_order_relaxed)) {
        tv_sleep_ns(ns);
        return;
    }
    uint64_t end = tv_mono_ns() + ns;
    if (pthread_mutex_trylock(&lease_mu) == 0) {
        if (sock < 0 && ++ticks % 5 == 0) connect_locked(); /* every 100 ms */
        pthread_mutex_unlock(&lease_mu);
    }
    /* wake at once for a recall: another process of the container is waiting on it */
    for (uint64_t now = tv_mono_ns(); now < end; now = tv_mono_ns()) {
        int fd = __atomic_load_n(&sock, __ATOMIC_RELAXED);
        if (fd < 0) {
            tv_sleep_ns(end - now);
            return;
        }
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int ms = (int)((end - now + 999999) / 1000000);
        if (poll(&p, 1, ms) <= 0) continue;
        if (pthread_mutex_trylock(&lease_mu) != 0) {
            tv_sleep_ns(1000000); /* an allocation is reading it: it handles recalls itself */
            continue;
        }
        if (sock == fd) drain_locked();
        pthread_mutex_unlock(&lease_mu);
    }
}

void tv_lease_after_fork_child(void)
{
    pthread_mutex_init(&lease_mu, NULL);
    if (sock >= 0) close(sock); /* the parent's connection: its leases stay the parent's */
    sock = -1;
    rlen = 0;
    connected_once = 0;
    for (int d = 0; d < TV_LEASE_SLOTS; d++) {
        atomic_store(&tv_lease[d].avail, 0);
        atomic_store(&tv_lease[d].leased, 0);
    }
}

/* ---- the driver's out-of-memory for memory the container is owed (lease.h) ----------------- */

#define OWED_RETRY_MS_DEFAULT 1000
#define OWED_RETRY_MS_MAX 10000
static int owed_retry_ms = -1; /* TESSERA_RECLAIM_RETRY_MS, read at the first failure */

static uint64_t owed_retry_bound_ns(void)
{
    int ms = __atomic_load_n(&owed_retry_ms, __ATOMIC_RELAXED);
    if (ms < 0) {
        const char *v = getenv("TESSERA_RECLAIM_RETRY_MS");
        char *end = NULL;
        long x = v && *v ? strtol(v, &end, 10) : OWED_RETRY_MS_DEFAULT;
        if (v && *v && (*end || x < 0)) {
            TV_LOG(TV_LOG_WARN, "TESSERA_RECLAIM_RETRY_MS=%s is not a number of ms: using %d", v,
                   OWED_RETRY_MS_DEFAULT);
            x = OWED_RETRY_MS_DEFAULT;
        }
        ms = (int)(x > OWED_RETRY_MS_MAX ? OWED_RETRY_MS_MAX : x);
        __atomic_store_n(&owed_retry_ms, ms, __ATOMIC_RELAXED);
    }
    return (uint64_t)ms * 1000000ull;
}

/* The card's free memory as the driver sees it, if the current context is on slot d. */
static int card_free(int d, uint64_t *out)
{
    size_t f = 0, total = 0;
    if (tv_ctx_dev_slot() != d || REAL(cuMemGetInfo_v2)(&f, &total) != CUDA_SUCCESS) return -1;
    *out = f;
    return 0;
}

enum { WHY_NONE, WHY_BACK, WHY_BLIND };
static const char *const why_text[] = {
    [WHY_BACK] = "memory is being given back for it (a reclaim, or a dead process of the "
                 "container)",
    [WHY_BLIND] = "the card's free memory cannot be read here",
};

int tv_owed_oom_wait(struct tv_oom_retry *t, int d, uint64_t bytes)
{
    uint64_t bound = owed_retry_bound_ns(), now = tv_mono_ns();
    if (!t->tries) {
        if (!bound) return 0;
        t->start_ns = t->quiet_from_ns = now;
        t->step_ns = 2000000;
        t->reason = card_free(d, &t->free_seen) == 0 ? WHY_NONE : WHY_BLIND;
    }
    uint64_t back = atomic_load_explicit(&tv_memory_back_ns, memory_order_relaxed);
    if (t->reason == WHY_NONE && back && back + bound >= t->start_ns) t->reason = WHY_BACK;
    uint64_t free_now;
    if (t->reason == WHY_NONE && t->tries && card_free(d, &free_now) == 0 &&
        free_now > t->free_seen) {
        t->free_seen = free_now; /* memory is being freed on the card: keep looking */
        t->quiet_from_ns = now;
    }
    if (!t->tries)
        TV_LOG(TV_LOG_INFO, "driver out of memory for %llu bytes owed on slot %d (a reclaimed "
               "process's memory not freed yet?): retrying for up to %llu ms%s%s",
               (unsigned long long)bytes, d, (unsigned long long)(bound / 1000000),
               t->reason ? ": " : " while memory is given back or freed on the card",
               t->reason ? why_text[t->reason] : "");
    uint64_t spent = now - t->start_ns;
    if (spent >= bound) return 0;
    if (t->reason == WHY_NONE && now - t->quiet_from_ns >= TV_OWED_QUIET_MS * 1000000ull) {
        TV_LOG(TV_LOG_WARN, "driver out of memory for %llu bytes owed on slot %d: the card is "
               "full and nothing is given back (no reclaim, no dead process of the container, "
               "no memory freed on the card for %d ms): failing after %llu ms, not %llu",
               (unsigned long long)bytes, d, TV_OWED_QUIET_MS,
               (unsigned long long)(spent / 1000000), (unsigned long long)(bound / 1000000));
        t->reason = -1; /* said: tv_owed_oom_done stays quiet */
        return 0;
    }
    uint64_t step = t->step_ns < bound - spent ? t->step_ns : bound - spent;
    tv_sleep_ns(step);
    if (t->step_ns < 64000000) t->step_ns *= 2;
    t->tries++;
    return 1;
}

void tv_owed_oom_done(const struct tv_oom_retry *t, int d, uint64_t bytes, int ok)
{
    if (!t->tries || t->reason < 0) return;
    unsigned long long ms = (tv_mono_ns() - t->start_ns) / 1000000;
    if (ok)
        TV_LOG(TV_LOG_INFO, "%llu bytes on slot %d allocated after %llu ms (%u retries)",
               (unsigned long long)bytes, d, ms, t->tries);
    else
        TV_LOG(TV_LOG_WARN, "driver still out of memory for %llu bytes owed on slot %d after "
               "%llu ms: failing", (unsigned long long)bytes, d, ms);
}
