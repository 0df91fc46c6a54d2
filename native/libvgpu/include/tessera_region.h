/*
 * tessera_region.h — the binary contract between libvgpu (inside every container process) and
 * the node agent (on the host). One header, mirrored in Python by tessera/region.py; the
 * layout test (tests/native/test_layout.py) compiles this header and compares every offset.
 *
 * Two files per container:
 *
 *  1. The SEALED LIMITS FILE  <limits dir>/limits  (struct tsr_limits)
 *     Written only by the node agent, on the host, by write-temp + fsync + rename inside the
 *     limits directory. The container mounts the DIRECTORY read-only (never the file: a
 *     bind-mounted file keeps the old inode after a rename). libvgpu re-reads it when its
 *     (inode, size, mtime) changes, polling every TSR_LIMITS_POLL_MS, so a new limit or a
 *     changed device flag is in force within 100 ms. A reader never sees a half-written file
 *     (rename is atomic) and also checks magic, major version, header_size and checksum.
 *
 *  2. The USAGE REGION  (struct tsr_region), an mmap'ed file shared by all processes of the
 *     container. Written by libvgpu (charged bytes, OOM counts, launch activity, measured SM %);
 *     read by the node agent without taking the lock (every counter is an aligned 64-bit or
 *     32-bit word, so single loads are never torn). The node agent may write only
 *     tsr_proc_slot.host_pid. The region carries no limit that libvgpu obeys: limits come only
 *     from the sealed file (or from env vars when no sealed file exists: standalone use).
 *
 * Versioning: a reader accepts a file whose magic matches and whose major version equals its
 * own; minor versions only add fields in reserved space, so readers ignore them.
 */
#ifndef TESSERA_REGION_H
#define TESSERA_REGION_H

#include <stdint.h>
#include <pthread.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TSR_LIMITS_MAGIC 0x4C525354u /* bytes "TSRL" (little-endian) */
#define TSR_REGION_MAGIC 0x52525354u /* bytes "TSRR" (little-endian) */
#define TSR_VERSION_MAJOR 1u
/* The usage region's minor version. 1.2 added the spill counters (tsr_region.spilled_bytes,
 * spill_limit_bytes, spilled_peak_bytes, tsr_proc_slot.spilled_bytes) in reserved space: 0 in
 * an older region. */
#define TSR_VERSION_MINOR 2u
/* The sealed limits file's minor version. 1.2 added the elastic fields of tsr_limits_device
 * (sm_burst_pct, mem_burst_bytes, sm_allow_x100): a reader treats them as 0 in a file of minor
 * < 2, so an older file reads as hard slices (burst = guarantee), exactly as before. 1.3 added
 * tsr_limits.spill_bytes (0 in a file of minor < 3: no spill). */
#define TSR_LIMITS_VERSION_MINOR 3u

#define TSR_MAX_DEVICES 16
#define TSR_MAX_PROCS 1024
#define TSR_UUID_LEN 64 /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", NUL-terminated */
#define TSR_PATH_LEN 256

/* Where the node agent mounts the sealed limits directory inside a container. When a limits file
 * exists there, libvgpu ignores every env var that could change a limit or the region path. */
#ifndef TSR_SEALED_LIMITS_DIR /* tests build a copy of libvgpu with their own */
#define TSR_SEALED_LIMITS_DIR "/run/tessera/limits"
#endif
#define TSR_LIMITS_FILE_NAME "limits"
/* Standalone use only (honoured only when TSR_SEALED_LIMITS_DIR/limits does not exist). */
#define TSR_ENV_LIMITS_DIR "TESSERA_LIMITS_DIR"
/* HAMi-compatible: path of the region file when the limits file names none. */
#define TSR_ENV_REGION_PATH "CUDA_DEVICE_MEMORY_SHARED_CACHE"

#define TSR_LIMITS_POLL_MS 20

/* ---- the sealed limits file ------------------------------------------------------------ */

/* tsr_limits.core_policy (HAMi GPU_CORE_UTILIZATION_POLICY) */
#define TSR_POLICY_DEFAULT 0u /* limit only while TSR_DEV_CONTENDED is set on the device */
#define TSR_POLICY_FORCE 1u   /* always limit */
#define TSR_POLICY_DISABLE 2u /* never limit compute */

/* tsr_limits.priority (HAMi nvidia.com/priority -> CUDA_TASK_PRIORITY) */
#define TSR_PRIORITY_HIGH 0
#define TSR_PRIORITY_LOW 1

