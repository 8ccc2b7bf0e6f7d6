// The tinyllm inference lab. Plain JavaScript, no library: each section of the page has its own block below.
// It talks to this server only: the OpenAI API (/v1/...) to generate, /lab/api/... for the engine's inside,
// /metrics for the Prometheus figures.
"use strict";

// --- small helpers ---------------------------------------------------------------------------------------------
const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v; else e.setAttribute(k, v);
  }
  if (text !== undefined) e.textContent = text;
  return e;
}

// Show whitespace so that a token made of spaces or a newline is still visible in a box.
const visible = (s) => s.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5") || "\u00b7";

function ms(seconds) {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
  return seconds < 1 ? `${(seconds * 1e3).toFixed(1)} ms` : `${seconds.toFixed(2)} s`;
}

function bytes(n) {  // binary units, as the seed writes KV sizes (512 KiB, 2.00 GiB)
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${Number.isInteger(n) ? n : n.toFixed(2)} ${units[i]}`;
}

const pct = (x) => `${(100 * x).toFixed(x < 0.001 && x > 0 ? 3 : 1)}%`;

// Every request gets its own colour, in order of first sight, shared by all views.
const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f",
                 "#ff9da7", "#86bcb6", "#d37295", "#8cd17d", "#499894", "#f1ce63", "#a0cbe8", "#fabfd2"];
const colours = new Map();
const labels = new Map();       // request id -> "A", "B", ... for requests sent from this page
function colourOf(id) {
  const base = id.split("/")[0];                 // samples of one request (id/1, id/2) share its colour
  if (!colours.has(base)) colours.set(base, PALETTE[colours.size % PALETTE.length]);
  return colours.get(base);
}
function labelOf(id) {
  const [base, sample] = id.split("/");
  const name = labels.get(base) || base.slice(0, 6);
  return sample ? `${name}/${sample}` : name;
}

// --- talking to the server: the API key (if the server has one) and JSON calls ---------------------------------
// The key stays in this page's memory (not in localStorage, where any script of this origin could read it later).
// CLIENT is this page's own random token: the server shows a request's text, and lets it be inspected, only to
// the page whose token made it (others' requests appear in the pool view without their text).
let apiKey = "";
const CLIENT = Array.from(crypto.getRandomValues(new Uint8Array(16)), (b) => b.toString(16).padStart(2, "0")).join("");
function headers() {
  const h = { "Content-Type": "application/json", "X-Tinyllm-Client": CLIENT };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

async function api(path, body) {
  const r = await fetch(path, body === undefined ? { headers: headers() }
                                                 : { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (r.status === 401) $("key-bar").hidden = false;
  const data = await r.json().catch(() => ({}));             // an error page may not be JSON
  if (!r.ok) throw new Error(data.error ? data.error.message : `HTTP ${r.status}`);
  return data;
}

$("key-save").addEventListener("click", () => {
  apiKey = $("api-key").value;
  $("key-bar").hidden = true;
});

// Stream a completion (OpenAI server-sent events); onChunk gets every decoded JSON chunk.
async function streamCompletion(body, chat, onChunk, signal) {
  const r = await fetch(chat ? "/v1/chat/completions" : "/v1/completions",
                        { method: "POST", headers: headers(), body: JSON.stringify({ ...body, stream: true }), signal });
  if (!r.ok) {
    if (r.status === 401) $("key-bar").hidden = false;
    const err = await r.json().catch(() => ({}));
    throw new Error(err.error ? err.error.message : `HTTP ${r.status}`);
  }
  const reader = r.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {          // one event per blank-line-terminated block
      const line = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 2);
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6);
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      onChunk(chunk, performance.now());
    }
  }
}

// The prompt as the chosen mode sends it: chat messages (the server applies the chat template) or plain text.
function promptBody(text, chat) {
  return chat ? { messages: [{ role: "user", content: text }] } : { prompt: text };
}

// One streamed chunk -> its token (text and logprobs) or null when it carries no token (the end, an eos).
function chunkToken(chunk, chat) {
  const c = chunk.choices && chunk.choices[0];
  if (!c || !c.logprobs) return null;                        // only token-bearing chunks have logprobs
  if (chat) {
    const item = c.logprobs.content[0];
    return { text: c.delta.content || "", token: item.token, logprob: item.logprob,
             top: item.top_logprobs.map((t) => [t.token, t.logprob]) };
  }
  return { text: c.text, token: c.logprobs.tokens[0], logprob: c.logprobs.token_logprobs[0],
           top: Object.entries(c.logprobs.top_logprobs[0]) };
}

// --- 1. Generate -------------------------------------------------------------------------------------------------
const gen = { requestId: null, boxes: [], times: [], start: 0, promptTokens: 0, abort: null };

function samplingBody() {
  const num = (id) => Number($(id).value);
  return { max_tokens: num("max-tokens"), temperature: num("temperature"), top_k: num("top-k"), top_p: num("top-p"),
           min_p: num("min-p"), repetition_penalty: num("rep-penalty"), seed: num("seed") };
}

// Colour of an inter-token latency relative to the run's median: green near it, red at 4x and more.
function latencyColour(gap, median) {
  const r = Math.min(Math.max(Math.log2(gap / median), 0) / 2, 1);   // 0 at <= median, 1 at >= 4x
  return `hsl(${120 - 120 * r}, 60%, ${82 - 12 * r}%)`;
}

function median(xs) {
  const s = [...xs].sort((a, b) => a - b), h = Math.floor(s.length / 2);
  return s.length ? (s.length % 2 ? s[h] : (s[h - 1] + s[h]) / 2) : 0;
}

function renderGenStats(final) {
  const t = gen.times, n = t.length;
  const gaps = t.slice(1).map((x, i) => (x - t[i]) / 1e3);
  const ttft = n ? (t[0] - gen.start) / 1e3 : null;
  const decodeTime = n > 1 ? (t[n - 1] - t[0]) / 1e3 : 0;
  $("st-ttft").textContent = ms(ttft);
  $("st-itl").textContent = gaps.length ? ms(gaps.reduce((a, b) => a + b, 0) / gaps.length) : "–";
  $("st-decode").textContent = gaps.length ? `${(gaps.length / decodeTime).toFixed(1)} tok/s` : "–";
  $("st-prefill").textContent = gen.promptTokens && ttft
    ? `${gen.promptTokens} tok in ${ms(ttft)} = ${(gen.promptTokens / ttft).toFixed(0)} tok/s` : "–";
  $("st-tokens").textContent = `${n}${final ? "" : "…"}`;
  const total = (ttft || 0) + decodeTime;
  $("split-prefill").style.width = total ? `${(100 * (ttft || 0)) / total}%` : "0";
  $("split-decode").style.width = total ? `${(100 * decodeTime) / total}%` : "0";
  // recolour every box against the current median gap
  const m = median(gaps);
  gen.boxes.forEach((box, i) => {
    if (i === 0) { box.style.background = "#cfd8e3"; return; }
    box.style.background = latencyColour(gaps[i - 1], m || 1);
  });
  $("itl-legend").innerHTML = m
    ? `<span class="sw" style="background:#cfd8e3"></span> first token (after prefill) ` +
      `<span class="sw" style="background:${latencyColour(m, m)}"></span> ≤ median gap ${ms(m)} ` +
      `<span class="sw" style="background:${latencyColour(2 * m, m)}"></span> 2× ` +
      `<span class="sw" style="background:${latencyColour(4 * m, m)}"></span> ≥ 4×`
    : "";
}

function addTokenBox(tok, at) {
  const i = gen.boxes.length;
  const box = el("button", { class: "tok", "data-index": String(i), "data-text": tok.text }, visible(tok.token));
  const gap = i ? ms((at - gen.times[i - 1]) / 1e3) : `${ms((at - gen.start) / 1e3)} (first token)`;
  const alts = tok.top.map(([t, lp]) => `${JSON.stringify(t)} ${(100 * Math.exp(lp)).toFixed(1)}%`).join(", ");
  box.title = `token ${i}: ${JSON.stringify(tok.token)}\nafter ${gap}\np = ${(100 * Math.exp(tok.logprob)).toFixed(1)}%` +
              `\nmost likely: ${alts}\nclick to look inside`;
  box.addEventListener("click", () => inspect(i));
  $("tokens").appendChild(box);
  gen.boxes.push(box);
  gen.times.push(at);
}

async function runGeneration() {
  const chat = document.querySelector("input[name=mode]:checked").value === "chat";
  Object.assign(gen, { requestId: null, boxes: [], times: [], promptTokens: 0, chat });
  $("tokens").textContent = "";
  $("gen-text").textContent = "";
  delete $("gen-text").dataset.done;                          // set again when this run ends (the tests wait on it)
  $("inside-body").hidden = true;                             // the previous run's token is no longer on the page
  $("inside-empty").textContent = "No token selected yet.";
  $("inside-empty").hidden = false;
  $("gen-error").hidden = true;
  $("go").disabled = true;
  $("stop").disabled = false;
  const controller = new AbortController();
  gen.abort = controller;
  const body = { ...promptBody($("prompt").value, chat), ...samplingBody(), stream_options: { include_usage: true },
                 ...(chat ? { logprobs: true, top_logprobs: 3 } : { logprobs: 3 }) };
  gen.start = performance.now();
  try {
    await streamCompletion(body, chat, (chunk, at) => {
      gen.requestId = chunk.id.slice(chunk.id.indexOf("-") + 1);     // "chatcmpl-<id>" -> the engine's id
      if (chunk.usage) { gen.promptTokens = chunk.usage.prompt_tokens; return; }
      const tok = chunkToken(chunk, chat);
      if (!tok) return;
      $("gen-text").textContent += tok.text;
      addTokenBox(tok, at);
      renderGenStats(false);
    }, controller.signal);
  } catch (e) {
    if (e.name !== "AbortError") { $("gen-error").textContent = e.message; $("gen-error").hidden = false; }
  } finally {
    renderGenStats(true);
    $("go").disabled = false;
    $("stop").disabled = true;
    $("gen-text").dataset.done = "true";
  }
}

$("go").addEventListener("click", runGeneration);
$("stop").addEventListener("click", () => gen.abort && gen.abort.abort());

// --- 2. Look inside a token -------------------------------------------------------------------------------------
const inside = { index: null, data: null };

async function inspect(index, layer) {
  if (!gen.requestId) return;
  inside.index = index;
  gen.boxes.forEach((b, i) => b.classList.toggle("selected", i === index));
  $("inside-error").hidden = true;
  $("inside-empty").textContent = "Replaying the request with a trace… (other requests pause meanwhile)";
  $("inside-empty").hidden = false;
  try {
    const body = { request_id: gen.requestId, token: index };
    if (layer !== undefined) body.layer = layer;
    inside.data = await api("/lab/api/inspect", body);
    $("inside-empty").hidden = true;
    renderInside();
    if (layer === undefined) $("inside").scrollIntoView({ behavior: "smooth" });
  } catch (e) {
    $("inside-empty").hidden = true;
    $("inside-error").textContent = e.message;
    $("inside-error").hidden = false;
  }
}

// A colour for an attention weight or probability p in [0, 1] (white -> deep blue; sqrt shows small values).
const heat = (p) => `rgba(37, 99, 235, ${Math.sqrt(Math.max(0, p)).toFixed(3)})`;

function fillSelect(select, n, value, extra) {
  select.textContent = "";
  if (extra) select.appendChild(el("option", { value: extra }, extra));
  for (let i = 0; i < n; i++) select.appendChild(el("option", { value: String(i) }, String(i)));
  select.value = String(value);
}

function renderInside() {
  const d = inside.data;
  $("inside-body").hidden = false;
  $("in-index").textContent = String(d.token_index);
  $("in-token").textContent = JSON.stringify(d.token.text);
  $("in-pos").textContent = String(d.position);
  const rep = $("in-replay");
  rep.textContent = d.replay.matches
    ? `replay matched the stream: all ${d.replay.streamed} tokens`
    : `replay differs from the stream from token ${d.replay.first_difference} (a near-tie in the logits)`;
  rep.className = `badge ${d.replay.matches ? "ok" : "warn"}`;
  rep.dataset.matches = String(d.replay.matches);
  const keepHead = $("in-head").value || "average";
  fillSelect($("in-layer"), d.n_layers, d.layer);
  fillSelect($("in-head"), d.n_heads, keepHead, "average");
  renderAttention();
  renderLens(d);
  renderStages(d);
}

function renderAttention() {
  const d = inside.data, head = $("in-head").value;
  const row = head === "average" ? d.attention.average : d.attention.heads[Number(head)];
  const text = $("att-row");
  text.textContent = "";
  row.forEach((p, j) => {
    const span = el("span", { class: j < d.prompt_len ? "att prompt" : "att", "data-p": String(p),
                              style: `background:${heat(p)}` }, visible(d.tokens[j]));
    span.title = `position ${j}: ${(100 * p).toFixed(2)}%`;
    text.appendChild(span);
  });
  text.dataset.head = head;
  renderSinkLine(d);
  renderAttentionMaps(d, head);
}

// --- the attention maps: scripts/attention.py's heatmaps and lines view, drawn in SVG (thumbnails on a canvas) ---
// A matrix is [S][S] over the window of positions start..position (rows: queries, keys; zeros above the diagonal).
function averageMatrix(heads) {
  return heads[0].map((r, t) => r.map((_, j) => heads.reduce((a, h) => a + h[t][j], 0) / heads.length));
}

// As attention.py's view(): the future masked; position 0 kept, masked ("hide"), or masked with every row divided by
// what the other positions get ("renormalise"; row 0 can read only position 0, so it is masked whole).
function attentionView(att, first, start) {
  const sink = start === 0 && first !== "show";            // position 0 is in the window only when start is 0
  const v = att.map((r) => {
    if (!sink || first !== "renormalise") return r.slice();
    const rest = r.slice(1).reduce((a, b) => a + b, 0);
    return r.map((p) => (rest > 0 ? p / rest : 0));
  });
  const masked = att.map((r, t) => r.map((_, j) => j > t || (sink && j === 0) || (sink && first === "renormalise" && t === 0)));
  let top = 0;
  v.forEach((r, t) => r.forEach((p, j) => { if (!masked[t][j]) top = Math.max(top, p); }));
  return { v, masked, top: first === "show" ? 1 : top || 1 };
}

// white -> the accent blue, by sqrt(p / top) so that small weights show (as heat() does), opaque for SVG
function heatRGB(x) {
  const a = Math.sqrt(Math.min(Math.max(x, 0), 1));
  return `rgb(${Math.round(255 - 218 * a)}, ${Math.round(255 - 156 * a)}, ${Math.round(255 - 20 * a)})`;
}

const SVGNS = "http://www.w3.org/2000/svg";
function svg(tag, attrs = {}, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}

const FIRST_TITLE = { show: "attention", hide: "attention, position 0 hidden",
                      renormalise: "share of what is not on position 0" };

function heatmapSVG(att, labels, start, first) {
  const { v, masked, top } = attentionView(att, first, start);
  const S = att.length, cell = Math.max(9, Math.min(18, Math.floor(560 / S)));
  const font = Math.min(11, cell - 1), maxLabel = Math.max(...labels.map((l) => l.length));
  const pad = Math.min(14 * 7, 12 + 7 * maxLabel);         // room for the labels, left and above
  const W = pad + S * cell + 110, H = pad + S * cell + 40;
  const root = svg("svg", { class: "heatmap", width: W, height: H, "data-first": first });
  const defs = svg("defs");
  const pat = svg("pattern", { id: "future", patternUnits: "userSpaceOnUse", width: 5, height: 5 });
  pat.appendChild(svg("rect", { width: 5, height: 5, fill: "#e5e7eb" }));
  pat.appendChild(svg("path", { d: "M0,5 L5,0", stroke: "#9ca3af", "stroke-width": 1 }));
  defs.appendChild(pat);
  const grad = svg("linearGradient", { id: "bar", x1: 0, y1: 1, x2: 0, y2: 0 });
  for (let i = 0; i <= 10; i++) grad.appendChild(svg("stop", { offset: i / 10, "stop-color": heatRGB(i / 10) }));
  defs.appendChild(grad);
  root.appendChild(defs);
  labels.forEach((l, t) => {
    const y = pad + t * cell + cell / 2, x = pad + t * cell + cell / 2;
    root.appendChild(svg("text", { class: "ylabel", x: pad - 4, y, "text-anchor": "end", "dominant-baseline": "middle",
                                   "font-size": font, "data-pos": start + t }, l));
    root.appendChild(svg("text", { class: "xlabel", x, y: pad - 4, transform: `rotate(-90 ${x} ${pad - 4})`,
                                   "dominant-baseline": "middle", "font-size": font, "data-pos": start + t }, l));
  });
  const cells = svg("g", { class: "cells" });
  for (let t = 0; t < S; t++) {
    for (let j = 0; j < S; j++) {
      const m = masked[t][j];
      cells.appendChild(svg("rect", { class: m ? "hm-cell masked" : "hm-cell", x: pad + j * cell, y: pad + t * cell,
                                      width: cell, height: cell, fill: m ? "url(#future)" : heatRGB(v[t][j] / top),
                                      "data-q": start + t, "data-k": start + j, "data-p": m ? "" : v[t][j].toFixed(5) }));
    }
  }
  root.appendChild(cells);
  // the colour bar, linear in the value shown, and what the hatching means
  const bx = pad + S * cell + 18, by = pad, bh = Math.max(80, Math.min(S * cell, 260));
  const bar = svg("g", { class: "colour-bar" });
  bar.appendChild(svg("rect", { x: bx, y: by, width: 12, height: bh, fill: "url(#bar)", stroke: "#cbd5e1" }));
  for (let i = 0; i <= 4; i++) {
    const y = by + bh - (i / 4) * bh;
    bar.appendChild(svg("line", { x1: bx + 12, x2: bx + 16, y1: y, y2: y, stroke: "#6b7785" }));
    bar.appendChild(svg("text", { class: "tick", x: bx + 19, y, "dominant-baseline": "middle", "font-size": 10 },
                        (top * i / 4).toFixed(2)));
  }
  bar.appendChild(svg("text", { class: "bar-label", x: bx, y: by + bh + 14, "font-size": 10 }, FIRST_TITLE[first]));
  bar.appendChild(svg("rect", { x: bx, y: by + bh + 22, width: 12, height: 12, fill: "url(#future)" }));
  bar.appendChild(svg("text", { class: "bar-label", x: bx + 16, y: by + bh + 32, "font-size": 10 }, "masked"));
  root.appendChild(bar);
  root.appendChild(svg("text", { class: "axis-title", x: pad, y: H - 8, "font-size": 11 },
                       "rows: query position · columns: key position it attends to"));
  root.addEventListener("mouseover", (e) => {
    const c = e.target.dataset;
    if (!c || c.q === undefined) return;
    const q = Number(c.q), k = Number(c.k);
    $("att-readout").textContent = `${q} ${JSON.stringify(inside.data.tokens[q])} → ${k} ` +
      `${JSON.stringify(inside.data.tokens[k])}: ${c.p === "" ? "masked" : pct(Number(c.p))}`;
  });
  return root;
}

// bertviz's head view: the tokens twice, queries left and keys right, a line from each query to each key it attends
// to, as thick and dark as the attention (over the largest value shown). Hover a query to see its lines alone.
function linesSVG(att, labels, start, first) {
  const { v, masked, top } = attentionView(att, first, start);
  const S = att.length, rowH = 16, maxLabel = Math.max(...labels.map((l) => l.length));
  const textW = Math.min(160, 10 + 7 * maxLabel), x1 = textW + 8, x2 = textW + 228;
  const root = svg("svg", { class: "lines", width: x2 + textW + 16, height: S * rowH + 34, "data-first": first });
  root.appendChild(svg("text", { class: "axis-title", x: x1, y: 12, "text-anchor": "end", "font-size": 11 }, "query"));
  root.appendChild(svg("text", { class: "axis-title", x: x2, y: 12, "font-size": 11 }, "key"));
  const y = (t) => 26 + t * rowH + rowH / 2;
  const lines = svg("g");
  for (let t = 0; t < S; t++) {
    for (let j = 0; j <= t; j++) {
      const w = masked[t][j] ? 0 : v[t][j] / top;
      if (w <= 0.02) continue;                                   // attention.py's threshold: ~0 draws nothing
      lines.appendChild(svg("line", { class: "att-line", x1, y1: y(t), x2, y2: y(j), stroke: "#2563eb",
                                      "stroke-opacity": w.toFixed(3), "stroke-width": (0.4 + 3 * w).toFixed(2),
                                      "data-q": start + t, "data-k": start + j, "data-p": v[t][j].toFixed(5) }));
    }
  }
  root.appendChild(lines);
  labels.forEach((l, t) => {
    const q = svg("text", { class: "qlabel", x: x1 - 6, y: y(t), "text-anchor": "end", "dominant-baseline": "middle",
                            "font-size": 11, "data-pos": start + t }, l);
    q.addEventListener("mouseenter", () => {
      root.classList.add("focus");
      root.querySelectorAll(".att-line").forEach((e) => e.classList.toggle("on", Number(e.dataset.q) === start + t));
      root.querySelectorAll(".klabel").forEach((e) => {
        e.classList.toggle("on", [...root.querySelectorAll(".att-line.on")].some((l2) => l2.dataset.k === e.dataset.pos));
      });
    });
    q.addEventListener("mouseleave", () => root.classList.remove("focus"));
    root.appendChild(q);
    root.appendChild(svg("text", { class: "klabel", x: x2 + 6, y: y(t), "dominant-baseline": "middle",
                                   "font-size": 11, "data-pos": start + t }, l));
  });
  return root;
}

function thumbnail(att, first, start) {
  const { v, masked, top } = attentionView(att, first, start);
  const S = att.length, canvas = el("canvas", { width: String(S), height: String(S) });
  const ctx = canvas.getContext("2d");
  for (let t = 0; t < S; t++) {
    for (let j = 0; j < S; j++) {
      ctx.fillStyle = masked[t][j] ? "#e5e7eb" : heatRGB(v[t][j] / top);
      ctx.fillRect(j, t, 1, 1);
    }
  }
  return canvas;
}

function renderAttentionMaps(d, head) {
  const m = d.attention.matrix, first = $("att-first").value, mode = $("att-view").value;
  const labels = d.tokens.slice(m.start).map(visible);
  const maps = m.heads.map((a, h) => [String(h), `head ${h} · KV ${Math.floor(h / (d.n_heads / d.n_kv_heads))}`, a]);
  maps.push(["average", "average", averageMatrix(m.heads)]);
  const thumbs = $("att-thumbs");
  thumbs.textContent = "";
  for (const [key, name, a] of maps) {
    const t = el("button", { class: key === head ? "thumb current" : "thumb", "data-head": key, title: `${name}: click` });
    t.appendChild(thumbnail(a, first, m.start));
    t.appendChild(el("span", {}, name));
    t.addEventListener("click", () => { $("in-head").value = key; renderAttention(); });
    thumbs.appendChild(t);
  }
  const [, name, chosen] = maps.find(([key]) => key === head);
  const big = $("att-big");
  big.textContent = "";
  big.appendChild(el("div", { class: "hint" }, `layer ${d.layer}, ${name}` + (m.start
    ? ` · positions ${m.start}..${d.position} only (the maps keep the last ${chosen.length}; position 0 is not among them)`
    : "")));
  big.appendChild((mode === "lines" ? linesSVG : heatmapSVG)(chosen, labels, m.start, first));
  big.dataset.head = head;
  big.dataset.view = mode;
}

// One line on the attention sink, in this model's own numbers at this layer and position.
function renderSinkLine(d) {
  const line = $("sink-line"), heads = d.attention.heads, q = d.position;
  if (q < 1) { line.textContent = ""; return; }
  const onFirst = heads.map((r) => r[0]);                      // each head's weight on position 0
  const mean = onFirst.reduce((a, b) => a + b, 0) / onFirst.length;
  const most = onFirst.filter((p) => p > 0.5).length;
  const norms = d.residual_norms, others = median(norms.slice(1));
  line.dataset.toFirst = mean.toFixed(4);
  line.dataset.normRatio = (norms[0] / others).toFixed(2);
  line.textContent = `The attention sink: position ${q} puts ${pct(mean)} of its attention on position 0 ` +
    `${JSON.stringify(d.tokens[0])} (the mean of the ${heads.length} heads of layer ${d.layer}; ${most} of them put ` +
    `more than half there), and leaving this layer the residual stream at position 0 has norm ` +
    `${norms[0].toFixed(0)}, ${(norms[0] / others).toFixed(1)}× the other positions' median (${others.toFixed(0)}). ` +
    `Softmax must put each row's weight somewhere; a head with nothing to read parks it on position 0, whose value ` +
    `is small: a near no-op. Hide position 0, or leave it out, to see what the heads do read.`;
}

