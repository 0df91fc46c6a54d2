/*
 * A fake libnvidia-ml.so.1 for the node agent's tests: the few NVML calls the agent makes
 * through pynvml, answering from a text file named by FAKE_NVML_CONFIG (read at nvmlInit):
 *
 *   gpu <uuid> <memory MiB> <numa> <pci bus id> <mig 0|1> <name, rest of line>
 *   topo <i> <j> <NVML topology level: 0 internal .. 50 system>
 *   nvlink <i> <j> <number of links>
 *   used <i> <MiB used> <utilization %>
 *
 * Events: lines "<device index | -1 for all> <event type> <event data>" appended to the file
 * named by FAKE_NVML_EVENTS are delivered, in order, by nvmlEventSetWait_v2.
 *
 * Processes: the file named by FAKE_NVML_PROCESSES holds lines "<device index> <pid> <used MiB>
 * <SM %>", parsed again whenever it changes, so a test changes what the GPU "holds" by
 * rewriting it (write a temporary file and rename it over). They
 * stand for processes that do not go through libvgpu at all. nvmlDeviceGetComputeRunningProcesses
 * (_v3, _v2 and the unversioned v1) and nvmlDeviceGetProcessUtilization answer from it as NVML
 * documents; a pid that no longer exists is not listed (the driver forgets an exited process).
 * Build with -DFAKE_NVML_NO_PROCESSES_V3 / _V2 / _V1 or -DFAKE_NVML_NO_PROCESS_UTILIZATION to
 * leave that entry point out (older drivers and partial stand-ins lack some).
 * Processes lines may carry two more fields, "<GPU instance id> <compute instance id>": the
 * process runs in that MIG instance (reported by the process list; the instance is then IN_USE).
 *
 * MIG: GPU instance profiles, placements, GPU/compute instances and MIG devices, from
 * `giprofile` / `gi` config lines; see fake_nvml_mig.c (included at the end of this file).
 * Build: gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -Wl,-Bsymbolic -o libnvidia-ml.so.1
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <errno.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_IN_USE 19
#define NVML_ERROR_INSUFFICIENT_RESOURCES 23
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

#define MAX_GPUS 16
#define MAX_LINKS 18

typedef struct {
    char bus_id_legacy[16];
    unsigned int domain, bus, device, pci_device_id, pci_subsystem_id;
    char bus_id[32];
} nvmlPciInfo_t;

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;

struct fake_gpu {
    char uuid[96];
    char name[96];
    char bus_id[32];
    unsigned long long memory_mib, used_mib;
    unsigned int util;
    int numa;
    unsigned int mig;
    int topo[MAX_GPUS];
    int link_peer[MAX_LINKS];
    int nlinks;
    unsigned long long registered;
};
typedef struct fake_gpu *nvmlDevice_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

struct fake_event_set { long offset; };
typedef struct fake_event_set *nvmlEventSet_t;

static struct fake_gpu gpus[MAX_GPUS];
static unsigned int ngpus;
static int initialised; /* NVML reference-counts nvmlInit / nvmlShutdown */

/* MIG (fake_nvml_mig.c, included at the end) */
static void mig_reset(void);
static int mig_config_line(const char *line);
static void mig_load_state(void);
static nvmlReturn_t mig_uuid_of(nvmlDevice_t d, char *uuid, unsigned int len, int *handled);
static nvmlReturn_t mig_name_of(nvmlDevice_t d, char *name, unsigned int len, int *handled);
static int mig_memory_of(nvmlDevice_t d, nvmlMemory_t *m);

