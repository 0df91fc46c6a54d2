/* fake_state.c — see fake_state.h. Linked into the fake libcuda, the fake NVML and fkstat. */
#define _GNU_SOURCE
#include "fake_state.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int fk_env_int(const char *name, int dflt)
{
    const char *v = getenv(name);
    return v && *v ? atoi(v) : dflt;
}

int64_t fk_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void fk_sleep_until(int64_t t)
{
    for (;;) {
        int64_t d = t - fk_now();
        if (d <= 0) return;
        struct timespec ts = {d / 1000000000, d % 1000000000};
        nanosleep(&ts, NULL);
    }
}

static void init_state(struct fk_state *s)
{
    memset(s, 0, sizeof *s);
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&s->mu, &a);
    pthread_mutexattr_destroy(&a);
    s->ndev = fk_env_int("FAKE_GPU_COUNT", 2);
    if (s->ndev < 1) s->ndev = 1;
    if (s->ndev > FK_MAX_DEV) s->ndev = FK_MAX_DEV;
    uint64_t mem = (uint64_t)fk_env_int("FAKE_GPU_MEM_MB", 16384) << 20;
    for (int i = 0; i < s->ndev; i++) {
        struct fk_dev *d = &s->dev[i];
        unsigned char b[16] = {0xfa, 0x4e, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                               0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, (unsigned char)i};
        memcpy(d->uuid_bytes, b, 16);
        snprintf(d->uuid, sizeof d->uuid,
                 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                 b[14], b[15]);
        d->total = mem;
    }
    /* FAKE_GPU_UUIDS: "GPU-<uuid>,GPU-<uuid>": the devices' UUIDs, e.g. a node's as the node
     * agent advertises them (a simulated node running real driver-API programs). */
    const char *uuids = getenv("FAKE_GPU_UUIDS");
    for (int i = 0; uuids && *uuids && i < s->ndev; i++) {
        struct fk_dev *d = &s->dev[i];
        unsigned char b[16];
        const char *p = uuids + (strncmp(uuids, "GPU-", 4) ? 0 : 4);
        int n = 0;
        while (n < 16 && p[0] && p[0] != ',') {
            unsigned v;
            if (*p == '-') { p++; continue; }
            if (sscanf(p, "%2x", &v) != 1) break;
            b[n++] = (unsigned char)v;
            p += 2;
        }
        if (n == 16) {
            memcpy(d->uuid_bytes, b, 16);
            snprintf(d->uuid, sizeof d->uuid, "%.*s", (int)strcspn(uuids, ","), uuids);
        }
        uuids = strchr(uuids, ',');
        if (uuids) uuids++;
    }
    __atomic_store_n(&s->magic, FK_MAGIC, __ATOMIC_RELEASE);
}

struct fk_state *fk_state_at(const char *path)
{
    size_t sz = sizeof(struct fk_state);
    struct fk_state *s;
    if (!path || !*path) {
        s = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (s == MAP_FAILED) abort();
        init_state(s);
        return s;
    }
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) {
        perror(path);
        abort();
    }
    flock(fd, LOCK_EX);
    struct stat st;
    fstat(fd, &st);
    if ((size_t)st.st_size < sz && ftruncate(fd, (off_t)sz) != 0) abort();
    s = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (s == MAP_FAILED) abort();
    if (__atomic_load_n(&s->magic, __ATOMIC_ACQUIRE) != FK_MAGIC) init_state(s);
    flock(fd, LOCK_UN);
    close(fd);
    return s;
}

static struct fk_state *g_state;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static void open_default(void)
{
    g_state = fk_state_at(getenv("FAKE_CUDA_STATE"));
}

struct fk_state *fk_state(void)
{
    pthread_once(&g_once, open_default);
    return g_state;
}

void fk_lock(struct fk_state *s)
{
    if (pthread_mutex_lock(&s->mu) == EOWNERDEAD) pthread_mutex_consistent(&s->mu);
}

void fk_unlock(struct fk_state *s)
{
    pthread_mutex_unlock(&s->mu);
}

int64_t fk_enqueue(struct fk_state *s, int dev, int64_t dur, int pid)
{
    struct fk_dev *d = &s->dev[dev];
    int64_t now = fk_now();
    int64_t start = d->busy_until > now ? d->busy_until : now;
    int64_t end = start + dur;
    d->busy_until = end;
    struct fk_interval *iv = &d->ring[d->ring_n % FK_RING];
    iv->start = start;
    iv->end = end;
    iv->pid = pid;
    d->ring_n++;
    return end;
}

