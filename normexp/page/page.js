/* normexp's report page: draws the charts from the page's own data (the <script id="page-data"> JSON)
   with the Plotly inlined above, and makes the run table sortable and filterable. Nothing is fetched.
   When every chart is drawn, <body data-ready> says "ok" (or "broken: ..." naming what failed), which the
   browser tests read. */
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("page-data").textContent);
  var CONFIG = {displaylogo: false, responsive: true, modeBarButtonsToRemove: ["select2d", "lasso2d"]};
  var FONT = {family: "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size: 12};
  var drawn = [];
  var failures = [];
  var times = window.normexpTimes = {};  // ms each part took to draw (the tests and the docs' budget read them)

  function attempt(name, draw) {
    var start = performance.now();
    try {
      var result = draw();
      if (result && result.then) {
        drawn.push(result.then(function () { times[name] = performance.now() - start; },
                                function (e) { failures.push(name + ": " + e); }));
      } else {
        times[name] = performance.now() - start;
      }
    } catch (e) {
      failures.push(name + ": " + (e && e.message ? e.message : e));
    }
  }

  function fmt(value) {
    if (value === null || value === undefined || !isFinite(value)) { return "—"; }
    return Number(value).toPrecision(4).replace(/\.?0+(e|$)/, "$1");
  }

  function rgba(hex, alpha) {
    var n = parseInt(hex.slice(1), 16);
    return "rgba(" + (n >> 16 & 255) + "," + (n >> 8 & 255) + "," + (n & 255) + "," + alpha + ")";
  }

  function thresholdShapes(limits, log) {
    return (limits || []).map(function (limit) {
      return {type: "line", xref: "paper", x0: 0, x1: 1, yref: "y", y0: limit, y1: limit,
              line: {color: "#222", width: 1, dash: "dash"}};
    });
  }

  /* a text task's floors (unigram, bigram): dash-dotted, each named at its right end */
  function floorShapes(floors) {
    return (floors || []).map(function (floor) {
      return {type: "line", xref: "paper", x0: 0, x1: 1, yref: "y", y0: floor.y, y1: floor.y,
              line: {color: "#8c564b", width: 1, dash: "dashdot"}};
    });
  }

  function floorLabels(floors, log) {
    return (floors || []).map(function (floor) {
      return {xref: "paper", x: 1, xanchor: "right", yref: "y", y: log ? Math.log10(floor.y) : floor.y,
              yanchor: "bottom", text: floor.name, showarrow: false, font: {size: 10, color: "#8c564b"}};
    });
  }

  /* ---------------------------------------------------------------- curves: mean ± standard error */
  function drawCurves() {
    var c = data.curves;
    var box = document.getElementById("curves-chart");
    if (!c || !box) { return null; }
    var traces = [];
    c.lines.forEach(function (line, i) {
      var group = "v" + i;
      var xs = [], upper = [], lower = [];
      line.x.forEach(function (x, k) {
        var y = line.y[k], se = line.se[k];
        if (y === null || se === null) { return; }
        var low = y - se;
        if (c.log && low <= 0) { low = y / 10; }
        xs.push(x); upper.push(y + se); lower.push(low);
      });
      if (xs.length > 1) {
        traces.push({type: "scatter", mode: "lines", x: xs.concat(xs.slice().reverse()),
                     y: upper.concat(lower.reverse()), fill: "toself", fillcolor: rgba(line.color, 0.16),
                     line: {width: 0}, hoverinfo: "skip", showlegend: false, legendgroup: group});
      }
      var name = line.name + " (n=" + line.runs + (line.diverged ? ", " + line.diverged + " diverged" : "") + ")";
      traces.push({
        type: "scatter", mode: "lines", name: name, legendgroup: group, x: line.x, y: line.y,
        line: {color: line.color, dash: line.dash, width: 1.8},
        customdata: line.x.map(function (_, k) {
          return [line.n[k], line.se[k] === null ? "" : " ± " + fmt(line.se[k]),
                  line.why[k] ? " (" + line.why[k] + ")" : ""];
        }),
        hovertemplate: "<b>" + line.name.replace(/</g, "&lt;") + "</b><br>step %{x}: %{y:.4g}%{customdata[1]}" +
                       "<br>mean of %{customdata[0]} of " + line.runs + " runs%{customdata[2]}<extra></extra>"
      });
    });
    var layout = {
      font: FONT, margin: {l: 64, r: 16, t: 36, b: 48}, hovermode: "closest",
      xaxis: {title: {text: "optimizer step"}, zeroline: false},
      yaxis: {title: {text: c.label}, type: c.log ? "log" : "linear", exponentformat: "none"},
      legend: {title: {text: c.keys.join(", ")}, font: {size: 11}, itemclick: "toggle", itemdoubleclick: "toggleothers"},
      shapes: thresholdShapes(c.limits).concat(floorShapes(c.floors)),
      annotations: floorLabels(c.floors, c.log)
    };
    if (c.range) { layout.yaxis.range = c.range; }
    return Plotly.newPlot(box, traces, layout, CONFIG);
  }

  /* ---------------------------------------------------------------- phase diagram */
  function colorbar(p, show) {
    if (!show) { return undefined; }
    var bar = {title: {text: p.label, side: "right"}, thickness: 12, len: 0.9};
    if (p.log) {
      var vals = [], text = [];
      for (var e = Math.floor(p.range[0]); e <= Math.ceil(p.range[1]); e++) {
        [1, 2, 5].forEach(function (m) {
          var v = e + Math.log10(m);
          if (v >= p.range[0] - 1e-9 && v <= p.range[1] + 1e-9) { vals.push(v); text.push(fmt(Math.pow(10, v))); }
        });
      }
      bar.tickvals = vals; bar.ticktext = text;
    }
    return bar;
  }

  function drawPhase() {
    var p = data.phase;
    var box = document.getElementById("phase-panels");
    if (!p || !box) { return null; }
    var plots = [];
    p.panels.forEach(function (panel, i) {
      var div = document.createElement("div");
      div.className = "panel";
      div.id = "phase-" + i;
      box.appendChild(div);
      var last = i === p.panels.length - 1 || p.panels.length === 1;
      var traces, layout = {
        font: FONT, margin: {l: 64, r: 10, t: 34, b: 56},
        title: {text: panel.title, font: {size: 13}, x: 0.02, xanchor: "left"},
        xaxis: {title: {text: p.x}}, yaxis: {title: {text: p.y}}
      };
      if (p.sampled) {
        var pts = panel.points;
        traces = [{
          type: "scatter", mode: "markers", x: pts.map(function (q) { return q.x; }),
          y: pts.map(function (q) { return q.y; }), text: pts.map(function (q) { return q.hover; }),
          hovertemplate: p.x + " %{x}<br>" + p.y + " %{y}<br>%{text}<extra></extra>",
          marker: {size: 11, color: pts.map(function (q) { return q.z; }), colorscale: "Viridis",
                   reversescale: !p.accuracy, cmin: p.range[0], cmax: p.range[1], showscale: last,
                   colorbar: colorbar(p, last),
                   symbol: pts.map(function (q) { return q.diverged ? "x" : "circle"; }),
                   line: {color: pts.map(function (q) { return q.trained ? "#d62728" : "#333"; }),
                          width: pts.map(function (q) { return q.trained ? 2.5 : 0.5; })}}
        }];
        layout.xaxis.type = p.xlog ? "log" : "linear";
        layout.yaxis.type = p.ylog ? "log" : "linear";
      } else {
        traces = [{
          type: "heatmap", x: panel.xs, y: panel.ys, z: panel.z, text: panel.text, customdata: panel.hover,
          texttemplate: "%{text}", textfont: {size: 11}, xgap: 1, ygap: 1, hoverongaps: false,
          hovertemplate: p.x + " %{x}, " + p.y + " %{y}<br>%{customdata}<extra></extra>",
          colorscale: "Viridis", reversescale: !p.accuracy, zmin: p.range[0], zmax: p.range[1], showscale: last,
          colorbar: colorbar(p, last)
        }];
        layout.xaxis.type = "category";
        layout.yaxis.type = "category";
        layout.shapes = panel.edges.map(function (s) {
          return {type: "line", x0: s[0], y0: s[1], x1: s[2], y1: s[3], line: {color: "#d62728", width: 3}};
        });
      }
      plots.push(Plotly.newPlot(div, traces, layout, CONFIG));
    });
    return Promise.all(plots);
  }

  /* ---------------------------------------------------------------- parallel coordinates */
  function drawParallel() {
    var q = data.parallel;
    var box = document.getElementById("parallel-chart");
    if (!q || !box) { return null; }
    var trace = {
      type: "parcoords", dimensions: q.dimensions,
      line: {color: q.color, colorscale: "Viridis", reversescale: !q.accuracy, cmin: q.cmin, cmax: q.cmax,
             showscale: true, colorbar: {title: {text: q.label, side: "right"}, thickness: 12,
                                         tickvals: q.dimensions[q.dimensions.length - 1].tickvals,
                                         ticktext: q.dimensions[q.dimensions.length - 1].ticktext}}
    };
    return Plotly.newPlot(box, [trace], {font: FONT, margin: {l: 70, r: 90, t: 50, b: 24}}, CONFIG);
  }

  /* ---------------------------------------------------------------- the run table */
  function setupRuns() {
    var table = document.getElementById("runs-table");
    if (!table) { return; }
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var heads = Array.prototype.slice.call(table.tHead.rows[0].cells);
    var count = document.getElementById("runs-count");
    var input = document.getElementById("runs-filter");
    var buttons = Array.prototype.slice.call(document.querySelectorAll("#runs-tools button"));
    var kind = "";
    rows.forEach(function (row, i) { row._order = i; row._text = row.textContent.toLowerCase(); });

    function value(row, column, numeric) {
      var cell = row.cells[column];
      var text = cell.getAttribute("data-v") || cell.textContent;
      if (!numeric) { return text.toLowerCase(); }
      var number = parseFloat(text);
      return isNaN(number) ? null : number;
    }

    function sortBy(column, descending) {
      var numeric = heads[column].getAttribute("data-type") === "num";
      var keyed = rows.map(function (row) { return [value(row, column, numeric), row]; });
      keyed.sort(function (a, b) {
        var x = a[0], y = b[0];
        if (x === null || y === null) {  // no value: last, whichever the direction
          return x === y ? a[1]._order - b[1]._order : x === null ? 1 : -1;
        }
        var order = numeric ? x - y : x < y ? -1 : x > y ? 1 : 0;
        return (descending ? -order : order) || a[1]._order - b[1]._order;
      });
      rows = keyed.map(function (pair) { return pair[1]; });
      var fragment = document.createDocumentFragment();
      rows.forEach(function (row) { fragment.appendChild(row); });
      body.appendChild(fragment);
      heads.forEach(function (head, i) {
        if (i === column) { head.setAttribute("aria-sort", descending ? "descending" : "ascending"); }
        else { head.removeAttribute("aria-sort"); }
      });
    }

    function filter() {
      var words = input.value.toLowerCase().split(/\s+/).filter(Boolean);
      var shown = 0;
      rows.forEach(function (row) {
        var ok = (!kind || row.classList.contains(kind)) &&
                 words.every(function (word) { return row._text.indexOf(word) >= 0; });
        row.style.display = ok ? "" : "none";
        shown += ok ? 1 : 0;
      });
      count.textContent = shown === rows.length ? "all " + rows.length + " runs" :
                          shown + " of " + rows.length + " runs";
    }

    heads.forEach(function (head, i) {
      head.addEventListener("click", function () {
        sortBy(i, head.getAttribute("aria-sort") === "ascending");
      });
    });
    input.addEventListener("input", filter);
    buttons.forEach(function (button) {
      button.addEventListener("click", function () {
        kind = button.getAttribute("data-kind");
        buttons.forEach(function (b) { b.classList.toggle("on", b === button); });
        filter();
      });
    });
    count.textContent = "all " + rows.length + " runs";  // every row shown: nothing to restyle on load
  }

  /* ---------------------------------------------------------------- the step table's hidden steps */
  function setupSteps() {
    Array.prototype.slice.call(document.querySelectorAll("button[data-steps]")).forEach(function (button) {
      var table = document.getElementById(button.getAttribute("data-steps"));
      button.addEventListener("click", function () {
        var fitted = table.classList.toggle("fit");
        button.textContent = fitted ? button.getAttribute("data-more") : "show fewer steps";
      });
    });
  }

  attempt("curves", drawCurves);
  attempt("phase", drawPhase);
  attempt("parallel", drawParallel);
  attempt("runs", setupRuns);
  attempt("steps", setupSteps);
  Promise.all(drawn).then(function () {
    document.body.setAttribute("data-ready", failures.length ? "broken: " + failures.join("; ") : "ok");
  });
})();
