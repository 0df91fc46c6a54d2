#!/usr/bin/env bash
# gpu-check.sh — libvgpu on a real NVIDIA GPU, in one go, in under 5 minutes.
#
#   native/libvgpu/gpu-check.sh [RESULTS_DIR]
#
# Builds libvgpu and small CUDA programs for sm_90 (override: ARCH=sm_80), then checks, with
# GPU 0 limited to $LIMIT_MIB MiB and $SM_PCT % of compute:
#   1. interception: cuGetProcAddress hands out libvgpu's functions on this driver
#   2. runtime API (cudart): cudaMemGetInfo shows the limit; cudaMalloc, cudaMallocAsync,
#      cudaMallocManaged, cudaMalloc3DArray and a pool beyond the limit fail with OOM
#   3. driver API (cuMemAlloc, cuMemCreate, cuMemAllocFromPoolAsync, arrays, contexts) — the
#      test suite's cuctl program, linked against the real libcuda
#   4. PyTorch and cuda-bindings/pynvml, if importable
#   5. compute limit accuracy: a 1 ms busy kernel back to back for 6 s at $SM_PCT %, per 1 s
#      window (kernel time from its own %globaltimer stamps), plus a 10/90 pair of processes
#   6. launch overhead: empty kernels, with and without the preload, interleaved
#   7. graph memory nodes: an allocation node launched and its graph destroyed stays charged
#      until freed (one of three fits under the limit, cuMemGetInfo shows it); glibc's dlsym
#      fetched through dlvsym still hands out libvgpu's functions
#   8. watchdog view: a process without libvgpu (as one that escaped the preload file through a
#      patched loader copy) allocates past the limit; the node agent's NVML probe
#      (services/node-agent/nvml_processes.py) must see its pid holding that memory
#   9. the node agent's watchdog: a process without libvgpu over its seal is seen and ended
#  10. MIG: the driver's profiles and placements for GPU 0 agree with tessera/mig.py; with MIG
#      already on, the agent's discovery (and, with TESSERA_GPU_CHECK_MIG_CREATE=1, one instance
#      created and destroyed). Never changes the MIG mode.
#  10b. MIG single strategy: the agent's NVML discovery through NVIDIA's single rule
#      (tests/node_agent/gpu_mig_single_check.py); skipped while no GPU is in MIG mode
#  11. MPS, server-side, per pod: the node agent's daemon driver (services/node-agent/mps.py)
#      runs two nvidia-cuda-mps-control -d on GPU 0 side by side (own pipe dirs, as for two
#      pods), each with its own limits (1024 MiB / 30 %, 2048 MiB / 60 %); a client of each
#      (cuctl, no libvgpu, env asking 64 GiB / 100 %) is stopped at its own server's limit and
#      listed by its daemon's get_client_list (tests/node_agent/gpu_mps_check.py); then `quit`
#  12. spill to host memory (sealed spill_bytes): cudaMalloc past the limit served from host
#      memory, cudaMemGetInfo unchanged, a prefetch onto the GPU refused; the bandwidth a kernel
#      gets from the spilled buffer against device memory (the slowdown docs/elastic.md states)
# Prints a summary and writes $RESULTS_DIR/gpu-check.json (default: a temp dir; $OUT if set).
set -uo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
ARCH=${ARCH:-sm_90}
LIMIT_MIB=${LIMIT_MIB:-4000}
SM_PCT=${SM_PCT:-30}
RESULTS=${1:-${OUT:-$(mktemp -d)}}
WORK=$(mktemp -d)
mkdir -p "$RESULTS"
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)
FAILS=0
declare -A RES

log() { printf '[gpu-check %3ds] %s\n' "$(($(date +%s) - START))" "$*"; }
pass() { log "PASS $1 ${2:-}"; RES[$1]="pass${2:+: $2}"; }
fail() { log "FAIL $1 ${2:-}"; RES[$1]="FAIL${2:+: $2}"; FAILS=$((FAILS + 1)); }
skip() { log "skip $1 ${2:-}"; RES[$1]="skipped${2:+: $2}"; }