$("att-first").addEventListener("change", () => inside.data && renderAttention());
$("att-view").addEventListener("change", () => inside.data && renderAttention());

// Punctuation, symbols or white space only: what the logit lens shows in the early layers.
const PUNCTUATION = /^[\s\p{P}\p{S}]*$/u;

// One line on why the lens shows punctuation, in this model's own numbers at this position.
function renderLensLine(d) {
  const tops = d.lens.map((row) => row.top[0]), L = tops.length;
  const punct = tops.filter((t) => PUNCTUATION.test(t.text));
  const seen = [...new Set(punct.map((t) => `'${visible(t.text)}'`))].slice(0, 4).join(" ");
  const hit = tops.findIndex((t) => t.id === d.token.id);
  let stays = L;
  while (stays > 0 && tops[stays - 1].id === d.token.id) stays--;
  const line = $("lens-line");
  line.dataset.punctuation = String(punct.length);
  line.dataset.firstHit = String(hit);
  const token = JSON.stringify(d.token.text);
  line.textContent = `In ${punct.length} of ${L} layers the lens's top guess is punctuation or a space` +
    `${seen ? ` (${seen})` : ""}: the final norm and head were trained on the last layer's output, so an earlier ` +
    `residual stream reads as its average direction, and the commonest next token of text is '.', ',' or a space ('\u2423'). ` +
    (hit < 0 ? `${token} is never the top guess: sampling picked it from further down.`
      : `${token} is first on top at layer ${hit} (${pct(tops[hit].prob)})` +
        (stays < L && stays !== hit ? ` and stays there from layer ${stays}.` : "."));
}

