// zerodp ui: controls → /api/<endpoint> → planner JSON → readouts and plotly charts.
// No cost model lives here: every figure is a field of the planner's answer. The only arithmetic
// is the slider scale (position p ↔ value 10^p or 2^p) and placing bars on a time axis.
"use strict";

const DEBOUNCE_MS = 150;
const COLORS = {
  params: "#4C72B0", grads: "#DD8452", optimizer: "#55A868", gradAcc: "#C44E52",
  gathered: "#8172B3", activations: "#937860", compute: ["#4C72B0", "#6F8FC7"],
  comm: ["#DD8452", "#E8A97E"], exposed: "rgba(196, 78, 82, 0.18)", mark: "#C44E52",
  stages: ["#4C72B0", "#DD8452", "#55A868", "#8172B3"],
};
const PHASE_COLORS = { forward: COLORS.optimizer, backward: COLORS.params };
const PLOT_CONFIG = { displayModeBar: false, responsive: true };
// the shipped CJK glyphs first (style.css: their unicode-range only), then the system's font
const CHART_FONT = '"zerodp CJK", system-ui, sans-serif';
const tr = (key, vars) => window.t(key, vars);  // where a local "t" (a timeline) hides i18n's t

let schema = null;   // /api/schema: parameters and defaults of every endpoint
let presets = null;  // /api/presets: hardware and model presets

// ---------------------------------------------------------------- helpers

function path(obj, dotted) {
  return dotted.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
}

// The page asks the server for refusals as answers (200 with {"status": 422, "error": ...}):
// a refused value is shown next to its field, not logged by the browser as a failed request.
function getJSON(url, signal) {
  return fetch(url, { signal, headers: { "X-Zerodp-Page": "1" } }).then(async (r) => {
    const body = await r.json();
    if (!r.ok || body.status === 422) {
      const e = new Error((pageLang() === "zh" && body.error_zh) || body.error || r.statusText);
      e.body = body;
      throw e;
    }
    return body;
  });
}

// Slider labels while dragging (the server's label replaces it when the answer comes).
function si(value, unit) {
  if (value === 0) return "0 " + unit;
  const prefixes = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"], [1, ""], [1e-3, "m"], [1e-6, "µ"], [1e-9, "n"]];
  for (const [scale, p] of prefixes) {
    if (Math.abs(value) >= scale) return `${+(value / scale).toPrecision(3)} ${p}${unit}`.trim();
  }
  return `${value.toPrecision(3)} ${unit}`;
}

const SCALES = {
  log10: { toValue: (p) => 10 ** p, toPosition: (v) => Math.log10(v) },
  log2: { toValue: (p) => 2 ** p, toPosition: (v) => Math.log2(v) },
};

// A legend entry broken into lines of at most ``px`` pixels (12 px font: a CJK character is one em,
// others about 0.6 em), at spaces or between CJK characters: plotly does not wrap legend text.
function wrapText(text, px) {
  const width = (w) => [...w].reduce((sum, c) => sum + (c > "\u2e80" ? 12 : 7), 0);
  const pieces = text.match(/[\u2e80-\uffff]|[^\s\u2e80-\uffff]+\s*|\s+/g) || [];
  const lines = [""];
  for (const piece of pieces) {
    const line = lines[lines.length - 1];
    if (line && width(line + piece.trimEnd()) > px) lines.push(piece.trimStart());
    else lines[lines.length - 1] = line + piece;
  }
  return lines.map((l) => l.trimEnd()).join("<br>");
}

function baseLayout(extra) {
  // the legend sits under the x axis, in a bottom margin kept for it
  const legend = extra.showlegend !== false;
  return Object.assign({
    margin: { l: 56, r: 12, t: 28, b: legend ? 84 : 48 },
    font: { family: CHART_FONT, size: 12 },
    paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "#fff",
    legend: { orientation: "h", x: 0, xref: "container", y: 0, yref: "container", yanchor: "bottom",
              traceorder: "normal" },
    hovermode: "closest",
  }, extra);
}

