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

let schema = null;   // /api/schema: parameters and defaults of every endpoint
let presets = null;  // /api/presets: hardware and model presets

// ---------------------------------------------------------------- helpers

function path(obj, dotted) {
  return dotted.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
}

function getJSON(url, signal) {
  return fetch(url, { signal }).then(async (r) => {
    const body = await r.json();
    if (!r.ok) { const e = new Error(body.error || r.statusText); e.body = body; throw e; }
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

function baseLayout(extra) {
  // the legend sits under the x axis, in a bottom margin kept for it
  const legend = extra.showlegend !== false;
  return Object.assign({
    margin: { l: 56, r: 12, t: 28, b: legend ? 84 : 48 },
    font: { family: "system-ui, sans-serif", size: 12 },
    paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "#fff",
    legend: { orientation: "h", x: 0, xref: "container", y: 0, yref: "container", yanchor: "bottom",
              traceorder: "normal" },
    hovermode: "closest",
  }, extra);
}

// A dashed horizontal line with a label; on a log axis plotly places annotations in log10 units.
function hline(y, text, { color = "#333", log = false } = {}) {
  return {
    shape: { type: "line", xref: "paper", x0: 0, x1: 1, y0: y, y1: y,
             line: { color, dash: "dash", width: 1 } },
    annotation: { xref: "paper", x: 1, y: log ? Math.log10(y) : y, yanchor: "bottom", xanchor: "right",
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
      const text = path(data, out.dataset.field);
      out.textContent = text == null ? "—" : typeof text === "number" ? text.toLocaleString("en") : text;
      if (out.dataset.valueField) out.dataset.value = path(data, out.dataset.valueField);
    }
  }

  showError(e) {
    for (const el of this.form.querySelectorAll("[aria-invalid]")) el.removeAttribute("aria-invalid");
    this.section.classList.toggle("failed", Boolean(e));
    this.error.textContent = e ? e.message : "";
    const field = e && e.body && e.body.field;
    if (field && this.control(field)) this.control(field).setAttribute("aria-invalid", "true");
  }
}

// ---------------------------------------------------------------- 1. memory

function renderMemory(d, panel) {
  const names = d.stages.map((s) => s.stage_name);
  const readout = (term, text, value, over) => {
    const div = document.createElement("div");
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = term;
    dd.textContent = text;
    dd.dataset.value = value;
    dd.classList.toggle("over", Boolean(over));
    div.append(dt, dd);
    return div;
  };
  // the seed's column: model states per GPU; red when the stage's total exceeds the HBM line
  const items = d.stages.map((s) => {
    const item = readout(s.stage_name, s.label, s.model_state_bytes, !s.fits);
    item.querySelector("dd").dataset.stage = s.stage_name;
    return item;
  });
  if (d.activations) items.push(readout("+ activations", d.activations.label, d.activations.total_bytes));
  document.getElementById("memory-readouts").replaceChildren(...items);
  const bar = (key, name, color) => ({
    type: "bar", name, x: names, y: d.stages.map((s) => s[key]), marker: { color },
    hovertemplate: "%{x}: %{y:.3s}B<extra>" + name + "</extra>",
  });
  const traces = [
    bar("param_bytes", "bf16 params", COLORS.params),
    bar("grad_bytes", "bf16 grads", COLORS.grads),
    bar("optimizer_bytes", "optimizer states", COLORS.optimizer),
  ];
  if (d.stages.some((s) => s.grad_acc_bytes > 0)) traces.push(bar("grad_acc_bytes", "fp32 grad acc", COLORS.gradAcc));
  if (d.stages.some((s) => s.gathered_unit_bytes > 0)) traces.push(bar("gathered_unit_bytes", "2 gathered units", COLORS.gathered));
  if (d.activations) {
    traces.push({ type: "bar", name: `activations (${d.activations.recompute} recompute)`, x: names,
                  y: names.map(() => d.activations.total_bytes), marker: { color: COLORS.activations } });
  }
  const hbm = hline(d.hbm_bytes, `HBM ${d.hardware} ${d.hbm_label}`, { color: COLORS.mark });
  draw("memory-bars", traces, baseLayout({
    barmode: "stack", height: 300, shapes: [hbm.shape], annotations: [hbm.annotation],
    title: { text: `${d.model.name}: bytes per GPU`, font: { size: 13 } }, showlegend: true,
    yaxis: { tickformat: "~s", ticksuffix: "B", rangemode: "tozero" },
  }));
  const n = Number(panel.control("n").dataset.value);
  const curve = Object.entries(d.curve.bytes).map(([name, ys], i) => ({
    type: "scatter", mode: "lines", name, x: d.curve.n, y: ys, line: { color: COLORS.stages[i] },
  }));
  curve.push({ type: "scatter", mode: "markers", name: `N = ${n}`, showlegend: false,
               x: names.map(() => n), y: d.stages.map((s) => s.model_state_bytes),
               marker: { color: COLORS.mark, size: 8 } });
  const hbmLog = hline(d.hbm_bytes, `HBM ${d.hbm_label}`, { color: COLORS.mark, log: true });
  draw("memory-curve", curve, baseLayout({
    height: 240, shapes: [hbmLog.shape], annotations: [hbmLog.annotation],
    title: { text: "per GPU as the number of GPUs N grows", font: { size: 13 } },
    xaxis: { type: "log" },
    yaxis: { type: "log", tickformat: "~s", ticksuffix: "B" },
  }));
  // the activation controls only matter for presets with a transformer shape
  const shaped = Boolean(d.model.layers);
  const fieldset = panel.form.querySelector("[data-needs-shape]");
  fieldset.disabled = !shaped;
  fieldset.title = shaped ? "" : "this model has no transformer shape";
}

function wireMemory(panel) {
  const model = panel.control("model");
  const params = panel.control("params");
  model.addEventListener("change", () => {
    const m = presets.models.find((x) => x.name === model.value);
    if (m) params.value = m.params;
  });
  params.addEventListener("input", () => { model.value = "custom"; });
}

// ---------------------------------------------------------------- 2. bucket overlap

function lanes(spansByLane, tail, title) {
  // spansByLane: [{lane, spans: [{start, end, name}], colors}], drawn as horizontal bars.
  const traces = spansByLane.map(({ lane, spans, colors }) => ({
    type: "bar", orientation: "h", name: lane, showlegend: false,
    y: spans.map(() => lane), base: spans.map((s) => s.start), x: spans.map((s) => s.end - s.start),
    text: spans.map((s) => s.name), textposition: "none",
    marker: { color: spans.map((s, i) => s.color || colors[i % colors.length]), line: { width: 0 } },
    hovertemplate: "%{text}<br>%{base:.3s}s → %{x:.3s}s long<extra></extra>",
  }));
  const layout = baseLayout({
    margin: { l: 84, r: 12, t: 28, b: 44 },
    height: 110 + 38 * spansByLane.length, barmode: "overlay", bargap: 0.25, showlegend: false,
    title: { text: title, font: { size: 13 } },
    xaxis: { tickformat: "~s", ticksuffix: "s", title: { text: "time from the start of backward" }, rangemode: "tozero" },
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
  const compute = t.compute.map((s) => ({ start: s.start_s, end: s.end_s, name: `${s.name} backward` }));
  const comm = t.buckets.length
    ? t.buckets.map((b) => ({ start: b.start_s, end: b.end_s, name: `bucket ${b.index} (${si(b.nbytes, "B")})` }))
    : t.runs.map((r) => ({ start: r.start_s, end: r.end_s,
                           name: `${r.count} buckets of ${si(r.nbytes, "B")} after ${r.layer}` }));
  const [traces, layout] = lanes(
    [{ lane: "compute", spans: compute, colors: COLORS.compute },
     { lane: t.collective.replace("_", " "), spans: comm, colors: COLORS.comm }],
    t.exposed_comm_s > 0 ? { from: t.backward_s, to: t.comm_end_s, text: `exposed ${d.labels.exposed}` } : null,
    `${d.model} on ${d.hardware} compute: ${d.labels.buckets} buckets of ${d.labels.bucket}`);
  draw("overlap-lanes", traces, layout);

  const pts = d.sweep.points;
  const bwd = hline(d.sweep.backward_s, `backward ${d.labels.backward}`, { log: true });
  draw("overlap-sweep", [
    { type: "scatter", mode: "lines+markers", name: "exposed communication",
      x: pts.map((p) => p.bucket_bytes), y: pts.map((p) => p.exposed_comm_s),
      marker: { size: 4, color: COLORS.comm[0] }, line: { color: COLORS.comm[0] },
      hovertemplate: "bucket %{x:.3s}B → exposed %{y:.3s}s<extra></extra>" },
    { type: "scatter", mode: "markers+text", name: "this bucket size", x: [t.bucket_bytes], y: [t.exposed_comm_s],
      marker: { size: 11, color: COLORS.mark, symbol: "diamond" },
      text: [`${d.labels.bucket}: ${d.labels.exposed}`], textposition: "top center",
      textfont: { color: COLORS.mark },
      hovertemplate: "bucket %{x:.3s}B → exposed %{y:.3s}s<extra></extra>" },
  ], baseLayout({
    height: 250, shapes: [bwd.shape], annotations: [bwd.annotation],
    title: { text: "exposed communication vs bucket size", font: { size: 13 } }, showlegend: false,
    xaxis: { type: "log", tickformat: "~s", ticksuffix: "B", title: { text: "bucket size" } },
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
    null, "recorded: forward (green), backward (blue), optimizer (grey), collectives (orange)");
  layout.xaxis.title.text = "time from each rank's first recorded event";
  draw("measured-lanes", traces, layout);
}

// ---------------------------------------------------------------- 3. roofline

function renderRoofline(d) {
  const c = d.curve;
  const here = d.threshold;
  const traces = [
    { type: "scatter", mode: "lines+markers", name: "threshold", x: c.n, y: c.threshold_tokens,
      line: { shape: "linear", color: COLORS.params }, marker: { size: 5 },
      text: c.bottleneck, hovertemplate: "%{x} GPUs: %{y:,.0f} tokens/GPU (%{text})<extra></extra>" },
  ];
  if (here.n != null) {
    traces.push({ type: "scatter", mode: "markers+text", name: "this DP size", x: [here.n], y: [here.threshold_tokens],
                  marker: { size: 11, color: COLORS.mark, symbol: "diamond" },
                  text: [`${d.labels.threshold} on ${here.n.toLocaleString("en")}`], textposition: "bottom left",
                  textfont: { color: COLORS.mark } });
  }
  const scale = hline(d.at_scale.threshold_tokens, `at scale ${d.labels.at_scale}`);
  draw("roofline-curve", traces, baseLayout({
    height: 260, shapes: [scale.shape], annotations: [scale.annotation],
    title: { text: `${here.hardware}: tokens/GPU to be compute-bound`, font: { size: 13 } }, showlegend: false,
    xaxis: { type: "log", title: { text: "data-parallel GPUs" } },
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
  ul.replaceChildren(...d.plan.warnings.map((w) => Object.assign(document.createElement("li"), { textContent: w })));
  draw("batch-sweep", [
    { type: "scatter", mode: "lines+markers", name: "grad_acc", x: s.dp, y: s.exact_grad_acc,
      marker: { size: 7, color: s.gpu_rich.map((r) => (r ? COLORS.mark : COLORS.params)) },
      line: { color: "#999", width: 1 }, text: s.gpu_rich.map((r) => (r ? "GPU-rich" : "")),
      hovertemplate: "dp %{x}: grad_acc %{y:.3g} %{text}<extra></extra>" },
    { type: "scatter", mode: "markers+text", name: "this dp", x: [d.plan.dp], y: [d.plan.exact_grad_acc],
      marker: { size: 12, color: "rgba(0,0,0,0)", line: { color: "#111", width: 2 } },
      text: [`dp ${d.plan.dp}: grad_acc ${d.plan.grad_acc}`], textposition: "middle right" },
  ], baseLayout({
    height: 250, showlegend: false,
    title: { text: `grad_acc for ${d.plan.samples} samples (red: GPU-rich)`, font: { size: 13 } },
    xaxis: { type: "log", title: { text: "dp (GPUs)" } },
    yaxis: { type: "log", title: { text: "grad_acc" } },
  }));
}

// ---------------------------------------------------------------- start

async function main() {
  [schema, presets] = await Promise.all([getJSON("/api/schema"), getJSON("/api/presets")]);
  const specs = {
    memory: [renderMemory, wireMemory],
    overlap: [renderOverlap, wireOverlap],
    roofline: [renderRoofline, wireRoofline],
    batch: [renderBatch, null],
  };
  for (const [id, [render, wire]] of Object.entries(specs)) {
    const panel = new Panel(document.getElementById(id), render);
    panel.init();
    if (wire) wire(panel);
    panel.fetch();
  }
  renderMeasured().catch((e) => console.warn("measured timeline:", e.message));
}

main().catch((e) => {
  document.querySelector("main").prepend(Object.assign(document.createElement("p"),
    { className: "error", role: "alert", textContent: `cannot reach the zerodp server: ${e.message}` }));
});
