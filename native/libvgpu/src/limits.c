/*
 * limits.c — the limiting layer's inputs: where the limits come from (the sealed file, else env
 * vars), and the per-device limits in force (tv.dev[]). The poll thread (init.c) calls
 * tv_limits_poll every TSR_LIMITS_POLL_MS so that a new limits file is in force within 100 ms.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "vgpu.h"

#define TV_DEFAULT_REGION "/tmp/tessera-vgpu.region"

static void update_throttle_any(void);

#define L (tv.lm)
static struct stat last_st; /* of the limits file we last read */
static int have_last_st;

/* ---- the limits file ---------------------------------------------------------------------- */

/* The elastic fields (1.2) as libvgpu uses them: absent before 1.2 (a hard slice, whatever an
 * older writer left in its reserved space); a burst never below its guarantee; an allowance
 * within [guarantee, burst]. Without a guarantee (unlimited) there is nothing to burst from. */
static void normalise_elastic(struct tsr_limits_device *e, uint16_t minor)
{
    if (minor < 2) {
        e->sm_burst_pct = 0;
        e->mem_burst_bytes = 0;
        e->sm_allow_x100 = 0;
    }
    int sm_limited = e->sm_limit_pct > 0 && e->sm_limit_pct < 100;
    if (!sm_limited || e->sm_burst_pct <= e->sm_limit_pct) e->sm_burst_pct = 0;
    if (e->sm_burst_pct > 100) e->sm_burst_pct = 100;
    if (!e->sm_burst_pct) {
        e->sm_allow_x100 = 0;
    } else if (e->sm_allow_x100) {
        if (e->sm_allow_x100 < e->sm_limit_pct * 100u) e->sm_allow_x100 = e->sm_limit_pct * 100u;
        if (e->sm_allow_x100 > e->sm_burst_pct * 100u) e->sm_allow_x100 = e->sm_burst_pct * 100u;
    }
    if (!e->mem_limit_bytes || e->mem_burst_bytes <= e->mem_limit_bytes) e->mem_burst_bytes = 0;
}

static int read_limits_file(const char *path, struct tsr_limits *out, struct stat *st_out)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    int rc = -1;
    struct stat st;
    unsigned char *buf = NULL;
    if (fstat(fd, &st) != 0 || st.st_size < (off_t)sizeof(struct tsr_limits) ||
        st.st_size > (1 << 20))
        goto out;
    buf = malloc((size_t)st.st_size);
    if (!buf) goto out;
    size_t got = 0;
    while (got < (size_t)st.st_size) {
        ssize_t n = pread(fd, buf + got, (size_t)st.st_size - got, (off_t)got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) goto out;
        got += (size_t)n;
    }
    struct tsr_limits l;
    memcpy(&l, buf, sizeof l);
    if (l.magic != TSR_LIMITS_MAGIC || l.major != TSR_VERSION_MAJOR ||
        l.header_size < sizeof(struct tsr_limits) || l.header_size > got ||
        l.num_devices > TSR_MAX_DEVICES) {
        TV_LOG(TV_LOG_ERROR, "limits file %s: bad header", path);
        goto out;
    }
    uint64_t sum;
    memcpy(&sum, buf + l.header_size - sizeof sum, sizeof sum);
    if (sum != tsr_fnv1a64(buf, l.header_size - sizeof sum)) {
        TV_LOG(TV_LOG_ERROR, "limits file %s: bad checksum", path);
        goto out;
    }
    for (unsigned i = 0; i < TSR_MAX_DEVICES; i++) {
        l.dev[i].uuid[TSR_UUID_LEN - 1] = 0;
        normalise_elastic(&l.dev[i], l.minor);
    }
    l.region_path[TSR_PATH_LEN - 1] = 0;
    if (l.minor < 3) l.spill_bytes = 0; /* reserved before 1.3: no spill */
    *out = l;
    if (st_out) *st_out = st;
    rc = 0;
out:
    free(buf);
    close(fd);
    return rc;
}

/* ---- env vars (standalone use only) ---------------------------------------------------------- */

static uint64_t parse_bytes(const char *s)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) return 0;
    while (isspace((unsigned char)*end)) end++;
    switch (tolower((unsigned char)*end)) {
    case 'g': return (uint64_t)v << 30;
    case 'm': return (uint64_t)v << 20;
    case 'k': return (uint64_t)v << 10;
    default: return v;
    }
}

