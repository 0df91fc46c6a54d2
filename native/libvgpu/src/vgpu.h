/* vgpu.h — libvgpu's internal interfaces (one process's view). */
#ifndef TV_VGPU_H
#define TV_VGPU_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#include "symbols.h"
#include "tessera_region.h"

#define TV_HIDDEN __attribute__((visibility("hidden")))
#define tv_likely(x) __builtin_expect(!!(x), 1)
#define tv_unlikely(x) __builtin_expect(!!(x), 0)

#define TV_MAX_CUDA_DEVS 64
#define TV_SM_PAUSE 1000u                   /* sm_eff: launches wait (yield with 0 %) */
#define TV_DEFAULT_CTX_CHARGE (64ull << 20) /* per context beyond the primary */

/* ---- log.c ---- */
enum { TV_LOG_ERROR = 0, TV_LOG_WARN = 1, TV_LOG_INFO = 2, TV_LOG_DEBUG = 4 };
extern int tv_log_level;
void tv_log_init(void) TV_HIDDEN;
void tv_log(int level, const char *fmt, ...) TV_HIDDEN __attribute__((format(printf, 2, 3)));
#define TV_LOG(lvl, ...)                                                                   \
    do {                                                                                   \
        if (tv_unlikely((lvl) <= tv_log_level)) tv_log((lvl), __VA_ARGS__);               \
    } while (0)

static inline uint64_t tv_mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO: no system call */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
static inline uint64_t tv_real_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
void tv_sleep_ns(uint64_t ns) TV_HIDDEN;

/* ---- per device slot, this process's copy of the limits in force ---- */
struct tv_dev {
    _Atomic uint64_t mem_limit; /* bytes, 0 = unlimited */
    _Atomic uint32_t sm_eff;    /* 0 = unthrottled, 1..99 = %, TV_SM_PAUSE = wait */
    _Atomic int ordinal;        /* CUDA ordinal in this process, -1 = not seen */
    uint64_t win_busy, win_ts;  /* poll thread: achieved-% window */
};

struct tv_state {
    /* init (hooks.c) */
    _Atomic int core_ready;
    _Atomic int cuda_ready;
    _Atomic int nvml_ready;
    void *cuda_handle;
    void *nvml_handle;

    /* limits (limits.c) */
    int sealed;                 /* limits come from a file (sealed dir or TESSERA_LIMITS_DIR) */
    char limits_file[TSR_PATH_LEN + 32];
    struct tsr_limits lim;      /* the last good limits file, or built from env */
    uint64_t env_mem[TSR_MAX_DEVICES];
    uint32_t env_sm[TSR_MAX_DEVICES];
    _Atomic uint32_t flags;     /* TSR_LIMITS_* */
    uint64_t ctx_charge;

    /* region (region.c) */
    struct tsr_region *region;
    int region_fd;
    int region_private;         /* no shared file: accounting is per process */
    _Atomic(struct tsr_proc_slot *) slot;
    int slot_idx;
    pid_t pid;
    uint64_t start_time;

    /* devices */
    _Atomic int cuda_slot[TV_MAX_CUDA_DEVS]; /* CUDA ordinal -> region device slot, -1 unknown */
    struct tv_dev dev[TSR_MAX_DEVICES];
    _Atomic int throttle_any;   /* some device has sm_eff != 0: launches take the slow path */

    pthread_mutex_t mu;         /* init, device mapping, limits reload */
};
extern struct tv_state tv TV_HIDDEN;

/* ---- hooks.c: init and the real driver ---- */
void tv_core_init(void) TV_HIDDEN;          /* limits + region, no driver needed */
int tv_cuda_init(void) TV_HIDDEN;           /* + the real libcuda; 0 ok */
int tv_nvml_init(void) TV_HIDDEN;           /* + the real libnvidia-ml; 0 ok */
void *tv_real_dlsym(void *handle, const char *name) TV_HIDDEN;
#define TV_CUDA_ENTER()                                                                    \
    do {                                                                                   \
        if (tv_unlikely(!atomic_load_explicit(&tv.cuda_ready, memory_order_acquire)) &&    \
            tv_cuda_init() != 0)                                                           \
            return CUDA_ERROR_NOT_INITIALIZED;                                             \
    } while (0)