if [ -z "${CUDA_HOME:-}" ]; then
    if [ -d /usr/local/cuda/include ]; then CUDA_HOME=/usr/local/cuda
    else CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); fi
fi
NVCC=${NVCC:-$( [ -x "$CUDA_HOME/bin/nvcc" ] && echo "$CUDA_HOME/bin/nvcc" || command -v nvcc)}
[ -x "$NVCC" ] || { log "no nvcc (set NVCC or CUDA_HOME)"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null |
    head -1 | while read -r line; do log "GPU: $line"; done

# ---- build ---------------------------------------------------------------------------------
log "building libvgpu and the check programs for $ARCH"
make -s -C "$HERE" BUILD="$WORK/build" CUDA_HOME="$CUDA_HOME" >/dev/null ||
    { log "libvgpu build failed"; exit 2; }
LIB="$WORK/build/libvgpu.so"
CUINC="$CUDA_HOME/include"
NVMLINC=$(make -s -C "$HERE" -f - print-nvml <<'EOF' 2>/dev/null
include cuda.mk
print-nvml: ; @echo $(NVML_H_DIR)
EOF
)
# what to link the driver-API program against: the toolkit's stub, else the driver itself
LIBCUDA_LINK=${LIBCUDA_LINK:-$(ls "$CUINC/../lib64/stubs/libcuda.so" 2>/dev/null ||
    ldconfig -p | awk '/libcuda\.so\.1 / {print $NF; exit}')}
[ -n "$LIBCUDA_LINK" ] || { log "no libcuda to link against (set LIBCUDA_LINK)"; exit 2; }
cc -O2 -std=gnu11 -pthread -I"$CUINC" -I"$NVMLINC" -I"$HERE/include" -I"$ROOT/tests/native/progs" \
    -o "$WORK/cuctl" "$ROOT/tests/native/progs/cuctl.c" -Wl,--no-as-needed "$LIBCUDA_LINK" \
    -Wl,--as-needed -ldl ||
    { log "cuctl build failed"; exit 2; }

cat >"$WORK/procaddr.c" <<'EOF'
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
int main(void) {
    const char *names[] = {"cuMemAlloc", "cuMemFree", "cuMemGetInfo", "cuDeviceTotalMem",
        "cuMemAllocManaged", "cuMemAllocPitch", "cuMemAllocAsync", "cuMemAllocFromPoolAsync",
        "cuMemFreeAsync", "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuArrayCreate",
        "cuArray3DCreate", "cuMipmappedArrayCreate", "cuCtxCreate", "cuGraphAddMemAllocNode",
        "cuGraphInstantiate", "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel",
        "cuGraphLaunch", "cuMemPoolCreate", "cuMemPoolTrimTo", "cuGetProcAddress"};
    int versions[] = {12000, 12080, 13000}, bad = 0, n = 0;
    cuuint64_t flags[] = {CU_GET_PROC_ADDRESS_DEFAULT, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM};
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    CUresult (*gpa)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
    *(void **)&gpa = dlsym(h, "cuGetProcAddress_v2");
    CUresult (*init)(unsigned); *(void **)&init = dlsym(h, "cuInit"); init(0);
    for (unsigned i = 0; i < sizeof names / sizeof *names; i++)
        for (int v = 0; v < 3; v++) for (int f = 0; f < 2; f++) {
            void *p = NULL; CUdriverProcAddressQueryResult st;
            if (gpa(names[i], &p, versions[v], flags[f], &st) != CUDA_SUCCESS || !p) continue;
            Dl_info info; n++;
            if (!dladdr(p, &info) || !strstr(info.dli_fname, "libvgpu")) {
                printf("not intercepted: %s (version %d, flags %d) -> %s\n", names[i], versions[v],
                       (int)flags[f], info.dli_fname ? info.dli_fname : "?");
                bad++;
            }
        }
    printf("{\"checked\": %d, \"not_intercepted\": %d}\n", n, bad);
    return bad != 0;
}
EOF
cc -O2 -I"$CUINC" -o "$WORK/procaddr" "$WORK/procaddr.c" -ldl || { log "procaddr build failed"; exit 2; }

cat >"$WORK/rt.cu" <<'EOF'
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>
#include <vector>
// Runtime API over the limit, then the busy kernel and the launch benchmark.
__global__ void busy(long long ns, unsigned long long *stamps, int i) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while ((long long)(t - t0) < ns);
    if (stamps) { stamps[2 * i] = t0; stamps[2 * i + 1] = t; }
}
__global__ void empty() {}
static double now() { timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + ts.tv_nsec / 1e9; }
int main(int argc, char **argv) {
    const char *mode = argv[1];
    if (!strcmp(mode, "oom")) {
        size_t limit = strtoull(argv[2], 0, 10) << 20, f, t, chunk = limit * 4 / 10;
        cudaMemGetInfo(&f, &t);
        printf("{\"check\": \"memgetinfo\", \"total\": %zu, \"free\": %zu, \"ok\": %s}\n", t, f, t == limit ? "true" : "false");
        const char *paths[] = {"cudaMalloc", "cudaMallocAsync", "cudaMallocManaged", "cudaMalloc3DArray", "cudaMallocFromPoolAsync"};
        cudaStream_t s; cudaStreamCreate(&s);
        cudaMemPool_t pool; cudaMemPoolProps pp = {}; pp.allocType = cudaMemAllocationTypePinned;
        pp.location.type = cudaMemLocationTypeDevice; pp.location.id = 0; cudaMemPoolCreate(&pool, &pp);
        for (int k = 0; k < 5; k++) {
            std::vector<void *> ptrs; std::vector<cudaArray_t> arrs; int ok = 0; cudaError_t last = cudaSuccess;
            for (int i = 0; i < 3; i++) {
                void *p = 0; cudaError_t e;
                if (k == 0) e = cudaMalloc(&p, chunk);
                else if (k == 1) { e = cudaMallocAsync(&p, chunk, s); cudaStreamSynchronize(s); }
                else if (k == 2) e = cudaMallocManaged(&p, chunk);
                else if (k == 3) { cudaArray_t a; cudaChannelFormatDesc d = cudaCreateChannelDesc<float>();
                    e = cudaMalloc3DArray(&a, &d, make_cudaExtent(1024, 1024, chunk / (4 << 20)));
                    if (!e) arrs.push_back(a); }
                else { e = cudaMallocFromPoolAsync(&p, chunk, pool, s); cudaStreamSynchronize(s); }
                if (!e) { ok++; if (p) ptrs.push_back(p); } else last = e;
                cudaGetLastError();
            }
            bool good = ok == 2 && last == cudaErrorMemoryAllocation;
            printf("{\"check\": \"%s\", \"succeeded\": %d, \"third\": \"%s\", \"ok\": %s}\n", paths[k], ok, cudaGetErrorName(last), good ? "true" : "false");
            for (void *p : ptrs) { if (k == 1 || k == 4) cudaFreeAsync(p, s); else cudaFree(p); }
            for (cudaArray_t a : arrs) cudaFreeArray(a);
            cudaStreamSynchronize(s);
            if (k == 4) cudaMemPoolTrimTo(pool, 0);
        }
        cudaDeviceSynchronize(); cudaMemGetInfo(&f, &t);
        printf("{\"check\": \"all freed\", \"free\": %zu, \"ok\": %s}\n", f, f == limit ? "true" : "false");
        return 0;
    }
    if (!strcmp(mode, "busy")) {  // busy SECONDS: 1 ms kernels back to back, stamps per kernel
        double secs = atof(argv[2]); int cap = (int)(secs * 1200) + 64;
        unsigned long long *st;
        if (cudaMallocManaged(&st, sizeof(*st) * 2 * cap) != cudaSuccess) { printf("{\"error\": \"cudaMallocManaged\"}\n"); return 3; }
        cudaMemset(st, 0, sizeof(*st) * 2 * cap); cudaDeviceSynchronize();
        double t0 = now(); int n = 0;
        while (now() - t0 < secs && n < cap) { busy<<<1, 1>>>(1000000, st, n++); if (n % 8 == 0) cudaDeviceSynchronize(); }
        cudaDeviceSynchronize();
        unsigned long long lo = ~0ull, hi = 0;
        for (int i = 0; i < n; i++) { if (st[2*i] && st[2*i] < lo) lo = st[2*i]; if (st[2*i+1] > hi) hi = st[2*i+1]; }
        printf("{\"kernels\": %d, \"windows\": [", n);
        for (unsigned long long w = lo; w + 1000000000ull <= hi; w += 1000000000ull) {
            unsigned long long busy_ns = 0;
            for (int i = 0; i < n; i++) { unsigned long long a = st[2*i], b = st[2*i+1];
                if (a < w) a = w; if (b > w + 1000000000ull) b = w + 1000000000ull; if (b > a) busy_ns += b - a; }
            printf("%s%.2f", w == lo ? "" : ", ", busy_ns / 1e7);
        }
        printf("]}\n");
        return 0;
    }
    if (!strcmp(mode, "launch")) {  // launch N: host cost of an empty kernel launch
        int n = atoi(argv[2]); empty<<<1, 1>>>(); cudaDeviceSynchronize();
        double t0 = now();
        for (int i = 0; i < n; i++) { empty<<<1, 1>>>(); if (i % 1024 == 1023) cudaDeviceSynchronize(); }
        cudaDeviceSynchronize();
        printf("%.1f\n", (now() - t0) * 1e9 / n);
        return 0;
    }
    return 2;
}
EOF
"$NVCC" -O2 -arch="$ARCH" -o "$WORK/rt" "$WORK/rt.cu" || { log "nvcc failed"; exit 2; }
log "built in $(($(date +%s) - START)) s"