static void load_env(void)
{
    char name[64];
    const char *all_mem = getenv("CUDA_DEVICE_MEMORY_LIMIT");
    L.env_mem_all = all_mem ? parse_bytes(all_mem) : 0;
    const char *all_sm = getenv("CUDA_DEVICE_SM_LIMIT");
    for (int i = 0; i < TSR_MAX_DEVICES; i++) {
        snprintf(name, sizeof name, "CUDA_DEVICE_MEMORY_LIMIT_%d", i);
        const char *m = getenv(name);
        L.env_mem[i] = m ? parse_bytes(m) : all_mem ? parse_bytes(all_mem) : 0;
        snprintf(name, sizeof name, "CUDA_DEVICE_SM_LIMIT_%d", i);
        const char *c = getenv(name);
        L.env_sm[i] = c ? (uint32_t)atoi(c) : all_sm ? (uint32_t)atoi(all_sm) : 0;
    }
    memset(&L.lim, 0, sizeof L.lim);
    L.lim.priority = TSR_PRIORITY_LOW;
    const char *p = getenv("CUDA_TASK_PRIORITY");
    if (p && *p) L.lim.priority = atoi(p);
    const char *pol = getenv("GPU_CORE_UTILIZATION_POLICY");
    L.lim.core_policy = TSR_POLICY_DEFAULT;
    if (pol && !strcasecmp(pol, "force")) L.lim.core_policy = TSR_POLICY_FORCE;
    if (pol && !strcasecmp(pol, "disable")) L.lim.core_policy = TSR_POLICY_DISABLE;
    const char *scrub = getenv("TESSERA_SCRUB_ON_FREE");
    if (scrub && (*scrub == '1' || !strcasecmp(scrub, "true")))
        L.lim.flags |= TSR_LIMITS_SCRUB_ON_FREE;
    const char *ctx = getenv("TESSERA_CTX_CHARGE_BYTES");
    if (ctx && *ctx) L.lim.ctx_charge_bytes = parse_bytes(ctx);
    const char *region = getenv(TSR_ENV_REGION_PATH);
    if (region) snprintf(L.lim.region_path, sizeof L.lim.region_path, "%s", region);
}

void tv_limits_load(void)
{
    const char *sealed = TSR_SEALED_LIMITS_DIR "/" TSR_LIMITS_FILE_NAME;
    struct stat st;
    if (stat(sealed, &st) == 0) {
        L.sealed = 1;
        L.file_mode = 1;
        snprintf(L.file, sizeof L.file, "%s", sealed);
    } else {
        const char *dir = getenv(TSR_ENV_LIMITS_DIR);
        if (dir && *dir) {
            snprintf(L.file, sizeof L.file, "%s/%s", dir, TSR_LIMITS_FILE_NAME);
            L.file_mode = stat(L.file, &st) == 0;
        }
    }
    if (L.file_mode) {
        if (read_limits_file(L.file, &L.lim, &last_st) == 0) {
            have_last_st = 1;
        } else {
            /* Fail closed: a sealed file we cannot read must not mean "no limit". */
            TV_LOG(TV_LOG_ERROR, "limits file %s unreadable: refusing device allocations",
                   L.file);
            memset(&L.lim, 0, sizeof L.lim);
            L.broken = 1;
        }
    } else {
        load_env();
    }
    atomic_store(&tv.flags, L.lim.flags);
    atomic_store(&tv.spill_limit, L.lim.spill_bytes);
    tv.ctx_charge = L.lim.ctx_charge_bytes ? L.lim.ctx_charge_bytes : TV_DEFAULT_CTX_CHARGE;
    update_throttle_any();
}

const char *tv_limits_region_path(void)
{
    if (L.lim.region_path[0]) return L.lim.region_path;
    if (!L.sealed) {
        const char *e = getenv(TSR_ENV_REGION_PATH);
        if (e && *e) return e;
    }
    return TV_DEFAULT_REGION;
}

/* ---- the limits in force, per device slot ------------------------------------------------ */

/* The compute rate in force (% x 100, see tv_dev.sm_eff). `allow_x100` is the elastic
 * allowance (normalised by read_limits_file: 0 on a hard slice, else within guarantee..burst, or
 * 0 = the guarantee); `burst` is non-zero on an elastic device. */
static uint32_t effective_sm(uint32_t limit, uint32_t dflags, uint32_t yield_pct, uint32_t policy,
                             uint32_t burst, uint32_t allow_x100)
{
    int limited = limit > 0 && limit < 100;
    if (dflags & TSR_DEV_YIELD) {
        if (yield_pct == 0) return TV_SM_PAUSE;
        uint32_t y = limited && limit < yield_pct ? limit : yield_pct;
        return y >= 100 ? 0 : y * 100;
    }
    if (!limited) return 0;
    if (burst && policy != TSR_POLICY_DISABLE)
        /* Elastic: what the node agent lends now, contended or not (the burst limit is the
         * user's own cap, alone on the card too); never below the guarantee. */
        return allow_x100 ? allow_x100 : limit * 100;
    switch (policy) {
    case TSR_POLICY_FORCE: return limit * 100;
    case TSR_POLICY_DISABLE: return 0;
    default:
        /* Without a node agent (env mode) nothing signals contention: limit always. */
        return (!L.file_mode || (dflags & TSR_DEV_CONTENDED)) ? limit * 100 : 0;
    }
}