static nvmlReturn_t load_config(void)
{
    const char *path = getenv("FAKE_NVML_CONFIG");
    FILE *f;
    char line[512];
    memset(gpus, 0, sizeof gpus);
    ngpus = 0;
    mig_reset();
    if (!path || !(f = fopen(path, "r")))
        return NVML_ERROR_UNKNOWN;
    while (fgets(line, sizeof line, f)) {
        int i, j, n, off = 0;
        unsigned long long a;
        unsigned int b;
        line[strcspn(line, "\n")] = 0;
        if (strncmp(line, "gpu ", 4) == 0 && ngpus < MAX_GPUS) {
            struct fake_gpu *g = &gpus[ngpus];
            if (sscanf(line + 4, "%95s %llu %d %31s %u %n", g->uuid, &g->memory_mib, &g->numa,
                       g->bus_id, &g->mig, &off) < 5)
                continue;
            snprintf(g->name, sizeof g->name, "%s", line + 4 + off);
            for (i = 0; i < MAX_GPUS; i++)
                g->topo[i] = 50;
            ngpus++;
        } else if (sscanf(line, "topo %d %d %d", &i, &j, &n) == 3 && i < MAX_GPUS && j < MAX_GPUS) {
            gpus[i].topo[j] = n;
            gpus[j].topo[i] = n;
        } else if (sscanf(line, "nvlink %d %d %d", &i, &j, &n) == 3 && i < MAX_GPUS && j < MAX_GPUS) {
            while (n-- > 0 && gpus[i].nlinks < MAX_LINKS && gpus[j].nlinks < MAX_LINKS) {
                gpus[i].link_peer[gpus[i].nlinks++] = j;
                gpus[j].link_peer[gpus[j].nlinks++] = i;
            }
        } else if (sscanf(line, "used %d %llu %u", &i, &a, &b) == 3 && i < MAX_GPUS) {
            gpus[i].used_mib = a;
            gpus[i].util = b;
        } else {
            mig_config_line(line);
        }
    }
    fclose(f);
    mig_load_state();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    nvmlReturn_t rc = load_config();
    if (rc == NVML_SUCCESS)
        initialised++;
    return rc;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlShutdown(void)
{
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    initialised--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t rc)
{
    switch (rc) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient Resources";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Version mismatch";
    default: return "Unknown Error";
    }
}

#define CHECK_DEV(d) do { if (!initialised) return NVML_ERROR_UNINITIALIZED; \
    if (!(d) || (d) < gpus || (d) >= gpus + ngpus) return NVML_ERROR_INVALID_ARGUMENT; } while (0)

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    *count = ngpus;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device)
{
    unsigned int i;
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!uuid || !device) return NVML_ERROR_INVALID_ARGUMENT;
    for (i = 0; i < ngpus; i++)
        if (strcmp(gpus[i].uuid, uuid) == 0) {
            *device = &gpus[i];
            return NVML_SUCCESS;
        }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (index >= ngpus) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpus[index];
    return NVML_SUCCESS;
}

static nvmlReturn_t copy_str(char *dst, unsigned int len, const char *src)
{
    if (strlen(src) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int len)
{
    int mig = 0;
    nvmlReturn_t rc = initialised ? mig_uuid_of(d, uuid, len, &mig) : NVML_SUCCESS;
    if (mig) return rc;
    CHECK_DEV(d);
    return copy_str(uuid, len, d->uuid);
}
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int len)
{
    int mig = 0;
    nvmlReturn_t rc = initialised ? mig_name_of(d, name, len, &mig) : NVML_SUCCESS;
    if (mig) return rc;
    CHECK_DEV(d);
    return copy_str(name, len, d->name);
}
nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *index)
{ CHECK_DEV(d); *index = (unsigned int)(d - gpus); return NVML_SUCCESS; }
nvmlReturn_t nvmlDeviceGetNumaNodeId(nvmlDevice_t d, int *node)
{ CHECK_DEV(d); *node = d->numa; return NVML_SUCCESS; }

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m)
{
    if (initialised && m && mig_memory_of(d, m)) return NVML_SUCCESS;
    CHECK_DEV(d);
    m->total = d->memory_mib << 20;
    m->used = d->used_mib << 20;
    m->free = m->total - m->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u)
{ CHECK_DEV(d); u->gpu = d->util; u->memory = 0; return NVML_SUCCESS; }

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending)
{ CHECK_DEV(d); *current = d->mig; *pending = d->mig; return NVML_SUCCESS; }

nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t a, nvmlDevice_t b, int *level)
{
    CHECK_DEV(a);
    CHECK_DEV(b);
    *level = a == b ? 0 : a->topo[b - gpus];
    return NVML_SUCCESS;
}

