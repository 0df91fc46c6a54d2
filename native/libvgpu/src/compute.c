/*
 * compute.c — the compute limit, applied to every launch path.
 *
 * Unthrottled (no device of the process is limited): one atomic load, a counter bump, and the
 * real call. No system call, no lock, no getenv, no logging.
 *
 * Throttled: a token bucket of GPU time per device, in the region, shared by all processes of
 * the container. It refills at limit% of wall time (capped at TV_BURST_NS). A launch waits while
 * the bucket is empty, then is charged the estimated GPU time of the launch. CUDA events recorded
 * around the launch measure what it really took; when they complete the bucket is corrected by
 * (estimate - actual), so over any window the container's GPU time is limit% of wall time, and
 * the estimate (a moving average per context) only bounds how far ahead the queue may run.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "vgpu.h"

#define TV_BURST_NS 10000000ll /* 10 ms of GPU time may be banked */
/* ... 30 ms while other processes share the device (owntime.c): a container whose thread was
 * descheduled catches up on its share, queued among its neighbours', instead of leaving it to
 * them. Not while yielding to a higher priority: it must stay out of that one's way. Below the
 * 4 x TV_BURST_NS beyond which a budget counts as written by the tenant. */
#define TV_SHARED_BURST_NS 30000000ll
#define TV_RING 64             /* launches in flight per context before we wait for one */
#define TV_MAX_CTX 64
#define TV_MIN_SLEEP 20000ull
#define TV_MAX_SLEEP 5000000ull

struct pair {
    CUevent start, end;
    int64_t est;
    int dslot;
};

struct ctxq {
    CUcontext ctx;
    struct pair ring[TV_RING];
    unsigned head, tail;
    int64_t est_ns; /* moving average of measured launches; -1 = none yet */
};

static pthread_mutex_t cq_mu = PTHREAD_MUTEX_INITIALIZER;
static struct ctxq *qs[TV_MAX_CTX];
static int64_t dev_est[TV_MAX_SLOTS];
static uint64_t last_launches;
static int fast_devices_noted; /* poll thread: note_devices_of_fast_launches() ran */
static int stopping; /* exit has begun: the poll thread no longer calls the driver */
/* Elastic devices, this process: when it last waited to launch, and since when it has launched
 * without a pause (or since the node agent last lowered its allowance). */
static _Atomic uint64_t last_gate[TV_MAX_SLOTS], steady_since[TV_MAX_SLOTS];
#define TV_PAUSE_NS 100000000ull  /* a gap this long between launches: it was idle */
#define TV_STEADY_NS 500000000ull /* launching this long without a pause: steady */

#define RD(d) tv_region_dev(&tv.rg, d)

/* ---- the bucket (lock-free, shared by the container's processes) -------------------------- */

static void refill(struct tsr_region_device *rd, uint32_t pct, uint64_t now, int64_t cap)
{
    uint64_t ts = __atomic_load_n(&rd->budget_ts_ns, __ATOMIC_RELAXED);
    if (now <= ts) return;
    if (!__atomic_compare_exchange_n(&rd->budget_ts_ns, &ts, now, 0, __ATOMIC_RELAXED,
                                     __ATOMIC_RELAXED))
        return; /* another thread or process refilled this interval */
    uint64_t dt = now - ts;
    if (dt > 1000 * 1000000000ull) dt = 1000 * 1000000000ull; /* no overflow at % x 100 */
    int64_t add = ts == 0 ? TV_BURST_NS : (int64_t)(dt * pct / TV_SM_FULL);
    int64_t b = __atomic_load_n(&rd->budget_ns, __ATOMIC_RELAXED), nb;
    do {
        nb = b + add;
        if (nb > cap) nb = b > cap && b <= TV_SHARED_BURST_NS ? b : cap;
        if (b > 4 * TV_BURST_NS) nb = -TV_BURST_NS; /* written into the region: a debt */
    } while (!__atomic_compare_exchange_n(&rd->budget_ns, &b, nb, 1, __ATOMIC_RELAXED,
                                          __ATOMIC_RELAXED));
}

static void charge(int d, int64_t ns)
{
    if (ns) __atomic_fetch_sub(&RD(d)->budget_ns, ns, __ATOMIC_RELAXED);
}