int64_t fk_busy(struct fk_state *s, int dev, int64_t t0, int64_t t1, int pid)
{
    struct fk_dev *d = &s->dev[dev];
    int64_t busy = 0;
    uint64_t n = d->ring_n, lo = n > FK_RING ? n - FK_RING : 0;
    for (uint64_t i = n; i > lo; i--) {
        struct fk_interval *iv = &d->ring[(i - 1) % FK_RING];
        if (iv->end <= t0) break; /* intervals are in time order */
        if (pid > 0 && iv->pid != pid) continue;
        int64_t a = iv->start > t0 ? iv->start : t0, b = iv->end < t1 ? iv->end : t1;
        if (b > a) busy += b - a;
    }
    return busy;
}

/* A real driver frees a dead process's memory when its device files close, which may be a
 * moment after its other files (its lease socket) closed. FAKE_EXIT_FREE_DELAY_MS=<n> models
 * that: a gone process's memory is the card's again only n ms after a check first found it gone
 * (0, the default: at once). */
static int freed(struct fk_proc *p)
{
    int64_t delay = (int64_t)fk_env_int("FAKE_EXIT_FREE_DELAY_MS", 0) * 1000000;
    if (delay <= 0) return 1;
    if (!p->gone_at) p->gone_at = fk_now();
    return fk_now() - p->gone_at >= delay;
}

void fk_proc_note(struct fk_state *s, int dev, int pid, int64_t delta)
{
    struct fk_proc *free_p = NULL;
    for (int i = 0; i < FK_MAX_PROCS; i++) {
        struct fk_proc *p = &s->procs[dev][i];
        if (p->pid == pid) {
            p->used = delta < 0 && (uint64_t)-delta > p->used ? 0 : p->used + (uint64_t)delta;
            return;
        }
        if (!free_p && (p->pid == 0 || (kill(p->pid, 0) != 0 && errno == ESRCH && freed(p))))
            free_p = p;
    }
    if (!free_p) return;
    /* a gone process's slot: what it held is the device's again (as fk_reap_dead), not lost */
    struct fk_dev *d = &s->dev[dev];
    d->used -= free_p->used < d->used ? free_p->used : d->used;
    *free_p = (struct fk_proc){.pid = pid, .used = delta > 0 ? (uint64_t)delta : 0};
}

/* A test's hook between fk_pid_gone's two checks (FAKE_PIDCHECK_GATE=<file>): say so on stderr,
 * then wait (up to 30 s) until the file exists — so a test can reap the process right there. */
static void pidcheck_gate(int pid)
{
    const char *gate = getenv("FAKE_PIDCHECK_GATE");
    if (!gate || !*gate) return;
    fprintf(stderr, "fake: pid %d checked, waiting for %s\n", pid, gate);
    fflush(stderr);
    for (int64_t end = fk_now() + 30000000000LL; access(gate, F_OK) != 0 && fk_now() < end;)
        fk_sleep_until(fk_now() + 1000000);
}

/* Exited or exiting: no such process, a zombie, or PF_EXITING (a driver frees a process's memory
 * as it exits). Only a /proc/<pid>/stat read that shows a live state says "not gone": a read that
 * fails because the process was reaped after kill() found it (by its parent, right after it
 * closed its files) asks kill() again — it was taken for alive, and its memory stayed held. */
static int fk_pid_gone(int pid)
{
    if (kill(pid, 0) != 0 && errno == ESRCH) return 1;
    pidcheck_gate(pid);
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = 0;
    const char *close_paren = n ? strrchr(buf, ')') : NULL;
    if (!close_paren || close_paren[1] != ' ') return kill(pid, 0) != 0 && errno == ESRCH;
    char state = close_paren[2];
    unsigned flags = 0; /* field 9; PF_EXITING (0x4): the process is exiting, its files closing */
    if (sscanf(close_paren + 2, "%*c %*d %*d %*d %*d %*d %u", &flags) != 1) flags = 0;
    return state == 'Z' || state == 'X' || (flags & 0x4u);
}

uint64_t fk_reap_dead(struct fk_state *s, int dev)
{
    uint64_t back = 0;
    for (int i = 0; i < FK_MAX_PROCS; i++) {
        struct fk_proc *p = &s->procs[dev][i];
        if (p->pid == 0 || !fk_pid_gone(p->pid) || !freed(p)) continue;
        back += p->used;
        *p = (struct fk_proc){0};
    }
    struct fk_dev *d = &s->dev[dev];
    if (back > d->used) back = d->used;
    d->used -= back;
    return back;
}