/* tsr_limits.flags */
#define TSR_LIMITS_SCRUB_ON_FREE (1u << 0) /* zero device memory before it is released */
#define TSR_LIMITS_OVERSUBSCRIBE (1u << 1) /* informational (HAMi CUDA_OVERSUBSCRIBE) */
#define TSR_LIMITS_LEASE (1u << 2)         /* device memory is leased from the node agent's lease
                                              socket (TSR_LEASE_SOCKET_NAME beside the limits
                                              file); without it nothing beyond what is leased */

/* The node agent's lease service for the container: a unix stream socket in the sealed limits
 * directory (read-only in the container, so the tenant cannot replace it). One line per message:
 *   libvgpu -> agent   "A <uuid> <need> <want>\n"  lease at least need, at most want bytes more
 *                      "R <uuid> <bytes>\n"        give back (no answer)
 *                      "H <uuid> <bytes>\n"        already held (after a reconnect; no answer)
 *                      "D\n"                       a recall was answered (after its "R"s)
 *   agent -> libvgpu   "G <bytes>\n"               granted (need <= bytes <= want)
 *                      "N\n"                       refused: the container's limit is leased
 *                      "C\n"                       recall: give back what you hold unused
 *                      "W\n"                       still waiting (a reclaim, an opt-in wait):
 *                                                  read past it; the answer follows
 * The agent counts leases per connection (SO_PEERCRED names the process); a closed connection's
 * leases are returned. The sum of a container's leases never exceeds its limit.
 * Spill (limits 1.3, spill_bytes) is leased the same way under the name TSR_LEASE_SPILL_NAME in
 * place of a GPU uuid: host memory the container's device allocations spill to, at most the
 * sealed spill_bytes for the container (its processes together), asked for exactly (no chunk)
 * and given back on free. An agent that does not know the name answers "N": no spill. */
#define TSR_LEASE_SOCKET_NAME "lease.sock"
#define TSR_LEASE_SPILL_NAME "host-spill"
#define TSR_LEASE_CHUNK (64ull << 20)

/* tsr_limits_device.flags: set and cleared by the node agent at run time */
#define TSR_DEV_CONTENDED (1u << 0) /* another container is active on this GPU */
#define TSR_DEV_YIELD (1u << 1)     /* a higher-priority container is active on this GPU:
                                       the SM limit becomes yield_sm_pct (whatever the policy) */

/* Guaranteed and burst limits (1.2). mem_limit_bytes and sm_limit_pct are the GUARANTEE: what
 * the container always gets (a hard slice when no burst is sealed). The burst limits say how far
 * beyond it the container may go while the card has room: 0 = no burst (burst = guarantee, the
 * hard slice of 1.0/1.1). A burst below its guarantee reads as the guarantee.
 *
 * Compute beyond the guarantee is LENT by the node agent, never taken by the tenant: the agent
 * computes each elastic container's allowance from the shares of the busy containers on the GPU
 * (weighted fair share, capped at each burst limit) and seals it here as sm_allow_x100 (this file
 * is read-only to the tenant). libvgpu limits an elastic device to the allowance clamped to
 * [guarantee, burst]; 0 (nothing published yet) = the guarantee. */
#define TSR_SM_ALLOW_FULL 10000u /* sm_allow_x100 of the whole card */

struct tsr_limits_device {
    char uuid[TSR_UUID_LEN];   /* GPU UUID as NVML prints it; "" = match by CUDA ordinal */
    uint64_t mem_limit_bytes;  /* guaranteed memory; 0 = unlimited */
    uint32_t sm_limit_pct;     /* guaranteed compute: 1..99 limits; 0 or >= 100 = unlimited */
    uint32_t flags;            /* TSR_DEV_* */
    uint32_t yield_sm_pct;     /* SM % while TSR_DEV_YIELD is set (0 = pause launches) */
    uint32_t sm_burst_pct;     /* 1.2: compute burst limit, sm_limit_pct..100; 0 = no burst */
    uint64_t mem_burst_bytes;  /* 1.2: memory burst limit, >= mem_limit_bytes; 0 = no burst */
    uint32_t sm_allow_x100;    /* 1.2, node agent at run time: compute lent now, % x 100
                                  (clamped to guarantee..burst); 0 = the guarantee */
    uint32_t reserved1;
    uint64_t reserved[3];
}; /* 128 bytes */

