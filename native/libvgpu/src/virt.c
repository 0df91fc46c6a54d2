/*
 * virt.c — what programs read back: the container's view of device memory.
 * total = the limit (never above the physical size; the physical size when unlimited, never 0),
 * used = what the container has charged, free = total - used clamped at 0 (never wraps around,
 * even when a lowered limit leaves usage above it), and never more than the physical free.
 */
#define _GNU_SOURCE
#include <string.h>

#include "account.h"
#include "vgpu.h"

uint64_t tv_dev_used(int d)
{
    return d < 0 || !tv.rg.map ? 0 : tv_region_used(&tv.rg, d);
}

static void container_view(int d, uint64_t limit, uint64_t phys_total, uint64_t phys_free,
                           uint64_t *total, uint64_t *free_, uint64_t *used)
{
    uint64_t u = tv_dev_used(d);
    uint64_t t = limit && limit < phys_total ? limit : phys_total;
    if (!limit) { /* unlimited: the physical view */
        *total = phys_total;
        *free_ = phys_free;
        if (used) *used = phys_total - phys_free;
        return;
    }
    uint64_t f = u < t ? t - u : 0;
    *total = t;
    *free_ = f < phys_free ? f : phys_free;
    if (used) *used = u;
}

CUresult CUDAAPI tv_cuMemGetInfo_v2(size_t *free_, size_t *total)
{
    TV_CUDA_ENTER();
    tv_mem_refresh_pools(); /* pools may have given freed memory back at a sync */
    size_t pf = 0, pt = 0;
    CUresult r = REAL(cuMemGetInfo_v2)(&pf, &pt);
    if (r != CUDA_SUCCESS) return r;
    int d = tv_ctx_dev_slot();
    uint64_t limit = d >= 0 ? tv_mem_cap(d) : 0;
    uint64_t t, f;
    container_view(d, limit, pt, pf, &t, &f, NULL);
    if (free_) *free_ = (size_t)f;
    if (total) *total = (size_t)t;
    return r;
}

CUresult CUDAAPI tv_cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuDeviceTotalMem_v2)(bytes, dev);
    if (r != CUDA_SUCCESS || !bytes) return r;
    int d = tv_dev_slot(dev);
    uint64_t limit = d >= 0 ? tv_mem_cap(d) : 0;
    if (limit && limit < *bytes) *bytes = (size_t)limit;
    return r;
}

/* NVML: the device's slot through its UUID (NVML and CUDA order devices differently). */
int tv_nvml_slot(nvmlDevice_t device, uint64_t *limit)
{
    char uuid[96];
    *limit = 0;
    if (REAL(nvmlDeviceGetUUID)(device, uuid, sizeof uuid) != NVML_SUCCESS) return -1;
    uuid[TSR_UUID_LEN - 1] = 0;
    int d = tv_uuid_slot(uuid);
    if (d < 0) return -1;
    *limit = tv_mem_cap(d);
    return d;
}

nvmlReturn_t tv_nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    if (tv_nvml_init() != 0) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = REAL(nvmlDeviceGetMemoryInfo)(device, memory);
    if (r != NVML_SUCCESS || !memory) return r;
    uint64_t limit;
    int d = tv_nvml_slot(device, &limit);
    if (d < 0 || !limit) return r;
    if (atomic_load(&tv.cuda_ready)) tv_mem_refresh_pools();
    uint64_t t, f, u;
    container_view(d, limit, memory->total, memory->free, &t, &f, &u);
    memory->total = t;
    memory->free = f;
    memory->used = u;
    return r;
}

nvmlReturn_t tv_nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    if (tv_nvml_init() != 0) return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = REAL(nvmlDeviceGetMemoryInfo_v2)(device, memory);
    if (r != NVML_SUCCESS || !memory) return r;
    uint64_t limit;
    int d = tv_nvml_slot(device, &limit);
    if (d < 0 || !limit) return r;
    if (atomic_load(&tv.cuda_ready)) tv_mem_refresh_pools();
    uint64_t t, f, u;
    container_view(d, limit, memory->total, memory->free + memory->reserved, &t, &f, &u);
    memory->total = t;
    memory->reserved = 0;
    memory->free = f;
    memory->used = u;
    return r;
}