/* ---- limits.c ---- */
void tv_limits_load(void) TV_HIDDEN;        /* at init: sealed file, else env */
int tv_limits_poll(void) TV_HIDDEN;         /* poll thread: reload when the file changed */
void tv_limits_apply_slot(int dslot) TV_HIDDEN; /* recompute tv.dev[dslot] from tv.lim/env */
const char *tv_limits_region_path(void) TV_HIDDEN;
void tv_poll_thread_start(void) TV_HIDDEN;
void tv_limits_after_fork_child(void) TV_HIDDEN;

/* ---- region.c ---- */
void tv_region_open(const char *path) TV_HIDDEN;
void tv_region_lock(void) TV_HIDDEN;
void tv_region_unlock(void) TV_HIDDEN;
struct tsr_proc_slot *tv_slot(void) TV_HIDDEN;   /* this process's slot, registering if needed */
void tv_region_release_slot(void) TV_HIDDEN;
int tv_region_dev_slot(const char *uuid) TV_HIDDEN; /* find or add, -1 if full */
int tv_region_reclaim_dead(void) TV_HIDDEN;   /* caller holds the lock */
void tv_region_periodic_reclaim(void) TV_HIDDEN; /* at most once a second per container */
int tv_region_find_dev(const char *uuid) TV_HIDDEN; /* -1 if the region has no such device */
int tv_mem_reserve(int dslot, uint64_t bytes) TV_HIDDEN; /* 0 ok, -1 over the limit */
void tv_mem_unreserve(int dslot, uint64_t bytes) TV_HIDDEN;
void tv_region_after_fork_child(void) TV_HIDDEN;

/* ---- devices (hooks.c) ---- */
int tv_dev_slot(CUdevice dev) TV_HIDDEN;    /* region device slot of a CUDA device, -1 unknown */
int tv_ctx_dev_slot(void) TV_HIDDEN;        /* ... of the current context's device */
int tv_stream_dev_slot(CUstream s) TV_HIDDEN;
void tv_format_uuid(const CUuuid *u, char out[TSR_UUID_LEN]) TV_HIDDEN;

/* ---- memory tracking (memtrack.h: memtrack.c, memory.c, mempool.c, vmm.c, ...) ---- */
void tv_memory_after_fork_child(void) TV_HIDDEN; /* memtrack.c */
int tv_mem_refresh_pools(void) TV_HIDDEN; /* mempool.c: uncharge what the driver took back */

/* ---- compute.c ---- */
void tv_compute_poll(uint64_t now_mono, uint64_t now_real) TV_HIDDEN; /* poll thread tick */
void tv_compute_after_fork_child(void) TV_HIDDEN;
void tv_compute_forget_ctx(CUcontext ctx) TV_HIDDEN; /* before the context is destroyed */
void tv_compute_shutdown(void) TV_HIDDEN;            /* at exit */
void tv_compute_recharge(int dslot, int64_t bucket_ns, int64_t busy_ns) TV_HIDDEN; /* owntime */

/* ---- owntime.c: own device time out of event time (NVML per-process utilisation) ---- */
int64_t tv_owntime_charge(int dslot, int64_t raw_ns) TV_HIDDEN; /* measured -> charged ns */
unsigned tv_owntime_poll(uint64_t now_mono) TV_HIDDEN; /* tick: bit d = NVML answered for d */
void tv_owntime_reset(void) TV_HIDDEN;                          /* after fork, in the child */

/* ---- virt.c ---- */
uint64_t tv_dev_used(int dslot) TV_HIDDEN;

#endif