static uint32_t entry_sm(const struct tsr_limits_device *e)
{
    return effective_sm(e->sm_limit_pct, e->flags, e->yield_sm_pct, L.lim.core_policy,
                        e->sm_burst_pct, e->sm_allow_x100);
}

/* Could the limits throttle some device, mapped in this process or not yet? */
static int limits_may_throttle(void)
{
    if (L.broken) return 0;
    if (L.file_mode) {
        for (unsigned i = 0; i < L.lim.num_devices; i++) {
            const struct tsr_limits_device *e = &L.lim.dev[i];
            if (entry_sm(e)) return 1;
        }
        return 0;
    }
    for (int i = 0; i < TSR_MAX_DEVICES; i++)
        if (effective_sm(L.env_sm[i], 0, 0, L.lim.core_policy, 0, 0)) return 1;
    return 0;
}

static void update_throttle_any(void)
{
    int any = limits_may_throttle();
    for (int i = 0; i < TV_MAX_SLOTS; i++) any |= atomic_load(&tv.dev[i].sm_eff) != 0;
    atomic_store(&tv.throttle_any, any);
}

static const char *slot_uuid(int d)
{
    return tv.rg.uuid[d][0] ? tv.rg.uuid[d] : tv_region_dev(&tv.rg, d)->uuid;
}

static const struct tsr_limits_device *limits_entry(int dslot)
{
    const char *uuid = slot_uuid(dslot);
    int ordinal = atomic_load(&tv.dev[dslot].ordinal);
    for (unsigned i = 0; i < L.lim.num_devices; i++)
        if (uuid[0] && !strncmp(L.lim.dev[i].uuid, uuid, TSR_UUID_LEN)) return &L.lim.dev[i];
    for (unsigned i = 0; i < L.lim.num_devices; i++)
        if (!L.lim.dev[i].uuid[0] && (int)i == ordinal) return &L.lim.dev[i];
    return NULL;
}

static int ordinal_entries(void)
{
    for (unsigned i = 0; i < L.lim.num_devices; i++)
        if (!L.lim.dev[i].uuid[0]) return 1;
    return 0;
}

/* A device whose UUID the driver cannot tell ("CUDA-<n>"): it may be any sealed device, so it
 * gets the smallest limits among them (never none). */
static const struct tsr_limits_device *strictest_entry(struct tsr_limits_device *out)
{
    if (!L.lim.num_devices) return NULL;
    memset(out, 0, sizeof *out);
    for (unsigned i = 0; i < L.lim.num_devices; i++) {
        const struct tsr_limits_device *e = &L.lim.dev[i];
        if (e->mem_limit_bytes && (!out->mem_limit_bytes || e->mem_limit_bytes < out->mem_limit_bytes))
            out->mem_limit_bytes = e->mem_limit_bytes;
        if (e->sm_limit_pct && e->sm_limit_pct < 100 &&
            (!out->sm_limit_pct || e->sm_limit_pct < out->sm_limit_pct)) {
            out->sm_limit_pct = e->sm_limit_pct;
            out->flags = e->flags;
            out->yield_sm_pct = e->yield_sm_pct;
        }
    }
    return out;
}