/* The node agent lends an elastic container less than before (a neighbour woke): nothing banked
 * at the old rate survives (a debt stays), and launches are priced by own device time at once
 * (owntime.c). Caller holds tv.mu. */
void tv_compute_lent_less(int d)
{
    if (d < 0 || d >= TV_MAX_SLOTS || !tv.rg.map) return;
    struct tsr_region_device *rd = RD(d);
    int64_t b = __atomic_load_n(&rd->budget_ns, __ATOMIC_RELAXED);
    while (b > 0 && !__atomic_compare_exchange_n(&rd->budget_ns, &b, 0, 1, __ATOMIC_RELAXED,
                                                 __ATOMIC_RELAXED)) {
    }
    tv_owntime_assume_shared(d, __atomic_load_n(&dev_est[d], __ATOMIC_RELAXED));
    atomic_store_explicit(&steady_since[d], tv_mono_ns(), memory_order_relaxed);
}

/* Owntime settles: charge the bucket `bucket_ns` more (negative: less) and count `busy_ns` more
 * device time used. */
void tv_compute_recharge(int d, int64_t bucket_ns, int64_t busy_ns)
{
    if (d < 0 || d >= TV_MAX_SLOTS || !tv.rg.map) return;
    charge(d, bucket_ns);
    if (busy_ns) __atomic_fetch_add(&RD(d)->busy_ns_total, (uint64_t)busy_ns, __ATOMIC_RELAXED);
}

/* ---- measuring launches ------------------------------------------------------------------- */

/* Caller holds cq_mu. Apply the completed measurements of one context. */
static void harvest(struct ctxq *q)
{
    while (q->head != q->tail) {
        struct pair *p = &q->ring[q->head % TV_RING];
        CUresult s = REAL(cuEventQuery)(p->end);
        if (s == CUDA_ERROR_NOT_READY) break;
        int64_t actual = p->est;
        float ms;
        if (s == CUDA_SUCCESS && REAL(cuEventElapsedTime)(&ms, p->start, p->end) == CUDA_SUCCESS &&
            ms >= 0)
            actual = tv_owntime_charge(p->dslot, (int64_t)((double)ms * 1e6));
        charge(p->dslot, actual - p->est);
        __atomic_fetch_add(&RD(p->dslot)->busy_ns_total, (uint64_t)actual, __ATOMIC_RELAXED);
        q->est_ns = q->est_ns < 0 ? actual : (q->est_ns * 7 + actual) / 8;
        dev_est[p->dslot] = q->est_ns;
        q->head++;
    }
}

/* Returns the device slots with launches still in flight after the harvest (bit d), or 0 when
 * the lock was busy (non-blocking). */
static unsigned harvest_all(int block)
{
    if (block) pthread_mutex_lock(&cq_mu);
    else if (pthread_mutex_trylock(&cq_mu) != 0) return 0;
    unsigned inflight = 0;
    for (int i = 0; i < TV_MAX_CTX && !stopping; i++) {
        struct ctxq *q = qs[i];
        if (!q) continue;
        harvest(q);
        for (unsigned k = q->head; k != q->tail; k++) {
            int d = q->ring[k % TV_RING].dslot;
            if (d >= 0 && d < 32) inflight |= 1u << d;
        }
    }
    pthread_mutex_unlock(&cq_mu);
    return inflight;
}

/* At exit, before the driver's own destructors: wait for a harvest in progress, stop the next. */
void tv_compute_shutdown(void)
{
    pthread_mutex_lock(&cq_mu);
    stopping = 1;
    pthread_mutex_unlock(&cq_mu);
}

/* Caller holds cq_mu. */
static struct ctxq *get_q(CUcontext ctx)
{
    int free_i = -1;
    for (int i = 0; i < TV_MAX_CTX; i++) {
        if (qs[i] && qs[i]->ctx == ctx) return qs[i];
        if (!qs[i] && free_i < 0) free_i = i;
    }
    if (free_i < 0) return NULL;
    struct ctxq *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    q->ctx = ctx;
    q->est_ns = -1;
    qs[free_i] = q;
    return q;
}

