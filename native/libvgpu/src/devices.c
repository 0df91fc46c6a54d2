/*
 * devices.c — which device slot a CUDA device, context, stream or NVML UUID is. Devices are
 * matched by UUID (NVML and CUDA may order them differently); a driver that cannot tell a UUID
 * gets a stand-in identity, which the limits treat as "any sealed device" (the smallest limit).
 */
#define _GNU_SOURCE
#include <stdio.h>

#include "vgpu.h"

void tv_format_uuid(const CUuuid *u, char out[TSR_UUID_LEN])
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    snprintf(out, TSR_UUID_LEN,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

/* Caller holds tv.mu. */
static int slot_for_uuid_locked(const char *uuid, int ordinal)
{
    struct tv_region_seed seed;
    tv_limits_seed(&seed);
    int s = tv_region_dev_slot(&tv.rg, uuid, &seed);
    if (s >= 0) {
        if (ordinal >= 0) atomic_store(&tv.dev[s].ordinal, ordinal);
        tv_limits_apply_slot(s);
    }
    return s;
}

int tv_dev_slot(CUdevice dev)
{
    if (dev < 0 || dev >= TV_MAX_CUDA_DEVS) return -1;
    int s = atomic_load_explicit(&tv.cuda_slot[dev], memory_order_acquire);
    if (tv_likely(s >= 0)) return s;
    char uuid[TSR_UUID_LEN];
    CUuuid u;
    if (TV_HAS(cuDeviceGetUuid_v2) || TV_HAS(cuDeviceGetUuid)) {
        CUresult r = TV_HAS(cuDeviceGetUuid_v2) ? REAL(cuDeviceGetUuid_v2)(&u, dev)
                                                : REAL(cuDeviceGetUuid)(&u, dev);
        if (r != CUDA_SUCCESS) return -1;
        tv_format_uuid(&u, uuid);
    } else {
        snprintf(uuid, sizeof uuid, "CUDA-%d", (int)dev); /* no UUID from this driver */
    }
    pthread_mutex_lock(&tv.mu);
    s = atomic_load(&tv.cuda_slot[dev]);
    if (s < 0) {
        uint32_t epoch = tv_region_epoch(&tv.rg);
        s = slot_for_uuid_locked(uuid, (int)dev);
        /* not kept: a stand-in (the region was bad), or a slot resolved while the region went
         * bad or was repaired (region.h, tv_region_epoch) */
        if (s >= 0 && !tv_region_standin(&tv.rg, s) && !atomic_load(&tv.rg.bad) &&
            tv_region_epoch(&tv.rg) == epoch) {
            atomic_store_explicit(&tv.cuda_slot[dev], s, memory_order_release);
            TV_LOG(TV_LOG_INFO, "device %d = %s -> slot %d, limit %llu bytes, sm %u", (int)dev,
                   uuid, s, (unsigned long long)atomic_load(&tv.dev[s].mem_limit),
                   atomic_load(&tv.dev[s].sm_eff));
        }
    }
    pthread_mutex_unlock(&tv.mu);
    return s;
}

int tv_ctx_dev_slot(void)
{
    CUdevice d;
    if (REAL(cuCtxGetDevice)(&d) != CUDA_SUCCESS) return -1;
    return tv_dev_slot(d);
}

int tv_stream_dev_slot(CUstream s)
{
    if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) return tv_ctx_dev_slot();
    /* Without cuStreamGetCtx (an older or partial driver) the stream's context is taken to be
     * the current one: the charge still lands on a limited device. */
    CUcontext sc = NULL, cur = NULL;
    if (REAL(cuStreamGetCtx)(s, &sc) != CUDA_SUCCESS || sc == NULL) return tv_ctx_dev_slot();
    if (REAL(cuCtxGetCurrent)(&cur) == CUDA_SUCCESS && sc == cur) return tv_ctx_dev_slot();
    if (REAL(cuCtxPushCurrent_v2)(sc) != CUDA_SUCCESS) return tv_ctx_dev_slot();
    int slot = tv_ctx_dev_slot();
    CUcontext popped;
    REAL(cuCtxPopCurrent_v2)(&popped);
    return slot;
}

int tv_uuid_slot(const char *uuid)
{
    int d = tv_region_find_dev(&tv.rg, uuid);
    pthread_mutex_lock(&tv.mu);
    /* a device no CUDA process of the container has touched yet: add it, take its limit */
    if (d < 0 || tv_region_standin(&tv.rg, d)) d = slot_for_uuid_locked(uuid, -1);
    else if (atomic_load(&tv.dev[d].ordinal) < 0) tv_limits_apply_slot(d);
    pthread_mutex_unlock(&tv.mu);
    return d;
}