/* Caller holds tv.mu. */
void tv_limits_apply_slot(int d)
{
    if (d < 0 || d >= TV_MAX_SLOTS) return;
    uint64_t mem = 0, mem_burst = 0;
    uint32_t eff = 0;
    int elastic = 0;
    if (L.broken) {
        mem = 1; /* nothing fits */
    } else if (L.file_mode) {
        struct tsr_limits_device any;
        const struct tsr_limits_device *e = limits_entry(d);
        if (!e && !strncmp(slot_uuid(d), "CUDA-", 5)) e = strictest_entry(&any);
        /* seen through NVML only (no CUDA ordinal yet) while the limits name devices by CUDA
         * ordinal (`tessera run`, HAMi-style): the strictest of them, never none */
        if (!e && atomic_load(&tv.dev[d].ordinal) < 0 && ordinal_entries())
            e = strictest_entry(&any);
        if (e) {
            mem = e->mem_limit_bytes;
            mem_burst = e->mem_burst_bytes;
            eff = entry_sm(e);
            elastic = e->sm_burst_pct != 0 && !(e->flags & TSR_DEV_YIELD) && eff != 0;
        }
        atomic_store(&tv.dev[d].yielding, e && (e->flags & TSR_DEV_YIELD));
    } else {
        int o = atomic_load(&tv.dev[d].ordinal);
        if (o >= 0 && o < TSR_MAX_DEVICES) {
            mem = L.env_mem[o];
            eff = effective_sm(L.env_sm[o], 0, 0, L.lim.core_policy, 0, 0);
        } else {
            mem = L.env_mem_all; /* seen through NVML only: the all-devices limit */
        }
    }
    atomic_store(&tv.dev[d].mem_limit, mem);
    atomic_store(&tv.dev[d].mem_burst, mem_burst);
    uint32_t was = atomic_exchange(&tv.dev[d].sm_eff, eff);
    atomic_store(&tv.dev[d].elastic, elastic);
    /* Lent compute taken back: what the container banked at the higher rate goes too, so the
     * neighbour that woke gets its share now, not after the borrower spent its bank. */
    if (elastic && was && was != TV_SM_PAUSE && eff < was) tv_compute_lent_less(d);
    update_throttle_any();
    if (L.file_mode || atomic_load(&tv.dev[d].ordinal) >= 0) {
        struct tsr_region_device *rd = tv_region_dev(&tv.rg, d);
        __atomic_store_n(&rd->limit_bytes, mem, __ATOMIC_RELAXED);
        __atomic_store_n(&rd->sm_limit_pct,
                         eff == 0 ? 100u : eff == TV_SM_PAUSE ? 0u : (eff + 50) / 100,
                         __ATOMIC_RELAXED);
    }
}

void tv_limits_seed(struct tv_region_seed *out)
{
    memset(out, 0, sizeof *out);
    out->priority = L.lim.priority;
    out->core_policy = L.lim.core_policy;
    out->region_is_account = !(L.lim.flags & TSR_LIMITS_LEASE);
    for (unsigned i = 0; i < L.lim.num_devices && i < TSR_MAX_DEVICES; i++)
        if (L.lim.dev[i].uuid[0])
            memcpy(out->uuids[out->nuuid++], L.lim.dev[i].uuid, TSR_UUID_LEN);
}

int tv_limits_any_mem(void)
{
    if (L.broken) return 1;
    if (L.file_mode) {
        for (unsigned i = 0; i < L.lim.num_devices; i++)
            if (L.lim.dev[i].mem_limit_bytes) return 1;
        return 0;
    }
    for (int i = 0; i < TSR_MAX_DEVICES; i++)
        if (L.env_mem[i]) return 1;
    return L.env_mem_all != 0;
}

static void apply_all(void)
{
    for (int d = 0; d < TV_MAX_SLOTS; d++)
        if (tv.rg.uuid[d][0] || atomic_load(&tv.dev[d].ordinal) >= 0) tv_limits_apply_slot(d);
}

int tv_limits_poll(void)
{
    if (!L.file_mode) return 0;
    struct stat st;
    if (stat(L.file, &st) != 0) return 0; /* keep what we have */
    if (have_last_st && st.st_ino == last_st.st_ino && st.st_dev == last_st.st_dev &&
        st.st_size == last_st.st_size && st.st_mtim.tv_sec == last_st.st_mtim.tv_sec &&
        st.st_mtim.tv_nsec == last_st.st_mtim.tv_nsec)
        return 0;
    struct tsr_limits l;
    struct stat rst;
    if (read_limits_file(L.file, &l, &rst) != 0) {
        last_st = st; /* do not re-read a bad file until it changes */
        have_last_st = 1;
        return 0;
    }
    pthread_mutex_lock(&tv.mu);
    int changed = memcmp(&l, &L.lim, sizeof l) != 0;
    L.lim = l;
    L.broken = 0;
    last_st = rst;
    have_last_st = 1;
    atomic_store(&tv.flags, l.flags);
    atomic_store(&tv.spill_limit, l.spill_bytes);
    tv.ctx_charge = l.ctx_charge_bytes ? l.ctx_charge_bytes : TV_DEFAULT_CTX_CHARGE;
    if (tv.rg.map) {
        __atomic_store_n(&tv.rg.map->priority, l.priority, __ATOMIC_RELAXED);
        __atomic_store_n(&tv.rg.map->core_policy, l.core_policy, __ATOMIC_RELAXED);
    }
    apply_all();
    update_throttle_any();
    pthread_mutex_unlock(&tv.mu);
    if (changed) TV_LOG(TV_LOG_INFO, "limits reloaded (generation %llu)",
                        (unsigned long long)l.generation);
    return changed;
}