contained() {  # run "$@" in a fresh "container": limits via env (standalone mode)
    local region="$WORK/region.$RANDOM"
    env LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_SHARED_CACHE="$region" \
        CUDA_DEVICE_MEMORY_LIMIT_0="${MEM:-$LIMIT_MIB}m" CUDA_DEVICE_SM_LIMIT_0="${SM:-0}" \
        GPU_CORE_UTILIZATION_POLICY=force LIBCUDA_LOG_LEVEL="${LOGLEVEL:-0}" "$@"
}

# ---- 1. interception -----------------------------------------------------------------------
out=$(contained timeout 30 "$WORK/procaddr")
rc=$?
echo "$out" >"$RESULTS/procaddr.txt"
if [ $rc -eq 0 ] && echo "$out" | grep -q '"not_intercepted": 0'; then pass procaddr "$(echo "$out" | tail -1)"
else fail procaddr "$(echo "$out" | tail -3 | tr '\n' ' ')"; fi

# ---- 2. runtime API --------------------------------------------------------------------------
out=$(contained timeout 60 "$WORK/rt" oom "$LIMIT_MIB")
echo "$out" >"$RESULTS/runtime-oom.jsonl"
if [ -n "$out" ] && ! echo "$out" | grep -q '"ok": false'; then pass runtime_api "$(echo "$out" | wc -l) checks"
else fail runtime_api "$(echo "$out" | grep '"ok": false' | tr '\n' ' ')"; fi