void tv_compute_forget_ctx(CUcontext ctx)
{
    if (!atomic_load(&tv.cuda_ready)) return;
    pthread_mutex_lock(&cq_mu);
    for (int i = 0; i < TV_MAX_CTX; i++) {
        struct ctxq *q = qs[i];
        if (!q || q->ctx != ctx) continue;
        harvest(q);
        for (int k = 0; k < TV_RING; k++) {
            if (q->ring[k].start) REAL(cuEventDestroy_v2)(q->ring[k].start);
            if (q->ring[k].end) REAL(cuEventDestroy_v2)(q->ring[k].end);
        }
        free(q);
        qs[i] = NULL;
    }
    pthread_mutex_unlock(&cq_mu);
}

void tv_compute_after_fork_child(void)
{
    pthread_mutex_init(&cq_mu, NULL);
    stopping = 0;
    for (int i = 0; i < TV_MAX_CTX; i++) { /* the child has no CUDA context of its parent */
        free(qs[i]);
        qs[i] = NULL;
    }
    last_launches = 0;
    fast_devices_noted = 0;
    tv_owntime_reset();
}

/* ---- waiting for budget ------------------------------------------------------------------- */

/* An elastic container catches up (30 ms bank) only in a steady state. One that just woke, or
 * whose allowance just dropped, banked at a rate nobody else could use while the device was in
 * transition: spent at once, it would take its waking neighbours' share for 100-200 ms. */
static int elastic_steady(int d, uint64_t now)
{
    uint64_t last = atomic_exchange_explicit(&last_gate[d], now, memory_order_relaxed);
    if (now - last > TV_PAUSE_NS) atomic_store_explicit(&steady_since[d], now, memory_order_relaxed);
    return now - atomic_load_explicit(&steady_since[d], memory_order_relaxed) >= TV_STEADY_NS;
}

static void wait_budget(int d)
{
    struct tsr_region_device *rd = RD(d);
    for (;;) {
        uint32_t eff = atomic_load_explicit(&tv.dev[d].sm_eff, memory_order_relaxed);
        if (eff == 0) return;
        uint64_t now = tv_mono_ns(), sleep;
        if (eff == TV_SM_PAUSE) {
            __atomic_store_n(&rd->budget_ts_ns, now, __ATOMIC_RELAXED); /* nothing accrues */
            sleep = TV_MAX_SLEEP;
        } else {
            int catch_up = tv_owntime_shared(d) && !atomic_load(&tv.dev[d].yielding) &&
                           (!atomic_load(&tv.dev[d].elastic) || elastic_steady(d, now));
            refill(rd, eff, now, catch_up ? TV_SHARED_BURST_NS : TV_BURST_NS);
            int64_t b = __atomic_load_n(&rd->budget_ns, __ATOMIC_RELAXED);
            if (tv_unlikely(b > 4 * TV_BURST_NS)) {
                /* far more than refills and corrections bank: written into the region by the
                 * tenant. Treated as an empty bucket (a debt of one burst), never as budget. */
                __atomic_compare_exchange_n(&rd->budget_ns, &b, -TV_BURST_NS, 0,
                                            __ATOMIC_RELAXED, __ATOMIC_RELAXED);
                continue;
            }
            if (b > 0) return;
            sleep = (uint64_t)(-b + 1000) * TV_SM_FULL / eff;
        }
        if (sleep < TV_MIN_SLEEP) sleep = TV_MIN_SLEEP;
        if (sleep > TV_MAX_SLEEP) sleep = TV_MAX_SLEEP;
        /* waiting for budget is wanting the device: the node agent reads it as busy (it lends
         * an idle container's share to the busy ones: tessera/elastic_compute.py) */
        __atomic_store_n(&rd->last_kernel_ns, tv_real_ns(), __ATOMIC_RELAXED);
        harvest_all(0);
        tv_sleep_ns(sleep);
    }
}

static void note_launch(int d)
{
    __atomic_fetch_add(&RD(d)->launches, 1, __ATOMIC_RELAXED);
    __atomic_store_n(&RD(d)->last_kernel_ns, tv_real_ns(), __ATOMIC_RELAXED);
}

static inline void bump_process_launches(void)
{
    struct tsr_proc_slot *s = atomic_load_explicit(&tv.rg.slot, memory_order_relaxed);
    if (s) __atomic_store_n(&s->launches, __atomic_load_n(&s->launches, __ATOMIC_RELAXED) + 1,
                            __ATOMIC_RELAXED);
}

