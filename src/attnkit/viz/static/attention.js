(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("attnkit-data").textContent);
  const L = data.layers, H = data.heads, NQ = data.lq, NK = data.lk;
  const $ = (id) => document.getElementById(id);
  // the page's own glyphs (embedded by attnkit) first, then the system's
  const FONT = '"attnkit-glyphs", system-ui, sans-serif';
  $("title").textContent = data.title;
  $("summary").textContent = L + " layers \u00d7 " + H + " heads, " + NQ + " \u00d7 " + NK + " tokens" +
    (data.note ? " \u00b7 " + data.note : "");

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
        " tokens per side and this input has " + NQ + " \u00d7 " + NK + ". Use the heatmap view, or a shorter text.";
      return;
    }
    const l = +$("head-layer").value;
    const rows = Math.max(NQ, NK);
    headCanvas.width = COL + 2 * 160; headCanvas.height = rows * ROW + 2 * PAD;
    const ctx = headCanvas.getContext("2d");
    ctx.clearRect(0, 0, headCanvas.width, headCanvas.height);
    ctx.font = "14px " + FONT; ctx.textBaseline = "middle";
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
    for (let i = 0; i < NQ; i++) { ctx.font = (hover && hover.side === "q" && hover.index === i ? "bold " : "") + "14px " + FONT; ctx.fillText(data.tokens[i], xl - 4, y(i)); }
    ctx.textAlign = "left";
    for (let j = 0; j < NK; j++) { ctx.font = (hover && hover.side === "k" && hover.index === j ? "bold " : "") + "14px " + FONT; ctx.fillText(data.keyTokens[j], xr + 4, y(j)); }
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
    $("hm-title").textContent = data.layerNames[l] + " \u00b7 head " + h;
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
      ctx.fillStyle = "#222"; ctx.font = Math.min(13, cell) + "px " + FONT; ctx.textBaseline = "middle";
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
    tip.textContent = data.tokens[i] + " \u2192 " + data.keyTokens[j] + "\n" + weight(geom.l, geom.h, i, j).toFixed(3);
    tip.style.left = (e.clientX + 12) + "px"; tip.style.top = (e.clientY + 12) + "px"; tip.hidden = false;
  });
  hm.addEventListener("mouseleave", () => { tip.hidden = true; });
  $("hm-layer").addEventListener("change", drawHeatmap);
  $("hm-head").addEventListener("change", drawHeatmap);
  // canvases drawn before the embedded glyphs loaded are drawn again once they have
  const glyphs = document.fonts ? document.fonts.load("14px attnkit-glyphs", data.tokens.join("") + data.keyTokens.join("")) : Promise.resolve();
  glyphs.catch(() => null).then(() => {
    if (!views.head.hidden) drawHeadView();
    if (!views.heatmap.hidden) drawHeatmap();
    document.body.dataset.ready = "1";
  });
})();
