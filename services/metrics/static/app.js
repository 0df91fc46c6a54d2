// Tessera dashboard: polls api/state and redraws. No framework, no network beyond this service.
"use strict";

const POLL_MS = 2000;
const GIB = 1024;

const $ = (id) => document.getElementById(id);

function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) => ({
    "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;",
  })[c]);
}

// One stable colour per pod, so a pod keeps its colour on every GPU and every refresh.
function podColor(key) {
  let hash = 2166136261;
  for (let i = 0; i < key.length; i++) {
    hash ^= key.charCodeAt(i);
    hash = Math.imul(hash, 16777619);
  }
  const hue = (hash >>> 0) % 360;
  return `hsl(${hue} 70% 66%)`;
}

function mem(mib) {
  if (mib == null) return "–";
  return mib >= GIB ? `${(mib / GIB).toFixed(mib >= 10 * GIB ? 0 : 1)} GiB` : `${Math.round(mib)} MiB`;
}

// HAMi's device type is "NVIDIA-" + the NVML name, which often starts with NVIDIA already.
function model(type) {
  return String(type || "").replace(/^NVIDIA-(?=NVIDIA)/, "");
}

function pct(part, whole) {
  return whole > 0 ? Math.round((100 * part) / whole) : 0;
}

function ago(seconds) {
  if (seconds == null) return "";
  if (seconds < 60) return `${Math.round(seconds)}s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)}m ${Math.round(seconds % 60)}s`;
  return `${Math.floor(seconds / 3600)}h ${Math.floor((seconds % 3600) / 60)}m`;
}

function clock(unix) {
  const d = new Date(unix * 1000);
  return d.toTimeString().slice(0, 8);
}

function stat(label, value, detail, cls, fraction) {
  const mini = fraction == null ? "" :
    `<div class="mini"><div style="width:${Math.min(100, fraction * 100).toFixed(1)}%"></div></div>`;
  return `<div class="stat ${cls || ""}"><div class="label">${esc(label)}</div>` +
    `<div class="value">${esc(value)}</div><div class="detail">${esc(detail || "")}</div>${mini}</div>`;
}

function renderTotals(t) {
  $("totals").innerHTML = [
    stat("Nodes", t.nodes, `${t.gpus} GPUs`),
    stat("Unhealthy GPUs", t.unhealthy_gpus, "reported by the node agents", t.unhealthy_gpus ? "err" : ""),
    stat("Memory allocated", `${pct(t.allocated_mib, t.memory_mib)}%`,
      `${mem(t.allocated_mib)} of ${mem(t.memory_mib)}`, "", t.memory_mib ? t.allocated_mib / t.memory_mib : 0),
    stat("Compute allocated", `${pct(t.allocated_cores, t.cores)}%`,
      `${t.allocated_cores}% of ${t.cores}%`, "", t.cores ? t.allocated_cores / t.cores : 0),
    stat("Pods on GPUs", t.pods, "active allocations"),
    stat("Pending pods", t.pending, "refused by the scheduler", t.pending ? "warn" : ""),
    stat("OOM events", t.ooms, "GPU memory limit hit", t.ooms ? "err" : ""),
    stat("Limit breaches", t.limit_breaches, "seen by the node watchdogs", t.limit_breaches ? "err" : ""),
  ].join("");
}

function segments(gpu, field, total) {
  return gpu.slices.map((s) => {
    const key = `${s.namespace}/${s.pod}`;
    const amount = s[field];
    const width = total > 0 ? (100 * amount) / total : 0;
    const label = field === "memory_mib" ? mem(amount) : `${amount}%`;
    const title = `${key} · ${s.container} · ${label} · ${s.state}${s.breach ? " · breached: " + s.breach : ""}`;
    return `<div class="seg ${esc(s.state)}${s.breach ? " breached" : ""}" data-pod="${esc(key)}" data-container="${esc(s.container)}"` +
      ` data-amount="${amount}" style="width:${width.toFixed(3)}%;background:${podColor(key)}"` +
      ` title="${esc(title)}">${width > 14 ? esc(s.pod) : ""}</div>`;
  }).join("");
}