function renderLens(d) {
  renderLensLine(d);
  const table = $("lens");
  table.textContent = "";
  const head = el("tr");
  ["layer", "1st", "2nd", "3rd"].forEach((h) => head.appendChild(el("th", {}, h)));
  table.appendChild(head);
  for (const row of d.lens) {
    const tr = el("tr");
    tr.appendChild(el("td", { class: "num" }, String(row.layer)));
    for (const t of row.top) {
      const td = el("td", { class: t.id === d.token.id ? "lens-cell hit" : "lens-cell",
                            style: `background:${heat(t.prob)}` });
      td.textContent = `${visible(t.text)} ${(100 * t.prob).toFixed(1)}%`;
      tr.appendChild(td);
    }
    table.appendChild(tr);
  }
}

function renderStages(d) {
  const box = $("stages");
  box.textContent = "";
  for (const st of d.sampling.stages) {
    const div = el("div", { class: "stage" });
    div.appendChild(el("div", { class: "stage-name" }, st.stage));
    for (const t of st.top.slice(0, 6)) {
      if (t.prob <= 0) continue;
      const line = el("div", { class: t.id === d.sampling.token ? "cand chosen-cand" : "cand" });
      line.appendChild(el("span", { class: "cand-text" }, visible(t.text)));
      const bar = el("span", { class: "bar" });
      bar.appendChild(el("span", { class: "bar-fill", style: `width:${(100 * t.prob).toFixed(1)}%` }));
      line.appendChild(bar);
      line.appendChild(el("span", { class: "num" }, `${(100 * t.prob).toFixed(1)}%`));
      div.appendChild(line);
    }
    box.appendChild(div);
  }
  box.appendChild(el("p", { class: "hint" },
    `Drawn: ${JSON.stringify(d.token.text)} with probability ${(100 * d.sampling.prob).toFixed(1)}% in the last stage.`));
}

