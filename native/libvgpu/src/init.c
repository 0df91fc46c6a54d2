/*
 * init.c — the top layer's lifecycle: the process state, lazy start-up (nothing happens at load
 * time beyond sorting the hook table: a process that never calls CUDA never opens a file), the
 * poll thread, fork and exit.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include "lease.h"
#include "vgpu.h"

struct tv_state tv = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .rg = {.fd = -1, .slot_idx = -1},
};

static _Atomic int poll_started;
static void poll_thread_start(void);

static void after_fork_child(void)
{
    pthread_mutex_init(&tv.mu, NULL);
    tv_region_after_fork_child(&tv.rg);
    tv_account_after_fork_child();
    tv_lease_after_fork_child();
    tv_compute_after_fork_child();
    atomic_store(&poll_started, 0);
    /* the next CUDA call registers the child and starts its poll thread */
    atomic_store(&tv.cuda_ready, 0);
}

__attribute__((constructor)) static void tv_constructor(void)
{
    /* glibc's lookup functions are found lazily, by the first lookup (driver.c) */
    for (int i = 0; i < TV_MAX_CUDA_DEVS; i++) atomic_store(&tv.cuda_slot[i], -1);
    for (int i = 0; i < TV_MAX_SLOTS; i++) atomic_store(&tv.dev[i].ordinal, -1);
    tv.rg.pid = getpid();
    pthread_atfork(NULL, NULL, after_fork_child);
    tv_intercept_init();
}

static void at_exit(void)
{
    tv_compute_shutdown();
    tv_region_release(&tv.rg);
}

void tv_core_init(void)
{
    if (atomic_load_explicit(&tv.core_ready, memory_order_acquire)) return;
    pthread_mutex_lock(&tv.mu);
    if (!atomic_load_explicit(&tv.core_ready, memory_order_relaxed)) {
        tv_log_init();
        tv_limits_load();
        tv_lease_init(tv.lm.file_mode ? tv.lm.file : "", tv.lm.lim.flags);
        struct tv_region_seed seed;
        tv_limits_seed(&seed);
        /* limits from a file: the node agent (or tessera run) prepared the region */
        tv_region_open(&tv.rg, tv_limits_region_path(), tv.lm.file_mode, &seed);
        atexit(at_exit);
        atomic_store_explicit(&tv.core_ready, 1, memory_order_release);
    }
    pthread_mutex_unlock(&tv.mu);
}

int tv_cuda_init(void)
{
    tv_core_init();
    if (atomic_load_explicit(&tv.cuda_ready, memory_order_acquire)) return 0;
    pthread_mutex_lock(&tv.mu);
    int rc = 0;
    if (!atomic_load_explicit(&tv.cuda_ready, memory_order_relaxed)) {
        if (!tv.cuda_handle) tv.cuda_handle = tv_driver_open(TV_LIB_CUDA);
        if (!tv.cuda_handle) {
            rc = -1;
        } else {
            if (!atomic_load(&tv.rg.bad)) tv_region_register(&tv.rg);
            tv_lease_attach(); /* before the driver makes a context: the watchdog's proof */
            poll_thread_start();
            atomic_store_explicit(&tv.cuda_ready, 1, memory_order_release);
        }
    }
    pthread_mutex_unlock(&tv.mu);
    return rc;
}

int tv_nvml_init(void)
{
    tv_core_init();
    if (atomic_load_explicit(&tv.nvml_ready, memory_order_acquire)) return 0;
    pthread_mutex_lock(&tv.mu);
    int rc = 0;
    if (!atomic_load_explicit(&tv.nvml_ready, memory_order_relaxed)) {
        tv.nvml_handle = tv_driver_open(TV_LIB_NVML);
        if (!tv.nvml_handle) rc = -1;
        else atomic_store_explicit(&tv.nvml_ready, 1, memory_order_release);
    }
    pthread_mutex_unlock(&tv.mu);
    return rc;
}

/* ---- the poll thread ------------------------------------------------------------------------ */

static void *poll_main(void *arg)
{
    (void)arg;
    sigset_t all;
    sigfillset(&all);
    sigdelset(&all, SIGBUS); /* a fault in a truncated region must reach region.c's handler */
    sigdelset(&all, SIGSEGV);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    unsigned tick = 0;
    struct tv_region_seed seed;
    for (;;) {
        tv_lease_wait((uint64_t)TSR_LIMITS_POLL_MS * 1000000ull); /* answers recalls at once */
        tv_limits_poll();
        pthread_mutex_lock(&tv.mu);
        tv_limits_seed(&seed);
        pthread_mutex_unlock(&tv.mu);
        tv_region_poll(&tv.rg, ++tick % (1000 / TSR_LIMITS_POLL_MS) == 0, &seed);
        tv_compute_poll(tv_mono_ns(), tv_real_ns());
    }
    return NULL;
}

static void poll_thread_start(void)
{
    int expected = 0;
    if (!atomic_compare_exchange_strong(&poll_started, &expected, 1)) return;
    pthread_t t;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&a, 256 * 1024);
    if (pthread_create(&t, &a, poll_main, NULL) != 0) {
        TV_LOG(TV_LOG_WARN, "cannot start the poll thread: limits will not be reloaded");
        atomic_store(&poll_started, 0);
    }
    pthread_attr_destroy(&a);
}
