(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("attnkit-data").textContent);
  const L = data.layers, H = data.heads, NQ = data.lq, NK = data.lk;
  const $ = (id) => document.getElementById(id);
  // the page's own glyphs (embedded by attnkit) first, then the system's
  const FONT = '"attnkit-glyphs", system-ui, sans-serif';
  $("title").textContent = data.title;
  const AX = data.axes;  // what the rows and the columns are
  $("summary").textContent = L + " layers \u00d7 " + H + " heads \u00b7 rows: " + NQ + " \u00d7 " + AX[0] +
    ", columns: " + NK + " \u00d7 " + AX[1] + (data.note ? " \u00b7 " + data.note : "");

  const raw = atob(data.weights);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  function weight(l, h, i, j) { return bytes[((l * H + h) * NQ + i) * NK + j] / 255 * data.scale[l * H + h]; }
  const means = {};  // layer -> the mean of its heads, scaled to [0, 1] (h = -1)
  function meanOf(l) {
    if (!means[l]) {
      const m = new Float32Array(NQ * NK);
      let top = 0;
      for (let h = 0; h < H; h++) for (let i = 0; i < NQ; i++) for (let j = 0; j < NK; j++) m[i * NK + j] += weight(l, h, i, j) / H;
      for (let p = 0; p < m.length; p++) top = Math.max(top, m[p]);
      means[l] = { values: m, top: top > 0 ? top : 1 };
    }
    return means[l];
  }
  function level(l, h, i, j) {
    if (h < 0) { const m = meanOf(l); return m.values[i * NK + j] / m.top; }
    return bytes[((l * H + h) * NQ + i) * NK + j] / 255;
  }
  function value(l, h, i, j) { return h < 0 ? meanOf(l).values[i * NK + j] : weight(l, h, i, j); }

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
  const views = { overview: $("overview-view"), model: $("model-view"), head: $("head-view"), heatmap: $("heatmap-view") };
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
  { const o = document.createElement("option"); o.value = -1; o.textContent = "mean of heads"; $("hm-head").appendChild(o); }

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
  let XL = 150;  // where the query labels end; set from the widest label when drawn
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
    // room for the widest label on each side (bold when hovered), so no token is clipped
    const probe = headCanvas.getContext("2d");
    probe.font = "bold 14px " + FONT;
    const widest = (labels) => labels.reduce((w, t) => Math.max(w, probe.measureText(t).width), 0);
    XL = Math.ceil(widest(data.tokens)) + 12;
    headCanvas.width = XL + COL + Math.ceil(widest(data.keyTokens)) + 12; headCanvas.height = rows * ROW + 2 * PAD;
    const ctx = headCanvas.getContext("2d");
    ctx.clearRect(0, 0, headCanvas.width, headCanvas.height);
    ctx.font = "14px " + FONT; ctx.textBaseline = "middle";
    const y = (i) => PAD + i * ROW + ROW / 2, xl = XL, xr = XL + COL;
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
    if (x < XL && row >= 0 && row < NQ) next = { side: "q", index: row };
    else if (x > XL + COL && row >= 0 && row < NK) next = { side: "k", index: row };
    if (JSON.stringify(next) !== JSON.stringify(hover)) { hover = next; drawHeadView(); }
  });
  headCanvas.addEventListener("mouseleave", () => { hover = null; drawHeadView(); });
  $("head-layer").addEventListener("change", drawHeadView);

  // heatmap view
  const hm = $("hm-canvas"), tip = $("tip");
  let geom = null;
  function drawHeatmap() {
    const l = +$("hm-layer").value, h = +$("hm-head").value;
    $("hm-title").textContent = data.layerNames[l] + " \u00b7 " + (h < 0 ? "mean of heads" : "head " + h);
    $("hm-xlabel").textContent = "columns: " + AX[1] + " \u2192";
    $("hm-ylabel").textContent = "rows: " + AX[0];
    // cells as large as the window lets both sides be (up to 48 px), so a short alignment fills the page
    const wide = Math.max(480, window.innerWidth - 320), tall = Math.max(480, window.innerHeight - 230);
    const cell = Math.max(2, Math.min(48, Math.floor(Math.min(wide / NK, tall / NQ))));
    const labels = cell >= 8;
    // room for the widest row label and the widest (rotated) column label
    const probe = hm.getContext("2d");
    probe.font = Math.min(15, cell) + "px " + FONT;
    const widest = (list) => list.reduce((w, t) => Math.max(w, probe.measureText(t).width), 0);
    const left = labels ? Math.ceil(widest(data.tokens)) + 14 : 10;
    const top = labels ? Math.ceil(widest(data.keyTokens) * Math.sin(Math.PI / 3)) + 14 : 10;
    $("hm-xlabel").style.marginLeft = (left + 24) + "px";
    $("hm-ylabel").style.marginTop = top + "px";
    // each column label runs up and to the right of its column (60 degrees): the last ones need room
    // past the matrix's right edge (the most recent, often most attended, columns)
    let right = left + NK * cell + 10;
    if (labels) {
      for (let j = 0; j < NK; j++) {
        right = Math.max(right, Math.ceil(left + j * cell + cell / 2 + probe.measureText(data.keyTokens[j]).width * Math.cos(Math.PI / 3)) + 8);
      }
    }
    hm.width = right; hm.height = top + NQ * cell + 10;
    const ctx = hm.getContext("2d");
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, hm.width, hm.height);
    const m = document.createElement("canvas");
    drawMatrix(m, l, h, cell);
    ctx.drawImage(m, left, top);
    if (labels) {
      ctx.fillStyle = "#222"; ctx.font = Math.min(15, cell) + "px " + FONT; ctx.textBaseline = "middle";
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
    tip.textContent = data.tokens[i] + " \u2192 " + data.keyTokens[j] + "\n" + value(geom.l, geom.h, i, j).toFixed(3);
    tip.style.left = (e.clientX + 12) + "px"; tip.style.top = (e.clientY + 12) + "px"; tip.hidden = false;
  });
  hm.addEventListener("mouseleave", () => { tip.hidden = true; });
  $("hm-layer").addEventListener("change", drawHeatmap);
  $("hm-head").addEventListener("change", drawHeatmap);
  // canvases drawn before the embedded glyphs loaded are drawn again once they have
  const glyphs = document.fonts ? document.fonts.load("14px attnkit-glyphs", data.tokens.join("") + data.keyTokens.join("")) : Promise.resolve();
  // --- overview: the page's answer, shown first when the caller gave one ------------------
  const ov = data.overview;
  if (ov) {
    document.querySelector('nav button[data-view="overview"]').hidden = false;
    $("ov-heading").textContent = ov.heading;
    $("ov-note").textContent = ov.note || "";
    const list = $("ov-list");
    if (ov.kind === "bars") {
      for (const item of ov.items) {
        const li = document.createElement("li");
        const name = document.createElement("div"); name.className = "item"; name.textContent = item.title; li.appendChild(name);
        if (item.caption) { const c = document.createElement("div"); c.className = "why"; c.textContent = item.caption; li.appendChild(c); }
        // one scale for every item (bars_overview's), so that the items compare
        const top = ov.scale || Math.max(1e-12, ...item.bars.map((b) => b[1]));
        for (const [label, v] of item.bars) {
          const row = document.createElement("div"); row.className = "bar-row";
          const n = document.createElement("span"); n.className = "name"; n.textContent = label; n.title = label;
          const track = document.createElement("span");
          const bar = document.createElement("div"); bar.className = "bar"; bar.style.width = Math.max(1, 100 * v / top) + "%";
          track.appendChild(bar);
          const t = document.createElement("span"); t.className = "value"; t.textContent = v.toFixed(ov.digits === undefined ? 2 : ov.digits);
          row.append(n, track, t); li.appendChild(row);
        }
        list.appendChild(li);
      }
    } else if (ov.kind === "waveform") {
      list.className = "spans";
      $("ov-wave-box").hidden = false;
      drawWave();
      ov.spans.forEach(([label, start, end], k) => {
        const li = document.createElement("li");
        li.style.borderBottom = "3px solid " + spanColor(k, 1);
        const c = document.createElement("span"); c.className = "char"; c.textContent = label;
        const t = document.createElement("span"); t.className = "time"; t.textContent = start.toFixed(2) + "\u2013" + end.toFixed(2) + " s";
        li.append(c, t);
        list.appendChild(li);
      });
    }
  }
  function spanColor(k, alpha) { return "hsla(" + Math.round(137.5 * k) % 360 + ",70%,48%," + alpha + ")"; }
  function drawWave() {
    const c = $("ov-wave"), W = 900, Hh = 200, top = 34, mid = top + (Hh - top - 24) / 2, amp = (Hh - top - 24) / 2;
    c.width = W; c.height = Hh;
    const ctx = c.getContext("2d"), env = ov.envelope, n = env.length / 2, x = (t) => 8 + (W - 16) * t / ov.seconds;
    ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, Hh);
    ov.spans.forEach(([label, start, end], k) => {
      ctx.fillStyle = spanColor(k, 0.22); ctx.fillRect(x(start), top, Math.max(2, x(end) - x(start)), Hh - top - 24);
      ctx.fillStyle = spanColor(k, 1); ctx.font = "bold 16px " + FONT; ctx.textAlign = "center"; ctx.textBaseline = "alphabetic";
      ctx.fillText(label, (x(start) + x(end)) / 2, top - 8);
    });
    ctx.strokeStyle = "#333"; ctx.lineWidth = 1; ctx.beginPath();
    for (let p = 0; p < n; p++) {
      const xp = 8 + (W - 16) * (p + 0.5) / n;
      ctx.moveTo(xp, mid - amp * env[2 * p + 1]); ctx.lineTo(xp, mid - amp * env[2 * p] + 0.5);
    }
    ctx.stroke();
    ctx.fillStyle = "#555"; ctx.font = "12px " + FONT; ctx.textAlign = "center"; ctx.textBaseline = "top";
    const tick = ov.seconds > 4 ? 1 : 0.5;
    for (let t = 0; t <= ov.seconds + 1e-9; t += tick) {
      ctx.textAlign = t === 0 ? "left" : "center";
      ctx.fillText(t.toFixed(1) + " s", t === 0 ? 2 : x(t), Hh - 18);
    }
  }

  $("hm-layer").value = data.focus[0]; $("hm-head").value = data.focus[1]; $("head-layer").value = data.focus[0];
  show(data.start);
  glyphs.catch(() => null).then(() => {
    if (ov && ov.kind === "waveform") drawWave();
    if (!views.head.hidden) drawHeadView();
    if (!views.heatmap.hidden) drawHeatmap();
    document.body.dataset.ready = "1";
  });
})();