// MIG instances on their card: a strip of the card's memory slices with each instance at its
// placement (start, size), labelled with its profile and the pod holding it.
function renderMig(gpu) {
  const instances = gpu.mig_instances || [];
  if (!instances.length) return "";
  const slots = gpu.mig_slices || Math.max(...instances.map((i) => i.start + i.size));
  const boxes = instances.map((i) => {
    const held = i.pod ? esc(i.pod) : "free";
    const title = `${i.profile} at slice ${i.start} (${i.size} slice${i.size === 1 ? "" : "s"}) · ` +
      `${i.pod || "free"}${i.container ? " · " + i.container : ""} · ${i.source}` +
      `${i.state !== "created" ? " · " + i.state : ""}${i.uuid ? " · " + i.uuid : ""}`;
    const colour = i.pod ? `background:${podColor(i.pod)}` : "";
    return `<div class="mig-instance ${i.pod ? "held" : "free"} ${esc(i.source)} ${esc(i.state)}"` +
      ` data-uuid="${esc(i.uuid)}" data-profile="${esc(i.profile)}" data-start="${i.start}"` +
      ` data-size="${i.size}" data-pod="${esc(i.pod)}" data-source="${esc(i.source)}"` +
      ` style="left:${((100 * i.start) / slots).toFixed(3)}%;width:${((100 * i.size) / slots).toFixed(3)}%;${colour}"` +
      ` title="${esc(title)}"><span class="mig-profile">${esc(i.profile)}</span>` +
      `<span class="mig-pod">${held}</span></div>`;
  }).join("");
  const kinds = [...new Set(instances.map((i) => i.source))].join(" + ");
  return `<div class="metric-row"><span class="metric-name">MIG</span>` +
    `<div class="mig-strip" data-slots="${slots}" style="--slot:${(100 / slots).toFixed(3)}%">${boxes}</div></div>` +
    `<div class="bar-caption"><span>${instances.length} instance${instances.length === 1 ? "" : "s"} (${esc(kinds)}) · ` +
    `${instances.filter((i) => i.pod).length} held</span><span>${slots} memory slices</span></div>`;
}

// MPS clients on their card: each pod's own server and the limits it holds (set server-side).
function renderMps(gpu) {
  const clients = gpu.mps_clients || [];
  if (gpu.mode !== "mps") return "";
  if (!clients.length) return `<div class="mps-none">MPS: no client</div>`;
  return `<ul class="mps-clients">${clients.map((c) =>
    `<li class="mps-client" data-pod="${esc(c.pod)}" data-container="${esc(c.container)}"` +
    ` data-memory="${c.memory_mib}" data-threads="${c.thread_pct}">` +
    `<span class="swatch" style="background:${podColor(c.pod)}"></span>` +
    `<span class="slice-name">MPS server · ${esc(c.pod)} <span class="ctr">${esc(c.container)}</span></span>` +
    `<span class="slice-fig">${mem(c.memory_mib)} pinned · ${c.thread_pct}% threads</span></li>`
  ).join("")}</ul>`;
}

