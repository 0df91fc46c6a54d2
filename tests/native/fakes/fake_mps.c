/*
 * fake_mps.c — the MPS client side of the fake libcuda.so.1 (no GPU here).
 *
 * As NVIDIA documents MPS: when CUDA is initialised and a control daemon answers on
 * CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps), the process becomes a client of the
 * server of its uid, and that server's limits — the pinned device memory limit and the active
 * thread percentage, fixed when the client connects — bind it; when no daemon answers it runs
 * without MPS. A client's own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT ("0=1G,1=512M" or one value)
 * and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE can only lower them, never raise them.
 *
 * The daemon is the fake control daemon (tests/node_agent/fake_mps_control.py): instead of the
 * real driver's private protocol the client sends `fake_client_attach <pid> <uid>` on the
 * daemon's socket `<pipe dir>/control` and reads `<limit bytes (0: none)> <thread %>`.
 * An allocation that would take the client past its limit on a device fails with
 * CUDA_ERROR_OUT_OF_MEMORY, whatever physical memory is free.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "fake_mps.h"

static pthread_mutex_t mps_mu = PTHREAD_MUTEX_INITIALIZER;
static int mps_client;        /* connected to a server */
static uint64_t mps_limit;    /* bytes per device, 0 = none */
static double mps_threads = 100.0;
static uint64_t mps_used[FK_MAX_DEV];

static uint64_t parse_size(const char *s)
{
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s) return 0;
    switch (toupper((unsigned char)*end)) {
    case 'K': return (uint64_t)v << 10;
    case 'M': return (uint64_t)v << 20;
    case 'G': return (uint64_t)v << 30;
    case 'T': return (uint64_t)v << 40;
    default: return (uint64_t)v;
    }
}

/* The client's own request for device 0 ("0=1G,1=2G" or a bare value); 0 = none. */
static uint64_t env_limit(void)
{
    const char *e = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
    if (!e || !*e) return 0;
    if (!strchr(e, '=')) return parse_size(e);
    for (const char *p = e; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL)
        if (p[0] == '0' && p[1] == '=') return parse_size(p + 2);
    return 0;
}

static int ask_daemon(const char *dir, char *reply, size_t cap)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (snprintf(a.sun_path, sizeof a.sun_path, "%s/control", dir) >= (int)sizeof a.sun_path)
        return -1;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1; /* no daemon: not an MPS client */
    }
    char req[96];
    int n = snprintf(req, sizeof req, "fake_client_attach %d %u\n", (int)getpid(), (unsigned)getuid());
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return -2;
    }
    size_t got = 0;
    while (got + 1 < cap) {
        ssize_t r = read(fd, reply + got, cap - 1 - got);
        if (r <= 0) break;
        got += (size_t)r;
        if (memchr(reply, '\0', got)) break;
    }
    reply[got] = 0;
    close(fd);
    return got ? 0 : -2;
}

CUresult fk_mps_attach(void)
{
    pthread_mutex_lock(&mps_mu);
    if (mps_client) {
        pthread_mutex_unlock(&mps_mu);
        return CUDA_SUCCESS;
    }
    const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
    char reply[256];
    int r = ask_daemon(dir && *dir ? dir : "/tmp/nvidia-mps", reply, sizeof reply);
    if (r == -1) {
        pthread_mutex_unlock(&mps_mu);
        return CUDA_SUCCESS;
    }
    unsigned long long limit = 0;
    double threads = 100.0;
    if (r != 0 || sscanf(reply, "%llu %lf", &limit, &threads) != 2) {
        pthread_mutex_unlock(&mps_mu);
        return CUDA_ERROR_MPS_CONNECTION_FAILED;
    }
    uint64_t mine = env_limit();
    mps_limit = limit;
    if (mine && (!mps_limit || mine < mps_limit)) mps_limit = mine; /* only lower */
    const char *t = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    double want = t && *t ? atof(t) : 0;
    mps_threads = want > 0 && want < threads ? want : threads;
    mps_client = 1;
    pthread_mutex_unlock(&mps_mu);
    return CUDA_SUCCESS;
}

int fk_mps_take(int dev, uint64_t bytes)
{
    if (dev < 0 || dev >= FK_MAX_DEV) return 0;
    pthread_mutex_lock(&mps_mu);
    int ok = !mps_client || !mps_limit || mps_used[dev] + bytes <= mps_limit;
    if (ok && mps_client) mps_used[dev] += bytes;
    pthread_mutex_unlock(&mps_mu);
    return ok ? 0 : -1;
}

void fk_mps_give(int dev, uint64_t bytes)
{
    if (dev < 0 || dev >= FK_MAX_DEV) return;
    pthread_mutex_lock(&mps_mu);
    if (mps_client) mps_used[dev] -= bytes < mps_used[dev] ? bytes : mps_used[dev];
    pthread_mutex_unlock(&mps_mu);
}

int fk_mps_threads(void)
{
    return mps_client ? (int)(mps_threads + 0.5) : 100;
}
