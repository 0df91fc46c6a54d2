/*
 * graphmem.c — graph memory nodes, charged for exactly as long as the driver keeps them.
 *
 * CUDA's contract (cuGraphAddMemAllocNode): an allocation node's address is fixed when the node
 * is added; launching the graph allocates it; it then stays allocated — beyond the destruction of
 * the exec and of the graph — until it is freed by cuMemFree / cuMemFreeAsync of that address,
 * by launching a graph with a free node for it, or, for an exec instantiated with
 * CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH, by the next launch of that exec (which
 * allocates it again).
 *
 * So: charged when the node is added (before the driver, as every path); held while the graph
 * or its exec exists OR the allocation is live (launched and not freed); uncharged when neither
 * holds any more. Destroying a graph and its exec uncharges only allocations that are not live.
 */
#define _GNU_SOURCE
#include "account.h"

_Atomic int tv_graphmem_nodes;

/* Caller holds mem_mu. A graph's record (refs: the graph itself + its instantiations). */
static uint64_t graph_key(CUgraph g, int create)
{
    uint64_t k = (uint64_t)(uintptr_t)g;
    if (map_find(&graphs, k) || !create) return k;
    struct ent e = {.key = k, .aux = 1};
    map_put(&graphs, &e);
    return k;
}

/* Caller holds mem_mu. Forget an allocation; its bytes are added to per_slot for uncharging. */
static void drop_alloc(struct ent *n, uint64_t per_slot[TV_MAX_SLOTS])
{
    if (n->dslot >= 0 && n->dslot < TV_MAX_SLOTS) per_slot[n->dslot] += n->size;
    n->key = TOMB;
    gnodes.live--;
    atomic_fetch_sub(&tv_graphmem_nodes, 1);
}

static void uncharge_all(const uint64_t per_slot[TV_MAX_SLOTS])
{
    for (int d = 0; d < TV_MAX_SLOTS; d++) tv_mem_unreserve(d, per_slot[d]);
}

/* Caller holds nothing. Drop a reference to a graph record; at zero, the graph's allocations
 * that are not live are uncharged and the live ones are left to their free. */
static void graph_unref(uint64_t key)
{
    uint64_t per_slot[TV_MAX_SLOTS] = {0};
    LOCK();
    struct ent *g = map_find(&graphs, key);
    if (g && --g->aux == 0) {
        map_take(&graphs, key, NULL);
        for (size_t i = 0; i < gnodes.cap; i++) {
            struct ent *n = &gnodes.e[i];
            if (n->key == EMPTY || n->key == TOMB || n->aux != key) continue;
            if (n->aux2) n->aux = 0; /* live: held until freed */
            else drop_alloc(n, per_slot);
        }
        for (size_t i = 0; i < gfrees.cap; i++) {
            struct ent *f = &gfrees.e[i];
            if (f->key != EMPTY && f->key != TOMB && f->aux == key) {
                f->key = TOMB;
                gfrees.live--;
            }
        }
    }
    UNLOCK();
    uncharge_all(per_slot);
}

static int mem_node_slot(const CUmemPoolProps *pp)
{
    return pp->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? tv_dev_slot(pp->location.id)
                                                            : tv_ctx_dev_slot();
}

static void track_alloc(CUgraph graph, CUdeviceptr dptr, uint64_t size, int ds)
{
    LOCK();
    uint64_t gk = graph_key(graph, 1);
    struct ent e = {.key = dptr, .size = size, .aux = gk, .aux2 = 0, .dslot = ds};
    map_put(&gnodes, &e);
    UNLOCK();
    atomic_fetch_add(&tv_graphmem_nodes, 1);
}

static void track_free(CUgraphNode node, CUgraph graph, CUdeviceptr dptr)
{
    LOCK();
    uint64_t gk = graph_key(graph, 1);
    struct ent e = {.key = (uint64_t)(uintptr_t)node, .size = dptr, .aux = gk};
    map_put(&gfrees, &e);
    UNLOCK();
}