$("in-head").addEventListener("change", renderAttention);
$("in-layer").addEventListener("change", () => inspect(inside.index, Number($("in-layer").value)));

// --- 3. The engine ------------------------------------------------------------------------------------------------
const QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "Why is the sky blue?",
                   "Write a haiku about the sea.", "What is 12 times 7?", "Give me a tip for learning to code.",
                   "What do bees make?", "Describe a cat in one sentence."];
let nextLabel = 0;

function sendMany(count, maxTokens, n) {
  for (let i = 0; i < count; i++) {
    const label = String.fromCharCode(65 + (nextLabel++ % 26));
    const body = { messages: [{ role: "user", content: QUESTIONS[i % QUESTIONS.length] }], max_tokens: maxTokens,
                   temperature: n > 1 ? 0.8 : 0, seed: 0, n };
    streamCompletion(body, true, (chunk) => {
      const id = chunk.id.slice(chunk.id.indexOf("-") + 1);
      if (!labels.has(id)) labels.set(id, label);
    }).catch((e) => console.warn(`request ${label}: ${e.message}`));
  }
}

$("eng-send").addEventListener("click", () => sendMany(Number($("eng-n").value), Number($("eng-max").value), 1));
$("eng-samples").addEventListener("click", () => sendMany(1, Number($("eng-max").value), 3));