/* The fast path: nothing is throttled in this process. */
static inline int fast_ok(void)
{
    if (tv_unlikely(!atomic_load_explicit(&tv.cuda_ready, memory_order_acquire))) return 0;
    if (tv_unlikely(atomic_load_explicit(&tv.throttle_any, memory_order_relaxed))) return 0;
    bump_process_launches();
    return 1;
}

typedef CUresult (*thunk_fn)(const void *args);

/* Throttle one launch on `stream`, measure it, and return what the driver returned. */
static CUresult gate(CUstream stream, int ptsz, thunk_fn fn, const void *args)
{
    if (ptsz && stream == NULL) stream = CU_STREAM_PER_THREAD;
    tv_slot();
    bump_process_launches();
    int d = tv_stream_dev_slot(stream);
    if (d < 0 || atomic_load_explicit(&tv.dev[d].sm_eff, memory_order_relaxed) == 0)
        return fn(args);
    wait_budget(d);
    CUcontext ctx = NULL;
    REAL(cuCtxGetCurrent)(&ctx);
    pthread_mutex_lock(&cq_mu);
    struct ctxq *q = ctx ? get_q(ctx) : NULL;
    if (!q) {
        pthread_mutex_unlock(&cq_mu);
        charge(d, dev_est[d]);
        note_launch(d);
        return fn(args);
    }
    harvest(q);
    if (q->tail - q->head >= TV_RING) { /* bound the queue: wait for the oldest launch */
        REAL(cuEventSynchronize)(q->ring[q->head % TV_RING].end);
        harvest(q);
        if (q->tail - q->head >= TV_RING) q->head++; /* a broken event: drop it */
    }
    struct pair *p = &q->ring[q->tail % TV_RING];
    if (!p->start && (REAL(cuEventCreate)(&p->start, CU_EVENT_DEFAULT) != CUDA_SUCCESS ||
                      REAL(cuEventCreate)(&p->end, CU_EVENT_BLOCKING_SYNC) != CUDA_SUCCESS)) {
        p->start = p->end = NULL;
        pthread_mutex_unlock(&cq_mu);
        charge(d, dev_est[d]);
        note_launch(d);
        return fn(args);
    }
    int64_t est = q->est_ns > 0 ? q->est_ns : 0;
    int first = q->est_ns < 0;
    REAL(cuEventRecord)(p->start, stream);
    CUresult r = fn(args);
    CUevent end = p->end;
    if (r == CUDA_SUCCESS) {
        if (REAL(cuEventRecord)(end, stream) == CUDA_SUCCESS) {
            p->est = est;
            p->dslot = d;
            q->tail++;
        } else {
            first = 0;
        }
        charge(d, est);
        note_launch(d);
    }
    pthread_mutex_unlock(&cq_mu);
    if (r == CUDA_SUCCESS && first) { /* learn the launch's cost before queueing more */
        REAL(cuEventSynchronize)(end);
        harvest_all(1);
    }
    return r;
}

/* ---- the launch paths -------------------------------------------------------------------- */

struct lk_args {
    CUfunction f;
    unsigned gx, gy, gz, bx, by, bz, sh;
    CUstream s;
    void **params, **extra;
    int ptsz, coop;
};

static CUresult lk_thunk(const void *p)
{
    const struct lk_args *a = p;
    if (a->coop)
        return (a->ptsz ? REAL(cuLaunchCooperativeKernel_ptsz) : REAL(cuLaunchCooperativeKernel))(
            a->f, a->gx, a->gy, a->gz, a->bx, a->by, a->bz, a->sh, a->s, a->params);
    return (a->ptsz ? REAL(cuLaunchKernel_ptsz) : REAL(cuLaunchKernel))(
        a->f, a->gx, a->gy, a->gz, a->bx, a->by, a->bz, a->sh, a->s, a->params, a->extra);
}

#define LAUNCH_KERNEL(NAME, PTSZ)                                                             \
    CUresult CUDAAPI tv_##NAME(CUfunction f, unsigned gx, unsigned gy, unsigned gz,           \
                               unsigned bx, unsigned by, unsigned bz, unsigned sh, CUstream s, \
                               void **params, void **extra)                                   \
    {                                                                                         \
        if (tv_likely(fast_ok()))                                                             \
            return REAL(NAME)(f, gx, gy, gz, bx, by, bz, sh, s, params, extra);               \
        TV_CUDA_ENTER();                                                                      \
        if (fast_ok()) return REAL(NAME)(f, gx, gy, gz, bx, by, bz, sh, s, params, extra);    \
        struct lk_args a = {f, gx, gy, gz, bx, by, bz, sh, s, params, extra, PTSZ, 0};        \
        return gate(s, PTSZ, lk_thunk, &a);                                                   \
    }