static void fill_pci(nvmlPciInfo_t *pci, const struct fake_gpu *g)
{
    memset(pci, 0, sizeof *pci);
    snprintf(pci->bus_id, sizeof pci->bus_id, "%s", g->bus_id);
    memcpy(pci->bus_id_legacy, g->bus_id, sizeof pci->bus_id_legacy - 1);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci)
{ CHECK_DEV(d); fill_pci(pci, d); return NVML_SUCCESS; }

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned int link, unsigned int *active)
{
    CHECK_DEV(d);
    if (link >= MAX_LINKS) return NVML_ERROR_INVALID_ARGUMENT;
    *active = (int)link < d->nlinks;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t d, unsigned int link,
                                                 nvmlPciInfo_t *pci)
{
    CHECK_DEV(d);
    if ((int)link >= d->nlinks) return NVML_ERROR_INVALID_ARGUMENT;
    fill_pci(pci, &gpus[d->link_peer[link]]);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types)
{ CHECK_DEV(d); *types = 0x1 | 0x2 | 0x8; return NVML_SUCCESS; }

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    *set = calloc(1, sizeof **set);
    return *set ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set)
{ CHECK_DEV(d); (void)set; d->registered |= types; return NVML_SUCCESS; }

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) { free(set); return NVML_SUCCESS; }

static int next_event(nvmlEventSet_t set, nvmlEventData_t *data)
{
    const char *path = getenv("FAKE_NVML_EVENTS");
    char line[256];
    FILE *f;
    int found = 0;
    if (!path || !(f = fopen(path, "r")))
        return 0;
    if (fseek(f, set->offset, SEEK_SET) == 0 && fgets(line, sizeof line, f) &&
        strchr(line, '\n')) {
        int index;
        unsigned long long type, value;
        set->offset = ftell(f);
        if (sscanf(line, "%d %llu %llu", &index, &type, &value) == 3) {
            memset(data, 0, sizeof *data);
            data->device = index >= 0 && (unsigned)index < ngpus ? &gpus[index] : NULL;
            data->eventType = type;
            data->eventData = value;
            found = 1;
        }
    }
    fclose(f);
    return found;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeout_ms)
{
    struct timespec tick = {0, 10 * 1000 * 1000};
    unsigned int waited = 0;
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    for (;;) {
        if (next_event(set, data))
            return NVML_SUCCESS;
        if (waited >= timeout_ms)
            return NVML_ERROR_TIMEOUT;
        nanosleep(&tick, NULL);
        waited += 10;
    }
}

/* ---- running processes (layouts as in NVIDIA's nvml.h) ------------------------------------ */

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;     /* 0xFFFFFFFF without MIG */
    unsigned int computeInstanceId; /* 0xFFFFFFFF without MIG */
} nvmlProcessInfo_v2_t;             /* also the _v3 entry point's nvmlProcessInfo_t */

typedef struct {
    unsigned int pid;
    unsigned long long timeStamp; /* CPU time, microseconds */
    unsigned int smUtil;
    unsigned int memUtil;
    unsigned int encUtil;
    unsigned int decUtil;
} nvmlProcessUtilizationSample_t;

#define MAX_FAKE_PROCS 256

struct fake_proc {
    unsigned int pid;
    unsigned long long used_mib;
    unsigned int sm;
    unsigned int gi, ci; /* MIG instance ids, 0xFFFFFFFF when on the whole GPU */
};

