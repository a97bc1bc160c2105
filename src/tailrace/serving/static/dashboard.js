// tailrace live dashboard: polls /dashboard/data (about once a second) and redraws.
// No build step, no dependencies. Every user-given string goes in via textContent.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const params = new URLSearchParams(location.search);
const INTERVAL = Math.max(200, Number(params.get("interval")) || 1000);
const PALETTE = ["#2f6fde", "#e8833a", "#1f9d6b", "#9b59b6", "#d2463c", "#16a2b8",
                 "#c9a227", "#6c7a89", "#e05297", "#3b9c3b"];
const NODE_W = 176, NODE_H = 92, GAP_X = 46, GAP_Y = 26;

let selected = params.get("pipeline");
let prev = null;          // previous poll: {t, pipelines: {name: records_in}, admitted, rejected}
let drawn = null;         // signature of the graph currently drawn
const history = [];       // [{admit, reject}] per poll, newest last

function fmtUs(v) {
  if (v === null || v === undefined) return "–";
  if (v >= 1e6) return (v / 1e6).toFixed(2) + "s";
  if (v >= 1e3) return (v / 1e3).toFixed(1) + "ms";
  return v >= 10 ? v.toFixed(0) + "µs" : v.toFixed(1) + "µs";
}
function fmtN(v) { return v >= 1e6 ? (v / 1e6).toFixed(1) + "M" : v >= 1e4 ? (v / 1e3).toFixed(1) + "k" : String(v); }
function fmtRate(v) { return v === null ? "–" : v >= 100 ? v.toFixed(0) : v.toFixed(1); }
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function sv(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function color(i) { return PALETTE[i % PALETTE.length]; }

// ---- plan graph: a small layered layout (longest path from the sources, left to right) ----
function layout(p) {
  const ids = p.nodes.map(n => n.id);
  const parents = Object.fromEntries(ids.map(id => [id, []]));
  for (const e of p.edges) if (parents[e.to]) parents[e.to].push(e.from);
  const layer = {};
  const visit = (id, seen) => {
    if (layer[id] !== undefined) return layer[id];
    if (seen.has(id)) return 0;
    seen.add(id);
    const ps = parents[id].filter(x => x in parents);
    layer[id] = ps.length ? 1 + Math.max(...ps.map(x => visit(x, seen))) : 0;
    return layer[id];
  };
  ids.forEach(id => visit(id, new Set()));
  const layers = [];
  ids.forEach(id => (layers[layer[id]] = layers[layer[id]] || []).push(id));
  const pos = {};
  layers.forEach((col, i) => {
    if (i > 0) {  // order by the mean position of parents (barycentre) to limit crossings
      const bc = id => { const ps = parents[id].filter(x => pos[x]);
        return ps.length ? ps.reduce((s, x) => s + pos[x].row, 0) / ps.length : 0; };
      col.sort((a, b) => bc(a) - bc(b));
    }
    col.forEach((id, r) => { pos[id] = {row: r, col: i}; });
  });
  const rows = Math.max(...layers.map(c => c.length));
  for (const id of ids) {
    const n = layers[pos[id].col].length;
    pos[id].x = 12 + pos[id].col * (NODE_W + GAP_X);
    pos[id].y = 12 + (pos[id].row + (rows - n) / 2) * (NODE_H + GAP_Y);
  }
  return {pos, width: 24 + layers.length * (NODE_W + GAP_X) - GAP_X,
          height: 24 + rows * (NODE_H + GAP_Y) - GAP_Y};
}

function drawGraph(p) {
  const box = document.getElementById("graph");
  const sig = p.name + "|" + p.nodes.map(n => n.id).join(",") + "|" +
              p.edges.map(e => e.from + ">" + e.to).join(",");
  if (sig !== drawn) {
    drawn = sig;
    const {pos, width, height} = layout(p);
    const svg = sv("svg", {viewBox: `0 0 ${width} ${height}`, width, height, id: "plan-svg"});
    const defs = sv("defs");
    const mk = sv("marker", {id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5,
                             markerWidth: 7, markerHeight: 7, orient: "auto"});
    mk.appendChild(sv("path", {d: "M0,0 L10,5 L0,10 z", fill: "#9aa3b5"}));
    defs.appendChild(mk); svg.appendChild(defs);
    for (const e of p.edges) {
      const a = pos[e.from], b = pos[e.to];
      if (!a || !b) continue;
      const x1 = a.x + NODE_W, y1 = a.y + NODE_H / 2, x2 = b.x - 2, y2 = b.y + NODE_H / 2;
      const mx = (x1 + x2) / 2;
      svg.appendChild(sv("path", {class: "edge" + (e.fused ? " fused" : ""),
        d: `M${x1},${y1} C${mx},${y1} ${mx},${y2} ${x2},${y2}`, "marker-end": "url(#arrow)"}));
      const label = e.fused ? "fused" : (e.port ? e.port : "");
      if (label) svg.appendChild(sv("text", {class: "elabel", x: mx, y: (y1 + y2) / 2 - 4,
                                             "text-anchor": "middle"}, label));
    }
    p.nodes.forEach(n => {
      const {x, y} = pos[n.id];
      const g = sv("g", {class: "node", transform: `translate(${x},${y})`, "data-stage": n.id});
      g.appendChild(sv("rect", {class: "box", width: NODE_W, height: NODE_H, rx: 8}));
      g.appendChild(sv("text", {class: "title", x: 10, y: 18}, n.id));
      g.appendChild(sv("text", {class: "sub", x: 10, y: 33},
                       n.op + (n.replicas > 1 ? ` · x${n.replicas}` : "") +
                       (n.fused ? " · fused" : "")));
      g.appendChild(sv("text", {class: "fig svc", x: 10, y: 52}));
      g.appendChild(sv("text", {class: "fig wait", x: 10, y: 67}));
      if (n.bound) {
        g.appendChild(sv("rect", {class: "qbg", x: 10, y: 76, width: NODE_W - 20, height: 6, rx: 3}));
        g.appendChild(sv("rect", {class: "qfill", x: 10, y: 76, width: 0, height: 6, rx: 3}));
      }
      svg.appendChild(g);
    });
    box.replaceChildren(svg);
    // fit the panel, but never shrink text below ~80%: wider plans scroll instead
    svg.style.width = Math.min(width, Math.max(box.clientWidth, width * 0.8)) + "px";
  }
  const shares = Object.fromEntries(p.p99.parts.map(x => [x.id, x.share]));
  const top = Math.max(0.0001, ...Object.values(shares));
  for (const n of p.nodes) {
    const g = box.querySelector(`g.node[data-stage="${CSS.escape(n.id)}"]`);
    if (!g) continue;
    g.querySelector(".svc").textContent = `svc p50 ${fmtUs(n.svc_p50_us)} · p99 ${fmtUs(n.svc_p99_us)}`;
    g.querySelector(".wait").textContent = n.bound
      ? `wait p99 ${fmtUs(n.wait_p99_us)} · q ${n.depth}/${n.bound}`
      : `${fmtN(n.records_out)} out` + (n.errors ? ` · ${n.errors} err` : "");
    const q = g.querySelector(".qfill");
    if (q) q.setAttribute("width", Math.min(1, n.depth / n.bound) * (NODE_W - 20));
    const heat = (shares[n.id] || 0) / top;   // the stage eating the most p99 glows red
    const r = Math.round(154 + heat * (210 - 154)), gr = Math.round(163 - heat * 93),
          b = Math.round(181 - heat * 121);
    g.querySelector("rect.box").setAttribute("stroke", `rgb(${r},${gr},${b})`);
  }
}

// ---- panels ----------------------------------------------------------------------------
function drawP99(p) {
  const bar = document.getElementById("p99bar"), legend = document.getElementById("p99legend");
  bar.replaceChildren(); legend.replaceChildren();
  const sum = p.p99.total_us;
  p.p99.parts.forEach((x, i) => {
    const c = color(i);
    for (const [v, alpha, what] of [[x.wait_us, "66", "queue wait"], [x.svc_us, "", "service"]]) {
      if (!sum || v <= 0) continue;
      const d = el("div", {title: `${x.id} ${what} p99 ${fmtUs(v)}`});
      d.style.width = (100 * v / sum) + "%"; d.style.background = c + alpha;
      bar.appendChild(d);
    }
    const item = el("span", {"data-stage": x.id});
    const sw = el("i", {class: "sw"}); sw.style.background = c;
    item.append(sw, x.id + " ", el("b", {}, (100 * x.share).toFixed(0) + "%"),
                el("span", {class: "muted"}, ` (wait ${fmtUs(x.wait_us)}, svc ${fmtUs(x.svc_us)})`));
    legend.appendChild(item);
  });
  if (p.p99.outside_us > 0 && sum) {
    const d = el("div", {class: "outside", title: `outside any stage ${fmtUs(p.p99.outside_us)}`});
    d.style.width = (100 * p.p99.outside_us / sum) + "%";
    bar.appendChild(d);
    const item = el("span", {"data-stage": "(outside stages)"});
    const sw = el("i", {class: "sw outside"});
    item.append(sw, "outside stages ", el("b", {}, (100 * p.p99.outside_share).toFixed(0) + "%"),
                el("span", {class: "muted"}, ` (admission queue, hand-offs: ${fmtUs(p.p99.outside_us)})`));
    legend.appendChild(item);
  }
  const note = el("div", {class: "muted note"},
                  `end-to-end p99 ${fmtUs(p.latency_p99_us)} · sum of stage p99s ` +
                  `${fmtUs(p.p99.staged_us)} · light: queue wait, solid: service ` +
                  "(percentiles do not add exactly: read it as where the slow requests spend time)");
  legend.appendChild(note);
}

function fmtMoney(v) { return String(Number(Number(v).toPrecision(4))); }

function drawTable(p) {
  const body = document.querySelector("#stages tbody");
  const rows = p.nodes.map(n => {
    const tr = el("tr", {"data-stage": n.id});
    const cells = [["stage", n.id + (n.replicas > 1 ? ` x${n.replicas}` : "")], ["op", n.op],
      ["records_in", fmtN(n.records_in)], ["records_out", fmtN(n.records_out)],
      ["errors", String(n.errors)],
      ["wait_p50", n.bound ? fmtUs(n.wait_p50_us) : "-"],
      ["wait_p99", n.bound ? fmtUs(n.wait_p99_us) : "-"],
      ["svc_p50", fmtUs(n.svc_p50_us)], ["svc_p99", fmtUs(n.svc_p99_us)],
      ["batch", n.batch_mean.toFixed(1)]];
    for (const [f, v] of cells) tr.appendChild(el("td", {"data-field": f}, v));
    const q = el("td", {"data-field": "queue"});
    if (n.bound) {
      const wrap = el("span", {class: "qcell"}), bar = el("i"), fill = el("b");
      fill.style.width = (100 * Math.min(1, n.depth / n.bound)) + "%";
      bar.appendChild(fill);
      wrap.append(bar, `${n.depth}/${n.bound} (max ${n.max_depth})`);
      q.appendChild(wrap);
    } else { q.textContent = n.fused ? "fused" : "-"; q.className = "fused"; }
    tr.appendChild(q);
    // priced engines: what the stage spent; budgeted routes: their margin and solved too
    const c = n.counters || {}, money = [];
    if (c.spend !== undefined || c.cost !== undefined) money.push(fmtMoney(c.spend ?? c.cost));
    if (c.margin !== undefined) money.push(`margin ${fmtMoney(c.margin)}`);
    if (c.solved !== undefined) money.push(`solved ${fmtN(c.solved)}/${fmtN(c.requests || 0)}`);
    tr.appendChild(el("td", {"data-field": "spend"}, money.length ? money.join(" · ") : "-"));
    return tr;
  });
  body.replaceChildren(...rows);
}

function drawAdmission(a, rates) {
  const dl = document.getElementById("adm");
  document.getElementById("adm-policy").textContent = a ? `policy ${a.policy}` : "no admission gate";
  dl.replaceChildren();
  if (!a) return;
  const kv = [["admitted", fmtN(a.admitted)], ["rejected (429)", fmtN(a.rejected)],
              ["in flight", a.in_flight], ["queued", a.queued],
              ["mean wait for admission", fmtUs(a.mean_wait_s * 1e6)]];
  for (const [r, n] of Object.entries(a.rejected_by_reason)) kv.push([`  ${r}`, fmtN(n)]);
  for (const [k, v] of kv) dl.append(el("dt", {}, k), el("dd", {}, String(v)));
  const spark = document.getElementById("adm-spark");
  spark.replaceChildren();
  const top = Math.max(1, ...history.map(h => Math.max(h.admit, h.reject)));
  for (const [key, cls] of [["admit", "#1f9d6b"], ["reject", "#d2463c"]]) {
    const pts = history.map((h, i) => `${(300 * i) / Math.max(1, history.length - 1)},` +
                                      `${58 - 54 * h[key] / top}`).join(" ");
    spark.appendChild(sv("polyline", {points: pts, fill: "none", stroke: cls,
                                      "stroke-width": 2, "vector-effect": "non-scaling-stroke"}));
  }
}

function drawPools(pools) {
  const box = document.getElementById("pools");
  if (!pools.length) { box.replaceChildren(el("p", {class: "muted"}, "no engine pools in this process")); return; }
  box.replaceChildren(...pools.map(p => {
    const d = el("div", {class: "pool", "data-pool": p.name});
    const head = el("div", {class: "head"});
    head.append(el("b", {}, p.name),
                el("span", {}, `${p.busy}/${p.up} busy · ${(100 * p.utilization).toFixed(0)}%`));
    const bar = el("div", {class: "bar"}), fill = el("b");
    fill.style.width = (100 * p.utilization) + "%"; bar.appendChild(fill);
    const reps = el("div", {class: "replicas"});
    for (const r of p.replicas) {
      reps.appendChild(el("span", {class: !r.healthy ? "down" : r.in_flight ? "busy" : ""},
                          `#${r.id} ${r.healthy ? r.in_flight + " in flight" : "down"}` +
                          (r.prompt_tokens ? ` · cache ${(100 * r.cache_hit_ratio).toFixed(0)}%` : "")));
    }
    const meta = el("div", {class: "muted"},
                    `queued ${p.queued} · batches ${fmtN(p.batches)} · mean batch ${p.mean_batch_size.toFixed(1)}`);
    d.append(head, bar, reps, meta);
    return d;
  }));
}

function drawHttp(routes) {
  const body = document.querySelector("#http tbody");
  if (!routes.length) { body.replaceChildren(el("tr", {}, "")); body.firstChild.appendChild(
    el("td", {colspan: 4, class: "muted"}, "no requests yet")); return; }
  body.replaceChildren(...routes.map(r => {
    const tr = el("tr", {"data-route": r.route});
    const bad = Object.entries(r.statuses).filter(([c]) => Number(c) >= 400)
      .map(([c, n]) => `${c}×${fmtN(n)}`).join(" ");
    const name = el("td", {title: `${r.method} ${r.route}`}, r.route.replace("/v1/", ""));
    if (bad) name.appendChild(el("div", {class: "bad small"}, bad));
    tr.append(name, el("td", {}, fmtN(r.count)), el("td", {}, fmtUs(r.p50_us)),
              el("td", {}, fmtUs(r.p99_us)));
    return tr;
  }));
}

function drawTabs(pipelines) {
  const nav = document.getElementById("tabs");
  const names = pipelines.map(p => p.name);
  if (nav.dataset.names !== names.join("\n")) {
    nav.dataset.names = names.join("\n");
    nav.replaceChildren(...names.map(n => {
      const b = el("button", {type: "button", "data-pipeline": n}, n);
      b.onclick = () => { selected = n; poll(); };
      return b;
    }));
  }
  for (const b of nav.children) b.classList.toggle("on", b.dataset.pipeline === selected);
}

function render(data) {
  const t = data.now;
  if (!data.pipelines.length) { document.getElementById("status").textContent = "no pipelines"; return; }
  if (!data.pipelines.some(p => p.name === selected)) selected = data.pipelines[0].name;
  const p = data.pipelines.find(x => x.name === selected);
  const a = data.admission;
  const dt = prev ? t - prev.t : 0;
  const rate = (now, before) => (dt > 0 && before !== undefined) ? Math.max(0, (now - before) / dt) : null;
  const admit = a && prev ? rate(a.admitted, prev.admitted) : null;
  const reject = a && prev ? rate(a.rejected, prev.rejected) : null;
  if (admit !== null) { history.push({admit, reject}); if (history.length > 60) history.shift(); }
  drawTabs(data.pipelines);
  document.getElementById("c-rate").textContent = fmtRate(rate(p.records_in, prev && prev.pipelines[p.name]));
  document.getElementById("c-count").textContent = `${fmtN(p.records_in)} · ${fmtN(p.records_out)} · ${fmtN(p.errors)}`;
  document.getElementById("c-p50").textContent = fmtUs(p.latency_p50_us);
  document.getElementById("c-p99").textContent = fmtUs(p.latency_p99_us);
  document.getElementById("c-admit").textContent = a ? fmtRate(admit) : "no gate";
  document.getElementById("c-reject").textContent = a ? fmtRate(reject) : "no gate";
  document.getElementById("plan-note").textContent =
    `${p.name} · ${p.nodes.length} operators` + (p.ready ? "" : " · not ready");
  drawGraph(p); drawP99(p); drawTable(p); drawAdmission(a, history); drawPools(data.pools);
  drawHttp(data.http || []);
  prev = {t, admitted: a ? a.admitted : 0, rejected: a ? a.rejected : 0,
          pipelines: Object.fromEntries(data.pipelines.map(x => [x.name, x.records_in]))};
  const st = document.getElementById("status");
  st.textContent = "updated " + new Date(t * 1000).toLocaleTimeString();
  st.classList.remove("stale");
}

let timer = null;
async function poll() {
  clearTimeout(timer);
  try {
    const r = await fetch("/dashboard/data", {cache: "no-store"});
    if (r.status === 401) throw new Error("this server needs its API key: open /dashboard?key=KEY");
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
  } catch (e) {
    const st = document.getElementById("status");
    st.textContent = "disconnected: " + e.message; st.classList.add("stale");
  }
  timer = setTimeout(poll, INTERVAL);
}
poll();
