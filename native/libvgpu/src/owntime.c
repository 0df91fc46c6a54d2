/*
 * owntime.c — what a launch costs this process in device time, when it shares the GPU.
 *
 * The limiter times its launches with a CUDA event before and after each one. Alone on a GPU that
 * is exact. Shared, it is not: an event completes when *its stream* reaches it, so the pair
 * around a kernel also spans the other contexts' work the GPU ran in between (their kernels
 * queued ahead of ours, their time slices). Charged that, a container pays for its neighbours'
 * kernels and gets less than its limit (10 % and 90 % containers got 6 % and 84 %).
 *
 * The device knows each process's share: NVML's per-process utilisation
 * (nvmlDeviceGetProcessUtilization: per process, the SM busy % the driver samples). Every 500 ms
 * the poll thread asks how busy this process kept the device since the last answer. While NVML
 * shows other processes busy on the device too:
 *  - a launch is charged this process's own device time per launch (NVML's time over the
 *    launches completed in the same interval, smoothed) instead of its stretched event time:
 *    the limit is applied to submitted work, priced at what the device says it costs;
 *  - each interval is settled: busy_ns_total (achieved %) is corrected at once to the device's
 *    figure, the bucket gradually (see pay_debts), so over time the container is charged
 *    exactly what the device gave it.
 * Alone on the device, the event measurements stand: they are finer than NVML's whole percents.
 *
 * Never fails open: without NVML, without the entry point, or when NVML does not list this
 * process (a pid namespace whose host pids the node agent has not written:
 * tsr_proc_slot.host_pid), launches are charged their full event time — the container is then
 * throttled at or below its limit, never above.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "vgpu.h"

#define OT_PERIOD_NS 500000000ull /* how often NVML is asked */
#define OT_SAMPLES 256

struct owntime {
    _Atomic int shared;          /* NVML's last answer showed other processes busy */
    _Atomic int64_t per_launch;  /* own device ns per launch while shared, 0 = not known yet */
    _Atomic int assumed;         /* per_launch is assume_shared's guess, not NVML's figure */
    _Atomic int64_t launches;    /* launches measured since the last NVML answer */
    _Atomic int64_t charged_ns;  /* ... and what they were charged */
    nvmlDevice_t handle;
    int have_handle;
    unsigned long long last_ts;  /* NVML timestamp (µs) of the newest sample seen */
    int seen;                    /* NVML has listed this process on this device */
    int64_t debt;                /* settled but not yet charged to the bucket (poll thread) */
};

static struct owntime ot[TV_MAX_SLOTS];
static int nvml_state; /* 0 not tried, 1 usable, -1 not available (poll thread only) */
static uint64_t next_poll;

void tv_owntime_reset(void)
{
    for (int d = 0; d < TV_MAX_SLOTS; d++) {
        atomic_store(&ot[d].shared, 0);
        atomic_store(&ot[d].per_launch, 0);
        atomic_store(&ot[d].assumed, 0);
        atomic_store(&ot[d].launches, 0);
        atomic_store(&ot[d].charged_ns, 0);
        ot[d].have_handle = 0;
        ot[d].last_ts = 0;
        ot[d].seen = 0;
        ot[d].debt = 0;
    }
    nvml_state = 0;
    next_poll = 0;
}

/* The node agent lowered an elastic allowance: neighbours woke on the device, before NVML's next
 * answer can say so. Price launches by own device time from now (the last per-launch figure NVML
 * gave, else `est`, the launch's cost measured alone): charged their stretched event time, the
 * launches still queued behind the neighbours' would put the container in debt for hundreds of
 * milliseconds, then be refunded — a stall, then a burst. NVML's next answer confirms or undoes
 * it, and settles the difference as always. */
void tv_owntime_assume_shared(int d, int64_t est)
{
    if (d < 0 || d >= TV_MAX_SLOTS) return;
    atomic_store(&ot[d].shared, 1);
    if (atomic_load(&ot[d].per_launch) <= 0 && est > 0) {
        atomic_store(&ot[d].per_launch, est);
        atomic_store(&ot[d].assumed, 1);
    }
}

int tv_owntime_shared(int d)
{
    return d >= 0 && d < TV_MAX_SLOTS && atomic_load_explicit(&ot[d].shared, memory_order_relaxed);
}

