/*
 * stress PROCS THREADS SECONDS LIMIT_BYTES: PROCS processes x THREADS threads allocate and free
 * random sizes (1..100 MiB, two held per thread) on device 0 as fast as they can. After every successful allocation
 * a thread reads the fake device's physical usage (all these processes together) and counts a
 * violation if it exceeds LIMIT_BYTES. Prints {"allocs","ooms","violations","max_used"}.
 */
#include <pthread.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

static struct api A;
static CUcontext ctx;
static double seconds;
static uint64_t limit;
static uint64_t (*phys_used)(int);

struct totals {
    long allocs, ooms, violations;
    uint64_t max_used;
};
static struct totals *shared; /* one per process, in shared memory */

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *worker(void *arg)
{
    struct totals *t = arg;
    unsigned seed = (unsigned)(uintptr_t)arg ^ (unsigned)getpid();
    A.cuCtxSetCurrent(ctx);
    CUdeviceptr held[8] = {0};
    double end = now() + seconds;
    while (now() < end) {
        int slot = rand_r(&seed) % 2;
        if (held[slot]) {
            A.cuMemFree(held[slot]);
            held[slot] = 0;
            continue;
        }
        size_t size = ((size_t)(rand_r(&seed) % 100) + 1) << 20;
        CUresult r = A.cuMemAlloc(&held[slot], size);
        if (r == CUDA_ERROR_OUT_OF_MEMORY) {
            __atomic_fetch_add(&t->ooms, 1, __ATOMIC_RELAXED);
            held[slot] = 0;
            continue;
        }
        if (r != CUDA_SUCCESS) {
            fprintf(stderr, "cuMemAlloc: %d\n", r);
            exit(4);
        }
        __atomic_fetch_add(&t->allocs, 1, __ATOMIC_RELAXED);
        uint64_t used = phys_used(0);
        uint64_t m = __atomic_load_n(&t->max_used, __ATOMIC_RELAXED);
        while (used > m && !__atomic_compare_exchange_n(&t->max_used, &m, used, 0, __ATOMIC_RELAXED,
                                                        __ATOMIC_RELAXED)) {
        }
        if (used > limit) __atomic_fetch_add(&t->violations, 1, __ATOMIC_RELAXED);
    }
    for (int i = 0; i < 8; i++)
        if (held[i]) A.cuMemFree(held[i]);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 5) return 2;
    int procs = atoi(argv[1]), threads = atoi(argv[2]);
    seconds = atof(argv[3]);
    limit = strtoull(argv[4], NULL, 10);
    shared = mmap(NULL, sizeof(struct totals) * (size_t)procs, PROT_READ | PROT_WRITE,
                  MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    for (int p = 0; p < procs; p++) {
        if (fork() == 0) {
            if (api_load(&A) != 0) _exit(3);
            *(void **)&phys_used = dlsym(RTLD_DEFAULT, "fake_physical_used");
            CUdevice d;
            if (A.cuInit(0) || A.cuDeviceGet(&d, 0) || A.cuDevicePrimaryCtxRetain(&ctx, d)) _exit(5);
            pthread_t t[64];
            for (int i = 0; i < threads && i < 64; i++)
                pthread_create(&t[i], NULL, worker, &shared[p]);
            for (int i = 0; i < threads && i < 64; i++) pthread_join(t[i], NULL);
            exit(0); /* a normal exit: libvgpu gives the process's slot back */
        }
    }
    int bad = 0, st;
    while (wait(&st) > 0)
        if (!WIFEXITED(st) || WEXITSTATUS(st)) bad++;
    struct totals sum = {0};
    for (int p = 0; p < procs; p++) {
        sum.allocs += shared[p].allocs;
        sum.ooms += shared[p].ooms;
        sum.violations += shared[p].violations;
        if (shared[p].max_used > sum.max_used) sum.max_used = shared[p].max_used;
    }
    printf("{\"allocs\": %ld, \"ooms\": %ld, \"violations\": %ld, \"max_used\": %llu, "
           "\"failed_procs\": %d}\n",
           sum.allocs, sum.ooms, sum.violations, (unsigned long long)sum.max_used, bad);
    return 0;
}