// A dashed horizontal line with a label; on a log axis plotly places annotations in log10 units.
// ``side``: "left" puts the label under the line at the left edge, "outside" right of the plot
// (keep a right margin for it); neither sits on a bar or a marker label.
function hline(y, text, { color = "#333", log = false, side = "left" } = {}) {
  const outside = side === "outside";
  return {
    shape: { type: "line", xref: "paper", x0: 0, x1: 1, y0: y, y1: y,
             line: { color, dash: "dash", width: 1 } },
    annotation: { xref: "paper", x: outside ? 1.01 : 0.01, y: log ? Math.log10(y) : y,
                  yanchor: outside ? "middle" : "top", xanchor: "left", align: "left",
                  text, showarrow: false, font: { size: 11, color } },
  };
}

function draw(id, traces, layout) {
  const el = document.getElementById(id);
  if (window.Plotly) Plotly.react(el, traces, layout, PLOT_CONFIG);
}

// ---------------------------------------------------------------- panels

class Panel {
  // One <section>: a form whose control names are the endpoint's parameters, readouts whose
  // data-field / data-value-field name fields of the answer, and a render() for the charts.
  constructor(section, render) {
    this.section = section;
    this.form = section.querySelector("form");
    this.endpoint = this.form.dataset.endpoint;
    this.render = render;
    this.error = section.querySelector(".error");
    this.timer = null;
    this.inflight = null;
    this.seq = 0;
  }

  control(name) { return this.form.elements.namedItem(name); }

  init() {
    for (const p of schema[this.endpoint].params) {
      const el = this.control(p.name);
      if (!el) continue;
      if (el.tagName === "SELECT") {
        el.replaceChildren(...p.choices.map((c) => new Option(c, c)));
      }
      this.set(p.name, p.default);
      el.addEventListener("input", () => { this.onInput(el); this.schedule(); });
      el.addEventListener("change", () => this.schedule());
    }
  }

  // Put a value into a control; a slider keeps the exact value until it is moved.
  set(name, value) {
    const el = this.control(name);
    if (el.type === "checkbox") el.checked = Boolean(value);
    else if (el.type === "range") {
      el.value = SCALES[el.dataset.scale].toPosition(value);
      el.dataset.value = value;
      this.showSlider(el, value);
    } else el.value = value == null ? "" : value;
  }

  onInput(el) {
    if (el.type === "range") {
      const value = SCALES[el.dataset.scale].toValue(Number(el.value));
      el.dataset.value = value;
      this.showSlider(el, value);
    }
    el.removeAttribute("aria-invalid");
  }

  showSlider(el, value) {
    const out = this.form.querySelector(`output[for="${el.id}"]`);
    const unit = el.dataset.unit;
    const text = unit === "" ? Math.round(value).toLocaleString("en") : si(value, unit);
    if (out) out.textContent = text;
    el.setAttribute("aria-valuetext", text);
  }

  query() {
    const q = new URLSearchParams();
    for (const el of this.form.elements) {
      if (!el.name || el.disabled) continue;
      if (el.type === "checkbox") q.set(el.name, el.checked);
      else if (el.type === "range") q.set(el.name, el.dataset.value);
      else q.set(el.name, el.value.trim());
    }
    return q;
  }

  schedule() {
    this.section.setAttribute("aria-busy", "true");
    clearTimeout(this.timer);
    this.timer = setTimeout(() => { this.timer = null; this.fetch(); }, DEBOUNCE_MS);
  }

  async fetch() {
    if (this.inflight) this.inflight.abort();
    this.inflight = new AbortController();
    const seq = ++this.seq;
    try {
      const data = await getJSON(`/api/${this.endpoint}?${this.query()}`, this.inflight.signal);
      if (seq !== this.seq) return;
      this.fill(data);
      this.render(data, this);
      this.showError(null);
    } catch (e) {
      if (e.name === "AbortError" || seq !== this.seq) return;
      this.showError(e);
    }
    // idle only when this is the newest answer and no change is waiting for its debounce
    if (seq === this.seq && this.timer === null) this.section.setAttribute("aria-busy", "false");
  }

