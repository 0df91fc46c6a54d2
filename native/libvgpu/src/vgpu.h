/*
 * vgpu.h — libvgpu's layers, top-down. Each layer calls only the ones below it.
 *
 *   interception  intercept.c (dlsym / dlvsym / dlmopen hooks, the cuGetProcAddress swap),
 *                 the entry points: memory.c mempool.c vmm.c arrays.c graphmem.c contexts.c
 *                 compute.c virt.c, and init.c (lazy start-up, the poll thread, fork, exit)
 *   accounting    account.c (account.h: what was charged, reserve / unreserve against the
 *   and limiting  limit), limits.c (the limits in force), devices.c (CUDA device -> slot),
 *                 the compute limiter (compute.c)
 *   bottom        region.c (region.h: the usage region), driver.c (driver.h: the real driver
 *                 table and glibc's own lookup), log.c (base.h)
 *
 * The process's state is one struct tv_state: each layer's part is its own struct, and the
 * bottom layer's functions take theirs explicitly (struct tv_region *).
 */
#ifndef TV_VGPU_H
#define TV_VGPU_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

#include "base.h"
#include "driver.h"
#include "region.h"

#define TV_MAX_CUDA_DEVS 64
#define TV_SM_PAUSE 0xFFFFFFFFu              /* sm_eff: launches wait (yield with 0 %) */
#define TV_SM_FULL 10000u                   /* sm_eff of the whole device (% x 100) */
#define TV_DEFAULT_CTX_CHARGE (64ull << 20) /* per context beyond the primary */

/* ---- per device slot, this process's copy of the limits in force ---- */
struct tv_dev {
    _Atomic uint64_t mem_limit; /* bytes, 0 = unlimited (the guarantee under limits 1.2) */
    _Atomic uint64_t mem_burst; /* limits 1.2: memory burst limit, bytes; 0 = none (hard slice) */
    _Atomic uint32_t sm_eff;    /* 0 = unthrottled, 1..TV_SM_FULL = % x 100, TV_SM_PAUSE = wait
                                   (an elastic device stays throttled even at the full device:
                                   its queue stays short, so lent compute comes back at once) */
    _Atomic int elastic;        /* limits 1.2: sm_eff is the allowance the node agent lends */
    _Atomic int yielding;       /* sm_eff comes from YIELD (a higher priority is active) */
    _Atomic int ordinal;        /* CUDA ordinal in this process, -1 = not seen */
    uint64_t win_busy, win_ts;  /* poll thread: achieved-% window */
};

/* limits.c: where the limits come from */
struct tv_limits {
    int sealed;                 /* the sealed file of the node agent exists */
    int file_mode;              /* limits come from a file (sealed, or TESSERA_LIMITS_DIR) */
    int broken;                 /* the file exists but never parsed: refuse all allocations */
    char file[TSR_PATH_LEN + 32];
    struct tsr_limits lim;      /* the last good limits file, or built from env */
    uint64_t env_mem[TSR_MAX_DEVICES], env_mem_all;
    uint32_t env_sm[TSR_MAX_DEVICES];
};

struct tv_state {
    /* init.c */
    _Atomic int core_ready;     /* limits read, region open */
    _Atomic int cuda_ready;     /* + the real driver, this process registered, poll thread */
    _Atomic int nvml_ready;
    void *cuda_handle;
    void *nvml_handle;
    pthread_mutex_t mu;         /* init, device mapping, limits reload */

    struct tv_limits lm;        /* limits.c */
    _Atomic uint32_t flags;     /* TSR_LIMITS_* in force */
    _Atomic uint64_t spill_limit; /* limits 1.3: host memory allocations may spill to (spill.c) */
    uint64_t ctx_charge;

    struct tv_region rg;        /* region.c */

    /* devices.c / limits.c */
    _Atomic int cuda_slot[TV_MAX_CUDA_DEVS]; /* CUDA ordinal -> device slot, -1 unknown */
    struct tv_dev dev[TV_MAX_SLOTS];
    _Atomic int throttle_any;   /* some device has sm_eff != 0: launches take the slow path */
};
extern struct tv_state tv TV_HIDDEN;

