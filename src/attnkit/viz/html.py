"""A self-contained interactive HTML view of attention weights.

One file, inline CSS and JavaScript, nothing fetched: it opens from a ``file://``
URL with the network off. Three views:

- model view: a thumbnail of every layer x head; click one to open it;
- head view: query tokens on the left, key tokens on the right, joined by lines
  whose opacity is the weight; the heads of a layer are toggled by coloured
  squares; hovering a token keeps only its lines;
- heatmap: the selected head with token labels, the value under the pointer.

Weights are stored as one byte per weight (scaled by each head's maximum) in
base64, so 128 tokens x 6 layers x 12 heads takes about 1.6 MB. Text from the
user reaches the page only through ``textContent`` and canvas text, never as HTML.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from attnkit._validate import AttnkitValueError
from attnkit.viz.heatmap import as_array

#: The most weights one file holds (about 21 MB of HTML).
MAX_CELLS = 16_000_000
#: The head view draws lines for at most this many tokens per side.
MAX_LINE_TOKENS = 256


def _script_json(value) -> str:
    """JSON that is safe inside a <script> element (no "</script>", no HTML parsing)."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    for raw, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(raw, escaped)
    return text


def attention_html(weights, tokens, *, key_tokens=None, layer_names=None, title: str = "attention") -> str:
    """The HTML page for ``weights: (layers, heads, Lq, Lk)`` over ``tokens``.

    ``key_tokens`` default to ``tokens`` (self-attention); ``layer_names`` label the rows.
    """
    import numpy as np

    array = as_array(weights)
    if array.ndim != 4:
        raise AttnkitValueError(f"weights must have shape (layers, heads, Lq, Lk), but got {array.shape}.")
    layers, heads, lq, lk = array.shape
    tokens = [str(t) for t in tokens]
    key_tokens = tokens if key_tokens is None else [str(t) for t in key_tokens]
    if len(tokens) != lq or len(key_tokens) != lk:
        raise AttnkitValueError(
            f"weights of shape {array.shape} need {lq} query tokens and {lk} key tokens, "
            f"but got {len(tokens)} and {len(key_tokens)}."
        )
    if array.size > MAX_CELLS:
        raise AttnkitValueError(
            f"{layers} layers x {heads} heads x {lq} x {lk} tokens = {array.size:,} weights is more "
            f"than one page holds ({MAX_CELLS:,}). Pick some layers or heads, or a shorter text."
        )
    names = [str(n) for n in layer_names] if layer_names is not None else [f"layer {i}" for i in range(layers)]
    array = np.nan_to_num(np.clip(array, 0.0, None))
    scale = array.reshape(layers * heads, -1).max(axis=1, initial=0.0)
    safe = np.where(scale > 0, scale, 1.0)[:, None]
    quantized = np.rint(array.reshape(layers * heads, -1) / safe * 255).astype(np.uint8)
    data = {
        "title": str(title),
        "tokens": tokens,
        "keyTokens": key_tokens,
        "layerNames": names,
        "layers": layers,
        "heads": heads,
        "lq": lq,
        "lk": lk,
        "scale": [float(x) for x in scale],
        "maxLineTokens": MAX_LINE_TOKENS,
        "weights": base64.b64encode(quantized.tobytes()).decode("ascii"),
    }
    return _PAGE.replace("{{title}}", html.escape(str(title))).replace("{{data}}", _script_json(data))