  fill(data) {
    for (const out of this.section.querySelectorAll("[data-field]")) {
      let text = path(data, out.dataset.field);
      if (typeof text === "string" && I18N.en["value." + text]) text = t("value." + text);
      out.textContent = text == null ? "—" : typeof text === "number" ? text.toLocaleString("en") : text;
      if (out.dataset.valueField) out.dataset.value = path(data, out.dataset.valueField);
    }
  }

  // The server's sentence next to the field it names (the panel's foot when it names none).
  showError(e) {
    this.lastError = e;
    // the sentence in the page's language, again after a switch (the server sends both)
    const message = e && (e.body ? (pageLang() === "zh" && e.body.error_zh) || e.body.error || e.message
                                 : e.message);
    for (const el of this.form.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
    for (const el of this.form.querySelectorAll(".field-error")) el.remove();
    this.section.classList.toggle("failed", Boolean(e));
    const field = e && e.body && e.body.field;
    const el = field && this.control(field);
    if (el && el.type !== "hidden") {
      el.setAttribute("aria-invalid", "true");
      const note = Object.assign(document.createElement("small"),
                                 { className: "field-error", role: "alert", textContent: message });
      note.id = `${this.endpoint}-${field}-error`;
      el.setAttribute("aria-describedby", note.id);
      const holder = el.closest("label, .slider") || el;
      holder.after(note);
      this.error.textContent = "";
    } else {
      this.error.textContent = e ? message : "";
    }
  }
}

// ---------------------------------------------------------------- 1. memory

function renderMemory(d, panel) {
  const zh = pageLang() === "zh";
  const names = d.stages.map((s) => s.stage_name);
  // per stage: the total (what "fits" compares with the HBM), red when it does not fit, and the
  // model states alone (the guide's column) under it
  const items = d.stages.map((s) => {
    const div = document.createElement("div");
    const dt = Object.assign(document.createElement("dt"), { textContent: s.stage_name });
    const dd = Object.assign(document.createElement("dd"), { textContent: s.total_label });
    dd.dataset.stage = s.stage_name;
    dd.dataset.value = s.total_bytes;
    dd.dataset.fits = s.fits;
    dd.classList.toggle("over", !s.fits);
    const fit = Object.assign(document.createElement("span"), {
      className: "fit", textContent: s.fits ? t("memory.fits") : t("memory.nofit") });
    const states = Object.assign(document.createElement("small"), {
      className: "states", textContent: `${t("memory.states")} ${s.label}` });
    states.dataset.stage = s.stage_name;
    div.append(dt, dd, fit, states);
    const c = d.comm && d.comm.find((x) => x.stage_name === s.stage_name);
    if (c) {  // the step's communication by leg (guide §14), the CLI's labels
      const comm = Object.assign(document.createElement("small"), {
        className: "comm", textContent: t("memory.comm", {
          intra: c.labels.intra_bytes, inter: c.labels.inter_bytes, time: c.labels.time }) });
      Object.assign(comm.dataset, { stage: s.stage_name, intra: c.intra_bytes, inter: c.inter_bytes,
                                    time: c.time_s });
      div.append(comm);
    }
    return div;
  });
  document.getElementById("memory-readouts").replaceChildren(...items);
  const m = d.model;
  const line = document.getElementById("memory-model");
  line.dataset.params = m.params;
  line.textContent = t("memory.line", {
    name: m.name, params: d.labels.params,
    active: m.active_params ? t("memory.active", { n: d.labels.active }) : "",
    layers: m.layers ? t("memory.layers.n", { n: m.layers }) : "" });
  document.getElementById("memory-includes").textContent =
    t("memory.includes") + (zh ? d.includes_zh.join(" + ") : d.includes.join(" + "));
  const warnings = zh ? d.warnings_zh : d.warnings;
  document.getElementById("memory-warnings").replaceChildren(
    ...warnings.map((w) => Object.assign(document.createElement("li"), { textContent: w })));
  const bar = (key, name, color) => ({
    type: "bar", name, x: names, y: d.stages.map((s) => s[key]), marker: { color },
    hovertemplate: "%{x}: %{y:.3s}B<extra>" + name + "</extra>",
  });
  const traces = [
    bar("param_bytes", `${t("bar.params")} (${d.precision})`, COLORS.params),
    bar("grad_bytes", t("bar.grads"), COLORS.grads),
    bar("optimizer_bytes", t("bar.optimizer"), COLORS.optimizer),
  ];
  if (d.stages.some((s) => s.grad_acc_bytes > 0)) traces.push(bar("grad_acc_bytes", t("bar.acc"), COLORS.gradAcc));
  if (d.stages.some((s) => s.gathered_unit_bytes > 0)) traces.push(bar("gathered_unit_bytes", t("bar.gathered"), COLORS.gathered));
  if (d.activations) traces.push(bar("activation_bytes", t("bar.activations"), COLORS.activations));
  const hbm = hline(d.hbm_bytes, `HBM<br>${d.hbm_label}`, { color: COLORS.mark, side: "outside" });
  const top = Math.max(d.hbm_bytes, ...d.stages.map((s) => s.total_bytes)) * 1.08;
  draw("memory-bars", traces, baseLayout({
    barmode: "stack", height: 320, shapes: [hbm.shape], annotations: [hbm.annotation],
    margin: { l: 56, r: 64, t: 28, b: 96 },
    title: { text: `${d.model.name}, N = ${d.n.toLocaleString("en")}: ${t("memory.chart")}`, font: { size: 13 } },
    showlegend: true, yaxis: { tickformat: "~s", ticksuffix: "B", range: [0, top] },
  }));
  const n = d.n;
  const curve = Object.entries(d.curve.bytes).map(([name, ys], i) => ({
    type: "scatter", mode: "lines", name, x: d.curve.n, y: ys, line: { color: COLORS.stages[i] },
    hovertemplate: `${name}: N = %{x}, %{y:.3s}B<extra></extra>`,
  }));
  curve.push({ type: "scatter", mode: "markers", name: `N = ${n}`, showlegend: false,
               x: names.map(() => n), y: d.stages.map((s) => s.total_bytes),
               marker: { color: COLORS.mark, size: 8 } });
  const hbmLog = hline(d.hbm_bytes, `HBM<br>${d.hbm_label}`, { color: COLORS.mark, log: true, side: "outside" });
  draw("memory-curve", curve, baseLayout({
    height: 250, shapes: [hbmLog.shape], annotations: [hbmLog.annotation],
    margin: { l: 56, r: 64, t: 28, b: 84 },
    title: { text: t("memory.curve"), font: { size: 13 } },
    xaxis: { type: "log", title: { text: "N" } },
    yaxis: { type: "log", tickformat: "~s", ticksuffix: "B" },
  }));
  panel.modelShown = d.model;
}

const SHAPE_FIELDS = ["layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "experts",
                      "experts_per_token", "shared_experts"];

// A model's shape as the editor's placeholders: what the empty fields stand for.
function shapeOf(m) {
  return {
    params: m.params, layers: m.layers, hidden: m.hidden, heads: m.heads, kv_heads: m.kv_heads,
    ffn: m.expert_ffn || m.ffn, vocab: m.vocab, experts: m.experts,
    experts_per_token: m.experts_per_token, shared_experts: m.shared_experts,
    tied: m.tied_embeddings,
  };
}

function wireMemory(panel) {
  const model = panel.control("model");
  const config = panel.control("config");
  const fields = [...panel.form.querySelectorAll("[data-model-field]")];
  const showShape = (m) => {
    const shape = m ? shapeOf(m) : {};
    for (const el of fields) {
      if (el.type === "checkbox") el.checked = Boolean(shape[el.name]);
      else { el.value = ""; el.placeholder = shape[el.name] == null ? "" : String(shape[el.name]); }
    }
  };
  const preset = () => presets.models.find((x) => x.name === model.value);
  model.addEventListener("change", () => {
    config.value = "";
    showShape(preset());
  });
  // editing the shape of a preset or a config makes the model custom, starting from that shape
  for (const el of fields) {
    el.addEventListener("input", () => {
      if (model.value === "custom" && !config.value.trim()) return;
      for (const other of fields) {
        if (other === el || other.type === "checkbox" || other.name === "params") continue;
        if (!other.value && other.placeholder) other.value = other.placeholder;
      }
      config.value = "";
      model.value = "custom";
    });
  }
  const useConfig = async () => {
    model.value = "custom";
    showShape(null);
    if (!config.value.trim()) return;
    try {
      const d = await getJSON(`/api/model?${new URLSearchParams({ config: config.value })}`);
      showShape(d.model);
    } catch (e) { /* the memory answer shows the error next to the box */ }
  };
  config.addEventListener("input", useConfig);
  document.getElementById("config-file").addEventListener("change", async (ev) => {
    const file = ev.target.files[0];
    if (!file) return;
    config.value = await file.text();
    await useConfig();
    panel.schedule();
  });
  showShape(preset());
}

// ---------------------------------------------------------------- 2. bucket overlap

function lanes(spansByLane, tail, title) {
  // spansByLane: [{lane, spans: [{start, end, name}], colors}], drawn as horizontal bars.
  const traces = spansByLane.map(({ lane, spans, colors }) => ({
    type: "bar", orientation: "h", name: lane, showlegend: false,
    y: spans.map(() => lane), base: spans.map((s) => s.start), x: spans.map((s) => s.end - s.start),
    text: spans.map((s) => s.name), textposition: "none",
    marker: { color: spans.map((s, i) => s.color || colors[i % colors.length]), line: { width: 0 } },
    hovertemplate: `%{text}<br>%{base:.3s}s → %{x:.3s}s ${tr("hover.long")}<extra></extra>`,
  }));
  const layout = baseLayout({
    margin: { l: 84, r: 12, t: 56, b: 44 },  // the title above, the exposed tail's label under it
    height: 138 + 38 * spansByLane.length, barmode: "overlay", bargap: 0.25, showlegend: false,
    title: { text: title, font: { size: 13 } },
    xaxis: { tickformat: "~s", ticksuffix: "s", title: { text: t("overlap.time") }, rangemode: "tozero" },
    yaxis: { autorange: "reversed", automargin: true },
    shapes: [], annotations: [],
  });
  if (tail) {
    layout.shapes.push({ type: "rect", xref: "x", yref: "paper", x0: tail.from, x1: tail.to, y0: 0, y1: 1,
                         fillcolor: COLORS.exposed, line: { width: 0 } });
    layout.annotations.push({ xref: "x", yref: "paper", x: tail.to, y: 1, xanchor: "right", yanchor: "bottom",
                              text: tail.text, showarrow: false, font: { color: COLORS.mark, size: 11 } });
  }
  return [traces, layout];
}

function renderOverlap(d) {
  const t = d.timeline;
  const compute = t.compute.map((s) => ({ start: s.start_s, end: s.end_s, name: `${s.name} ${tr("overlap.backward")}` }));
  const comm = t.buckets.length
    ? t.buckets.map((b) => ({ start: b.start_s, end: b.end_s,
                              name: tr("hover.bucket", { i: b.index, size: si(b.nbytes, "B") }) }))
    : t.runs.map((r) => ({ start: r.start_s, end: r.end_s,
                           name: tr("hover.run", { n: r.count, size: si(r.nbytes, "B"), layer: r.layer }) }));
  const [traces, layout] = lanes(
    [{ lane: tr("overlap.compute"), spans: compute, colors: COLORS.compute },
     { lane: { all_reduce: "AllReduce", reduce_scatter: "ReduceScatter" }[t.collective] || t.collective,
       spans: comm, colors: COLORS.comm }],
    t.exposed_comm_s > 0 ? { from: t.backward_s, to: t.comm_end_s, text: `${tr("overlap.exposed")} ${d.labels.exposed}` } : null,
    tr("overlap.lanes", { model: d.model, hw: d.hardware, n: d.labels.buckets, size: d.labels.bucket }));
  draw("overlap-lanes", traces, layout);

  const pts = d.sweep.points;
  const bwd = hline(d.sweep.backward_s, `${tr("overlap.backward")} ${d.labels.backward}`, { log: true });
  // the marker's label goes on the side with room: right of a marker in the left half
  const xs = pts.map((p) => Math.log10(p.bucket_bytes));
  const mid = (Math.min(...xs) + Math.max(...xs)) / 2;
  const side = Math.log10(t.bucket_bytes) < mid ? "top right" : "top left";
  draw("overlap-sweep", [
    { type: "scatter", mode: "lines+markers", name: tr("overlap.exposed"),
      x: pts.map((p) => p.bucket_bytes), y: pts.map((p) => p.exposed_comm_s),
      marker: { size: 4, color: COLORS.comm[0] }, line: { color: COLORS.comm[0] },
      hovertemplate: tr("hover.sweep") },
    { type: "scatter", mode: "markers+text", name: tr("overlap.bucketsize"), x: [t.bucket_bytes], y: [t.exposed_comm_s],
      marker: { size: 11, color: COLORS.mark, symbol: "diamond" },
      text: [`${d.labels.bucket}: ${d.labels.exposed}`], textposition: side, cliponaxis: false,
      textfont: { color: COLORS.mark },
      hovertemplate: tr("hover.sweep") },
  ], baseLayout({
    height: 250, shapes: [bwd.shape], annotations: [bwd.annotation],
    title: { text: tr("overlap.sweep"), font: { size: 13 } }, showlegend: false,
    margin: { l: 56, r: 24, t: 40, b: 48 },
    xaxis: { type: "log", tickformat: "~s", ticksuffix: "B", title: { text: tr("overlap.bucketsize") } },
    yaxis: { type: "log", tickformat: "~s", ticksuffix: "s" },
  }));
}

function wireOverlap(panel) {
  // picking hardware sets α′, bandwidth and ring size to that hardware's values (then drag them)
  const hw = panel.control("hardware");
  hw.addEventListener("change", () => {
    const h = presets.hardware.find((x) => x.name === hw.value);
    if (!h) return;
    panel.set("latency", h.small_message_latency);
    panel.set("bandwidth", h.intra_bw);
    panel.set("n", h.devices_per_node);
  });
}

async function renderMeasured() {
  const m = await getJSON("/api/measured");
  if (!m.trace) return;
  document.getElementById("measured").hidden = false;
  document.getElementById("measured-source").textContent = m.trace.path.split("/").pop();
  const groups = new Map();
  const order = (s) => [s.rank, s.lane === "compute" ? 0 : 1];  // compute above comm, rank by rank
  const spans = [...m.trace.spans].sort((a, b) => {
    const [ra, la] = order(a), [rb, lb] = order(b);
    return ra - rb || la - lb;
  });
  for (const s of spans) {
    const key = `rank ${s.rank} ${s.lane}`;
    if (!groups.has(key)) groups.set(key, []);
    const what = [s.name, s.args.label, s.args.bytes && si(s.args.bytes, "B")].filter(Boolean).join(" · ");
    groups.get(key).push({ start: s.start_s, end: s.end_s, name: `rank ${s.rank}: ${what}`,
                           color: s.lane === "compute" ? PHASE_COLORS[s.name] || "#999" : undefined });
  }
  const [traces, layout] = lanes(
    [...groups].map(([lane, spans]) => ({ lane, spans,
      colors: lane.endsWith("comm") ? COLORS.comm : COLORS.compute })),
    null, t("overlap.measured.title"));
  layout.xaxis.title.text = t("overlap.measured.time");
  draw("measured-lanes", traces, layout);
}

// ---------------------------------------------------------------- 3. roofline

function renderRoofline(d) {
  const c = d.curve;
  const here = d.threshold;
  const traces = [
    { type: "scatter", mode: "lines+markers", name: "threshold", x: c.n, y: c.threshold_tokens,
      line: { shape: "linear", color: COLORS.params }, marker: { size: 5 },
      text: c.bottleneck.map((b) => t("value." + b)), hovertemplate: t("hover.roofline") },
  ];
  if (here.n != null) {
    traces.push({ type: "scatter", mode: "markers+text", name: "this DP size", x: [here.n], y: [here.threshold_tokens],
                  marker: { size: 11, color: COLORS.mark, symbol: "diamond" },
                  text: [`${d.labels.threshold} (${t("roofline.on")} ${here.n.toLocaleString("en")})`],
                  textposition: "bottom left", cliponaxis: false,
                  textfont: { color: COLORS.mark } });
  }
  const scale = hline(d.at_scale.threshold_tokens, `${t("roofline.at_scale")} ${d.labels.at_scale}`);
  draw("roofline-curve", traces, baseLayout({
    height: 260, shapes: [scale.shape], annotations: [scale.annotation],
    title: { text: t("roofline.chart", { hw: here.hardware }), font: { size: 13 } }, showlegend: false,
    xaxis: { type: "log", title: { text: t("roofline.gpus") } },
    yaxis: { rangemode: "tozero", tickformat: "~s" },
  }));
}

function wireRoofline(panel) {
  const hw = panel.control("hardware");
  const axes = panel.control("axes");
  const limit = () => {
    const h = presets.hardware.find((x) => x.name === hw.value);
    if (!h) return;
    axes.max = h.axes;
    if (Number(axes.value) > h.axes) axes.value = h.axes;
  };
  hw.addEventListener("change", limit);
  limit();
}

// ---------------------------------------------------------------- 4. batch

function renderBatch(d, panel) {
  const s = d.sweep;
  const ul = panel.section.querySelector(".warnings");
  const warnings = pageLang() === "zh" ? d.warnings_zh : d.plan.warnings;
  ul.replaceChildren(...warnings.map((w) => Object.assign(document.createElement("li"), { textContent: w })));
  const exact = d.plan.exact_grad_acc;
  const here = exact === d.plan.grad_acc ? `grad_acc ${d.plan.grad_acc}`
    : `grad_acc ${d.plan.grad_acc} (${t("batch.exact")} ${d.labels.exact_grad_acc})`;
  // grad_acc >= 1 only (the CLI refuses less): GPU-rich sizes sit on the floor of 1, in red
  const ok = s.dp.map((_, i) => i).filter((i) => !s.gpu_rich[i]);
  const rich = s.dp.map((_, i) => i).filter((i) => s.gpu_rich[i]);
  const top = Math.max(1, ...ok.map((i) => s.exact_grad_acc[i]));
  const chartWidth = document.getElementById("batch-sweep").clientWidth;
  const legendText = (key) => (chartWidth < 520 ? wrapText(t(key), chartWidth - 60) : t(key));
  draw("batch-sweep", [
    { type: "scatter", mode: "lines+markers", name: legendText("batch.legend.ok"), x: ok.map((i) => s.dp[i]),
      y: ok.map((i) => s.exact_grad_acc[i]), marker: { size: 7, color: COLORS.params },
      line: { color: "#999", width: 1 },
      hovertemplate: "dp %{x}: grad_acc %{y:.3g}<extra></extra>" },  // same in both languages
    { type: "scatter", mode: "markers", name: legendText("batch.legend.rich"), x: rich.map((i) => s.dp[i]),
      y: rich.map(() => 1), marker: { size: 7, color: COLORS.mark, symbol: "x" },
      hovertemplate: `dp %{x}: ${t("batch.rich")}<extra></extra>` },
    { type: "scatter", mode: "markers+text", name: "this dp", x: [d.plan.dp], y: [Math.max(1, exact)],
      marker: { size: 12, color: "rgba(0,0,0,0)", line: { color: "#111", width: 2 } },
      text: [`dp ${d.plan.dp}: ${here}`], cliponaxis: false, showlegend: false,
      textposition: d.plan.dp > Math.sqrt(s.dp[0] * s.dp[s.dp.length - 1]) ? "middle left" : "middle right" },
  ], baseLayout({
    // on a phone the two legend entries stack, so that neither runs past the chart's edge
    ...(chartWidth < 520 ? {
      height: 340, margin: { l: 56, r: 12, t: 28, b: 130 },
      legend: { orientation: "v", x: 0, xanchor: "left", xref: "container", y: 0, yref: "container",
                yanchor: "bottom" },
    } : { height: 290 }),
    showlegend: true,
    title: { text: t("batch.chart", { samples: d.plan.samples }), font: { size: 13 } },
    xaxis: { type: "log", title: { text: t("batch.xaxis") } },
    yaxis: { type: "log", title: { text: "grad_acc" }, range: [-0.15, Math.log10(top) + 0.25] },
  }));
}

// ---------------------------------------------------------------- 5. recommend

function renderRecommend(d, panel) {
  const table = document.getElementById("recommend-table");
  const head = document.createElement("tr");
  head.append(...d.columns.map((c) => Object.assign(document.createElement("th"),
    { textContent: t("recommend.col." + c), scope: "col" })));
  const zh = pageLang() === "zh";
  const body = (zh ? d.rows_zh : d.rows).map((r) => {
    const tr = document.createElement("tr");
    tr.append(...r.map((cell) => Object.assign(document.createElement("td"), { textContent: cell })));
    return tr;
  });
  const caption = Object.assign(document.createElement("caption"), { textContent: t("recommend.summary", {
    model: d.model, n: pageLang() === "zh" ? `${d.n.toLocaleString("en")} 张卡` : d.labels.n, optimizer: d.optimizer,
    samples: d.labels.samples, seq: d.seq.toLocaleString("en"),
    searched: d.searched.toLocaleString("en"), ms: Math.round(d.elapsed_s * 1e3) }) });
  table.replaceChildren(caption, Object.assign(document.createElement("thead"), {}), document.createElement("tbody"));
  table.tHead.append(head);
  table.tBodies[0].append(...body);
  document.getElementById("recommend-rejected").replaceChildren(...d.rejected.map((x) =>
    Object.assign(document.createElement("li"), {
      textContent: `${x.count.toLocaleString("en")} · ${I18N[pageLang()]["reason." + x.reason] || x.reason}`
        + (x.example ? ` — ${zh ? x.example_zh : x.example}` : "") })));
  document.getElementById("recommend-notes").textContent = (zh ? d.notes_zh : d.notes).join(" ");
  document.getElementById("recommend-compute").textContent = t("recommend.compute", {
    efficiency: (100 * d.efficiency).toFixed(0), source: zh ? d.efficiency_source_zh : d.efficiency_source });
  document.getElementById("recommend-train").textContent =
    d.train_flags ? t("recommend.train") + "zerodp train " + d.train_flags : "";
}

function wireRecommend(panel) {
  // a picked config.json goes into the paste box; either one replaces the preset
  document.getElementById("recommend-config-file").addEventListener("change", async (ev) => {
    const file = ev.target.files[0];
    if (!file) return;
    panel.control("config").value = await file.text();
    panel.schedule();
  });
}

// ---------------------------------------------------------------- start

const panels = [];

// The language switch: the choice goes into the URL (?lang=zh), the words and charts follow.
function wireLanguage() {
  for (const a of document.querySelectorAll("[data-lang]")) {
    a.addEventListener("click", (ev) => {
      ev.preventDefault();
      const url = new URL(location.href);
      url.searchParams.set("lang", a.dataset.lang);
      history.replaceState(null, "", url);
      applyLang();
      for (const panel of panels) {
        if (panel.lastError) panel.showError(panel.lastError);  // at once, before the refetch
        panel.schedule();
      }
      renderMeasured().catch(() => {});
    });
  }
}

async function main() {
  // One markup for the controls several forms share (the levers of guide §14): from its <template>.
  for (const el of document.querySelectorAll("[data-template]")) {
    el.replaceChildren(document.getElementById(el.dataset.template).content.cloneNode(true));
  }
  await loadWords();
  applyLang();
  wireLanguage();
  [schema, presets] = await Promise.all([getJSON("/api/schema"), getJSON("/api/presets")]);
  const specs = {
    memory: [renderMemory, wireMemory],
    overlap: [renderOverlap, wireOverlap],
    roofline: [renderRoofline, wireRoofline],
    batch: [renderBatch, null],
    recommend: [renderRecommend, wireRecommend],
  };
  for (const [id, [render, wire]] of Object.entries(specs)) {
    const panel = new Panel(document.getElementById(id), render);
    panel.init();
    if (wire) wire(panel);
    panels.push(panel);
    panel.fetch();
  }
  renderMeasured().catch((e) => console.warn("measured timeline:", e.message));
}

main().catch((e) => {
  document.querySelector("main").prepend(Object.assign(document.createElement("p"),
    { className: "error", role: "alert", textContent: `${t("error.server")}: ${e.message}` }));
});