function renderGpu(gpu) {
  const memUsed = gpu.host_used_mib;
  const usedMark = memUsed && gpu.memory_mib > 0
    ? `<div class="used-mark" style="left:${Math.min(100, (100 * memUsed) / gpu.memory_mib).toFixed(2)}%"` +
      ` title="used on the card: ${mem(memUsed)}"></div>` : "";
  const scaled = gpu.physical_memory_mib && gpu.physical_memory_mib !== gpu.memory_mib
    ? ` · ${mem(gpu.physical_memory_mib)} physical` : "";
  const health = gpu.healthy ? `<span class="badge ok">healthy</span>` : `<span class="badge err">unhealthy</span>`;
  const util = gpu.host_utilization != null ? ` · ${Math.round(gpu.host_utilization)}% busy` : "";
  const slices = gpu.slices.length
    ? `<ul class="slices">${gpu.slices.map((s) => {
        const key = `${s.namespace}/${s.pod}`;
        const usage = [];
        if (s.used_mib != null) usage.push(`uses ${mem(s.used_mib)}`);
        if (s.borrowed_mib) usage.push(`borrows ${mem(s.borrowed_mib)}`);
        if (s.lent_pct) usage.push(`lent ${s.lent_pct}% SM`);
        if (s.sm_util != null) {
          usage.push(s.sm_limit ? `${Math.round(s.sm_util)}/${s.sm_limit}% SM` : `${Math.round(s.sm_util)}% SM`);
        }
        return `<li data-pod="${esc(key)}"><span class="swatch" style="background:${podColor(key)}"></span>` +
          `<span class="slice-name">${esc(key)} <span class="ctr">${esc(s.container)}` +
          `${s.state !== "allocated" ? " · " + esc(s.state) : ""}</span>` +
          `${s.breach ? ` <span class="badge err breach">breached: ${esc(s.breach)}</span>` : ""}</span>` +
          `<span class="slice-fig">${mem(s.memory_mib)}${s.memory_limit_mib ? ` guaranteed, up to ${mem(s.memory_limit_mib)}` : ""} · ${s.cores}%${s.cores_limit ? ` guaranteed, up to ${s.cores_limit}%` : ""}${usage.length ? " · " + usage.join(" · ") : ""}</span></li>`;
      }).join("")}</ul>`
    : (gpu.mig_instances || []).some((i) => i.pod) ? ""
    : `<div class="no-slices">idle: no pod holds this GPU</div>`;
  return `<article class="gpu ${gpu.healthy ? "" : "unhealthy"}" data-uuid="${esc(gpu.uuid)}">
    <div class="gpu-head"><span class="gpu-title">${esc(gpu.device_word || "GPU")} ${gpu.index} · ${esc(model(gpu.type))}</span>${health}
      <span class="badge">${gpu.shared}/${gpu.split_count} slots</span>
      ${gpu.mode && gpu.mode !== "hami-core" ? `<span class="badge mode">${esc(gpu.mode.toUpperCase())}</span>` : ""}
      <span class="gpu-uuid mono" title="${esc(gpu.uuid)}">${esc(gpu.short_uuid || gpu.uuid)}</span></div>
    <div class="metric-row"><span class="metric-name">memory</span>
      <div class="bar mem">${segments(gpu, "memory_mib", gpu.memory_mib)}${usedMark}</div></div>
    <div class="bar-caption"><span>${mem(gpu.allocated_mib)} of ${mem(gpu.memory_mib)} allocated${scaled}</span>
      <span>${memUsed != null ? mem(memUsed) + " used" : ""}</span></div>
    <div class="metric-row"><span class="metric-name">compute</span>
      <div class="bar cores">${segments(gpu, "cores", gpu.cores)}</div></div>
    <div class="bar-caption"><span>${gpu.allocated_cores}% of ${gpu.cores}% allocated${util}</span><span></span></div>
    ${renderMig(gpu)}
    ${renderMps(gpu)}
    ${slices}
  </article>`;
}

function renderNodes(nodes) {
  if (!nodes.length) {
    $("nodes").innerHTML = `<p class="empty">No node has registered yet.</p>`;
    return;
  }
  $("nodes").innerHTML = nodes.map((n) => {
    const state = n.registered
      ? `<span class="badge ok">registered</span>`
      : `<span class="badge err">not heartbeating</span>`;
    const beat = n.heartbeat_age_s != null ? `heartbeat ${ago(n.heartbeat_age_s)} ago` : "";
    const orphans = n.orphans.length
      ? `<p class="badge warn">${n.orphans.length} grant(s) on GPUs the node no longer reports</p>` : "";
    return `<section class="node" data-node="${esc(n.name)}">
      <div class="node-head"><span class="node-name">${esc(n.name)}</span>${state}
        <span class="node-meta">${n.gpus.length} GPU${n.gpus.length === 1 ? "" : "s"} · ${beat}</span></div>
      ${orphans}
      <div class="gpus">${n.gpus.map(renderGpu).join("") || '<p class="empty">no GPUs</p>'}</div>
    </section>`;
  }).join("");
}