__attribute__((unused)) static int process_alive(unsigned int pid)
{
    return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

/* The state file, parsed again only when it changes (rewritten by rename: a new inode). */
static struct { int gpu; struct fake_proc p; } state[MAX_FAKE_PROCS];
static unsigned int nstate;
static struct stat state_st;

static void load_state(void)
{
    const char *path = getenv("FAKE_NVML_PROCESSES");
    char line[256];
    struct stat st;
    FILE *f;
    if (!path || stat(path, &st) != 0) {
        nstate = 0;
        memset(&state_st, 0, sizeof state_st);
        return;
    }
    if (st.st_ino == state_st.st_ino && st.st_dev == state_st.st_dev &&
        st.st_size == state_st.st_size && st.st_mtim.tv_sec == state_st.st_mtim.tv_sec &&
        st.st_mtim.tv_nsec == state_st.st_mtim.tv_nsec)
        return;
    nstate = 0;
    if (!(f = fopen(path, "r")))
        return;
    while (nstate < MAX_FAKE_PROCS && fgets(line, sizeof line, f)) {
        /* optional 5th/6th fields: the GPU and compute instance ids the process runs in */
        state[nstate].p.gi = state[nstate].p.ci = 0xFFFFFFFFu;
        if (sscanf(line, "%d %u %llu %u %u %u", &state[nstate].gpu, &state[nstate].p.pid,
                   &state[nstate].p.used_mib, &state[nstate].p.sm, &state[nstate].p.gi,
                   &state[nstate].p.ci) >= 4)
            nstate++;
    }
    fclose(f);
    state_st = st;
}

/* The processes the state file lists on GPU `d` (that still exist). */
__attribute__((unused)) static unsigned int load_processes(nvmlDevice_t d, struct fake_proc *out)
{
    unsigned int i, n = 0;
    load_state();
    for (i = 0; i < nstate; i++) {
        int index = state[i].gpu;
        if (index < 0 || (unsigned)index >= ngpus || &gpus[index] != d ||
            !process_alive(state[i].p.pid))
            continue;
        out[n++] = state[i].p;
    }
    return n;
}

/* NVML's contract: *count 0 (infos may be NULL) asks the size: INSUFFICIENT_SIZE with the count,
 * or SUCCESS when nothing runs; a buffer too small gets INSUFFICIENT_SIZE and the needed count. */
#define RUNNING_PROCESSES(name, type, fill)                                                   \
nvmlReturn_t name(nvmlDevice_t d, unsigned int *count, type *infos)                         \
{                                                                                           \
    struct fake_proc procs[MAX_FAKE_PROCS];                                                 \
    unsigned int n, i;                                                                      \
    CHECK_DEV(d);                                                                           \
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;                                         \
    n = load_processes(d, procs);                                                           \
    if (*count < n) { *count = n; return NVML_ERROR_INSUFFICIENT_SIZE; }                    \
    if (n && !infos) return NVML_ERROR_INVALID_ARGUMENT;                                    \
    for (i = 0; i < n; i++) {                                                               \
        memset(&infos[i], 0, sizeof infos[i]);                                              \
        infos[i].pid = procs[i].pid;                                                        \
        infos[i].usedGpuMemory = procs[i].used_mib << 20;                                   \
        fill                                                                                \
    }                                                                                       \
    *count = n;                                                                             \
    return NVML_SUCCESS;                                                                    \
}

#ifndef FAKE_NVML_NO_PROCESSES_V3
RUNNING_PROCESSES(nvmlDeviceGetComputeRunningProcesses_v3, nvmlProcessInfo_v2_t,
                  infos[i].gpuInstanceId = procs[i].gi; infos[i].computeInstanceId = procs[i].ci;)
#endif
#ifndef FAKE_NVML_NO_PROCESSES_V2
RUNNING_PROCESSES(nvmlDeviceGetComputeRunningProcesses_v2, nvmlProcessInfo_v2_t,
                  infos[i].gpuInstanceId = procs[i].gi; infos[i].computeInstanceId = procs[i].ci;)
#endif
#ifndef FAKE_NVML_NO_PROCESSES_V1
RUNNING_PROCESSES(nvmlDeviceGetComputeRunningProcesses, nvmlProcessInfo_v1_t, ;)
#endif

#ifndef FAKE_NVML_NO_PROCESS_UTILIZATION
/* One sample per listed process, stamped now: NOT_FOUND when none is newer than lastSeen. */
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d,
                                             nvmlProcessUtilizationSample_t *samples,
                                             unsigned int *count, unsigned long long last_seen)
{
    struct fake_proc procs[MAX_FAKE_PROCS];
    struct timespec ts;
    unsigned long long stamp;
    unsigned int n, i;
    CHECK_DEV(d);
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    clock_gettime(CLOCK_REALTIME, &ts);
    stamp = (unsigned long long)ts.tv_sec * 1000000ull + (unsigned long long)ts.tv_nsec / 1000;
    n = load_processes(d, procs);
    if (n == 0 || stamp <= last_seen) return NVML_ERROR_NOT_FOUND;
    if (!samples || *count < n) { *count = n; return NVML_ERROR_INSUFFICIENT_SIZE; }
    for (i = 0; i < n; i++) {
        memset(&samples[i], 0, sizeof samples[i]);
        samples[i].pid = procs[i].pid;
        samples[i].timeStamp = stamp;
        samples[i].smUtil = procs[i].sm;
    }
    *count = n;
    return NVML_SUCCESS;
}
#endif

#include "fake_nvml_mig.c"

/* NVML refuses to destroy a compute instance a process runs in (NVML_ERROR_IN_USE). */
static int ci_has_process(const struct fake_ci *c)
{
    struct fake_proc procs[MAX_FAKE_PROCS];
    unsigned int n = load_processes(&gpus[c->gpu], procs), i;
    for (i = 0; i < n; i++)
        if (procs[i].gi == gis[c->gpu][c->gi].id && procs[i].ci == c->id) return 1;
    return 0;
}