function renderPool(snap) {
  const pool = $("pool"), p = snap.pool;
  if (pool.children.length !== snap.blocks.length) {        // build the grid once, then only recolour it
    pool.textContent = "";
    snap.blocks.forEach(() => pool.appendChild(el("span", { class: "block" })));
  }
  let shared = 0, cached = 0;
  snap.blocks.forEach((b, i) => {
    const cell = pool.children[i];
    cell.dataset.state = b.state;
    cell.dataset.owners = b.owners.join(",");
    cell.className = `block ${b.state}`;
    if (b.state === "used") cell.style.background = colourOf(b.owners[0]);
    else if (b.state === "shared") {                        // stripes: one colour per owner
      const cs = [...new Set(b.owners.map(colourOf))];
      cell.style.background = cs.length > 1
        ? `repeating-linear-gradient(45deg, ${cs.map((c, k) => `${c} ${k * 4}px ${(k + 1) * 4}px`).join(", ")})`
        : cs[0];
      shared++;
    } else cell.style.background = "";
    if (b.state === "cached") cached++;
    cell.title = `block ${i}: ${b.state}${b.owners.length ? ` — ${b.owners.map(labelOf).join(", ")}` : ""}` +
                 `${b.prefix ? " (in the prefix cache)" : ""}`;
  });
  $("pool-summary").textContent = `${p.num_used} of ${p.num_blocks} blocks in use (${pct(p.num_used / p.num_blocks)}), ` +
    `${shared} shared, ${cached} cached · one block = ${p.block_size} positions = ${bytes(p.bytes_per_block)}`;
}