CUresult CUDAAPI tv_cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                           const CUgraphNode *deps, size_t n,
                                           CUDA_MEM_ALLOC_NODE_PARAMS *p)
{
    TV_CUDA_ENTER();
    if (!p) return REAL(cuGraphAddMemAllocNode)(phGraphNode, hGraph, deps, n, p);
    int ds = mem_node_slot(&p->poolProps);
    if (charged_alloc(ds, p->bytesize) != CUDA_SUCCESS) return OOM;
    CUresult r = REAL(cuGraphAddMemAllocNode)(phGraphNode, hGraph, deps, n, p);
    if (r != CUDA_SUCCESS) tv_mem_unreserve(ds, p->bytesize);
    else if (ds >= 0) track_alloc(hGraph, p->dptr, p->bytesize, ds);
    return r;
}

CUresult CUDAAPI tv_cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                          const CUgraphNode *deps, size_t n, CUdeviceptr dptr)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphAddMemFreeNode)(phGraphNode, hGraph, deps, n, dptr);
    if (r == CUDA_SUCCESS) track_free(*phGraphNode, hGraph, dptr);
    return r;
}

static CUresult add_node(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps,
                         const CUgraphEdgeData *edges, size_t n, CUgraphNodeParams *p, int v2)
{
    TV_CUDA_ENTER();
    int mem = p && p->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC;
    int ds = mem ? mem_node_slot(&p->alloc.poolProps) : -1;
    uint64_t bytes = mem ? p->alloc.bytesize : 0;
    if (mem && charged_alloc(ds, bytes) != CUDA_SUCCESS) return OOM;
    CUresult r = v2 ? REAL(cuGraphAddNode_v2)(ph, g, deps, edges, n, p)
                    : REAL(cuGraphAddNode)(ph, g, deps, n, p);
    if (r != CUDA_SUCCESS) {
        if (mem) tv_mem_unreserve(ds, bytes);
    } else if (mem && ds >= 0) {
        track_alloc(g, p->alloc.dptr, bytes, ds);
    } else if (p && p->type == CU_GRAPH_NODE_TYPE_MEM_FREE) {
        track_free(*ph, g, p->free.dptr);
    }
    return r;
}

CUresult CUDAAPI tv_cuGraphAddNode(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps, size_t n,
                                   CUgraphNodeParams *p)
{
    return add_node(ph, g, deps, NULL, n, p, 0);
}
CUresult CUDAAPI tv_cuGraphAddNode_v2(CUgraphNode *ph, CUgraph g, const CUgraphNode *deps,
                                      const CUgraphEdgeData *edges, size_t n,
                                      CUgraphNodeParams *p)
{
    return add_node(ph, g, deps, edges, n, p, 1);
}

CUresult CUDAAPI tv_cuGraphDestroy(CUgraph hGraph)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphDestroy)(hGraph);
    if (r == CUDA_SUCCESS) {
        uint64_t k = (uint64_t)(uintptr_t)hGraph;
        LOCK();
        struct ent *g = map_find(&graphs, k);
        int has = g != NULL;
        if (g && g->aux > 1) { /* execs outlive it: re-key, a new graph may reuse the address */
            static uint64_t next_key = 1ull << 62;
            uint64_t nk = next_key++;
            struct ent moved = *g;
            moved.key = nk;
            map_take(&graphs, k, NULL);
            map_put(&graphs, &moved);
            for (size_t i = 0; i < gnodes.cap; i++)
                if (gnodes.e[i].key != EMPTY && gnodes.e[i].key != TOMB && gnodes.e[i].aux == k)
                    gnodes.e[i].aux = nk;
            for (size_t i = 0; i < gfrees.cap; i++)
                if (gfrees.e[i].key != EMPTY && gfrees.e[i].key != TOMB && gfrees.e[i].aux == k)
                    gfrees.e[i].aux = nk;
            for (size_t i = 0; i < execs.cap; i++)
                if (execs.e[i].key != EMPTY && execs.e[i].key != TOMB && execs.e[i].aux == k)
                    execs.e[i].aux = nk;
            k = nk;
        }
        UNLOCK();
        if (has) graph_unref(k);
    }
    return r;
}