# ---- 3. driver API: the test suite's cuctl on the real driver -----------------------------------
C=$((LIMIT_MIB * 4 / 10 << 20))
script="init
info
alloc plain $C
alloc plain $C
alloc plain $C
free 0
free 1
alloc vmm $C
alloc vmm $C
alloc vmm $C
free 2
free 3
pool_create
alloc pool $C
alloc pool $C
alloc pool $C
free 4
free 5
pool_trim 0
pool_destroy
alloc array3d $C
alloc array3d $C
alloc array3d $C
nvml
"
for mode in direct dlsym procaddr; do
    out=$(echo "$script" | TV_TEST_MODE=$mode contained timeout 60 "$WORK/cuctl")
    echo "$out" >"$RESULTS/driver-$mode.jsonl"
    oks=$(echo "$out" | grep -c '"ok": true'); ooms=$(echo "$out" | grep -c '"rc": 2,')
    total=$(echo "$out" | sed -n 2p)
    if [ "$ooms" -eq 4 ] && echo "$total" | grep -q "\"total\": $((LIMIT_MIB << 20))"; then
        pass "driver_api_$mode" "$oks ok, $ooms refused"
    else fail "driver_api_$mode" "$oks ok, $ooms refused (expected 4); $total"; fi
done

# ---- 4. PyTorch, cuda-bindings, pynvml --------------------------------------------------------------
PY=${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || command -v python3)}
if "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    out=$(contained timeout 120 "$PY" - "$LIMIT_MIB" <<'EOF' 2>&1
import sys, torch
limit = int(sys.argv[1]) << 20
free, total = torch.cuda.mem_get_info()
a = torch.empty(int(limit * 0.45), dtype=torch.uint8, device="cuda")
b = torch.empty(int(limit * 0.45), dtype=torch.uint8, device="cuda")
try:
    c = torch.empty(int(limit * 0.45), dtype=torch.uint8, device="cuda")
    oom = False
