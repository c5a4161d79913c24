// attnkit.viz.widget: the layer x head grid, one head's weights or statistics, in a notebook (anywidget).
// The model holds `data` (static: the grid), `selected` ([layer, head], [-1, -1] for the grid alone),
// `rows` and `combine` (query rows whose weights are combined into one profile, "mean" or "sum") and
// `detail` (the selected head's view, computed in Python when any of those change).
const METRICS = {
  entropy: "entropy (bits)", max_weight: "largest weight", sink_mass: "first-token mass", mean_distance: "mean distance",
};

function plural(n, word) { return `${n.toLocaleString("en-US")} ${word}${n === 1 ? "" : "s"}`; }

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

// the rows of the selection after a click on row i (shift: the range from the last row clicked)
let lastRow = -1;
function toggled(chosen, i, range) {
  const set = new Set(chosen);
  if (range && lastRow >= 0) {
    for (let r = Math.min(lastRow, i); r <= Math.max(lastRow, i); r++) set.add(r);
  } else if (set.has(i)) set.delete(i);
  else set.add(i);
  lastRow = i;
  return [...set].sort((a, b) => a - b);
}

function heatmap(panel, data, d, model) {
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
  const chosen = model.get("rows") || [];
  ctx.strokeStyle = "#d33";
  for (const i of chosen) if (i < rows) ctx.strokeRect(0.5, i * cell + 0.5, cols * cell - 1, Math.max(cell - 1, 1));
  const tip = el("div", { class: "ak-tip" }, "hover over a cell: query → key, weight; click rows to combine them (shift: a range)");
  canvas.addEventListener("mousemove", (e) => {
    const r = canvas.getBoundingClientRect();
    const i = Math.floor((e.clientY - r.top) / cell), j = Math.floor((e.clientX - r.left) / cell);
    if (i < 0 || j < 0 || i >= rows || j >= cols) return;
    const b = values[i * cols + j], w = b ? Math.pow(10, d.hi - d.decades + (b - 1) / 254 * d.decades) : 0;
    tip.textContent = `${d.queryTokens[i]} → ${d.keyTokens[j]}: ${w.toPrecision(3)}`;
  });
  canvas.addEventListener("click", (e) => {
    const r = canvas.getBoundingClientRect(), i = Math.floor((e.clientY - r.top) / cell);
    if (i < 0 || i >= rows) return;
    model.set("rows", toggled(model.get("rows") || [], i, e.shiftKey));
    model.save_changes();
  });
  panel.append(canvas, tip);
}

// the combined profile of the chosen rows (their mean or sum over the keys) and the keys it favours
function selection(panel, d, model, names) {
  const s = d.selection;
  if (!s) return;
  const how = el("select", { class: "ak-combine" });
  for (const name of ["mean", "sum"]) how.append(el("option", { value: name }, name));
  how.value = s.how;
  how.addEventListener("change", () => { model.set("combine", how.value); model.save_changes(); });
  const clear = el("button", { class: "ak-clear" }, "clear rows");
  clear.addEventListener("click", () => { model.set("rows", []); model.save_changes(); });
  const shown = s.rows.length > 6 ? `${s.rows.slice(0, 6).map(names).join(", ")}, ...` : s.rows.map(names).join(", ");
  const box = el("div", { class: "ak-selection" });
  box.append(el("label", {}, "rows combined by "), how, clear);
  panel.append(box);
  const per = s.binSize > 1 ? ` (${s.binSize} tokens per point: the largest)` : "";
  profile(panel, `${s.how} of the weights of ${s.rows.length} rows (${shown})${per}`, s.weights, false, undefined,
    s.binSize, "key position");
  topList(panel, `where the ${s.rows.length} rows look together`, s.top);
}

function ticks(lo, hi, count) {  // round numbers spanning [lo, hi]
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(+t.toPrecision(12));
  return out;
}

function label(v, log) {  // a tick's text: powers of ten on a log axis, short numbers otherwise
  if (log) return Number.isInteger(v) ? `1e${v}` : "";
  const a = Math.abs(v);
  return a >= 1e4 || (a > 0 && a < 1e-2) ? v.toExponential(0) : `${+v.toPrecision(3)}`;
}

