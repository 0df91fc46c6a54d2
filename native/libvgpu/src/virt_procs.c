/*
 * virt_procs.c — what a process in a container reads back of the processes running on a GPU
 * (nvidia-smi's process table, pynvml, DCGM-less dashboards): its own container's processes only,
 * each with the device memory charged to it, from the first call — no CUDA context needed.
 *
 * The container's processes are the region's process slots. A process is listed on a device
 * when it has memory charged there, or when the real NVML lists it (a context without memory;
 * NVML reports host pids, matched through tsr_proc_slot.host_pid, else the pid itself). Pids are
 * reported as the container sees them; usedGpuMemory is the bytes charged to that process
 * (the container view, like nvmlDeviceGetMemoryInfo's `used`). Other containers' processes are
 * not shown. A device the container does not virtualise (no region slot) answers as the driver
 * does.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "vgpu.h"

#define VP_MAX 1024 /* processes asked from the real NVML */

enum vp_kind { VP_COMPUTE, VP_GRAPHICS, VP_MPS };

struct vp_entry {
    unsigned pid;
    unsigned long long used;
};

/* The real list (host pids) of `kind`, through the entry point of the caller's version. */
static int real_list(enum vp_kind kind, int ver, nvmlDevice_t dev, unsigned *pids, unsigned max)
{
    unsigned n = max;
    nvmlReturn_t r = NVML_ERROR_FUNCTION_NOT_FOUND;
    if (ver == 1) {
        nvmlProcessInfo_v1_t *b = calloc(max, sizeof *b);
        if (!b) return -1;
        if (kind == VP_COMPUTE) r = REAL(nvmlDeviceGetComputeRunningProcesses)(dev, &n, b);
        else if (kind == VP_GRAPHICS) r = REAL(nvmlDeviceGetGraphicsRunningProcesses)(dev, &n, b);
        for (unsigned i = 0; r == NVML_SUCCESS && i < n && i < max; i++) pids[i] = b[i].pid;
        free(b);
    } else {
        nvmlProcessInfo_v2_t *b = calloc(max, sizeof *b);
        if (!b) return -1;
        if (kind == VP_COMPUTE)
            r = ver == 3 ? REAL(nvmlDeviceGetComputeRunningProcesses_v3)(dev, &n, b)
                         : REAL(nvmlDeviceGetComputeRunningProcesses_v2)(dev, &n, b);
        else if (kind == VP_GRAPHICS)
            r = ver == 3 ? REAL(nvmlDeviceGetGraphicsRunningProcesses_v3)(dev, &n, b)
                         : REAL(nvmlDeviceGetGraphicsRunningProcesses_v2)(dev, &n, b);
        else
            r = REAL(nvmlDeviceGetMPSComputeRunningProcesses_v3)(dev, &n, b);
        for (unsigned i = 0; r == NVML_SUCCESS && i < n && i < max; i++) pids[i] = b[i].pid;
        free(b);
    }
    if (r != NVML_SUCCESS) return -(int)r - 1;
    return (int)(n < max ? n : max);
}

static int listed(const unsigned *pids, int n, unsigned pid)
{
    for (int i = 0; i < n; i++)
        if (pids[i] == pid) return 1;
    return 0;
}

/* The container's processes on slot d: compute lists those with memory there too. */
static unsigned own_list(int d, enum vp_kind kind, const unsigned *host, int nhost,
                         struct vp_entry *out, unsigned max)
{
    unsigned n = 0;
    struct tsr_region *r = tv.rg.map;
    if (!r || atomic_load(&tv.rg.bad)) return 0;
    for (unsigned i = 0; i < TSR_MAX_PROCS && n < max; i++) {
        const struct tsr_proc_slot *p = &r->procs[i];
        int32_t pid = __atomic_load_n(&p->pid, __ATOMIC_RELAXED);
        if (pid <= 0) continue; /* free (or garbage: never reported) */
        int32_t hp = __atomic_load_n(&p->host_pid, __ATOMIC_RELAXED);
        unsigned long long used = 0;
        if (d < TSR_MAX_DEVICES) used = __atomic_load_n(&p->used[d], __ATOMIC_RELAXED);
        else if (pid == tv.rg.pid) used = tv.rg.mine[d]; /* a private slot: only our own */
        int seen = listed(host, nhost, (unsigned)(hp > 0 ? hp : pid));
        if (seen || (kind == VP_COMPUTE && used > 0))
            out[n++] = (struct vp_entry){(unsigned)pid, used};
    }
    return n;
}

