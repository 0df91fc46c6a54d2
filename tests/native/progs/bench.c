/*
 * bench launch N | alloc N | startup DEADLINE_NS — what libvgpu adds (bench/libvgpu.py runs it
 * with and without the preload, in the same run, and under callgrind).
 *   launch N    N unthrottled cuLaunchKernel of a zero-length kernel  -> ns per launch
 *   alloc N     N cuMemAlloc + cuMemFree pairs of 1 MiB               -> ns per pair
 *   startup T   wait until CLOCK_MONOTONIC T, then cuInit, context, first allocation -> ns
 */
#include <time.h>
#include <unistd.h>

#include "common.h"

static int64_t now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc != 3) return 2;
    long n = atol(argv[2]);
    CUdevice d;
    CUcontext c;
    if (!strcmp(argv[1], "startup")) {
        struct timespec ts = {n / 1000000000, n % 1000000000};
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL);
        int64_t t0 = now();
        CUdeviceptr p;
        if (cuInit(0) || cuDeviceGet(&d, 0) || cuDevicePrimaryCtxRetain(&c, d) || cuCtxSetCurrent(c) ||
            cuMemAlloc_v2(&p, 1 << 20))
            return 3;
        printf("%lld\n", (long long)(now() - t0));
        cuMemFree_v2(p);
        return 0;
    }
    if (cuInit(0) || cuDeviceGet(&d, 0) || cuDevicePrimaryCtxRetain(&c, d) || cuCtxSetCurrent(c))
        return 3;
    CUmodule m;
    CUfunction f;
    cuModuleLoadData(&m, "fake");
    cuModuleGetFunction(&f, m, "k_0us");
    CUdeviceptr warm;
    cuMemAlloc_v2(&warm, 4096); /* libvgpu's one-time setup happens before the clock starts */
    cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    int64_t t0 = now();
    if (!strcmp(argv[1], "launch")) {
        for (long i = 0; i < n; i++) cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    } else {
        for (long i = 0; i < n; i++) {
            CUdeviceptr p;
            if (cuMemAlloc_v2(&p, 1 << 20)) return 4;
            cuMemFree_v2(p);
        }
    }
    printf("%.2f\n", (double)(now() - t0) / (double)n);
    cuMemFree_v2(warm);
    cuModuleUnload(m);
    return 0;
}
