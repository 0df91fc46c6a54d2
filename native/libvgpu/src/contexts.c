/* contexts.c — contexts beyond the primary one, charged tv.ctx_charge each. */
#define _GNU_SOURCE
#include "account.h"

static CUresult ctx_create(CUcontext *pctx, CUdevice dev, int v, unsigned flags,
                           CUexecAffinityParam *aff, int naff, CUctxCreateParams *params)
{
    TV_CUDA_ENTER();
    int ds = tv_dev_slot(dev);
    uint64_t charge = tv.ctx_charge;
    if (charged_alloc(ds, charge) != CUDA_SUCCESS) return OOM;
    CUresult r = v == 2   ? REAL(cuCtxCreate_v2)(pctx, flags, dev)
                 : v == 3 ? REAL(cuCtxCreate_v3)(pctx, aff, naff, flags, dev)
                          : REAL(cuCtxCreate_v4)(pctx, params, flags, dev);
    if (r != CUDA_SUCCESS) tv_mem_unreserve(ds, charge);
    else if (ds >= 0) track(&ctxs, (uint64_t)(uintptr_t)*pctx, charge, ds, K_PLAIN, 0);
    return r;
}

CUresult CUDAAPI tv_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    return ctx_create(pctx, dev, 2, flags, NULL, 0, NULL);
}
CUresult CUDAAPI tv_cuCtxCreate_v3(CUcontext *pctx, CUexecAffinityParam *aff, int n,
                                   unsigned int flags, CUdevice dev)
{
    return ctx_create(pctx, dev, 3, flags, aff, n, NULL);
}
CUresult CUDAAPI tv_cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *p, unsigned int flags,
                                   CUdevice dev)
{
    return ctx_create(pctx, dev, 4, flags, NULL, 0, p);
}

CUresult CUDAAPI tv_cuCtxDestroy_v2(CUcontext ctx)
{
    TV_CUDA_ENTER();
    tv_compute_forget_ctx(ctx);
    CUresult r = REAL(cuCtxDestroy_v2)(ctx);
    struct ent e;
    if (r == CUDA_SUCCESS && untrack(&ctxs, (uint64_t)(uintptr_t)ctx, &e))
        tv_mem_unreserve(e.dslot, e.size);
    return r;
}