static nvmlReturn_t passthrough(enum vp_kind kind, int ver, nvmlDevice_t dev, unsigned *count,
                                void *infos)
{
    if (kind == VP_MPS) return REAL(nvmlDeviceGetMPSComputeRunningProcesses_v3)(dev, count, infos);
    if (kind == VP_GRAPHICS)
        return ver == 1   ? REAL(nvmlDeviceGetGraphicsRunningProcesses)(dev, count, infos)
               : ver == 2 ? REAL(nvmlDeviceGetGraphicsRunningProcesses_v2)(dev, count, infos)
                          : REAL(nvmlDeviceGetGraphicsRunningProcesses_v3)(dev, count, infos);
    return ver == 1   ? REAL(nvmlDeviceGetComputeRunningProcesses)(dev, count, infos)
           : ver == 2 ? REAL(nvmlDeviceGetComputeRunningProcesses_v2)(dev, count, infos)
                      : REAL(nvmlDeviceGetComputeRunningProcesses_v3)(dev, count, infos);
}

static nvmlReturn_t running(enum vp_kind kind, int ver, nvmlDevice_t dev, unsigned *count,
                            void *infos)
{
    if (tv_nvml_init() != 0) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    uint64_t limit;
    int d = tv_nvml_slot(dev, &limit);
    unsigned *host = calloc(VP_MAX, sizeof *host);
    struct vp_entry *own = calloc(VP_MAX, sizeof *own);
    nvmlReturn_t rc = NVML_SUCCESS;
    if (!host || !own) {
        rc = NVML_ERROR_MEMORY;
        goto out;
    }
    int nhost = real_list(kind, ver, dev, host, VP_MAX);
    if (nhost < 0) {
        nvmlReturn_t e = (nvmlReturn_t)(-nhost - 1);
        /* compute processes are known from the region even where the driver cannot list them */
        if (kind != VP_COMPUTE || d < 0) {
            rc = e;
            goto out;
        }
        nhost = 0;
    }
    if (d < 0) { /* not a device of ours: as the driver answers */
        rc = passthrough(kind, ver, dev, count, infos);
        goto out;
    }
    unsigned n = own_list(d, kind, host, nhost, own, VP_MAX);
    if (!infos || *count < n) {
        *count = n;
        rc = n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
        goto out;
    }
    for (unsigned i = 0; i < n; i++) {
        if (ver == 1) {
            ((nvmlProcessInfo_v1_t *)infos)[i] = (nvmlProcessInfo_v1_t){own[i].pid, own[i].used};
        } else {
            ((nvmlProcessInfo_v2_t *)infos)[i] = (nvmlProcessInfo_v2_t){
                .pid = own[i].pid,
                .usedGpuMemory = own[i].used,
                .gpuInstanceId = 0xFFFFFFFFu,
                .computeInstanceId = 0xFFFFFFFFu,
            };
        }
    }
    *count = n;
out:
    free(host);
    free(own);
    return rc;
}

#define VP_HOOK(NAME, KIND, VER, TYPE)                                                         \
    nvmlReturn_t tv_##NAME(nvmlDevice_t device, unsigned int *infoCount, TYPE *infos)          \
    {                                                                                          \
        return running(KIND, VER, device, infoCount, infos);                                   \
    }
VP_HOOK(nvmlDeviceGetComputeRunningProcesses_v3, VP_COMPUTE, 3, nvmlProcessInfo_t)
VP_HOOK(nvmlDeviceGetComputeRunningProcesses_v2, VP_COMPUTE, 2, nvmlProcessInfo_v2_t)
VP_HOOK(nvmlDeviceGetComputeRunningProcesses, VP_COMPUTE, 1, nvmlProcessInfo_v1_t)
VP_HOOK(nvmlDeviceGetGraphicsRunningProcesses_v3, VP_GRAPHICS, 3, nvmlProcessInfo_t)
VP_HOOK(nvmlDeviceGetGraphicsRunningProcesses_v2, VP_GRAPHICS, 2, nvmlProcessInfo_v2_t)
VP_HOOK(nvmlDeviceGetGraphicsRunningProcesses, VP_GRAPHICS, 1, nvmlProcessInfo_v1_t)
VP_HOOK(nvmlDeviceGetMPSComputeRunningProcesses_v3, VP_MPS, 3, nvmlProcessInfo_t)
