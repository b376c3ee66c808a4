"""The dashboard's page: plain HTML and JavaScript, served by hotspare/observe/dashboard.py.
No build step and nothing loaded from elsewhere: the loss curve and the timeline are drawn on a
canvas and in SVG by the script below. The page keeps its state from the event records alone
(the schema of hotspare.coordinator.events), replayed then followed over server-sent events.

On the coordinator service's dashboard (``cluster`` records; each job's records carry ``job``)
the devices are grouped by host, the newest job is shown unless another is chosen in the
header's job selector (the jobs whose records the dashboard keeps; choosing one reconnects and
the dashboard replays its records), and, when the page was served with a nonce, each host and device has cordon, drain and uncordon buttons: each asks for a confirmation,
then posts the action with the nonce; the tile changes colour when the registry's next
``cluster`` record says so."""

LOGIN = """<!doctype html><html><head><meta charset="utf-8"><title>hotspare: log in</title>
<style>body{font:15px system-ui,sans-serif;background:#f4f6f8;display:flex;justify-content:center;margin-top:12vh}
form{background:#fff;padding:2em 2.5em;border-radius:8px;box-shadow:0 1px 4px #0002}
input{font:inherit;padding:.4em;width:28em}button{font:inherit;padding:.4em 1.2em;margin-top:1em}
.err{color:#c0392b}</style></head><body><form method="post" action="/login">
<h2>hotspare dashboard</h2><p>The token is in the file <code>hotspare run</code> named in its log
(<code>dashboard: ... token in FILE</code>).</p><p class="err" id="error">{error}</p>
<input type="password" name="token" id="token" autofocus placeholder="token"><br>
<button type="submit" id="login">Log in</button></form></body></html>"""

PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>hotspare</title>
<style>
body{font:14px system-ui,sans-serif;margin:0;background:#f4f6f8;color:#222}
header{background:#1f2d3d;color:#fff;padding:.7em 1.2em;display:flex;gap:2em;align-items:baseline}
header h1{font-size:18px;margin:0}#status{font-weight:600}
main{display:grid;grid-template-columns:1fr 1fr;gap:1em;padding:1em}
section{background:#fff;border-radius:6px;box-shadow:0 1px 3px #0002;padding:.8em 1em}
section.wide{grid-column:1/3}h2{font-size:15px;margin:.2em 0 .6em}
.counters{display:flex;gap:1.2em;flex-wrap:wrap}.counter{min-width:9em}
.counter b{display:block;font-size:24px}.counter span{color:#666;font-size:12px}
#devices{display:flex;flex-wrap:wrap;gap:.5em}
.dev{width:9.5em;padding:.5em;border-radius:5px;color:#fff;font-size:12px;cursor:default}
.dev b{display:block;font-size:13px}.spare{outline:3px dashed #1f2d3d;outline-offset:-3px}
.healthy{background:#27ae60}.suspect{background:#d4ac0d}.cordoned{background:#e67e22}
.draining{background:#8e44ad}.quarantined{background:#c0392b}.retired{background:#7f8c8d}.unknown{background:#95a5a6}
table{border-collapse:collapse;width:100%}td,th{text-align:left;padding:.2em .5em;border-bottom:1px solid #eee}
#timeline .item{padding:.4em 0;border-bottom:1px solid #eee}.kind-failure{color:#c0392b}.kind-recovered{color:#27ae60}
.kind-migration{color:#8e44ad}.bar{display:flex;height:12px;margin-top:.3em}.bar div{height:12px}
.legend span{display:inline-block;margin-right:1em;font-size:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:3px}
canvas{width:100%;height:260px}
.host{flex-basis:100%;margin-bottom:.4em}.hosthead{margin-bottom:.3em}.tiles{display:flex;flex-wrap:wrap;gap:.5em}
.acts button{font-size:11px;margin:.3em .2em 0 0;padding:.1em .4em}.dev .acts{display:block}
#actions-bar{margin-bottom:.6em}
#action-result.ok{color:#27ae60}#action-result.err{color:#c0392b}
</style></head><body>
<header><h1>hotspare</h1><select id="jobsel" hidden title="the job shown"></select><span id="job"></span><span id="status">connecting...</span><span id="where"></span></header>
<main>
<section class="wide"><div class="counters" id="counters"></div></section>
<section><h2 id="devices-title">Devices</h2>
<div id="actions-bar" hidden><input id="reason" maxlength="200" size="32" placeholder="reason (optional)">
<span id="action-result"></span></div><div id="devices"></div>
<p class="legend"><span><i class="healthy"></i>healthy</span><span><i class="suspect"></i>suspect</span>
<span><i class="cordoned"></i>cordoned</span><span><i class="draining"></i>draining</span>
<span><i class="quarantined"></i>quarantined</span><span><i class="retired"></i>retired</span>
<span>dashed: a warm spare</span></p></section>
<section><h2>Ranks</h2><table id="ranks"><thead><tr><th>rank</th><th>worker</th><th>device</th></tr></thead>
<tbody></tbody></table></section>
<section class="wide"><h2>Loss <span id="curve-what"></span></h2>
<canvas id="curve" width="1200" height="260"></canvas></section>
<section class="wide"><h2>Timeline</h2><div class="legend" id="phase-legend"></div><div id="timeline"></div></section>
</main><script src="/app.js"></script></body></html>"""

SCRIPT = r"""
"use strict";
const PHASES = {detect: "#c0392b", decide: "#e67e22", rebuild_groups: "#8e44ad", transfer_state: "#2471a3",
                first_committed_step: "#27ae60"};
const S = {start: null, job: {}, devices: {}, readings: {}, placement: [], spares: [], gen: 0, world: 0,
           step: null, dt: null, curve: [], failures: [], recovered: {}, failovers: {}, migrations: [], loans: [],
           health: [], end: null, last: null, cluster: null, jobName: null,
           jobs: [], chosen: null, replayed: false, closed: false};   // chosen: a job picked, null: the newest
const NONCE = (document.querySelector('meta[name="hotspare-nonce"]') || {}).content || null;
const CONFIRM = {
  cordon: t => `Cordon ${t}?\n\nNo new work is placed on it; what runs there keeps running.`,
  drain: t => `Drain ${t}?\n\nIt is cordoned, and a rank on it is moved to a spare at the next step boundary; ` +
              "then it is quarantined for diagnostics.",
  uncordon: t => `Uncordon ${t}?\n\nIt returns to service (a quarantined device returns only by passing ` +
                 "its diagnostics)."};
const $ = id => document.getElementById(id);
const ENT = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"};
const esc = s => String(s).replace(/[&<>"']/g, c => ENT[c]);
const key = d => d.worker + "@" + d.step;

function resetJob() {
  for (const k of ["placement", "spares", "curve", "failures", "migrations", "loans", "health"]) S[k] = [];
  Object.assign(S, {start: null, job: {}, gen: 0, world: 0, step: null, dt: null, recovered: {}, failovers: {},
                    end: null});
}

function apply(r) {
  const d = r.data; S.last = r.t;
  if (r.kind === "cluster") { S.cluster = d; for (const x of d.devices) S.devices[x.device] = x; return; }
  if (r.job !== undefined) {                              // the service's page: its newest job, or the one chosen
    if (r.kind === "run_start" && !S.jobs.includes(r.job)) S.jobs.push(r.job);
    if (S.chosen !== null && r.job !== S.chosen) return;
    if (r.job !== S.jobName) {
      if (r.kind !== "run_start") return;
      resetJob(); S.jobName = r.job;
    }
  }
  switch (r.kind) {
    case "run_start": S.start = r.t; S.job = d.job; break;
    case "devices": for (const x of d.devices) S.devices[x.device] = x; break;
    case "readings": for (const x of d.readings) if (x.source !== "runtime") S.readings[x.device] = x.metrics; break;
    case "generation": S.gen = d.gen; S.world = d.world_size; if (d.placement) S.placement = d.placement; break;
    case "spares": S.spares = d.workers || []; break;
    case "worker_said":
      if (d.msg.type === "commit" && d.msg.rank === 0) {
        S.step = d.msg.step; S.dt = d.msg.dt;
        const loss = d.msg.metrics && d.msg.metrics.loss;
        S.curve.push([r.t, typeof loss === "number" ? loss : null, d.msg.step]);
      }
      break;
    case "failure": S.failures.push(r); break;
    case "failover": S.failovers[key(d)] = r; break;
    case "recovered": case "unrecovered": S.recovered[key(d)] = r; break;
    case "migration": S.migrations.push(r); break;
    case "device_loaned": S.loans.push(r); break;
    case "health_event": S.health.push(r); break;
    case "run_end": S.end = r; break;
  }
}

function counters() {
  const rec = Object.values(S.recovered).filter(r => r.kind === "recovered");
  const down = rec.reduce((a, r) => a + (r.data.downtime_s || 0), 0);
  const zero = Object.values(S.failovers).filter(r => r.data.recovery_path === "memory" && r.data.lost_steps === 0).length;
  const gens = {}; for (const r of Object.values(S.failovers)) gens[r.data.generation] = r.data.lost_steps || 0;
  const lostSteps = Object.values(gens).reduce((a, b) => a + b, 0);
  const first = S.curve.length ? S.curve[0][0] : null;
  const wall = first !== null ? (S.end ? S.end.t : S.last) - first : 0;
  const goodput = wall > 0 ? Math.max(0, 1 - down / wall) : null;
  const n = S.failures.length;
  const items = [["failures handled", n],
    ["recovered with zero lost steps", n ? `${zero}/${n} (${Math.round(100 * zero / n)}%)` : "-"],
    ["total downtime", down.toFixed(2) + " s"], ["lost steps", lostSteps],
    ["goodput (1 − downtime ÷ time since the first step)", goodput === null ? "-" : (100 * goodput).toFixed(1) + "%"],
    ["committed step", S.step === null ? "-" : S.step],
    ["step time", S.dt === null ? "-" : (1000 * S.dt).toFixed(0) + " ms"], ["generation", S.gen],
    ["warm spares", S.spares.length]];
  $("counters").innerHTML = items.map(([k, v]) =>
    `<div class="counter"><b>${esc(v)}</b><span>${esc(k)}</span></div>`).join("");
}

function buttons(target) {
  if (!NONCE) return "";
  return `<span class="acts">` + Object.keys(CONFIRM).map(a =>
    `<button data-action="${a}" data-target="${esc(target)}">${a}</button>`).join("") + "</span>";
}

let devicesHtml = "";
function devices() {
  const onDev = {}; for (const p of S.placement) if (p.device) onDev[p.device] = "rank " + p.rank;
  for (const p of S.spares) if (p.device) onDev[p.device] = "spare " + p.worker;
  const tile = name => {
    const x = S.devices[name] || {state: "unknown"}, m = S.readings[name] || {}, who = onDev[name] || "idle";
    const read = Object.entries(m).filter(([k, v]) => typeof v !== "object").map(([k, v]) => `${k} ${v}`).join(", ");
    const tip = `${name}: ${x.state} (${x.reason || ""})\n${who}\n${read}`;
    const spare = who.startsWith("spare") ? " spare" : "";
    const temp = m.temp_c !== undefined ? "<br>" + esc(m.temp_c) + " C" : "";
    return `<div class="dev ${esc(x.state)}${spare}" data-device="${esc(name)}" data-state="${esc(x.state)}" ` +
           `title="${esc(tip)}"><b>${esc(name)}</b>${esc(x.state)}<br>${esc(who)}${temp}${buttons(name)}</div>`;
  };
  let html;
  if (S.cluster) {
    $("devices-title").textContent = "Cluster: hosts and devices";
    const inHosts = new Set(S.cluster.hosts.flatMap(h => h.devices));
    const rest = Object.keys(S.devices).filter(n => !inHosts.has(n)).sort();
    html = S.cluster.hosts.map(h => `<div class="host" data-host="${esc(h.name)}"><div class="hosthead">` +
      `<b>${esc(h.name)}</b> ${esc(h.phase)}${h.spare ? " (spare host)" : ""} ${buttons(h.name)}</div>` +
      `<div class="tiles">${h.devices.map(tile).join("")}</div></div>`).join("") +
      (rest.length ? `<div class="host"><div class="hosthead">not registered now</div>` +
                     `<div class="tiles">${rest.map(tile).join("")}</div></div>` : "");
  } else {
    html = Object.keys(S.devices).sort().map(tile).join("");
  }
  if (html !== devicesHtml) { devicesHtml = html; $("devices").innerHTML = html; }   // a button keeps its click
  $("ranks").tBodies[0].innerHTML = S.placement.map(p =>
    `<tr><td>${p.rank}</td><td>${esc(p.worker)}</td><td>${esc(p.device || "-")}</td></tr>`).join("");
}

async function act(action, target) {
  const out = $("action-result");
  if (!confirm(CONFIRM[action](target))) {
    out.className = ""; out.textContent = `${action} ${target}: not confirmed`; return;
  }
  const reason = $("reason").value.trim() || "by the operator";
  out.className = ""; out.textContent = `${action} ${target}...`;
  try {
    const r = await fetch("/api/action", {method: "POST", credentials: "same-origin",
      headers: {"Content-Type": "application/json", "X-Hotspare-Nonce": NONCE},
      body: JSON.stringify({action, target, confirm: target, reason})});
    const body = await r.json();
    out.className = body.ok ? "ok" : "err"; out.textContent = body.message;
  } catch (e) { out.className = "err"; out.textContent = `${action} ${target}: ${e}`; }
}
if (NONCE) {
  $("actions-bar").hidden = false;
  $("devices").addEventListener("click", e => {
    const b = e.target.closest("button[data-action]");
    if (b) act(b.dataset.action, b.dataset.target);
  });
}

function curve() {
  const c = $("curve"), g = c.getContext("2d"), W = c.width, H = c.height, L = 50, B = 24;
  g.clearRect(0, 0, W, H);
  const pts = S.curve.filter(p => p[1] !== null);
  const useLoss = pts.length > 0, data = useLoss ? pts : S.curve.map(p => [p[0], p[2]]);
  $("curve-what").textContent = useLoss ? "(rank 0, per committed step)" : "(no loss logged: committed step)";
  if (data.length < 2) return;
  const t0 = data[0][0], t1 = Math.max(data[data.length - 1][0], S.last || 0);
  let lo = Math.min(...data.map(p => p[1])), hi = Math.max(...data.map(p => p[1]));
  if (hi === lo) hi = lo + 1;
  const X = t => L + (W - L - 10) * (t - t0) / Math.max(1e-9, t1 - t0), Y = v => 10 + (H - B - 10) * (hi - v) / (hi - lo);
  g.strokeStyle = "#ccc"; g.fillStyle = "#666"; g.font = "11px sans-serif";
  for (let i = 0; i <= 4; i++) { const v = lo + (hi - lo) * i / 4; g.fillText(v.toFixed(2), 4, Y(v) + 4);
    g.beginPath(); g.moveTo(L, Y(v)); g.lineTo(W - 10, Y(v)); g.stroke(); }
  g.fillText(`${(t1 - t0).toFixed(0)} s`, W - 40, H - 6);
  for (const f of S.failures) {
    const struck = f.t - (f.data.detection_latency_s || 0), back = S.recovered[key(f.data)];
    if (back && back.kind === "recovered") {
      g.fillStyle = "#c0392b33"; g.fillRect(X(struck), 10, X(back.t) - X(struck), H - B - 10);
      g.strokeStyle = "#27ae60"; g.beginPath(); g.moveTo(X(back.t), 10); g.lineTo(X(back.t), H - B); g.stroke();
    }
    g.strokeStyle = "#c0392b"; g.setLineDash([4, 3]);
    g.beginPath(); g.moveTo(X(struck), 10); g.lineTo(X(struck), H - B); g.stroke();
    g.setLineDash([]); g.fillStyle = "#c0392b"; g.fillText(`rank ${f.data.rank} ${f.data.kind}`, X(struck) + 3, 22);
  }
  g.strokeStyle = "#34495e"; g.lineWidth = 1.3; g.beginPath();
  data.forEach((p, i) => i ? g.lineTo(X(p[0]), Y(p[1])) : g.moveTo(X(p[0]), Y(p[1]))); g.stroke(); g.lineWidth = 1;
}

function timeline() {
  $("phase-legend").innerHTML = Object.entries(PHASES).map(([k, c]) =>
    `<span><i style="background:${c}"></i>${k.replace(/_/g, " ")}</span>`).join("");
  const rel = t => S.start !== null ? `+${(t - S.start).toFixed(2)} s` : "";
  const items = [];
  for (const f of S.failures) {
    const d = f.data, over = S.recovered[key(d)], fo = S.failovers[key(d)];
    let html = `<div class="item" data-kind="failure"><span class="kind-failure">${rel(f.t)} FAILURE</span> ` +
               `rank ${esc(d.rank)} (${esc(d.worker)}) ${esc(d.kind)} at step ${esc(d.step)}`;
    if (fo) html += `<br>${rel(fo.t)} FAILOVER by ${esc(fo.data.recovery_path)}: ${esc(fo.data.reason)}`;
    if (over && over.kind === "recovered") {
      const o = over.data, total = o.downtime_s || 1e-9;
      html += `<br><span class="kind-recovered" data-kind="recovered">${rel(over.t)} RECOVERED</span> ` +
              `downtime ${o.downtime_s.toFixed(3)} s, lost steps ${esc(o.lost_steps)}` +
              `<div class="bar" style="width:${Math.min(100, 20 + 20 * Math.log10(1 + 10 * total))}%">` +
              Object.entries(o.phases_s || {}).filter(([k, v]) => v).map(([k, v]) =>
                `<div title="${esc(k)} ${v.toFixed(3)} s" style="width:${100 * v / total}%;background:${PHASES[k]}"></div>`
              ).join("") + "</div>";
    } else if (over) html += `<br><span class="kind-failure">not recovered: the job stopped</span>`;
    items.push([f.t, html + "</div>"]);
  }
  for (const m of S.migrations) items.push([m.t, `<div class="item" data-kind="migration">` +
    `<span class="kind-migration">${rel(m.t)} MIGRATION</span> rank ${esc(m.data.rank)} off ${esc(m.data.device)}: ` +
    `${esc(m.data.outcome)}</div>`]);
  for (const l of S.loans) items.push([l.t, `<div class="item" data-kind="loan">` +
    `<span class="kind-migration">${rel(l.t)} BORROWED</span> ${esc(l.data.borrower)} got ` +
    `${esc((l.data.hosts || []).join(", "))} (${esc(l.data.slots)} slots)` +
    (l.data.lender ? ` from ${esc(l.data.lender)}, paused` : " from the idle pool") + `: ${esc(l.data.reason)}</div>`]);
  for (const h of S.health) items.push([h.t, `<div class="item" data-kind="health">${rel(h.t)} HEALTH ` +
    `${esc(h.data.device)}: ${esc(h.data.action)} by ${esc(h.data.rule)}: ${esc(h.data.reason)}</div>`]);
  items.sort((a, b) => b[0] - a[0]);
  $("timeline").innerHTML = items.map(i => i[1]).join("") || "<p>no failures, fences, migrations or borrowings yet</p>";
}

let pending = false;
function render() {
  pending = false;
  $("job").textContent = S.job.script ? `${S.job.script.split("/").pop()} ${(S.job.args || []).join(" ")}` : "";
  $("status").textContent = S.closed ? "the dashboard closed: its service or run stopped" :
    S.end ? `${S.end.data.outcome} (exit ${S.end.data.exit_code})` : S.start !== null ? "running" :
    S.chosen !== null && S.replayed && !S.jobs.includes(S.chosen) ? `job ${S.chosen}: its records are no longer kept` :
    S.cluster ? "no job yet" : "connecting...";
  jobSelector();
  $("where").textContent = S.world ? `${S.world} ranks, gen ${S.gen}` : "";
  counters(); devices(); curve(); timeline();
}
function schedule() { if (!pending) { pending = true; requestAnimationFrame(render); } }

let jobsShown = "";
function jobSelector() {
  const sel = $("jobsel"), want = [...S.jobs, S.chosen].join(" ");
  sel.hidden = S.jobs.length === 0;
  if (want === jobsShown) return;
  jobsShown = want;
  const names = S.jobs.slice().reverse();
  if (S.chosen !== null && !names.includes(S.chosen)) names.push(S.chosen);
  sel.innerHTML = `<option value="">newest job</option>` +
    names.map(j => `<option value="${esc(j)}">${esc(j)}</option>`).join("");
  sel.value = S.chosen === null ? "" : S.chosen;
}

let source = null;
function connect() {
  source = new EventSource("/events");
  source.onmessage = e => { apply(JSON.parse(e.data)); schedule(); };
  source.addEventListener("replayed", () => { S.replayed = true; schedule(); });
  source.addEventListener("end", () => { S.closed = true; source.close(); schedule(); });
  source.onerror = () => { if (S.end && S.jobs.length === 0) { source.close(); }
                           else if (!S.closed) { $("status").textContent = "reconnecting..."; } };
  source.onopen = () => { for (const k of Object.keys(S)) if (Array.isArray(S[k])) S[k].length = 0;
    S.recovered = {}; S.failovers = {}; S.devices = {}; S.readings = {}; S.end = null; S.cluster = null;
    S.jobName = null; S.start = null; S.replayed = false; devicesHtml = ""; };
}
$("jobsel").addEventListener("change", e => {      // the dashboard replays what it keeps: that job's from its start
  S.chosen = e.target.value || null; source.close(); connect(); schedule();
});
connect();
"""
