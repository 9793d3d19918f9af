"""The report page's style and script, inlined into report.html so it opens with no network.

The script draws one SVG chart per panel from the page's JSON (``<script id="report-data">``, written by
:func:`ppo_watchdog.observe.report.render_html`): the kept timeline as a solid line, the branches a rollback or
restart abandoned as dashed grey lines, rolled-back spans shaded, decisions as coloured vertical lines,
non-finite values as red marks on the top edge. Hovering shows every panel's values at that step; dragging
across a chart zooms all of them to those steps, a double click (or the button) zooms back out. When it has
drawn every chart it sets ``data-rendered="ok"`` on ``<body>``; an error sets ``data-error`` instead (the
headless-browser test reads both).
"""

from __future__ import annotations

STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.5em 2em;color:#222;background:#fafafa}
h1{font-size:1.4em;margin:0 0 .4em}h2{font-size:1.1em;margin:1.2em 0 .4em}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:.8em 1.2em;display:grid;
 grid-template-columns:max-content 1fr;gap:.25em 1.2em;font-size:14px;max-width:1200px}
.card dt{color:#666}.card dd{margin:0;font-family:ui-monospace,monospace;word-break:break-all}
.outcome-finished{color:#1a7f37;font-weight:600}.outcome-failed,.outcome-stopped{color:#c62828;font-weight:600}
.legend{display:flex;flex-wrap:wrap;gap:1.2em;font-size:13px;margin:.5em 0;align-items:center}
.legend svg{vertical-align:middle}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:12px;max-width:1600px}
.panel{background:#fff;border:1px solid #ddd;border-radius:6px;padding:4px 6px}
.panel h3{font-size:13px;margin:2px 4px;font-weight:600}.panel h3 small{color:#777;font-weight:400}
svg.chart{width:100%;height:210px;display:block;user-select:none;cursor:crosshair}
svg.chart text{font-size:10px;fill:#555}
svg.chart .grid{stroke:#eee}svg.chart .axis{stroke:#999}
svg.chart .kept{fill:none;stroke:#1f77b4;stroke-width:1.6}
svg.chart .abandoned{fill:none;stroke:#999;stroke-width:1.2;stroke-dasharray:4 3}
svg.chart .span{fill:#d62728;opacity:.09}
svg.chart .bad{fill:#d62728}
svg.chart .hover{stroke:#333;stroke-width:.7}svg.chart .sel{fill:#1f77b4;opacity:.15}
.tip{position:fixed;pointer-events:none;background:#fff;border:1px solid #aaa;border-radius:4px;padding:4px 7px;
 font-size:12px;box-shadow:0 1px 4px rgba(0,0,0,.15);display:none;white-space:pre;font-family:ui-monospace,monospace}
ol.decisions{font-size:14px;line-height:1.5;padding-left:1.6em;max-width:1200px}
ol.decisions li span.st{display:inline-block;min-width:5.5em;font-size:12px;color:#fff;border-radius:3px;
 padding:0 4px;margin-right:.5em;text-align:center}
button{font-size:12px}.muted{color:#777;font-size:13px}
"""

SCRIPT = r"""
"use strict";
window.addEventListener("error", function (e) { document.body.dataset.error = String(e.message); });
(function () {
  var D = JSON.parse(document.getElementById("report-data").textContent);
  var NS = "http://www.w3.org/2000/svg", W = 560, H = 210, L = 62, R = 10, T = 12, B = 24;
  var view = [D.xmin, D.xmax], charts = [], tip = document.getElementById("tip");

  function el(name, attrs, parent) {
    var e = document.createElementNS(NS, name);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "-";
    var a = Math.abs(v);
    return (a !== 0 && (a < 1e-3 || a >= 1e5)) ? v.toExponential(2) : String(+v.toPrecision(4));
  }
  function ticksLinear(lo, hi) {
    var span = hi - lo, step = Math.pow(10, Math.floor(Math.log10(span / 4)));
    [1, 2, 5, 10].some(function (m) { if (span / (step * m) <= 6) { step *= m; return true; } return false; });
    var out = [];
    for (var t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(+t.toPrecision(12));
    return out;
  }
  function ticksLog(lo, hi) {  // lo, hi in log10 units
    var out = [], mult = (hi - lo) < 1.5 ? [1, 2, 5] : [1];
    for (var e = Math.floor(lo); e <= Math.ceil(hi); e++)
      mult.forEach(function (m) { var t = Math.log10(m) + e; if (t >= lo - 1e-9 && t <= hi + 1e-9) out.push(t); });
    return out.length > 8 ? out.filter(function (_, i) { return i % Math.ceil(out.length / 8) === 0; }) : out;
  }
  function inView(pts) { return pts.filter(function (p) { return p[0] >= view[0] && p[0] <= view[1]; }); }

  function draw(c) {
    var p = c.panel, svg = c.svg;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    var all = inView(p.kept);
    p.branches.forEach(function (b) { all = all.concat(inView(b)); });
    var ys = all.map(function (q) { return q[1]; }).filter(function (v) { return v !== null && (!p.log || v > 0); });
    if (p.log) ys = ys.map(Math.log10);
    var lo = Math.min.apply(null, ys), hi = Math.max.apply(null, ys);
    if (!ys.length) { lo = 0; hi = 1; }
    if (hi - lo < 1e-12) { var d = Math.abs(hi) * 0.1 || (p.log ? 0.5 : 1); lo -= d; hi += d; }
    var pad = (hi - lo) * 0.06; lo -= pad; hi += pad;
    var x0 = view[0], x1 = Math.max(view[1], view[0] + 1);
    function sx(s) { return L + (s - x0) / (x1 - x0) * (W - L - R); }
    function sy(v) { var y = p.log ? Math.log10(v) : v; return T + (hi - y) / (hi - lo) * (H - T - B); }
    c.sx = sx; c.x0 = x0; c.x1 = x1;
    var clip = "clip-" + c.i;
    el("rect", {x: L, y: T, width: W - L - R, height: H - T - B}, el("clipPath", {id: clip}, el("defs", {}, svg)));
    (p.log ? ticksLog(lo, hi) : ticksLinear(lo, hi)).forEach(function (t) {
      var y = T + (hi - t) / (hi - lo) * (H - T - B);
      el("line", {x1: L, x2: W - R, y1: y, y2: y, "class": "grid"}, svg);
      el("text", {x: L - 4, y: y + 3, "text-anchor": "end"}, svg).textContent = fmt(p.log ? Math.pow(10, t) : t);
    });
    ticksLinear(x0, x1).filter(function (t) { return t === Math.round(t); }).forEach(function (t) {
      el("text", {x: sx(t), y: H - 8, "text-anchor": "middle"}, svg).textContent = String(t);
    });
    el("line", {x1: L, x2: L, y1: T, y2: H - B, "class": "axis"}, svg);
    el("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, "class": "axis"}, svg);
    var g = el("g", {"clip-path": "url(#" + clip + ")"}, svg);
    D.spans.forEach(function (s) {
      el("rect", {x: sx(s[0]), y: T, width: Math.max(1, sx(s[1]) - sx(s[0])), height: H - T - B, "class": "span"}, g);
    });
    D.marks.forEach(function (m) {
      var ln = el("line", {x1: sx(m.step), x2: sx(m.step), y1: T, y2: H - B, stroke: m.colour, "stroke-width": 1.2,
                           "stroke-dasharray": "2 2", "class": "decision"}, g);
      el("title", {}, ln).textContent = m.text;
    });
    function path(pts, cls) {
      var d = "", pen = false;
      pts.forEach(function (q) {
        if (q[1] === null || (p.log && q[1] <= 0)) { pen = false; return; }
        d += (pen ? "L" : "M") + sx(q[0]).toFixed(1) + "," + sy(q[1]).toFixed(1); pen = true;
      });
      if (d) el("path", {d: d, "class": cls}, g);
    }
    p.branches.forEach(function (b) { path(b, "abandoned"); });
    path(p.kept, "kept");
    p.bad.forEach(function (b) {
      var x = sx(b[0]);
      var m = el("path", {d: "M" + (x - 4) + "," + T + "L" + (x + 4) + "," + T + "L" + x + "," + (T + 7) + "Z",
                          "class": "bad"}, g);
      el("title", {}, m).textContent = b[1] + " at step " + b[0];
    });
    c.hover = el("line", {x1: -10, x2: -10, y1: T, y2: H - B, "class": "hover"}, svg);
    c.sel = el("rect", {x: 0, y: T, width: 0, height: H - T - B, "class": "sel"}, svg);
  }

  function stepAt(c, evt) {
    var box = c.svg.getBoundingClientRect(), x = (evt.clientX - box.left) * W / box.width;
    return Math.round(c.x0 + (x - L) / (W - L - R) * (c.x1 - c.x0));
  }
  function valueAt(pts, s) {
    for (var i = 0; i < pts.length; i++) if (pts[i][0] === s) return pts[i][1];
    return undefined;
  }
  function hover(s, evt) {
    var lines = ["step " + s];
    charts.forEach(function (c) {
      var x = s >= c.x0 && s <= c.x1 ? c.sx(s) : -10;
      c.hover.setAttribute("x1", x); c.hover.setAttribute("x2", x);
      var v = valueAt(c.panel.kept, s), bad = c.panel.bad.filter(function (b) { return b[0] === s; });
      var old = c.panel.branches.map(function (b) { return valueAt(b, s); }).filter(function (q) { return q !== undefined; });
      if (v !== undefined || old.length || bad.length)
        lines.push(c.panel.title + ": " + (bad.length ? bad[0][1] : fmt(v)) +
                   (old.length ? "   abandoned: " + old.map(fmt).join(", ") : ""));
    });
    D.marks.forEach(function (m) { if (m.step === s) lines.push(m.text); });
    tip.textContent = lines.join("\n");
    tip.style.display = "block";
    tip.style.left = Math.min(evt.clientX + 14, window.innerWidth - tip.offsetWidth - 8) + "px";
    tip.style.top = (evt.clientY + 14) + "px";
  }
  function zoom(a, b) { view = [Math.min(a, b), Math.max(a, b)]; charts.forEach(draw); }

  D.panels.forEach(function (p, i) {
    var box = document.createElement("div"); box.className = "panel";
    var h = document.createElement("h3"); h.textContent = p.title + " ";
    var small = document.createElement("small"); small.textContent = p.key + (p.log ? " (log axis)" : "");
    h.appendChild(small); box.appendChild(h);
    var svg = el("svg", {viewBox: "0 0 " + W + " " + H, preserveAspectRatio: "none", "class": "chart",
                         "data-key": p.key}, box);
    document.getElementById("charts").appendChild(box);
    var c = {panel: p, svg: svg, i: i}, start = null;
    charts.push(c);
    svg.addEventListener("mousemove", function (evt) {
      var s = stepAt(c, evt);
      hover(s, evt);
      if (start !== null) {
        var a = c.sx(Math.max(c.x0, Math.min(start, s))), b = c.sx(Math.min(c.x1, Math.max(start, s)));
        c.sel.setAttribute("x", a); c.sel.setAttribute("width", Math.max(0, b - a));
      }
    });
    svg.addEventListener("mouseleave", function () { tip.style.display = "none"; });
    svg.addEventListener("mousedown", function (evt) { start = stepAt(c, evt); evt.preventDefault(); });
    svg.addEventListener("mouseup", function (evt) {
      var s = stepAt(c, evt);
      if (start !== null && Math.abs(s - start) >= 2) zoom(start, s);
      else c.sel.setAttribute("width", 0);
      start = null;
    });
    svg.addEventListener("dblclick", function () { zoom(D.xmin, D.xmax); });
  });
  document.getElementById("reset").addEventListener("click", function () { zoom(D.xmin, D.xmax); });
  charts.forEach(draw);
  if (!document.body.dataset.error) document.body.dataset.rendered = "ok";
})();
"""
