/*
 * fake_state.h — the state a fake GPU keeps, shared by every process that loads the fake
 * libcuda.so.1 / libnvidia-ml.so.1 with the same FAKE_CUDA_STATE file: per-device physical
 * memory and an execution timeline. Kernels of a device run one after another in real time
 * (CLOCK_MONOTONIC); each executed interval is kept in a ring so that utilisation over any
 * window can be measured (fake NVML, fkstat).
 *
 * Environment: FAKE_CUDA_STATE (file; unset = private to the process), FAKE_GPU_COUNT (2),
 * FAKE_GPU_MEM_MB (16384), FAKE_KERNEL_US (100: a kernel's duration unless its name ends in
 * _<N>us), FAKE_CTX_BYTES (0: physical memory of a non-primary context), FAKE_NVML_REVERSE (1:
 * NVML enumerates devices in the reverse CUDA order), FAKE_CHECK_SCRUB (1: count frees of
 * memory that was not all zeros, for the scrub-on-free tests), FAKE_NVML_PID_OFFSET (0: added
 * to the pids NVML reports, as seen from outside a pid namespace), FAKE_PIDCHECK_GATE (a test's
 * hook: a file whose creation the "is this holder gone?" check waits for, see fake_state.c),
 * FAKE_EXIT_FREE_DELAY_MS (0: a gone process's memory is the card's again only this long after a
 * check first found it gone — a driver that frees a dying process's memory late).
 *
 * The timeline: every process's kernels on a device go into one queue, in submission order, and
 * run one at a time for their duration (a GPU time-slicing between contexts at kernel
 * granularity). An event completes when the work its process submitted to the device before it
 * is done (stream order; a process's streams on a device count as one queue), not when other
 * processes' work is — so an event pair around a kernel spans the other processes' kernels
 * queued ahead of it, as on a real shared GPU. Each interval is kept with its pid: fkstat and
 * the fake NVML's per-process utilisation read the device's truth from it.
 */
#ifndef FAKE_STATE_H
#define FAKE_STATE_H

#include <pthread.h>
#include <stdint.h>

#define FK_MAX_DEV 4
#define FK_RING (1 << 15)
#define FK_MAX_EXPORTS 256
#define FK_MAGIC 0x4B414646u

struct fk_interval {
    int64_t start, end;
    int32_t pid, pad;
};

struct fk_dev {
    char uuid[64];
    unsigned char uuid_bytes[16];
    uint64_t total, used;
    int64_t busy_until;
    uint64_t ring_n;
    struct fk_interval ring[FK_RING];
};

struct fk_export {
    int32_t in_use, dev, refs, pad;
    uint64_t size;
};

/* A process with a context on a device, and the device memory it holds (NVML's process list). */
struct fk_proc {
    int32_t pid, pad;
    uint64_t used;
    int64_t gone_at; /* when a check first found it gone (FAKE_EXIT_FREE_DELAY_MS), 0 before */
};
#define FK_MAX_PROCS 64

struct fk_state {
    uint32_t magic;
    int32_t ndev;
    pthread_mutex_t mu; /* robust, process-shared */
    struct fk_dev dev[FK_MAX_DEV];
    struct fk_export exports[FK_MAX_EXPORTS];
    struct fk_proc procs[FK_MAX_DEV][FK_MAX_PROCS];
};

struct fk_state *fk_state(void);          /* open/create once per process */
struct fk_state *fk_state_at(const char *path);
void fk_lock(struct fk_state *s);
void fk_unlock(struct fk_state *s);
int64_t fk_now(void);                     /* CLOCK_MONOTONIC ns */
void fk_sleep_until(int64_t t);
/* Append [start, end) for pid to dev's timeline: returns the end. Caller holds the lock. */
int64_t fk_enqueue(struct fk_state *s, int dev, int64_t dur, int pid);
/* GPU busy ns of dev inside [t0, t1), only pid's kernels when pid > 0. */
int64_t fk_busy(struct fk_state *s, int dev, int64_t t0, int64_t t1, int pid);
int fk_env_int(const char *name, int dflt);
/* pid holds `delta` more bytes on dev (0: it has a context there). Caller holds the lock. */
void fk_proc_note(struct fk_state *s, int dev, int pid, int64_t delta);
/* A real driver frees what a process held when it dies: give back the memory of dev's processes
 * that no longer exist (reaped). Returns the bytes. Caller holds the lock. */
uint64_t fk_reap_dead(struct fk_state *s, int dev);

#endif