except torch.cuda.OutOfMemoryError:
    oom = True
x = torch.randn(2048, 2048, device="cuda"); (x @ x).sum().item()
print({"total": total, "limit": limit, "third_refused": oom, "ok": total == limit and oom})
EOF
)
    echo "$out" >"$RESULTS/torch.txt"
    if echo "$out" | tail -1 | grep -q "'ok': True"; then pass torch "$(echo "$out" | tail -1)"; else fail torch "$(echo "$out" | tail -2 | tr '\n' ' ')"; fi
else skip torch "not importable"; fi
if "$PY" -c "import cuda.bindings.driver, pynvml" 2>/dev/null; then
    out=$(contained timeout 60 "$PY" - "$LIMIT_MIB" <<'EOF' 2>&1
import sys
from cuda.bindings import driver as cu
import pynvml
limit = int(sys.argv[1]) << 20
cu.cuInit(0); _, dev = cu.cuDeviceGet(0); _, ctx = cu.cuDevicePrimaryCtxRetain(dev); cu.cuCtxSetCurrent(ctx)
_, free, total = cu.cuMemGetInfo()
r1, p1 = cu.cuMemAlloc(int(limit * 0.6)); r2, p2 = cu.cuMemAlloc(int(limit * 0.6))
pynvml.nvmlInit(); m = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
ok = total == limit and int(r1) == 0 and int(r2) == 2 and m.total == limit
print({"total": int(total), "second_alloc": int(r2), "nvml_total": m.total, "nvml_used": m.used, "ok": ok})
EOF
)
    echo "$out" >"$RESULTS/cuda-bindings.txt"
    if echo "$out" | tail -1 | grep -q "'ok': True"; then pass cuda_bindings "$(echo "$out" | tail -1)"; else fail cuda_bindings "$(echo "$out" | tail -2 | tr '\n' ' ')"; fi
else skip cuda_bindings "not importable"; fi