struct tsr_limits {
    uint32_t magic;            /* TSR_LIMITS_MAGIC */
    uint16_t major;            /* TSR_VERSION_MAJOR */
    uint16_t minor;            /* TSR_LIMITS_VERSION_MINOR */
    uint32_t header_size;      /* sizeof(struct tsr_limits) of the writer; the file is this long */
    uint32_t num_devices;      /* entries used in dev[] */
    uint64_t generation;       /* incremented by the agent on every write */
    int32_t priority;          /* TSR_PRIORITY_* */
    uint32_t core_policy;      /* TSR_POLICY_* */
    uint32_t flags;            /* TSR_LIMITS_* */
    uint32_t reserved0;
    uint64_t ctx_charge_bytes; /* charged per context beyond the primary; 0 = libvgpu default */
    char region_path[TSR_PATH_LEN]; /* the usage region the container must use ("" = env/default) */
    uint64_t spill_bytes;      /* 1.3: host memory the container may take, in all, for device
                                  allocations that do not fit (managed memory preferring the
                                  CPU, spill.c); 0 = no spill (an OOM, as before) */
    uint64_t reserved[7];
    struct tsr_limits_device dev[TSR_MAX_DEVICES];
    uint64_t checksum;         /* FNV-1a 64 of every byte before this field */
};

/* ---- the usage region ------------------------------------------------------------------ */

#define TSR_SM_UNKNOWN 0xFFFFFFFFu
#define TSR_LOCK_READY 0x4B434F4Cu /* "LOCK": tsr_region.lock_ready */ /* achieved_sm_x100 when libvgpu does not time this device */

struct tsr_region_device {
    char uuid[TSR_UUID_LEN];      /* written by libvgpu: the GPU behind this slot */
    uint64_t used_bytes;          /* charged device memory, the container's total (= sum of
                                     procs[].used[i]); changed only under the region lock */
    uint64_t peak_bytes;          /* high-water mark of used_bytes */
    uint64_t limit_bytes;         /* the memory limit in force (informational) */
    uint64_t oom_count;           /* allocations refused because of the limit */
    uint64_t last_kernel_ns;      /* CLOCK_REALTIME ns of recent launch activity (0 = none);
                                     precise when throttled, else updated every poll tick */
    uint32_t sm_limit_pct;        /* SM % in force now: 100 = not limited, 0 = paused */
    uint32_t achieved_sm_x100;    /* measured SM % x 100 over the last window, or TSR_SM_UNKNOWN */
    uint64_t busy_ns_total;       /* measured GPU busy ns of throttled launches */
    int64_t budget_ns;            /* compute token bucket (GPU ns), shared by the container */
    uint64_t budget_ts_ns;        /* CLOCK_MONOTONIC ns of the last refill */
    uint64_t launches;            /* launches seen on the throttled path */
    uint64_t reserved[6];
}; /* 192 bytes */

struct tsr_proc_slot {
    int32_t pid;                  /* pid in the container's namespace; 0 = free slot */
    int32_t host_pid;             /* written by the node agent when it knows it; 0 = unknown */
    uint64_t start_time;          /* /proc/<pid>/stat starttime: a reused pid is a new process */
    uint64_t launches;            /* launches of this process (all paths) */
    uint64_t used[TSR_MAX_DEVICES]; /* bytes charged to this process, per device slot */
    uint64_t spilled_bytes;       /* 1.2: host memory this process spilled (all its GPUs) */
    uint64_t reserved[3];
}; /* 184 bytes */

struct tsr_region {
    uint32_t magic;               /* TSR_REGION_MAGIC, stored last when the region is ready */
    uint16_t major;
    uint16_t minor;
    uint32_t size;                /* sizeof(struct tsr_region) */
    uint32_t num_devices;         /* device slots in use */
    uint32_t max_procs;           /* TSR_MAX_PROCS */
    int32_t priority;             /* copied from the limits (informational) */
    uint32_t core_policy;         /* copied from the limits (informational) */
    uint32_t lock_ready;          /* TSR_LOCK_READY once libvgpu initialised the lock (1.1) */
    union {
        pthread_mutex_t mutex;    /* PTHREAD_PROCESS_SHARED + PTHREAD_MUTEX_ROBUST */
        uint8_t raw[64];          /* opaque to the node agent: never lock it from the host */
    } lock;
    uint64_t created_ns;          /* CLOCK_REALTIME at initialisation */
    uint64_t reclaim_ns;          /* CLOCK_MONOTONIC of the last dead-slot sweep */
    uint64_t spilled_bytes;       /* 1.2: host memory the container's device allocations spilled
                                     to (= sum of procs[].spilled_bytes); under the lock */
    uint64_t spill_limit_bytes;   /* 1.2: the spill limit in force (informational) */
    uint64_t spilled_peak_bytes;  /* 1.2: high-water mark of spilled_bytes */
    uint64_t reserved[3];
    struct tsr_region_device dev[TSR_MAX_DEVICES];
    struct tsr_proc_slot procs[TSR_MAX_PROCS];
};

static inline uint64_t tsr_fnv1a64(const void *data, unsigned long len)
{
    const unsigned char *p = (const unsigned char *)data;
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned long i = 0; i < len; i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

#ifdef __cplusplus
}
#endif

#endif /* TESSERA_REGION_H */