LAUNCH_KERNEL(cuLaunchKernel, 0)
LAUNCH_KERNEL(cuLaunchKernel_ptsz, 1)

#define LAUNCH_COOP(NAME, PTSZ)                                                               \
    CUresult CUDAAPI tv_##NAME(CUfunction f, unsigned gx, unsigned gy, unsigned gz,           \
                               unsigned bx, unsigned by, unsigned bz, unsigned sh, CUstream s, \
                               void **params)                                                 \
    {                                                                                         \
        if (tv_likely(fast_ok())) return REAL(NAME)(f, gx, gy, gz, bx, by, bz, sh, s, params);\
        TV_CUDA_ENTER();                                                                      \
        if (fast_ok()) return REAL(NAME)(f, gx, gy, gz, bx, by, bz, sh, s, params);           \
        struct lk_args a = {f, gx, gy, gz, bx, by, bz, sh, s, params, NULL, PTSZ, 1};         \
        return gate(s, PTSZ, lk_thunk, &a);                                                   \
    }
LAUNCH_COOP(cuLaunchCooperativeKernel, 0)
LAUNCH_COOP(cuLaunchCooperativeKernel_ptsz, 1)

struct ex_args {
    const CUlaunchConfig *c;
    CUfunction f;
    void **params, **extra;
    int ptsz;
};

static CUresult ex_thunk(const void *p)
{
    const struct ex_args *a = p;
    return (a->ptsz ? REAL(cuLaunchKernelEx_ptsz) : REAL(cuLaunchKernelEx))(a->c, a->f, a->params,
                                                                            a->extra);
}

#define LAUNCH_EX(NAME, PTSZ)                                                                 \
    CUresult CUDAAPI tv_##NAME(const CUlaunchConfig *c, CUfunction f, void **params,          \
                               void **extra)                                                  \
    {                                                                                         \
        if (tv_likely(fast_ok())) return REAL(NAME)(c, f, params, extra);                     \
        TV_CUDA_ENTER();                                                                      \
        if (fast_ok()) return REAL(NAME)(c, f, params, extra);                                \
        struct ex_args a = {c, f, params, extra, PTSZ};                                       \
        return gate(c ? c->hStream : NULL, PTSZ, ex_thunk, &a);                               \
    }
LAUNCH_EX(cuLaunchKernelEx, 0)
LAUNCH_EX(cuLaunchKernelEx_ptsz, 1)

struct graph_args {
    CUgraphExec g;
    CUstream s;
    int ptsz;
};

static CUresult graph_thunk(const void *p)
{
    const struct graph_args *a = p;
    return (a->ptsz ? REAL(cuGraphLaunch_ptsz) : REAL(cuGraphLaunch))(a->g, a->s);
}

#define LAUNCH_GRAPH(NAME, PTSZ)                                                              \
    CUresult CUDAAPI tv_##NAME(CUgraphExec g, CUstream s)                                     \
    {                                                                                         \
        CUresult r;                                                                           \
        if (tv_likely(fast_ok())) {                                                           \
            r = REAL(NAME)(g, s);                                                             \
        } else {                                                                              \
            TV_CUDA_ENTER();                                                                  \
            struct graph_args a = {g, s, PTSZ};                                               \
            r = fast_ok() ? REAL(NAME)(g, s) : gate(s, PTSZ, graph_thunk, &a);                \
        }                                                                                     \
        /* graph memory nodes: its allocations are live now (graphmem.c) */                  \
        if (r == CUDA_SUCCESS &&                                                              \
            atomic_load_explicit(&tv_graphmem_nodes, memory_order_relaxed))                   \
            tv_graphmem_launched(g);                                                          \
        return r;                                                                             \
    }
LAUNCH_GRAPH(cuGraphLaunch, 0)
LAUNCH_GRAPH(cuGraphLaunch_ptsz, 1)

/* Deprecated multi-device cooperative launch: every device waits for its budget and is charged
 * its recent per-launch estimate (no events: the launch spans contexts). */