def save_html(path, weights, tokens, **kwargs) -> Path:
    """Write :func:`attention_html` to ``path``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(attention_html(weights, tokens, **kwargs), encoding="utf-8")
    return path


_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{title}}</title>
<style>
  body { font: 14px system-ui, sans-serif; margin: 0; color: #222; background: #fafafa; }
  header { padding: 10px 16px; background: #fff; border-bottom: 1px solid #ddd; display: flex; gap: 16px; align-items: center; flex-wrap: wrap; }
  h1 { font-size: 17px; margin: 0; font-weight: 600; }
  nav button { font: inherit; padding: 5px 12px; border: 1px solid #bbb; background: #fff; border-radius: 4px; cursor: pointer; }
  nav button.active { background: #2d5be3; color: #fff; border-color: #2d5be3; }
  main { padding: 14px 16px; }
  .controls { margin-bottom: 10px; display: flex; gap: 10px; align-items: center; flex-wrap: wrap; }
  .grid { display: grid; gap: 6px; align-items: center; justify-content: start; }
  .grid .label { font-size: 12px; color: #555; white-space: nowrap; }
  canvas.thumb { width: 72px; height: 72px; image-rendering: pixelated; border: 1px solid #ccc; cursor: pointer; background: #fff; }
  canvas.thumb:hover { outline: 2px solid #2d5be3; }
  .swatch { display: inline-block; width: 16px; height: 16px; border-radius: 3px; margin-right: 3px; cursor: pointer; border: 2px solid transparent; vertical-align: middle; }
  .swatch.off { opacity: 0.2; }
  .message { padding: 10px 12px; background: #fff4d6; border: 1px solid #e6c96b; border-radius: 4px; max-width: 720px; }
  .tip { position: fixed; pointer-events: none; background: #222; color: #fff; padding: 4px 8px; border-radius: 4px; font-size: 12px; white-space: pre; }
  .hint { color: #666; font-size: 12px; }
</style>
</head>
<body>
<header>
  <h1 id="title"></h1>
  <nav>
    <button data-view="model" class="active">Model view</button>
    <button data-view="head">Head view</button>
    <button data-view="heatmap">Heatmap</button>
  </nav>
  <span class="hint" id="summary"></span>
</header>
<main>
  <section id="model-view">
    <p class="hint">Every layer and head; click a thumbnail to open it.</p>
    <div id="model-grid" class="grid"></div>
  </section>
  <section id="head-view" hidden>
    <div class="controls">
      <label>Layer <select id="head-layer"></select></label>
      <span id="head-toggles"></span>
      <span class="hint">Click a square to toggle a head; hover a token to keep only its lines.</span>
    </div>
    <div id="head-message" class="message" hidden></div>
    <canvas id="head-canvas"></canvas>
  </section>
  <section id="heatmap-view" hidden>
    <div class="controls">
      <label>Layer <select id="hm-layer"></select></label>
      <label>Head <select id="hm-head"></select></label>
      <strong id="hm-title"></strong>
    </div>
    <canvas id="hm-canvas"></canvas>
  </section>
  <div id="fatal" class="message" hidden></div>
</main>
<div id="tip" class="tip" hidden></div>
<script type="application/json" id="attnkit-data">{{data}}</script>
<script>
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("attnkit-data").textContent);
  const L = data.layers, H = data.heads, NQ = data.lq, NK = data.lk;
  const $ = (id) => document.getElementById(id);
  $("title").textContent = data.title;
  $("summary").textContent = L + " layers \\u00d7 " + H + " heads, " + NQ + " \\u00d7 " + NK + " tokens";

  const raw = atob(data.weights);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  function weight(l, h, i, j) { return bytes[((l * H + h) * NQ + i) * NK + j] / 255 * data.scale[l * H + h]; }
  function level(l, h, i, j) { return bytes[((l * H + h) * NQ + i) * NK + j] / 255; }

  const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  function viridis(t) {
    const x = Math.min(Math.max(t, 0), 1) * (stops.length - 1), k = Math.min(Math.floor(x), stops.length - 2), f = x - k;
    return stops[k].map((c, n) => Math.round(c + f * (stops[k + 1][n] - c)));
  }
  function headColor(h, alpha) { return "hsla(" + Math.round(360 * h / H) + ",70%,45%," + alpha + ")"; }

  function drawMatrix(canvas, l, h, cell) {
    canvas.width = NK * cell; canvas.height = NQ * cell;
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(NK, NQ);
    for (let i = 0; i < NQ; i++) for (let j = 0; j < NK; j++) {
      const c = viridis(level(l, h, i, j)), p = 4 * (i * NK + j);
      img.data[p] = c[0]; img.data[p + 1] = c[1]; img.data[p + 2] = c[2]; img.data[p + 3] = 255;
    }
    if (cell === 1) { ctx.putImageData(img, 0, 0); return; }
    const tmp = document.createElement("canvas"); tmp.width = NK; tmp.height = NQ;
    tmp.getContext("2d").putImageData(img, 0, 0);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(tmp, 0, 0, NK * cell, NQ * cell);
  }

  // --- views ---------------------------------------------------------------------------
  const views = { model: $("model-view"), head: $("head-view"), heatmap: $("heatmap-view") };
  function show(name) {
    for (const [key, el] of Object.entries(views)) el.hidden = key !== name;
    for (const b of document.querySelectorAll("nav button")) b.classList.toggle("active", b.dataset.view === name);
    if (name === "head") drawHeadView();
    if (name === "heatmap") drawHeatmap();
  }
  for (const b of document.querySelectorAll("nav button")) b.addEventListener("click", () => show(b.dataset.view));

  function fillSelect(select, n, label) {
    for (let i = 0; i < n; i++) { const o = document.createElement("option"); o.value = i; o.textContent = label(i); select.appendChild(o); }
  }
  fillSelect($("head-layer"), L, (i) => data.layerNames[i]);
  fillSelect($("hm-layer"), L, (i) => data.layerNames[i]);
  fillSelect($("hm-head"), H, (i) => "head " + i);

  // model view: thumbnails
  const grid = $("model-grid");
  grid.style.gridTemplateColumns = "auto repeat(" + H + ", 74px)";
  grid.appendChild(document.createElement("span"));
  for (let h = 0; h < H; h++) { const s = document.createElement("span"); s.className = "label"; s.textContent = "head " + h; grid.appendChild(s); }
  for (let l = 0; l < L; l++) {
    const s = document.createElement("span"); s.className = "label"; s.textContent = data.layerNames[l]; grid.appendChild(s);
    for (let h = 0; h < H; h++) {
      const c = document.createElement("canvas");
      c.className = "thumb"; c.dataset.layer = l; c.dataset.head = h; c.title = data.layerNames[l] + ", head " + h;
      drawMatrix(c, l, h, 1);
      c.addEventListener("click", () => openHead(l, h));
      grid.appendChild(c);
    }
  }
  function openHead(l, h) { $("hm-layer").value = l; $("hm-head").value = h; $("head-layer").value = l; show("heatmap"); }

  // head view: two columns of tokens joined by lines
  const active = new Array(H).fill(true);
  const toggles = $("head-toggles");
  for (let h = 0; h < H; h++) {
    const sq = document.createElement("span");
    sq.className = "swatch"; sq.style.background = headColor(h, 1); sq.title = "head " + h; sq.dataset.head = h;
    sq.addEventListener("click", () => { active[h] = !active[h]; sq.classList.toggle("off", !active[h]); drawHeadView(); });
    toggles.appendChild(sq);
  }
  const headCanvas = $("head-canvas");
  let hover = null;  // {side: "q"|"k", index}
  const ROW = 22, COL = 340, PAD = 12;
  function drawHeadView() {
    const tooMany = NQ > data.maxLineTokens || NK > data.maxLineTokens;
    $("head-message").hidden = !tooMany;
    headCanvas.hidden = tooMany;
    if (tooMany) {
      $("head-message").textContent = "The head view draws lines for at most " + data.maxLineTokens +
        " tokens per side and this input has " + NQ + " \\u00d7 " + NK + ". Use the heatmap view, or a shorter text.";
      return;
    }
    const l = +$("head-layer").value;
    const rows = Math.max(NQ, NK);
    headCanvas.width = COL + 2 * 160; headCanvas.height = rows * ROW + 2 * PAD;
    const ctx = headCanvas.getContext("2d");
    ctx.clearRect(0, 0, headCanvas.width, headCanvas.height);
    ctx.font = "14px system-ui, sans-serif"; ctx.textBaseline = "middle";
    const y = (i) => PAD + i * ROW + ROW / 2, xl = 150, xr = 150 + COL;
    for (let h = 0; h < H; h++) {
      if (!active[h]) continue;
      for (let i = 0; i < NQ; i++) {
        if (hover && hover.side === "q" && hover.index !== i) continue;
        for (let j = 0; j < NK; j++) {
          if (hover && hover.side === "k" && hover.index !== j) continue;
          const w = weight(l, h, i, j);
          if (w < 0.01) continue;
          ctx.strokeStyle = headColor(h, Math.min(1, w)); ctx.lineWidth = 2;
          ctx.beginPath(); ctx.moveTo(xl + 4, y(i)); ctx.lineTo(xr - 4, y(j)); ctx.stroke();
        }
      }
    }
    ctx.fillStyle = "#222";
    ctx.textAlign = "right";
    for (let i = 0; i < NQ; i++) { ctx.font = (hover && hover.side === "q" && hover.index === i ? "bold " : "") + "14px system-ui, sans-serif"; ctx.fillText(data.tokens[i], xl - 4, y(i)); }
    ctx.textAlign = "left";
    for (let j = 0; j < NK; j++) { ctx.font = (hover && hover.side === "k" && hover.index === j ? "bold " : "") + "14px system-ui, sans-serif"; ctx.fillText(data.keyTokens[j], xr + 4, y(j)); }
  }
  headCanvas.addEventListener("mousemove", (e) => {
    const r = headCanvas.getBoundingClientRect(), x = e.clientX - r.left, row = Math.floor((e.clientY - r.top - PAD) / ROW);
    let next = null;
    if (x < 150 && row >= 0 && row < NQ) next = { side: "q", index: row };
    else if (x > 150 + COL && row >= 0 && row < NK) next = { side: "k", index: row };
    if (JSON.stringify(next) !== JSON.stringify(hover)) { hover = next; drawHeadView(); }
  });
  headCanvas.addEventListener("mouseleave", () => { hover = null; drawHeadView(); });
  $("head-layer").addEventListener("change", drawHeadView);

  // heatmap view
  const hm = $("hm-canvas"), tip = $("tip");
  let geom = null;
  function drawHeatmap() {
    const l = +$("hm-layer").value, h = +$("hm-head").value;
    $("hm-title").textContent = data.layerNames[l] + " \\u00b7 head " + h;
    const cell = Math.max(2, Math.min(28, Math.floor(720 / Math.max(NQ, NK))));
    const labels = cell >= 8;
    const left = labels ? 120 : 10, top = labels ? 110 : 10;
    hm.width = left + NK * cell + 10; hm.height = top + NQ * cell + 10;
    const ctx = hm.getContext("2d");
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, hm.width, hm.height);
    const m = document.createElement("canvas");
    drawMatrix(m, l, h, cell);
    ctx.drawImage(m, left, top);
    if (labels) {
      ctx.fillStyle = "#222"; ctx.font = Math.min(13, cell) + "px system-ui, sans-serif"; ctx.textBaseline = "middle";
      ctx.textAlign = "right";
      for (let i = 0; i < NQ; i++) ctx.fillText(data.tokens[i], left - 4, top + i * cell + cell / 2);
      for (let j = 0; j < NK; j++) {
        ctx.save(); ctx.translate(left + j * cell + cell / 2, top - 4); ctx.rotate(-Math.PI / 3);
        ctx.textAlign = "left"; ctx.fillText(data.keyTokens[j], 0, 0); ctx.restore();
      }
    }
    geom = { l, h, cell, left, top };
  }
  hm.addEventListener("mousemove", (e) => {
    if (!geom) return;
    const r = hm.getBoundingClientRect();
    const j = Math.floor((e.clientX - r.left - geom.left) / geom.cell), i = Math.floor((e.clientY - r.top - geom.top) / geom.cell);
    if (i < 0 || j < 0 || i >= NQ || j >= NK) { tip.hidden = true; return; }
    tip.textContent = data.tokens[i] + " \\u2192 " + data.keyTokens[j] + "\\n" + weight(geom.l, geom.h, i, j).toFixed(3);
    tip.style.left = (e.clientX + 12) + "px"; tip.style.top = (e.clientY + 12) + "px"; tip.hidden = false;
  });
  hm.addEventListener("mouseleave", () => { tip.hidden = true; });
  $("hm-layer").addEventListener("change", drawHeatmap);
  $("hm-head").addEventListener("change", drawHeatmap);
  document.body.dataset.ready = "1";
})();
</script>
</body>
</html>
"""