/* The measured event time of one completed launch -> the device time to charge. Any thread. */
int64_t tv_owntime_charge(int d, int64_t raw_ns)
{
    if (d < 0 || d >= TV_MAX_SLOTS || raw_ns < 0) return raw_ns;
    int64_t c = raw_ns, pl = atomic_load_explicit(&ot[d].per_launch, memory_order_relaxed);
    if (atomic_load_explicit(&ot[d].shared, memory_order_relaxed) && pl > 0 && pl < raw_ns) c = pl;
    atomic_fetch_add_explicit(&ot[d].launches, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&ot[d].charged_ns, c, memory_order_relaxed);
    return c;
}

static int nvml_usable(void)
{
    if (nvml_state) return nvml_state > 0;
    nvml_state = -1;
    /* quietly: a container without NVML is normal; launches are then charged their event time */
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) return 0;
    dlclose(h);
    if (tv_nvml_init() != 0 || !TV_HAS(nvmlInit_v2) || !TV_HAS(nvmlDeviceGetCount_v2) ||
        !TV_HAS(nvmlDeviceGetHandleByIndex_v2) || !TV_HAS(nvmlDeviceGetUUID) ||
        !TV_HAS(nvmlDeviceGetProcessUtilization))
        return 0;
    if (REAL(nvmlInit_v2)() != NVML_SUCCESS) return 0;
    nvml_state = 1;
    return 1;
}

static int find_handle(int d)
{
    if (ot[d].have_handle) return 1;
    const char *want = tv_region_dev(&tv.rg, d)->uuid;
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
    struct tsr_proc_slot *s = atomic_load(&tv.rg.slot);
    int32_t hp = s ? __atomic_load_n(&s->host_pid, __ATOMIC_RELAXED) : 0;
    return hp > 0 ? (unsigned)hp : (unsigned)tv.rg.pid; /* 0 or negative: not written */
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
 * neighbours on the device, and make the next intervals swing the other way. */
static void pay_debts(void)
{
    for (int d = 0; d < TV_MAX_SLOTS; d++) {
        int64_t part = ot[d].debt / 25;
        if (!part) part = ot[d].debt;
        if (!part) continue;
        tv_compute_recharge(d, part, 0);
        ot[d].debt -= part;
    }
}

/* Poll thread, every tick (20 ms). Returns bit d set when NVML answered for device d. */
unsigned tv_owntime_poll(uint64_t now_mono)
{
    if (!tv.rg.map) return 0;
    pay_debts();
    if (now_mono < next_poll) return 0;
    next_poll = now_mono + OT_PERIOD_NS;
    int any = 0;
    for (int d = 0; d < TV_MAX_SLOTS; d++)
        any |= atomic_load(&tv.dev[d].ordinal) >= 0 && atomic_load(&tv.dev[d].sm_eff) != 0;
    if (!any || !nvml_usable()) return 0;
    unsigned answered = 0;
    for (int d = 0; d < TV_MAX_SLOTS; d++) {
        if (atomic_load(&tv.dev[d].ordinal) < 0 || atomic_load(&tv.dev[d].sm_eff) == 0) continue;
        if (!find_handle(d)) continue;
        int others;
        int64_t own = nvml_own_busy(d, &others);
        int64_t n = atomic_exchange(&ot[d].launches, 0);
        int64_t charged = atomic_exchange(&ot[d].charged_ns, 0);
        if (own < 0) { /* NVML cannot see this process: full event time */
            atomic_store(&ot[d].shared, 0);
            continue;
        }
        answered |= 1u << d;
        atomic_store(&ot[d].shared, others);
        if (!others) continue;
        if (n > 0) {
            /* smoothed; but NVML's first figure replaces a guess (assume_shared's `est` is an
             * event time, stretched by the neighbours' kernels when the container started among
             * them: weighed 2:1 against NVML it kept launches overpriced for seconds — the
             * container held below its share, then refunded above it) */
            int64_t pl = atomic_load(&ot[d].per_launch), now_pl = own / n;
            int guess = atomic_exchange(&ot[d].assumed, 0);
            atomic_store(&ot[d].per_launch, pl > 0 && !guess ? (2 * pl + now_pl) / 3 : now_pl);
        }
        tv_compute_recharge(d, 0, own - charged);
        ot[d].debt += own - charged;
        TV_LOG(TV_LOG_DEBUG, "owntime dev %d: own %lld ns, %lld launches charged %lld, %lld/launch",
               d, (long long)own, (long long)n, (long long)charged,
               (long long)atomic_load(&ot[d].per_launch));
    }
    return answered;
}