function renderPending(pending) {
  $("pending-count").textContent = pending.length;
  if (!pending.length) {
    $("pending").innerHTML = `<p class="empty">Nothing is waiting for a GPU.</p>`;
    return;
  }
  $("pending").innerHTML = pending.map((p) => {
    const key = `${p.namespace}/${p.name}`;
    const entries = Object.entries(p.node_reasons);
    const shown = entries.slice(0, 6).map(([node, why]) =>
      `<li><span class="rn">${esc(node)}</span><span>${esc(why)}</span></li>`).join("");
    const more = entries.length > 6 ? `<li><span class="rn"></span><span>+${entries.length - 6} more nodes</span></li>` : "";
    return `<div class="pending-pod" data-pod="${esc(key)}">
      <div class="who">${esc(key)}</div>
      <div class="when">waiting ${ago(p.waiting_s)} · ${p.attempts} attempt${p.attempts === 1 ? "" : "s"}</div>
      <div class="summary">${esc(p.summary)}</div>
      <ul class="reasons">${shown}${more}</ul>
    </div>`;
  }).join("");
}

function renderEvents(events) {
  if (!events.length) {
    $("events").innerHTML = `<li class="empty">No events yet.</li>`;
    return;
  }
  $("events").innerHTML = events.map((e) =>
    `<li class="sev-${esc(e.severity)}"><span class="t">${clock(e.at)}</span>` +
    `<span class="k">${esc(e.kind === "alloc" ? e.action : e.kind)}</span>` +
    `<span class="txt">${esc(e.text)}${e.reason ? `<span class="why">${esc(e.reason)}</span>` : ""}</span></li>`
  ).join("");
}

function quotaRow(label, used, limit, format) {
  if (limit == null) return `<div class="q-row"><span class="q-name">${label}</span>` +
    `<span class="q-fig">${format(used)} · no limit</span></div>`;
  const share = limit > 0 ? used / limit : 1;
  const cls = share >= 0.95 ? "err" : share >= 0.8 ? "warn" : "";
  return `<div class="q-row"><span class="q-name">${label}</span>` +
    `<span class="q-fig">${format(used)} of ${format(limit)}</span></div>` +
    `<div class="mini q ${cls}"><div style="width:${Math.min(100, share * 100).toFixed(1)}%"></div></div>`;
}

function renderQuotas(quotas) {
  if (!quotas.length) {
    $("quotas").innerHTML = `<p class="empty">No namespace holds GPU quota.</p>`;
    return;
  }
  $("quotas").innerHTML = quotas.map((q) =>
    `<div class="quota" data-namespace="${esc(q.namespace)}"><div class="who">${esc(q.namespace)}</div>` +
    quotaRow("memory", q.used.memory_mib || 0, q.limits.memory_mib, mem) +
    quotaRow("compute", q.used.cores || 0, q.limits.cores, (v) => `${v}%`) +
    (q.limits.gpus != null ? quotaRow("GPUs", q.used.gpus || 0, q.limits.gpus, String) : "") +
    `</div>`).join("");
}

function setLive(cls, text) {
  $("live").className = `live ${cls}`;
  $("live-text").textContent = text;
}

let lastOk = 0;

async function refresh() {
  try {
    const response = await fetch("api/state", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const state = await response.json();
    renderTotals(state.totals);
    renderNodes(state.nodes);
    renderPending(state.pending);
    renderQuotas(state.quotas);
    renderEvents(state.events);
    lastOk = Date.now();
    document.body.dataset.updated = String(lastOk);
    if (state.synced) setLive("ok", `live · ${new Date().toTimeString().slice(0, 8)}`);
    else setLive("replaying", "replaying the bus…");
  } catch (err) {
    const since = lastOk ? ` · last update ${ago((Date.now() - lastOk) / 1000)} ago` : "";
    setLive("down", `metrics service unreachable${since}`);
  } finally {
    setTimeout(refresh, POLL_MS);
  }
}

refresh();