function requestCard(r) {
  const card = el("div", { class: "card", "data-id": r.id });
  card.style.borderLeftColor = colourOf(r.id);
  const total = r.prompt_tokens + r.output_tokens;
  card.appendChild(el("div", { class: "card-head" },
    `${labelOf(r.id)}${r.slot !== null ? ` · slot ${r.slot}` : ""} · ${r.blocks.length} blocks` +
    `${r.cached_tokens ? ` · ${r.cached_tokens} prompt tokens from the prefix cache` : ""}` +
    `${r.preemptions ? ` · preempted ${r.preemptions}×` : ""}`));
  const bar = el("div", { class: "progress" });
  bar.appendChild(el("span", { class: "progress-prompt",
                               style: `width:${(100 * Math.min(r.computed, r.prompt_tokens)) / (r.prompt_tokens + r.max_tokens)}%` }));
  bar.appendChild(el("span", { class: "progress-output",
                               style: `width:${(100 * r.output_tokens) / (r.prompt_tokens + r.max_tokens)}%` }));
  card.appendChild(bar);
  card.appendChild(el("div", { class: "card-text" },
    `prompt ${r.prompt_tokens} · output ${r.output_tokens}/${r.max_tokens} · KV of ${Math.min(r.computed, total)} ` +
    `positions` +
    `${r.text ? ` · “…${r.text.slice(-40)}”` : ""}`));
  return card;
}

function renderQueues(snap) {
  for (const name of ["running", "waiting"]) {
    const box = $(name);
    box.textContent = "";
    snap[name].forEach((r) => box.appendChild(requestCard(r)));
    if (!snap[name].length) box.appendChild(el("div", { class: "hint" }, "none"));
    $(`${name}-count`).textContent = `(${snap[name].length}${name === "running" ? ` of ${snap.scheduler.max_num_seqs} slots` : ""})`;
  }
}