CUresult CUDAAPI tv_cuLaunchCooperativeKernelMultiDevice(CUDA_LAUNCH_PARAMS *list, unsigned n,
                                                         unsigned flags)
{
    if (tv_likely(fast_ok())) return REAL(cuLaunchCooperativeKernelMultiDevice)(list, n, flags);
    TV_CUDA_ENTER();
    if (fast_ok()) return REAL(cuLaunchCooperativeKernelMultiDevice)(list, n, flags);
    int slots[TSR_MAX_DEVICES], ns = 0;
    for (unsigned i = 0; list && i < n && ns < TSR_MAX_DEVICES; i++) {
        int d = tv_stream_dev_slot(list[i].hStream);
        if (d >= 0 && atomic_load(&tv.dev[d].sm_eff)) {
            wait_budget(d);
            slots[ns++] = d;
        }
    }
    CUresult r = REAL(cuLaunchCooperativeKernelMultiDevice)(list, n, flags);
    if (r == CUDA_SUCCESS)
        for (int i = 0; i < ns; i++) {
            charge(slots[i], dev_est[slots[i]]);
            note_launch(slots[i]);
        }
    return r;
}

/* ---- the poll thread's share --------------------------------------------------------------- */

/* Unthrottled launches take the fast path, which never asks which device they are on. A process
 * that launches without having allocated (so without a device slot) still shows as active on
 * the node agent's contention view: its visible devices are registered, once, from here. */
static void note_devices_of_fast_launches(void)
{
    if (fast_devices_noted || !atomic_load(&tv.cuda_ready) ||
        __atomic_load_n(&stopping, __ATOMIC_RELAXED))
        return;
    for (int d = 0; d < TV_MAX_SLOTS; d++)
        if (atomic_load(&tv.dev[d].ordinal) >= 0) return; /* it has devices: they are marked */
    int n = 0;
    if (REAL(cuDeviceGetCount)(&n) != CUDA_SUCCESS) return;
    fast_devices_noted = 1;
    for (int i = 0; i < n && i < TV_MAX_CUDA_DEVS; i++) tv_dev_slot(i);
}

void tv_compute_poll(uint64_t now_mono, uint64_t now_real)
{
    if (!tv.rg.map) return;
    unsigned nvml_mask = 0, inflight = 0;
    if (atomic_load(&tv.cuda_ready)) {
        inflight = harvest_all(0);
        if (!__atomic_load_n(&stopping, __ATOMIC_RELAXED)) nvml_mask = tv_owntime_poll(now_mono);
    }
    struct tsr_proc_slot *s = atomic_load(&tv.rg.slot);
    uint64_t l = s ? __atomic_load_n(&s->launches, __ATOMIC_RELAXED) : 0;
    int active = l != last_launches;
    last_launches = l;
    if (active) note_devices_of_fast_launches();
    for (int d = 0; d < TV_MAX_SLOTS; d++) {
        if (atomic_load(&tv.dev[d].ordinal) < 0) continue;
        struct tsr_region_device *rd = RD(d);
        /* work still queued on the device counts as activity (a long kernel, a deep queue) */
        if (active || (inflight & (1u << d)))
            __atomic_store_n(&rd->last_kernel_ns, now_real, __ATOMIC_RELAXED);
        struct tv_dev *v = &tv.dev[d];
        /* achieved % over ~1 s; when NVML answers for this device (every 500 ms), from one
         * answer to another, so that settled windows are published as the device saw them */
        uint64_t age = now_mono - v->win_ts;
        int due = nvml_mask & (1u << d) ? age >= 900000000ull : age >= 1000000000ull;
        if (!due) continue;
        uint64_t busy = __atomic_load_n(&rd->busy_ns_total, __ATOMIC_RELAXED);
        uint32_t eff = atomic_load(&v->sm_eff);
        if (v->win_ts && now_mono > v->win_ts) {
            int64_t delta = (int64_t)(busy - v->win_busy); /* a settled window may lower it */
            uint64_t pct = delta > 0 ? (uint64_t)delta * 10000 / (now_mono - v->win_ts) : 0;
            __atomic_store_n(&rd->achieved_sm_x100,
                             eff ? (uint32_t)(pct > 10000 ? 10000 : pct) : TSR_SM_UNKNOWN,
                             __ATOMIC_RELAXED);
        }
        v->win_busy = busy;
        v->win_ts = now_mono;
    }
}
