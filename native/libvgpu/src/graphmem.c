/* graphmem.c — graph memory nodes: charged when added, uncharged when the graph and every exec
 * instantiated from it are destroyed. */
#define _GNU_SOURCE
#include "memtrack.h"

static uint64_t graph_keys = 1ull << 62; /* under mem_mu: keys of graphs outlived by their execs */

/* Caller holds mem_mu. The key of a graph's record (graphs can die before their execs). */
static uint64_t graph_key(CUgraph g, int create)
{
    uint64_t k = (uint64_t)(uintptr_t)g;
    if (map_find(&graphs, k) || !create) return k;
    struct ent e = {.key = k, .aux = 1};
    map_put(&graphs, &e);
    return k;
}

/* Caller holds nothing. Drop a reference to a graph record; at zero, uncharge its nodes. */
static void graph_unref(uint64_t key, int graph_destroyed)
{
    uint64_t per_slot[TSR_MAX_DEVICES] = {0};
    int release = 0;
    LOCK();
    struct ent *g = map_find(&graphs, key);
    if (g && --g->aux == 0) {
        release = 1;
        map_take(&graphs, key, NULL);
    } else if (g && graph_destroyed) {
        /* Execs keep the memory; re-key so that a new graph at the same address is distinct. */
        uint64_t nk = graph_keys++;
        struct ent moved = *g;
        moved.key = nk;
        map_take(&graphs, key, NULL);
        map_put(&graphs, &moved);
        for (size_t i = 0; i < gnodes.cap; i++)
            if (gnodes.e[i].key != EMPTY && gnodes.e[i].key != TOMB && gnodes.e[i].aux == key)
                gnodes.e[i].aux = nk;
        for (size_t i = 0; i < execs.cap; i++)
            if (execs.e[i].key != EMPTY && execs.e[i].key != TOMB && execs.e[i].aux == key)
                execs.e[i].aux = nk;
    }
    if (release)
        for (size_t i = 0; i < gnodes.cap; i++) {
            struct ent *n = &gnodes.e[i];
            if (n->key != EMPTY && n->key != TOMB && n->aux == key) {
                if (n->dslot >= 0 && n->dslot < TSR_MAX_DEVICES) per_slot[n->dslot] += n->size;
                n->key = TOMB;
                gnodes.live--;
            }
        }
    UNLOCK();
    for (int d = 0; d < TSR_MAX_DEVICES; d++) tv_mem_unreserve(d, per_slot[d]);
}

static int mem_node_slot(const CUmemPoolProps *pp)
{
    return pp->location.type == CU_MEM_LOCATION_TYPE_DEVICE ? tv_dev_slot(pp->location.id)
                                                            : tv_ctx_dev_slot();
}

static void track_mem_node(CUgraphNode node, CUgraph graph, uint64_t size, int ds)
{
    LOCK();
    uint64_t gk = graph_key(graph, 1);
    struct ent e = {.key = (uint64_t)(uintptr_t)node, .size = size, .aux = gk, .dslot = ds};
    map_put(&gnodes, &e);
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
    else if (ds >= 0) track_mem_node(*phGraphNode, hGraph, p->bytesize, ds);
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
    if (r != CUDA_SUCCESS) tv_mem_unreserve(ds, bytes);
    else if (mem && ds >= 0) track_mem_node(*ph, g, bytes, ds);
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
        LOCK();
        int has = map_find(&graphs, (uint64_t)(uintptr_t)hGraph) != NULL;
        UNLOCK();
        if (has) graph_unref((uint64_t)(uintptr_t)hGraph, 1);
    }
    return r;
}

static void track_exec(CUgraphExec exec, CUgraph graph)
{
    LOCK();
    uint64_t gk = graph_key(graph, 0);
    struct ent *g = map_find(&graphs, gk);
    if (g) {
        g->aux++;
        struct ent e = {.key = (uint64_t)(uintptr_t)exec, .aux = gk};
        map_put(&execs, &e);
    }
    UNLOCK();
}

CUresult CUDAAPI tv_cuGraphInstantiateWithFlags(CUgraphExec *ph, CUgraph g,
                                                unsigned long long flags)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphInstantiateWithFlags)(ph, g, flags);
    if (r == CUDA_SUCCESS) track_exec(*ph, g);
    return r;
}

CUresult CUDAAPI tv_cuGraphInstantiateWithParams(CUgraphExec *ph, CUgraph g,
                                                 CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphInstantiateWithParams)(ph, g, p);
    if (r == CUDA_SUCCESS) track_exec(*ph, g);
    return r;
}

CUresult CUDAAPI tv_cuGraphInstantiateWithParams_ptsz(CUgraphExec *ph, CUgraph g,
                                                      CUDA_GRAPH_INSTANTIATE_PARAMS *p)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphInstantiateWithParams_ptsz)(ph, g, p);
    if (r == CUDA_SUCCESS) track_exec(*ph, g);
    return r;
}

CUresult CUDAAPI tv_cuGraphExecDestroy(CUgraphExec hGraphExec)
{
    TV_CUDA_ENTER();
    CUresult r = REAL(cuGraphExecDestroy)(hGraphExec);
    struct ent e;
    if (r == CUDA_SUCCESS && untrack(&execs, (uint64_t)(uintptr_t)hGraphExec, &e))
        graph_unref(e.aux, 0);
    return r;
}
