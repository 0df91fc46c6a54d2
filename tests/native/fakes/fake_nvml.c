/* fake_nvml.c — a fake libnvidia-ml.so.1 over the same fake devices (fake_state.h): memory from
 * the shared physical counters, utilisation from the execution timeline. With FAKE_NVML_REVERSE=1
 * NVML enumerates the devices in the reverse of CUDA's order (as real machines may). */
#define _GNU_SOURCE
#define NVML_NO_UNVERSIONED_FUNC_DEFS /* define the legacy names as well */
#include <nvml.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "fake_state.h"

#define API __attribute__((visibility("default")))

struct fk_nvml_dev {
    int dev;
};
static struct fk_nvml_dev devs[FK_MAX_DEV];

static int cuda_index(unsigned i)
{
    int n = fk_state()->ndev;
    return fk_env_int("FAKE_NVML_REVERSE", 0) ? n - 1 - (int)i : (int)i;
}
static int dev_of(nvmlDevice_t d)
{
    return ((struct fk_nvml_dev *)d)->dev;
}

API nvmlReturn_t nvmlInit_v2(void)
{
    (void)fk_state();
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlInit(void)
{
    return nvmlInit_v2();
}
API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    return nvmlInit_v2();
}
API nvmlReturn_t nvmlShutdown(void)
{
    return NVML_SUCCESS;
}
API const char *nvmlErrorString(nvmlReturn_t r)
{
    return r == NVML_SUCCESS ? "Success" : "Error";
}
API nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned int n)
{
    snprintf(v, n, "580.00");
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n)
{
    *n = (unsigned)fk_state()->ndev;
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetCount(unsigned int *n)
{
    return nvmlDeviceGetCount_v2(n);
}
API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d)
{
    if ((int)i >= fk_state()->ndev) return NVML_ERROR_INVALID_ARGUMENT;
    devs[i].dev = cuda_index(i);
    *d = (nvmlDevice_t)&devs[i];
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int i, nvmlDevice_t *d)
{
    return nvmlDeviceGetHandleByIndex_v2(i, d);
}
API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int n)
{
    snprintf(uuid, n, "%s", fk_state()->dev[dev_of(d)].uuid);
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int n)
{
    snprintf(name, n, "Fake GPU %d", dev_of(d));
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    struct fk_dev *x = &fk_state()->dev[dev_of(d)];
    unsigned long long used = __atomic_load_n(&x->used, __ATOMIC_RELAXED);
    m->total = x->total;
    m->used = used;
    m->free = x->total - used;
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m)
{
    struct fk_dev *x = &fk_state()->dev[dev_of(d)];
    unsigned long long used = __atomic_load_n(&x->used, __ATOMIC_RELAXED);
    m->total = x->total;
    m->reserved = 0;
    m->used = used;
    m->free = x->total - used;
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u)
{
    struct fk_state *s = fk_state();
    int64_t now = fk_now();
    fk_lock(s);
    int64_t busy = fk_busy(s, dev_of(d), now - 1000000000, now, 0);
    fk_unlock(s);
    u->gpu = (unsigned)(busy / 10000000);
    u->memory = 0;
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *out,
                                                 unsigned int *count, unsigned long long since_us)
{
    struct fk_state *s = fk_state();
    int dev = dev_of(d);
    int64_t now = fk_now(), t0 = (int64_t)since_us * 1000;
    if (t0 < now - 1000000000 || t0 >= now) t0 = now - 1000000000;
    int pids[64], n = 0, pid_offset = fk_env_int("FAKE_NVML_PID_OFFSET", 0);
    fk_lock(s);
    struct fk_dev *x = &s->dev[dev];
    uint64_t hi = x->ring_n, lo = hi > FK_RING ? hi - FK_RING : 0;
    for (uint64_t i = hi; i > lo && n < 64; i--) {
        struct fk_interval *iv = &x->ring[(i - 1) % FK_RING];
        if (iv->end <= t0) break;
        int seen = 0;
        for (int k = 0; k < n; k++) seen |= pids[k] == iv->pid;
        if (!seen) pids[n++] = iv->pid;
    }
    if (!out) {
        fk_unlock(s);
        *count = (unsigned)n;
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    if (*count < (unsigned)n) {
        fk_unlock(s);
        *count = (unsigned)n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int k = 0; k < n; k++) {
        int64_t busy = fk_busy(s, dev, t0, now, pids[k]);
        /* FAKE_NVML_PID_OFFSET: report pids as a host outside the caller's pid namespace would */
        out[k] = (nvmlProcessUtilizationSample_t){.pid = (unsigned)(pids[k] + pid_offset),
                                                  .timeStamp = (unsigned long long)now / 1000,
                                                  .smUtil = (unsigned)((busy * 100 + (now - t0) / 2) / (now - t0))};
    }
    fk_unlock(s);
    *count = (unsigned)n;
    return NVML_SUCCESS;
}

/* Running processes: those with a context on the device (live ones), with the memory they hold.
 * The fake GPU runs no graphics or MPS clients. With FAKE_NVML_PID_OFFSET, host pids. */
static nvmlReturn_t procs(nvmlDevice_t d, unsigned *count, void *infos, int ver)
{
    struct fk_state *s = fk_state();
    struct fk_proc out[FK_MAX_PROCS];
    unsigned n = 0;
    int off = fk_env_int("FAKE_NVML_PID_OFFSET", 0);
    fk_lock(s);
    for (int i = 0; i < FK_MAX_PROCS; i++) {
        struct fk_proc *p = &s->procs[dev_of(d)][i];
        if (p->pid > 0 && kill(p->pid, 0) == 0) out[n++] = *p;
    }
    fk_unlock(s);
    if (!infos || *count < n) {
        *count = n;
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    for (unsigned i = 0; i < n; i++) {
        unsigned pid = (unsigned)(out[i].pid + off);
        if (ver == 1)
            ((nvmlProcessInfo_v1_t *)infos)[i] = (nvmlProcessInfo_v1_t){pid, out[i].used};
        else
            ((nvmlProcessInfo_v2_t *)infos)[i] = (nvmlProcessInfo_v2_t){pid, out[i].used,
                                                                        0xFFFFFFFFu, 0xFFFFFFFFu};
    }
    *count = n;
    return NVML_SUCCESS;
}
static nvmlReturn_t none(unsigned *count)
{
    *count = 0;
    return NVML_SUCCESS;
}
API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_t *p)
{
    return procs(d, c, p, 3);
}
API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_v2_t *p)
{
    return procs(d, c, p, 2);
}
API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_v1_t *p)
{
    return procs(d, c, p, 1);
}
API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_t *p)
{
    (void)d, (void)p;
    return none(c);
}
API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_v2_t *p)
{
    (void)d, (void)p;
    return none(c);
}
API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_v1_t *p)
{
    (void)d, (void)p;
    return none(c);
}
API nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_t *p)
{
    (void)d, (void)p;
    return none(c);
}
