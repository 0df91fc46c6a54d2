/*
 * owntime.c — how much of the device time an event pair measured was really this process's.
 *
 * The limiter times its launches with a CUDA event before and after each one. Alone on a GPU that
 * is exact. When other containers share the GPU it is not: an event completes when *its stream*
 * reaches it, so the pair around a kernel also spans the other contexts' work the GPU ran in
 * between (their kernels queued ahead of ours, their time slices). Charged that, a container is
 * billed for its neighbours' kernels and gets less than its limit.
 *
 * The device itself knows each process's share: NVML's per-process utilisation
 * (nvmlDeviceGetProcessUtilization, the per-process SM busy % the driver samples). Every 500 ms
 * the poll thread asks it how busy this process kept the device since the last answer and
 * compares that with the raw event time measured over the same interval. The ratio
 * (own time / measured time, 0.01..1, smoothed) is applied to every measurement: the bucket is
 * charged, and achieved % is published, in own device time.
 *
 * Never fails open: without NVML, without the entry point, or when NVML does not list this
 * process (a pid namespace the node agent has not mapped: tsr_proc_slot.host_pid), the ratio
 * stays 1 — the container is charged the full measured time, i.e. throttled at or below its
 * limit. Contention can only add time to an event pair, so the ratio is never above 1.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "vgpu.h"

#define OT_PERIOD_NS 500000000ull /* how often NVML is asked */
#define OT_MIN_RAW_NS 5000000ll   /* a window with less measured time says nothing */
#define OT_ONE 1000000u           /* ratio 1.0 in parts per million */
#define OT_MIN 10000u             /* 0.01 */
#define OT_SAMPLES 256

struct owntime {
    _Atomic uint32_t ppm;      /* the ratio applied to measurements */
    _Atomic int64_t raw_ns;    /* event time measured since the last NVML answer */
    _Atomic int64_t charged_ns; /* ... and what was charged for it */
    nvmlDevice_t handle;
    int have_handle;
    unsigned long long last_ts; /* NVML timestamp (µs) of the newest sample seen */
    double own_avg, raw_avg;    /* decaying sums of own (NVML) and measured time, ns */
    int seen;                   /* NVML has listed this process on this device */
    int64_t debt;               /* settled but not yet charged to the bucket (poll thread) */
};

static struct owntime ot[TSR_MAX_DEVICES];
static int nvml_state; /* 0 not tried, 1 usable, -1 not available (poll thread only) */
static uint64_t next_poll;

void tv_owntime_reset(void)
{
    for (int d = 0; d < TSR_MAX_DEVICES; d++) {
        atomic_store(&ot[d].ppm, OT_ONE);
        atomic_store(&ot[d].raw_ns, 0);
        atomic_store(&ot[d].charged_ns, 0);
        ot[d].have_handle = 0;
        ot[d].last_ts = 0;
        ot[d].own_avg = ot[d].raw_avg = 0;
        ot[d].seen = 0;
        ot[d].debt = 0;
    }
    nvml_state = 0;
    next_poll = 0;
}

__attribute__((constructor)) static void owntime_init(void)
{
    for (int d = 0; d < TSR_MAX_DEVICES; d++) atomic_store(&ot[d].ppm, OT_ONE);
}

/* Measured (raw) event time of one launch -> the device time to charge. Any thread. */
int64_t tv_owntime_charge(int d, int64_t raw_ns)
{
    if (d < 0 || d >= TSR_MAX_DEVICES || raw_ns <= 0) return raw_ns;
    atomic_fetch_add_explicit(&ot[d].raw_ns, raw_ns, memory_order_relaxed);
    uint32_t ppm = atomic_load_explicit(&ot[d].ppm, memory_order_relaxed);
    int64_t c = ppm >= OT_ONE ? raw_ns : (int64_t)((__int128)raw_ns * ppm / OT_ONE);
    atomic_fetch_add_explicit(&ot[d].charged_ns, c, memory_order_relaxed);
    return c;
}

static int nvml_usable(void)
{
    if (nvml_state) return nvml_state > 0;
    nvml_state = -1;
    /* quietly: a container without NVML is normal, the ratio then stays 1 */
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return 0;
    dlclose(h);
    if (tv_nvml_init() != 0 || !REAL(nvmlInit_v2) || !REAL(nvmlDeviceGetCount_v2) ||
        !REAL(nvmlDeviceGetHandleByIndex_v2) || !REAL(nvmlDeviceGetUUID) ||
        !REAL(nvmlDeviceGetProcessUtilization))
        return 0;
    if (REAL(nvmlInit_v2)() != NVML_SUCCESS) return 0;
    nvml_state = 1;
    return 1;
}

static int find_handle(int d)
{
    if (ot[d].have_handle) return 1;
    const char *want = tv.region->dev[d].uuid;
    unsigned n = 0;
    if (!want[0] || REAL(nvmlDeviceGetCount_v2)(&n) != NVML_SUCCESS) return 0;
    for (unsigned i = 0; i < n; i++) {
        nvmlDevice_t h;
        char uuid[96];
        if (REAL(nvmlDeviceGetHandleByIndex_v2)(i, &h) != NVML_SUCCESS ||
            REAL(nvmlDeviceGetUUID)(h, uuid, sizeof uuid) != NVML_SUCCESS)
            continue;
        uuid[TSR_UUID_LEN - 1] = 0;
        if (!strncmp(uuid, want, TSR_UUID_LEN)) {
            ot[d].handle = h;
            ot[d].have_handle = 1;
            return 1;
        }
    }
    return 0;
}

