/* arrays.c — CUDA arrays and mipmapped arrays, charged by their computed size. */
#define _GNU_SOURCE
#include "account.h"

static uint64_t elem_bytes(CUarray_format f, unsigned channels)
{
    uint64_t b;
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: b = 1; break;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: b = 2; break;
    default: b = 4; break; /* 32-bit and packed formats: an upper bound per channel */
    }
    return b * (channels ? channels : 1);
}

static uint64_t array_bytes(const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels)
{
    uint64_t w = d->Width, h = d->Height, z = d->Depth, total = 0;
    int layered = (d->Flags & CUDA_ARRAY3D_LAYERED) || (d->Flags & CUDA_ARRAY3D_CUBEMAP);
    uint64_t eb = elem_bytes(d->Format, d->NumChannels);
    for (unsigned l = 0; l < (levels ? levels : 1); l++) {
        uint64_t lw = w >> l ? w >> l : 1;
        uint64_t lh = h ? (h >> l ? h >> l : 1) : 1;
        uint64_t lz = z ? (layered ? z : (z >> l ? z >> l : 1)) : 1;
        total += lw * lh * lz * eb;
    }
    return total;
}

static CUresult driver_array_create(void *out, unsigned levels, int which, const void *orig)
{
    if (which == 1) return REAL(cuArrayCreate_v2)((CUarray *)out, orig);
    if (which == 3) return REAL(cuArray3DCreate_v2)((CUarray *)out, orig);
    return REAL(cuMipmappedArrayCreate)((CUmipmappedArray *)out, orig, levels);
}

/* An array's layout is the driver's own (tiled for texture reads): no spill can stand in. */
static CUresult array_create(void *out, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned levels,
                             int which, const void *orig)
{
    TV_CUDA_ENTER();
    int ds = tv_ctx_dev_slot();
    uint64_t bytes = array_bytes(d, levels);
    if (charged_alloc(ds, bytes) != CUDA_SUCCESS) return OOM;
    CUresult r = driver_array_create(out, levels, which, orig);
    TV_RETRY_OWED_OOM(r, ds, bytes, driver_array_create(out, levels, which, orig));
    if (r != CUDA_SUCCESS) tv_mem_unreserve(ds, bytes);
    else if (ds >= 0) track(&arrays, (uint64_t)(uintptr_t)*(void **)out, bytes, ds, K_PLAIN, 0);
    return r;
}

CUresult CUDAAPI tv_cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *desc)
{
    if (!desc) return REAL(cuArrayCreate_v2) ? REAL(cuArrayCreate_v2)(pHandle, desc)
                                             : CUDA_ERROR_INVALID_VALUE;
    CUDA_ARRAY3D_DESCRIPTOR d = {.Width = desc->Width, .Height = desc->Height, .Depth = 0,
                                 .Format = desc->Format, .NumChannels = desc->NumChannels};
    return array_create(pHandle, &d, 1, 1, desc);
}

CUresult CUDAAPI tv_cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *desc)
{
    if (!desc) return REAL(cuArray3DCreate_v2) ? REAL(cuArray3DCreate_v2)(pHandle, desc)
                                               : CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, desc, 1, 3, desc);
}

CUresult CUDAAPI tv_cuMipmappedArrayCreate(CUmipmappedArray *pHandle,
                                           const CUDA_ARRAY3D_DESCRIPTOR *desc,
                                           unsigned int numMipmapLevels)
{
    if (!desc) return REAL(cuMipmappedArrayCreate)
                          ? REAL(cuMipmappedArrayCreate)(pHandle, desc, numMipmapLevels)
                          : CUDA_ERROR_INVALID_VALUE;
    return array_create(pHandle, desc, numMipmapLevels, 2, desc);
}

static CUresult array_destroy(uint64_t key, int mip)
{
    TV_CUDA_ENTER();
    CUresult r = mip ? REAL(cuMipmappedArrayDestroy)((CUmipmappedArray)(uintptr_t)key)
                     : REAL(cuArrayDestroy)((CUarray)(uintptr_t)key);
    struct ent e;
    if (r == CUDA_SUCCESS && untrack(&arrays, key, &e)) tv_mem_unreserve(e.dslot, e.size);
    return r;
}

CUresult CUDAAPI tv_cuArrayDestroy(CUarray hArray)
{
    return array_destroy((uint64_t)(uintptr_t)hArray, 0);
}
CUresult CUDAAPI tv_cuMipmappedArrayDestroy(CUmipmappedArray h)
{
    return array_destroy((uint64_t)(uintptr_t)h, 1);
}