function renderTimeline(snap) {
  const box = $("timeline");
  const atEnd = box.scrollLeft + box.clientWidth >= box.scrollWidth - 2;   // follow the newest step unless scrolled back
  box.textContent = "";
  const used = snap.timeline.flatMap((s) => Object.keys(s.slots).map(Number));
  const slots = Math.max(4, ...used.map((s) => s + 1));
  for (let slot = 0; slot < slots; slot++) {
    const row = el("div", { class: "tl-row" });
    row.appendChild(el("span", { class: "tl-name" }, `slot ${slot}`));
    for (const step of snap.timeline) {
      const c = step.slots[slot];
      const cell = el("span", { class: c ? (c.token ? "tl-cell tok" : "tl-cell pre") : "tl-cell" });
      if (c) {
        cell.style.background = colourOf(c.id);
        cell.title = `${labelOf(c.id)}: ${c.token ? "a token" : "prompt (prefill) only"} · step of ${step.tokens} ` +
                     `tokens, ${ms(step.duration)}, ${ms(step.ago)} ago`;
      }
      row.appendChild(cell);
    }
    box.appendChild(row);
  }
  if (!snap.timeline.length) box.appendChild(el("div", { class: "hint" }, "no steps yet"));
  if (atEnd) box.scrollLeft = box.scrollWidth;
}

let lastSnapshot = null;          // the engine as last polled (the arithmetic view reads its step times)
async function pollEngine() {
  try {
    const snap = await api("/lab/api/engine");
    lastSnapshot = snap;
    renderPool(snap);
    renderQueues(snap);
    renderTimeline(snap);
    renderMeasured();
    $("status").textContent = snap.running.length ? `running ${snap.running.length}` : "idle";
    $("status").className = "badge ok";
  } catch (e) {
    $("status").textContent = e.message.includes("warming up") ? "warming up…" : "engine unavailable";
    $("status").className = "badge warn";
  }
  setTimeout(pollEngine, document.hidden ? 2000 : 300);
}

// The Prometheus text format: one "name{labels} value" per line; keep the lab's few figures.
const METRICS = [
  ["tinyllm:num_requests_running", "requests running"], ["tinyllm:num_requests_waiting", "requests waiting"],
  ["tinyllm:kv_cache_usage_perc", "KV cache usage (fraction of blocks)"],
  ["tinyllm:prompt_tokens_total", "prompt tokens"], ["tinyllm:generation_tokens_total", "generated tokens"],
  ["tinyllm:prefix_cache_hits_total", "prefix cache hits (tokens)"],
  ["tinyllm:prefix_cache_queries_total", "prefix cache lookups (tokens)"],
  ["tinyllm:num_preemptions_total", "preemptions"],
  ["tinyllm:time_to_first_token_seconds", "mean time to first token"],
  ["tinyllm:inter_token_latency_seconds", "mean inter-token latency"],
];

function parsePrometheus(text) {
  const values = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([^{\s]+)(\{[^}]*\})?\s+(\S+)/);
    if (m) values[m[1]] = (values[m[1]] || 0) + Number(m[3]);   // summed over label sets
  }
  return values;
}

async function pollMetrics() {
  try {
    const r = await fetch("/metrics", { headers: headers() });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const v = parsePrometheus(await r.text());
    const table = $("metrics");
    table.textContent = "";
    for (const [name, what] of METRICS) {
      let value = v[name];
      if (v[`${name}_count`] !== undefined) {                // a histogram: show its mean
        const n = v[`${name}_count`];
        value = n ? ms(v[`${name}_sum`] / n) : "–";
      } else if (value === undefined) value = "–";
      else if (name.endsWith("_perc")) value = pct(value);
      const tr = el("tr");
      tr.appendChild(el("td", {}, what));
      tr.appendChild(el("td", { class: "num" }, String(value)));
      tr.appendChild(el("td", { class: "muted" }, name));
      table.appendChild(tr);
    }
  } catch (e) { /* the engine view shows the server's state */ }
  setTimeout(pollMetrics, document.hidden ? 5000 : 500);
}

// --- 4. The arithmetic ------------------------------------------------------------------------------------------------
let presets = null, lastCalc = null;
const form = $("calc");

// "this server": the served model's shape on this machine's hardware as calibrated (roofs.py, cached), when it is.
function applyPreset(key) {
  const shape = presets.models[key];
  const machine = key === "served" ? presets.machine.hardware : null;
  for (const [k, v] of Object.entries({ ...shape, ...(machine || presets.hardware), ...presets.defaults })) {
    if (form.elements[k]) form.elements[k].value = String(v);
  }
  form.dataset.preset = key;
  form.dataset.hardware = machine ? "calibrated" : "seed";
  renderMachine(key);
}

function renderMachine(key) {
  const box = $("calc-machine"), m = presets.machine, c = m.calibration, hw = m.hardware;
  box.hidden = key !== "served";
  $("calc-measure").textContent = hw ? "measure again" : "measure this machine (seconds; the engine pauses)";
  $("calc-machine-text").textContent = hw
    ? `Hardware: this machine as ${c.source} measured it (${c.measured}, ${c.threads} thread${c.threads > 1 ? "s" : ""}): ` +
      `read bandwidth ${hw.bandwidth_gbs.toFixed(1)} GB/s, float32 sgemm ${(hw.peak_tflops * 1e3).toFixed(0)} GFLOP/s, ` +
      `${hw.memory_gib.toFixed(1)} GiB of RAM (cached in ${m.file}).`
    : `${m.error || "This machine has not been measured yet"}: the hardware fields hold the seed's hypothetical ` +
      `accelerator, far faster than this server. Measure it here, or run python scripts/capacity.py --calibrate.`;
}

async function measureMachine() {
  const button = $("calc-measure");
  button.disabled = true;
  $("calc-machine-text").textContent = "Measuring the read bandwidth and the sgemm peak… (the engine pauses)";
  try {
    presets.machine = await api("/lab/api/calibrate", {});
    applyPreset("served");
    await recalc();
  } catch (e) {
    $("calc-machine-text").textContent = `The measurement failed: ${e.message}`;
  } finally {
    button.disabled = false;
  }
}