/* This process's pid as NVML reports it: the host pid the node agent wrote, else our own. */
static unsigned nvml_pid(void)
{
    struct tsr_proc_slot *s = atomic_load(&tv.slot);
    uint32_t hp = s ? __atomic_load_n(&s->host_pid, __ATOMIC_RELAXED) : 0;
    return hp ? hp : (unsigned)tv.pid;
}

/* Own busy ns since ot[d].last_ts per NVML; -1 when NVML said nothing about this process. */
static int64_t nvml_own_busy(int d, int *others)
{
    static nvmlProcessUtilizationSample_t s[OT_SAMPLES]; /* poll thread only */
    unsigned n = OT_SAMPLES;
    if (REAL(nvmlDeviceGetProcessUtilization)(ot[d].handle, s, &n, ot[d].last_ts) != NVML_SUCCESS)
        return -1;
    if (n > OT_SAMPLES) n = OT_SAMPLES;
    unsigned pid = nvml_pid();
    unsigned long long prev = ot[d].last_ts, newest = prev;
    int64_t busy = 0;
    int mine = 0;
    /* this process's samples in time order; each covers the time since the one before */
    for (;;) {
        unsigned long long best = ~0ull;
        int bi = -1;
        for (unsigned i = 0; i < n; i++)
            if (s[i].pid == pid && s[i].timeStamp > prev && s[i].timeStamp < best) {
                best = s[i].timeStamp;
                bi = (int)i;
            }
        if (bi < 0) break;
        unsigned util = s[bi].smUtil > 100 ? 100 : s[bi].smUtil;
        if (ot[d].last_ts) busy += (int64_t)((best - prev) * 1000ull * util / 100);
        prev = best;
        mine = 1;
    }
    *others = 0;
    for (unsigned i = 0; i < n; i++) {
        if (s[i].timeStamp > newest) newest = s[i].timeStamp;
        if (s[i].pid != pid && s[i].smUtil > 0 && s[i].timeStamp > ot[d].last_ts) *others = 1;
    }
    int first = ot[d].last_ts == 0;
    ot[d].last_ts = newest;
    ot[d].seen |= mine;
    /* not listed: idle in that interval if NVML has listed us before, else NVML cannot see us */
    return first || !ot[d].seen ? -1 : busy;
}

/* Poll thread, every tick: every OT_PERIOD_NS, for each throttled device, compare what NVML
 * says this process used with what was measured and charged over the same interval. */
/* The bucket takes a settlement gradually (a 25th of what is left per 20 ms tick, never
 * forgiven): paid back at once, a refund would let the container burst, queue ahead of its
 * neighbours on the device, and make the next windows swing the other way. */
static void pay_debts(void)
{
    for (int d = 0; d < TSR_MAX_DEVICES; d++) {
        int64_t part = ot[d].debt / 25;
        if (!part) part = ot[d].debt;
        if (!part) continue;
        tv_compute_recharge(d, part, 0);
        ot[d].debt -= part;
    }
}

unsigned tv_owntime_poll(uint64_t now_mono)
{
    if (!tv.region) return 0;
    pay_debts();
    if (now_mono < next_poll) return 0;
    next_poll = now_mono + OT_PERIOD_NS;
    int any = 0;
    for (int d = 0; d < TSR_MAX_DEVICES; d++)
        any |= atomic_load(&tv.dev[d].ordinal) >= 0 && atomic_load(&tv.dev[d].sm_eff) != 0;
    if (!any || !nvml_usable()) return 0;
    unsigned answered = 0;
    for (int d = 0; d < TSR_MAX_DEVICES; d++) {
        if (atomic_load(&tv.dev[d].ordinal) < 0 || atomic_load(&tv.dev[d].sm_eff) == 0) continue;
        if (!find_handle(d)) continue;
        int others;
        int64_t own = nvml_own_busy(d, &others);
        int64_t raw = atomic_exchange(&ot[d].raw_ns, 0);
        int64_t charged = atomic_exchange(&ot[d].charged_ns, 0);
        if (own < 0) continue;
        answered |= 1u << d;
        if (raw >= OT_MIN_RAW_NS) {
            /* a ratio of (exponentially weighted) sums, not an average of ratios: contention
             * that stretches the measurements also lowers that window's ratio */
            ot[d].own_avg = ot[d].own_avg * 2 / 3 + (double)own;
            ot[d].raw_avg = ot[d].raw_avg * 2 / 3 + (double)raw;
            double r = ot[d].own_avg / ot[d].raw_avg * OT_ONE;
            atomic_store(&ot[d].ppm, r > OT_ONE ? OT_ONE : r < OT_MIN ? OT_MIN : (uint32_t)r);
        }
        /* Shared with other processes, settle the window: busy_ns_total and (gradually) the
         * bucket end up holding what the device says this process used, not the ratio's estimate
         * of it (the ratio lags the contention it corrects, which would bias the charge). Alone,
         * the event measurements stand: they are finer than NVML's whole percents. */
        uint32_t ppm = atomic_load(&ot[d].ppm);
        if (others) {
            tv_compute_recharge(d, 0, own - charged);
            ot[d].debt += own - charged;
        }
        TV_LOG(TV_LOG_DEBUG, "owntime dev %d: own %lld ns, measured %lld, charged %lld, ratio %.3f",
               d, (long long)own, (long long)raw, (long long)charged, (double)ppm / OT_ONE);
    }
    return answered;
}
