// attnkit.viz.widget: the layer x head grid, one head's weights or statistics, in a notebook (anywidget).
// The model holds `data` (static: the grid), `selected` ([layer, head], [-1, -1] for the grid alone)
// and `detail` (the selected head's view, computed in Python when `selected` changes).
const METRICS = {
  entropy: "entropy (bits)", max_weight: "largest weight", sink_mass: "first-token mass", mean_distance: "mean distance",
};

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function shade(x) {  // 0..1 -> white..deep blue
  const t = Math.max(0, Math.min(1, x));
  return `rgb(${Math.round(255 - 200 * t)},${Math.round(255 - 160 * t)},${Math.round(255 - 60 * t)})`;
}

function bytes(b64) {
  const s = atob(b64), out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return out;
}

function grid(root, data, model) {
  const box = el("div", { class: "ak-grid" });
  const pick = el("select", { class: "ak-metric" });
  for (const name of Object.keys(data.summary)) pick.append(el("option", { value: name }, METRICS[name] || name));
  const table = el("table", { class: "ak-table" });
  function draw() {
    const name = pick.value, values = data.summary[name];
    const flat = values.flat(), lo = Math.min(...flat), hi = Math.max(...flat);
    table.replaceChildren();
    const head = el("tr");
    head.append(el("th", {}, ""));
    for (let h = 0; h < data.heads; h++) head.append(el("th", {}, `head ${h}`));
    table.append(head);
    const [sl, sh] = model.get("selected");
    values.forEach((row, l) => {
      const tr = el("tr");
      tr.append(el("th", {}, data.layerNames[l]));
      row.forEach((x, h) => {
        const td = el("td", { class: "ak-cell", "data-layer": l, "data-head": h, title: `${data.layerNames[l]} · head ${h}` },
          x.toFixed(name === "mean_distance" ? 1 : 2));
        td.style.background = shade(hi > lo ? (x - lo) / (hi - lo) : 0.5);
        if (l === sl && h === sh) td.classList.add("ak-picked");
        td.addEventListener("click", () => { model.set("selected", [l, h]); model.save_changes(); });
        tr.append(td);
      });
      table.append(tr);
    });
  }
  pick.addEventListener("change", draw);
  box.append(el("label", {}, "colour by "), pick, table);
  root.append(box);
  return draw;
}

function heatmap(panel, data, d) {
  const rows = d.rows, cols = d.cols, values = bytes(d.bytes);
  const cell = Math.max(1, Math.min(12, Math.floor(480 / Math.max(rows, cols))));
  const canvas = el("canvas", { class: "ak-heatmap", width: cols * cell, height: rows * cell });
  const ctx = canvas.getContext("2d");
  for (let i = 0; i < rows; i++) {
    for (let j = 0; j < cols; j++) {
      ctx.fillStyle = shade(values[i * cols + j] / 255);
      ctx.fillRect(j * cell, i * cell, cell, cell);
    }
  }
  const tip = el("div", { class: "ak-tip" }, "hover over a cell: query → key, weight");
  canvas.addEventListener("mousemove", (e) => {
    const r = canvas.getBoundingClientRect();
    const i = Math.floor((e.clientY - r.top) / cell), j = Math.floor((e.clientX - r.left) / cell);
    if (i < 0 || j < 0 || i >= rows || j >= cols) return;
    const b = values[i * cols + j], w = b ? Math.pow(10, d.hi - d.decades + (b - 1) / 254 * d.decades) : 0;
    tip.textContent = `${d.queryTokens[i]} → ${d.keyTokens[j]}: ${w.toPrecision(3)}`;
  });
  panel.append(canvas, tip);
}

function profile(panel, title, values, log, mark) {  // one line over the keys (or queries), binned
  const w = 640, h = 120, n = values.length;
  const svgNS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNS, "svg");
  svg.setAttribute("width", w); svg.setAttribute("height", h); svg.setAttribute("class", "ak-profile");
  const ys = values.map((v) => (log ? Math.log10(Math.max(v, 1e-12)) : v));
  const lo = log ? Math.max(Math.min(...ys), Math.max(...ys) - 6) : Math.min(0, ...ys), hi = Math.max(...ys);
  const pts = ys.map((y, i) => `${((i + 0.5) / n * w).toFixed(1)},${(h - 4 - (h - 8) * (hi > lo ? (Math.max(y, lo) - lo) / (hi - lo) : 0.5)).toFixed(1)}`);
  const line = document.createElementNS(svgNS, "polyline");
  line.setAttribute("points", pts.join(" ")); line.setAttribute("fill", "none"); line.setAttribute("stroke", "#2a5db0");
  svg.append(line);
  if (mark !== undefined) {
    const m = document.createElementNS(svgNS, "line");
    const x = ((mark + 0.5) / n * w).toFixed(1);
    m.setAttribute("x1", x); m.setAttribute("x2", x); m.setAttribute("y1", 0); m.setAttribute("y2", h);
    m.setAttribute("stroke", "#d33"); m.setAttribute("class", "ak-mark");
    svg.append(m);
  }
  panel.append(el("h4", {}, title), svg);
}

function topList(panel, title, top) {
  const list = el("ol", { class: "ak-top" });
  for (const t of top) list.append(el("li", {}, `${t.token} (position ${t.position}): ${t.value.toPrecision(3)}`));
  panel.append(el("h4", {}, title), list);
}

function detail(root, data, model) {
  const panel = el("div", { class: "ak-detail" });
  root.append(panel);
  return () => {
    const d = model.get("detail");
    panel.replaceChildren();
    if (!d || d.layer === undefined) {
      panel.append(el("p", { class: "ak-hint" }, "Click a head in the grid to look at it."));
      return;
    }
    const back = el("button", { class: "ak-back" }, "← grid only");
    back.addEventListener("click", () => { model.set("selected", [-1, -1]); model.save_changes(); });
    panel.append(el("h3", { class: "ak-title" }, `${data.layerNames[d.layer]} · head ${d.head}`), back);
    if (d.kind === "weights") {
      heatmap(panel, data, d);
      return;
    }
    const per = d.binSize > 1 ? ` (${d.binSize} tokens per point: the largest)` : "";
    profile(panel, `mass each key receives, log scale${per}`, d.received, true);
    topList(panel, "keys that receive the most", d.topReceived);
    profile(panel, `entropy of each query's weights (bits)${d.binSize > 1 ? `, ${d.binSize} rows per point: the mean` : ""}`, d.entropy, false);
    d.rows.forEach((r, i) => {
      profile(panel, `weights of query row ${r} (${d.rowTokens[i]})${per}`, d.rowWeights[i], true, Math.floor(r / d.binSize));
      topList(panel, `where row ${r} looks`, d.rowTop[i]);
    });
  };
}

function render({ model, el: root }) {
  const data = model.get("data");
  root.classList.add("attnkit-widget");
  root.append(el("div", { class: "ak-head" }, `${data.title} — ${data.layers} layers × ${data.heads} heads, ${data.length} tokens`));
  const drawGrid = grid(root, data, model);
  const drawDetail = detail(root, data, model);
  drawGrid();
  drawDetail();
  const onSelect = () => drawGrid();
  model.on("change:selected", onSelect);
  model.on("change:detail", drawDetail);
  return () => { model.off("change:selected", onSelect); model.off("change:detail", drawDetail); };
}

export default { render };