static void track_exec(CUgraphExec exec, CUgraph graph, unsigned long long flags)
{
    LOCK();
    uint64_t gk = graph_key(graph, 0);
    struct ent *g = map_find(&graphs, gk);
    if (g) {
        g->aux++;
        struct ent e = {.key = (uint64_t)(uintptr_t)exec, .aux = gk,
                        .kind = (flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) != 0};
        map_put(&execs, &e);
    }
    UNLOCK();
}

CUresult CUDAAPI tv_cuGraphInstantiateWithFlags(CUgraphExec *ph, CUgraph g,
                                                unsigned long long flags)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphInstantiateWithFlags)(ph, g, flags);
    if (r == CUDA_SUCCESS) track_exec(*ph, g, flags);
    return r;
}

CUresult CUDAAPI tv_cuGraphInstantiateWithParams(CUgraphExec *ph, CUgraph g,
                                                 CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphInstantiateWithParams)(ph, g, p);
    if (r == CUDA_SUCCESS) track_exec(*ph, g, p ? p->flags : 0);
    return r;
}

CUresult CUDAAPI tv_cuGraphInstantiateWithParams_ptsz(CUgraphExec *ph, CUgraph g,
                                                      CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphInstantiateWithParams_ptsz)(ph, g, p);
    if (r == CUDA_SUCCESS) track_exec(*ph, g, p ? p->flags : 0);
    return r;
}

/* The pre-12 instantiations (CUDA 10/11 runtimes ask for them by version). */
CUresult CUDAAPI tv_cuGraphInstantiate_v2(CUgraphExec *ph, CUgraph g, CUgraphNode *err,
                                          char *log, size_t logsize)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphInstantiate_v2)(ph, g, err, log, logsize);
    if (r == CUDA_SUCCESS) track_exec(*ph, g, 0);
    return r;
}
CUresult CUDAAPI tv_cuGraphInstantiate(CUgraphExec *ph, CUgraph g, CUgraphNode *err, char *log,
                                       size_t logsize)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphInstantiate)(ph, g, err, log, logsize);
    if (r == CUDA_SUCCESS) track_exec(*ph, g, 0);
    return r;
}

CUresult CUDAAPI tv_cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphExecDestroy)(hGraphExec);
    struct ent e;
    if (r == CUDA_SUCCESS && untrack(&execs, (uint64_t)(uintptr_t)hGraphExec, &e))
        graph_unref(e.aux);
    return r;
}

/* Caller holds mem_mu. An allocation freed (by a free node, cuMemFree or cuMemFreeAsync). */
static void freed_locked(uint64_t dptr, uint64_t per_slot[TV_MAX_SLOTS])
{
    struct ent *n = map_find(&gnodes, dptr);
    if (!n) return;
    n->aux2 = 0;
    if (n->aux == 0) drop_alloc(n, per_slot); /* its graph is gone: nothing holds it now */
}

void tv_graphmem_launched(CUgraphExec exec)
{
    uint64_t per_slot[TV_MAX_SLOTS] = {0};
    LOCK();
    struct ent *x = map_find(&execs, (uint64_t)(uintptr_t)exec);
    if (x) {
        uint64_t gk = x->aux;
        for (size_t i = 0; i < gnodes.cap; i++) { /* its allocation nodes ran */
            struct ent *n = &gnodes.e[i];
            if (n->key != EMPTY && n->key != TOMB && n->aux == gk) n->aux2 = 1;
        }
        for (size_t i = 0; i < gfrees.cap; i++) { /* and its free nodes after them */
            struct ent *f = &gfrees.e[i];
            if (f->key != EMPTY && f->key != TOMB && f->aux == gk) freed_locked(f->size, per_slot);
        }
    }
    UNLOCK();
    uncharge_all(per_slot);
}

int tv_graphmem_freed(CUdeviceptr p)
{
    uint64_t per_slot[TV_MAX_SLOTS] = {0};
    LOCK();
    int found = map_find(&gnodes, p) != NULL;
    if (found) freed_locked(p, per_slot);
    UNLOCK();
    uncharge_all(per_slot);
    return found;
}