# ---- 5. compute limit accuracy ---------------------------------------------------------------------
out=$(SM=$SM_PCT contained timeout 60 "$WORK/rt" busy 6)
echo "$out" >"$RESULTS/busy-$SM_PCT.json"
bad=$("$PY" -c "import json,sys; w=json.loads(sys.argv[1])['windows']; print(sum(abs(x-$SM_PCT)>5 for x in w) if w else 99)" "$out" 2>/dev/null || echo 99)
if [ "$bad" = 0 ]; then pass "compute_${SM_PCT}pct" "$out"; else fail "compute_${SM_PCT}pct" "$out"; fi
out=$(timeout 60 "$WORK/rt" busy 2)
echo "$out" >"$RESULTS/busy-unlimited.json"
log "unlimited busy kernel: $out"
(SM=10 contained timeout 60 "$WORK/rt" busy 6 >"$WORK/b10") &
p10=$!
(SM=90 contained timeout 60 "$WORK/rt" busy 6 >"$WORK/b90") &
wait $p10; wait
cp "$WORK/b10" "$RESULTS/busy-pair-10.json"; cp "$WORK/b90" "$RESULTS/busy-pair-90.json"
pair=$("$PY" -c "
import json
a = json.load(open('$WORK/b10'))['windows'][1:-1]; b = json.load(open('$WORK/b90'))['windows'][1:-1]
print(round(sum(a)/len(a), 1), round(sum(b)/len(b), 1))" 2>/dev/null || echo "? ?")
log "10 % / 90 % pair (two processes, separate regions): $pair  (GPU time-slices between processes; see README)"
RES[compute_pair_10_90]="$pair"

# ---- 6. launch overhead ------------------------------------------------------------------------------
w=(); l=()
for i in 1 2 3 4 5; do
    w+=("$(timeout 60 "$WORK/rt" launch 200000)")
    l+=("$(MEM=0 contained timeout 60 "$WORK/rt" launch 200000)")
done
med() { printf '%s\n' "$@" | sort -n | sed -n 3p; }
w0=$(med "${w[@]}"); l0=$(med "${l[@]}")
added=$("$PY" -c "print(round($l0 - $w0, 1))" 2>/dev/null || echo "?")
log "empty kernel launch: ${w0} ns without, ${l0} ns with libvgpu (median of 5): +${added} ns"
RES[launch_ns]="without $w0, with $l0, added $added (target <= 50)"

# ---- 7. graph memory nodes and dlvsym -------------------------------------------------------------
G=$((LIMIT_MIB * 6 / 10 << 20))
out=$(printf 'init\ngraphmem %s\ngraphmem %s\ngraphmem %s\ninfo\nfree 0\ngraphmem %s\nroute dlvsym_dlsym %s\n' \
    "$G" "$G" "$G" "$G" "$((LIMIT_MIB * 3 / 10 << 20))" | TV_TEST_MODE=dlsym contained timeout 60 "$WORK/cuctl")
echo "$out" >"$RESULTS/graphmem.jsonl"
oks=$(echo "$out" | sed -n 2,4p | grep -c '"ok": true')
free_b=$(echo "$out" | sed -n 5p | sed -n 's/.*"free": \([0-9]*\).*/\1/p')
after=$(echo "$out" | sed -n 7p); route=$(echo "$out" | sed -n 8p)
if [ "$oks" -eq 1 ] && [ -n "$free_b" ] && [ $((free_b >> 20)) -le $((LIMIT_MIB * 4 / 10 + 1)) ] &&
    echo "$after" | grep -q '"ok": true' && echo "$route" | grep -q '"ours": true'; then
    pass graph_memory "1 of 3 fit, free $((free_b >> 20)) MiB after one, freed and re-used; dlvsym route ours"
else fail graph_memory "$(echo "$out" | tr '\n' ' ')"; fi

# ---- 8. the watchdog's view of a process that bypasses libvgpu -------------------------------------
PROBE="$ROOT/services/node-agent/nvml_processes.py"
if [ ! -f "$PROBE" ]; then
    skip watchdog_view "no services/node-agent/nvml_processes.py"
else
    B=$((LIMIT_MIB * 7 / 10 << 20))
    # no libvgpu at all: what a process that escaped the preload (a patched loader copy,
    # tests/native/test_tenant.py) holds, as only the watchdog can see it
    (printf 'init\nalloc plain %s\nalloc plain %s\n' "$B" "$B"; sleep 8) |
        "$WORK/cuctl" >"$WORK/bypass.out" 2>&1 &
    sleep 3
    BYPASS=$(pgrep -n -f "^$WORK/cuctl" || true)
    seen=$("$PY" -c 'import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("nvml_processes", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
probe, pid, limit = mod.NvmlProcessProbe(), int(sys.argv[2] or 0), int(sys.argv[3]) << 20
t0 = time.monotonic()
while time.monotonic() - t0 < 4:
    mine = [p for p in probe.poll() if p.pid == pid]
    if mine and (mine[0].used_bytes or 0) > limit:
        print(f"pid {pid} holds {mine[0].used_bytes >> 20} MiB > {limit >> 20} MiB, "
              f"seen in {time.monotonic() - t0:.1f} s")
        break
    time.sleep(0.5)
else:
    print("NOT SEEN")' "$PROBE" "$BYPASS" "$LIMIT_MIB" 2>&1 | tail -1)
    [ -n "$BYPASS" ] && kill "$BYPASS" 2>/dev/null
    wait
    echo "$seen" >"$RESULTS/watchdog-view.txt"
    if grep -q '"ok": true' "$WORK/bypass.out" && [ -n "$seen" ] && [ "$seen" = "${seen#NOT}" ]; then
        pass watchdog_view "$seen"
    else fail watchdog_view "$seen; $(tr '\n' ' ' <"$WORK/bypass.out")"; fi
fi

# ---- 9. the node agent's watchdog on real NVML ---------------------------------------------------
# A process that never loads libvgpu holds 2 GiB against a 1 GiB seal: seen, judged, ended.
if wd=$(cd "$ROOT" && timeout 120 "$PY" tests/node_agent/gpu_watchdog_check.py 2>"$WORK/wd.err"); then
    pass watchdog "$wd"
else
    fail watchdog "${wd:-$(tail -3 "$WORK/wd.err" | tr '\n' ' ')}"
fi

# ---- 10. MIG profile tables and discovery on the real driver -----------------------------------
if mg=$(cd "$ROOT" && timeout 60 "$PY" tests/node_agent/gpu_mig_check.py 2>"$WORK/mig.err"); then
    pass mig "$mg"
else
    fail mig "${mg:-$(tail -3 "$WORK/mig.err" | tr '\n' ' ')}"
fi

# ---- 10b. MIG single strategy: NVIDIA's rule on the real instances ---------------------------------
if ms=$(cd "$ROOT" && timeout 60 "$PY" tests/node_agent/gpu_mig_single_check.py 2>"$WORK/migs.err"); then
    pass mig_single "$ms"
else
    fail mig_single "${ms:-$(tail -3 "$WORK/migs.err" | tr '\n' ' ')}"
fi

# ---- 11. MPS: two pods' servers on one GPU, each client stopped at its own limit ------------------
if command -v nvidia-cuda-mps-control >/dev/null; then
    MPS_UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
    mps_out=$(cd "$ROOT" && timeout 180 "$PY" tests/node_agent/gpu_mps_check.py \
        nvidia-cuda-mps-control "$MPS_UUID" "$WORK/cuctl" 2>"$WORK/mps.err" | tail -1)
    echo "$mps_out" >"$RESULTS/mps.txt"
    if echo "$mps_out" | grep -q '"ok": true'; then
        pass mps_server_limits "$mps_out"
    else fail mps_server_limits "${mps_out:-$(tail -3 "$WORK/mps.err" | tr '\n' ' ')}"; fi
else
    skip mps_server_limits "no nvidia-cuda-mps-control"
fi

# ---- 12. spill to host memory: past the limit, cudaMalloc is served from host memory --------------
# (sealed limits 1.3 spill_bytes; docs/elastic.md "Spilling to host memory"). Measures what a
# kernel reading a spilled buffer gets against one in device memory: the slowdown the docs state.
# Its own program and build: a compile error here fails this check only.
cat >"$WORK/spill.cu" <<'EOF'
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
__global__ void readall(const float *p, size_t n, int reps, float *out) {
    float acc = 0;
    for (int r = 0; r < reps; r++)
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
             i += (size_t)gridDim.x * blockDim.x)
            acc += p[i];
    if (acc == 12345.0f) *out = acc;  // never: keeps the reads
}
static double gbps(const void *p, size_t bytes, float *out) {
    cudaEvent_t a, b;
    cudaEventCreate(&a); cudaEventCreate(&b);
    size_t n = bytes / sizeof(float);
    readall<<<528, 256>>>((const float *)p, n, 1, out);  // warm: mappings, caches
    cudaDeviceSynchronize();
    cudaEventRecord(a);
    readall<<<528, 256>>>((const float *)p, n, 3, out);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    return ms > 0 ? 3.0 * bytes / (ms / 1e3) / 1e9 : 0;
}
int main(int argc, char **argv) {
    size_t limit = strtoull(argv[1], 0, 10) << 20, buf = 256ull << 20, f = 0, t = 0;
    float *out = 0;
    void *dev = 0, *fill = 0, *spilled = 0;
    cudaError_t e1 = cudaMalloc(&dev, buf), e2 = cudaMalloc(&fill, limit - buf - (16 << 20));
    cudaError_t e3 = cudaMalloc(&out, sizeof(float));
    cudaError_t es = cudaMalloc(&spilled, buf);  // past the limit: spilled
    cudaMemGetInfo(&f, &t);
    if (e1 || e2 || e3 || es) {
        printf("{\"error\": \"%s %s %s %s\", \"ok\": false}\n", cudaGetErrorName(e1),
               cudaGetErrorName(e2), cudaGetErrorName(e3), cudaGetErrorName(es));
        return 0;
    }
    cudaMemset(dev, 1, buf);
    cudaMemset(spilled, 1, buf);  // a device write into it: stays on the host
    cudaDeviceSynchronize();
    double on_card = gbps(dev, buf, out), on_host = gbps(spilled, buf, out);
#if CUDART_VERSION >= 13000
    cudaMemLocation loc = {};
    loc.type = cudaMemLocationTypeDevice;
    loc.id = 0;
    cudaError_t pf = cudaMemPrefetchAsync(spilled, buf, loc, 0, 0);
#else
    cudaError_t pf = cudaMemPrefetchAsync(spilled, buf, 0, 0);
#endif
    cudaGetLastError();
    bool ok = t == limit && f < buf && on_card > 0 && on_host > 0 && on_card > on_host &&
              pf == cudaErrorInvalidValue;
    printf("{\"device_gbps\": %.1f, \"spilled_gbps\": %.1f, \"slowdown\": %.1f, "
           "\"memgetinfo_total\": %zu, \"memgetinfo_free\": %zu, \"prefetch\": \"%s\", "
           "\"ok\": %s}\n", on_card, on_host, on_host > 0 ? on_card / on_host : 0.0, t, f,
           cudaGetErrorName(pf), ok ? "true" : "false");
    return 0;
}
EOF
if "$NVCC" -O2 -arch="$ARCH" -o "$WORK/spill" "$WORK/spill.cu" 2>"$WORK/spill-nvcc.err"; then
    SPILL_DIR="$WORK/spill-state"
    if (cd "$ROOT" && "$PY" - "$SPILL_DIR" "$LIMIT_MIB" <<'EOF'
import sys
from pathlib import Path

from tessera import region

d, limit = Path(sys.argv[1]), int(sys.argv[2]) << 20
region.prepare_region_file(d / "region")
region.seal_limits(d / "limits", region.ContainerLimits(
    devices=(region.DeviceLimit("", mem_limit_bytes=limit),), core_policy="disable",
    region_path=str(d / "region"), spill_bytes=1 << 30))
EOF
    ); then
        out=$(env LD_PRELOAD="$LIB" TESSERA_LIMITS_DIR="$SPILL_DIR/limits" LIBCUDA_LOG_LEVEL=0 \
            timeout 120 "$WORK/spill" "$LIMIT_MIB" 2>&1 | tail -1)
        echo "$out" >"$RESULTS/spill.json"
        if echo "$out" | grep -q '"ok": true'; then pass spill_to_host "$out"
        else fail spill_to_host "$out"; fi
    else
        fail spill_to_host "could not seal the limits with tessera.region ($PY)"
    fi
else
    fail spill_to_host "nvcc: $(tail -3 "$WORK/spill-nvcc.err" | tr '\n' ' ')"
fi

# ---- summary ---------------------------------------------------------------------------------------
{
    echo "{"
    first=1
    for k in "${!RES[@]}"; do
        [ $first -eq 1 ] || echo ","
        first=0
        printf '  "%s": "%s"' "$k" "$(echo "${RES[$k]}" | sed 's/\\/\\\\/g; s/"/\\"/g')"
    done
    printf '\n}\n'
} >"$RESULTS/gpu-check.json"
log "results in $RESULTS/gpu-check.json; $FAILS failure(s); $(($(date +%s) - START)) s in all"
exit $((FAILS > 0))
