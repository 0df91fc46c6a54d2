/* memtrack.c — the tables of what libvgpu charged (memtrack.h), their lock, fork handling. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "memtrack.h"

static void map_grow(struct map *m)
{
    struct map old = *m;
    size_t cap = old.cap ? old.cap * 2 : 64;
    if (old.live * 4 < old.cap) cap = old.cap; /* mostly tombstones: rehash in place */
    struct ent *e = calloc(cap, sizeof *e);
    if (!e) return; /* keep going with the old table */
    m->e = e;
    m->cap = cap;
    m->used = m->live = 0;
    for (size_t i = 0; i < old.cap; i++)
        if (old.e[i].key != EMPTY && old.e[i].key != TOMB) map_put(m, &old.e[i]);
    free(old.e);
}

void map_put(struct map *m, const struct ent *v)
{
    struct ent *f = map_find(m, v->key);
    if (f) {
        *f = *v;
        return;
    }
    if ((m->used + 1) * 2 > m->cap) map_grow(m);
    if (!m->cap) return;
    for (size_t i = mix(v->key) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (m->e[i].key == EMPTY || m->e[i].key == TOMB) {
            if (m->e[i].key == EMPTY) m->used++;
            m->e[i] = *v;
            m->live++;
            return;
        }
    }
}

void map_clear(struct map *m)
{
    free(m->e);
    memset(m, 0, sizeof *m);
}

pthread_mutex_t mem_mu = PTHREAD_MUTEX_INITIALIZER;
struct map ptrs, pools, handles, vmaps, arrays, gnodes, graphs, execs, ctxs;

void tv_memory_after_fork_child(void)
{
    pthread_mutex_init(&mem_mu, NULL);
    map_clear(&ptrs);
    map_clear(&pools);
    map_clear(&handles);
    map_clear(&vmaps);
    map_clear(&arrays);
    map_clear(&gnodes);
    map_clear(&graphs);
    map_clear(&execs);
    map_clear(&ctxs);
}