// The step time this server measured: the median of the timeline's decode steps (every slot one token) at `batch`.
function measuredStep(batch) {
  const steps = (lastSnapshot ? lastSnapshot.timeline : []).filter((s) => {
    const cells = Object.values(s.slots);
    return cells.length === batch && s.tokens === batch && cells.every((c) => c.token);
  });
  return steps.length ? { seconds: median(steps.map((s) => s.duration)), count: steps.length } : null;
}

function renderMeasured() {
  const row = document.querySelector("tr[data-row='decode step measured here']");
  if (!row || !lastCalc) return;
  const batch = Number(form.elements.batch.value), m = measuredStep(batch);
  row.children[1].textContent = m ? ms(m.seconds) : "–";
  row.children[2].textContent = m
    ? `median of the last ${m.count} decode steps at batch ${batch} in the slot timeline: ` +
      `${(m.seconds / lastCalc.decode_step_s).toFixed(1)}× the prediction above (Python, sampling, small kernels)`
    : `no decode step at batch ${batch} among the timeline's last steps: generate something (batch 1) or send ` +
      `requests at once`;
  row.dataset.measured = m ? String(m.seconds) : "";
}

function calcValues() {
  const body = {};
  for (const input of form.querySelectorAll("input, select[name]")) body[input.name] = Number(input.value);
  return body;
}

const CALC_ROWS = [
  ["KV cache per token", (r) => bytes(r.kv_bytes_per_token), "2 (K and V) × layers × KV heads × head dim × bytes"],
  ["KV cache per sequence", (r) => bytes(r.kv_bytes_per_sequence), "per token × context"],
  ["sequences that fit", (r) => String(r.max_sequences), "(memory × usable − weights) ÷ KV per sequence"],
  ["bytes read per decode step", (r) => bytes(r.decode_step_bytes),
   "every weight once + batch × context × KV per token"],
  ["of which weights", (r) => pct(r.weights_share_of_step_bytes), "the share the whole batch shares"],
  ["decode step (ITL)", (r) => ms(r.decode_step_s), "max(bytes ÷ bandwidth, FLOPs ÷ peak): the roofline"],
  ["bound by", (r) => r.bound, "decode FLOPs per byte vs the ridge point"],
  ["FLOPs per byte: decode / ridge", (r) => `${r.decode_flops_per_byte.toFixed(2)} / ${r.ridge_flops_per_byte.toFixed(0)}`,
   "under the ridge: memory-bound"],
  ["tokens/s per user", (r) => r.tokens_per_s_per_sequence.toFixed(0), "1 ÷ ITL"],
  ["tokens/s, whole batch", (r) => r.tokens_per_s_total.toFixed(0), "batch ÷ ITL"],
  ["time to first token", (r) => ms(r.ttft_s), "the prompt's prefill on the roofline (no queueing)"],
  ["whole request", (r) => ms(r.total_s), "TTFT + (output tokens − 1) × ITL"],
];

// A value the form itself knows is wrong (empty, under its minimum) is reported here, without a server round trip.
function formProblem() {
  const bad = [...form.elements].find((e) => e.name && !e.checkValidity());
  if (!bad) return null;
  const what = bad.closest("label").firstChild.textContent.trim();
  return `${what}: ${bad.validationMessage}`;
}

let calcTimer = null;
async function recalc() {
  const problem = formProblem();
  if (problem) {
    $("calc-error").textContent = problem;
    $("calc-error").hidden = false;
    return;
  }
  try {
    const r = await api("/lab/api/capacity", calcValues());
    $("calc-error").hidden = true;
    const verdict = $("calc-verdict");
    verdict.textContent = r.fit.verdict;
    verdict.className = `verdict ${r.fit.fits ? "fits" : "no-fit"}`;
    verdict.dataset.fits = String(r.fit.fits);
    r.warnings.forEach((w) => verdict.appendChild(el("span", { class: "warning" }, w)));
    verdict.hidden = false;
    const table = $("calc-out");
    table.textContent = "";
    const rows = form.dataset.preset === "served"
      ? [...CALC_ROWS.slice(0, 6), ["decode step measured here", () => "–", ""], ...CALC_ROWS.slice(6)] : CALC_ROWS;
    for (const [name, fmt, how] of rows) {
      const tr = el("tr", { "data-row": name });
      tr.appendChild(el("td", {}, name));
      tr.appendChild(el("td", { class: "num big" }, fmt(r)));
      tr.appendChild(el("td", { class: "muted" }, how));
      table.appendChild(tr);
    }
    lastCalc = r;
    renderMeasured();
  } catch (e) {
    $("calc-error").textContent = e.message;
    $("calc-error").hidden = false;
  }
}

form.addEventListener("input", () => { clearTimeout(calcTimer); calcTimer = setTimeout(recalc, 120); });
$("calc-preset").addEventListener("change", () => { applyPreset($("calc-preset").value); recalc(); });
$("calc-measure").addEventListener("click", measureMachine);

async function initCalculator() {
  presets = await api("/lab/api/presets");
  for (const [key, shape] of Object.entries(presets.models)) {
    $("calc-preset").appendChild(el("option", { value: key }, key === "served" ? `this server: ${shape.name}` : shape.name));
  }
  applyPreset("7b");
  await recalc();
}

// --- start ------------------------------------------------------------------------------------------------------
async function init() {
  document.querySelectorAll(".origin").forEach((e) => { e.textContent = location.origin; });
  try {
    const models = await api("/v1/models");
    $("model-name").textContent = models.data[0].id;
  } catch (e) { /* shown by the status badge */ }
  pollEngine();
  pollMetrics();
  await initCalculator();
  document.body.dataset.ready = "true";
}

init();