/* ---- init.c, intercept.c (top) ---- */
void tv_intercept_init(void) TV_HIDDEN;     /* constructor: the sorted hook table */
void tv_core_init(void) TV_HIDDEN;          /* limits + region, no driver needed */
int tv_cuda_init(void) TV_HIDDEN;           /* + the real libcuda; 0 ok */
int tv_nvml_init(void) TV_HIDDEN;           /* + the real libnvidia-ml; 0 ok */
#define TV_CUDA_ENTER()                                                                    \
    do {                                                                                   \
        if (tv_unlikely(!atomic_load_explicit(&tv.cuda_ready, memory_order_acquire)) &&    \
            tv_cuda_init() != 0)                                                           \
            return CUDA_ERROR_NOT_INITIALIZED;                                             \
    } while (0)
/* This process's slot in the region (registered by tv_cuda_init). */
static inline struct tsr_proc_slot *tv_slot(void)
{
    struct tsr_proc_slot *s = atomic_load_explicit(&tv.rg.slot, memory_order_acquire);
    return tv_likely(s != NULL) ? s : tv_region_register(&tv.rg);
}

/* ---- limits.c (middle) ---- */
void tv_limits_load(void) TV_HIDDEN;        /* at init: sealed file, else env */
int tv_limits_poll(void) TV_HIDDEN;         /* poll thread: reload when the file changed */
void tv_limits_apply_slot(int dslot) TV_HIDDEN; /* recompute tv.dev[dslot]; caller holds tv.mu */
const char *tv_limits_region_path(void) TV_HIDDEN;
void tv_limits_seed(struct tv_region_seed *out) TV_HIDDEN; /* what the region must know */
int tv_limits_any_mem(void) TV_HIDDEN;      /* some memory limit (or a broken file) exists */

/* ---- devices.c (middle) ---- */
int tv_dev_slot(CUdevice dev) TV_HIDDEN;    /* device slot of a CUDA device, -1 unknown */
int tv_ctx_dev_slot(void) TV_HIDDEN;        /* ... of the current context's device */
int tv_stream_dev_slot(CUstream s) TV_HIDDEN;
int tv_uuid_slot(const char *uuid) TV_HIDDEN; /* NVML: by UUID, applying its limits */
void tv_format_uuid(const CUuuid *u, char out[TSR_UUID_LEN]) TV_HIDDEN;

/* ---- account.c (middle; account.h for the allocation paths) ---- */
void tv_account_after_fork_child(void) TV_HIDDEN;
int tv_mem_refresh_pools(void) TV_HIDDEN;   /* uncharge what the driver took back */

/* ---- compute.c ---- */
void tv_compute_poll(uint64_t now_mono, uint64_t now_real) TV_HIDDEN; /* poll thread tick */
void tv_compute_after_fork_child(void) TV_HIDDEN;
void tv_compute_forget_ctx(CUcontext ctx) TV_HIDDEN; /* before the context is destroyed */
void tv_compute_shutdown(void) TV_HIDDEN;            /* at exit */
void tv_compute_recharge(int dslot, int64_t bucket_ns, int64_t busy_ns) TV_HIDDEN; /* owntime */
void tv_compute_lent_less(int dslot) TV_HIDDEN; /* the allowance went down: drop what is banked */

/* ---- owntime.c: own device time out of event time (NVML per-process utilisation) ---- */
int64_t tv_owntime_charge(int dslot, int64_t raw_ns) TV_HIDDEN; /* measured -> charged ns */
unsigned tv_owntime_poll(uint64_t now_mono) TV_HIDDEN; /* tick: bit d = NVML answered for d */
int tv_owntime_shared(int dslot) TV_HIDDEN; /* NVML's last answer showed others busy */
void tv_owntime_assume_shared(int dslot, int64_t est_ns) TV_HIDDEN; /* the agent says so */
void tv_owntime_reset(void) TV_HIDDEN;                          /* after fork, in the child */

/* ---- graphmem.c ---- */
extern _Atomic int tv_graphmem_nodes TV_HIDDEN;      /* memory nodes tracked (0: skip) */
void tv_graphmem_launched(CUgraphExec exec) TV_HIDDEN; /* after a successful graph launch */
int tv_graphmem_freed(CUdeviceptr p) TV_HIDDEN;      /* cuMemFree(Async) of a graph alloc */

/* ---- virt.c ---- */
uint64_t tv_dev_used(int dslot) TV_HIDDEN;
int tv_nvml_slot(nvmlDevice_t device, uint64_t *limit) TV_HIDDEN; /* -1: not ours to virtualise */

#endif