// one line over the keys (or queries), binned: axes with ticks, the y axis on a log scale for weights
function profile(panel, title, values, log, mark, binSize, what) {
  const w = 640, h = 150, left = 52, right = 8, top = 6, bottom = 30, n = values.length;
  const pw = w - left - right, ph = h - top - bottom;
  const svgNS = "http://www.w3.org/2000/svg";
  const make = (tag, attrs, text) => {
    const node = document.createElementNS(svgNS, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  };
  const svg = make("svg", { width: w, height: h, class: "ak-profile" });
  const ys = values.map((v) => (log ? Math.log10(Math.max(v, 1e-12)) : v));
  let lo = log ? Math.max(Math.min(...ys), Math.max(...ys) - 6) : Math.min(0, ...ys), hi = Math.max(...ys);
  if (log) { lo = Math.floor(lo); hi = Math.max(Math.ceil(hi), lo + 1); }
  if (!(hi > lo)) hi = lo + 1;
  const X = (i) => left + (i + 0.5) / n * pw, Y = (y) => top + ph - ph * (Math.max(y, lo) - lo) / (hi - lo);
  svg.append(make("line", { x1: left, x2: left, y1: top, y2: top + ph, class: "ak-axis" }));
  svg.append(make("line", { x1: left, x2: left + pw, y1: top + ph, y2: top + ph, class: "ak-axis" }));
  for (const t of log ? ticks(lo, hi, Math.min(6, hi - lo)).filter(Number.isInteger) : ticks(lo, hi, 4)) {
    svg.append(make("line", { x1: left - 4, x2: left, y1: Y(t), y2: Y(t), class: "ak-axis" }));
    svg.append(make("text", { x: left - 6, y: Y(t) + 3, "text-anchor": "end", class: "ak-tick" }, label(t, log)));
  }
  const tokens = n * (binSize || 1);
  for (const t of ticks(0, Math.max(tokens - 1, 1), 6)) {
    const x = left + (t + 0.5) / tokens * pw;
    svg.append(make("line", { x1: x, x2: x, y1: top + ph, y2: top + ph + 4, class: "ak-axis" }));
    svg.append(make("text", { x, y: top + ph + 15, "text-anchor": "middle", class: "ak-tick" }, `${t}`));
  }
  svg.append(make("text", { x: left + pw / 2, y: h - 2, "text-anchor": "middle", class: "ak-axis-title" }, what));
  const pts = ys.map((y, i) => `${X(i).toFixed(1)},${Y(y).toFixed(1)}`);
  svg.append(make("polyline", { points: pts.join(" "), fill: "none", stroke: "#2a5db0" }));
  if (mark !== undefined) {
    const x = X(mark).toFixed(1);
    svg.append(make("line", { x1: x, x2: x, y1: top, y2: top + ph, stroke: "#d33", class: "ak-mark" }));
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
      heatmap(panel, data, d, model);
      selection(panel, d, model, (r) => `${r} (${d.queryTokens[r]})`);
      return;
    }
    const per = d.binSize > 1 ? ` (${d.binSize} tokens per point: the largest)` : "";
    profile(panel, `mass each key receives, log scale${per}`, d.received, true, undefined, d.binSize, "key position");
    topList(panel, "keys that receive the most", d.topReceived);
    profile(panel, `entropy of each query's weights (bits)${d.binSize > 1 ? `, ${d.binSize} rows per point: the mean` : ""}`,
      d.entropy, false, undefined, d.binSize, "query position");
    const chosen = new Set(model.get("rows") || []);
    d.rows.forEach((r, i) => {
      profile(panel, `weights of query row ${r} (${d.rowTokens[i]}), log scale${per}`, d.rowWeights[i], true,
        Math.floor(r / d.binSize), d.binSize, "key position");
      if (d.rows.length > 1) {  // rows to combine: a box each
        const box = el("input", { type: "checkbox", class: "ak-row-pick", "data-row": r });
        box.checked = chosen.has(r);
        box.addEventListener("change", () => {
          const now = new Set(model.get("rows") || []);
          if (box.checked) now.add(r); else now.delete(r);
          model.set("rows", [...now].sort((a, b) => a - b));
          model.save_changes();
        });
        const label = el("label", { class: "ak-row-label" });
        label.append(box, document.createTextNode(` combine row ${r}`));
        panel.append(label);
      }
      topList(panel, `where row ${r} looks`, d.rowTop[i]);
    });
    selection(panel, d, model, (r) => `${r} (${d.rowTokens[d.rows.indexOf(r)]})`);
  };
}

function render({ model, el: root }) {
  const data = model.get("data");
  // the static view the output carries for exports and viewers without a widget manager: hidden once this renders
  if (data.staticId) document.querySelectorAll(`.attnkit-static-${data.staticId}`).forEach((n) => { n.style.display = "none"; });
  root.classList.add("attnkit-widget");
  root.append(el("div", { class: "ak-head" }, `${data.title} — ${plural(data.layers, "layer")} × ${plural(data.heads, "head")}, ${plural(data.length, "token")}`));
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
