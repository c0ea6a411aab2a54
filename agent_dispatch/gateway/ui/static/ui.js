// agent-dispatch web UI: refreshes the page from its JSON view model every few seconds.
// Everything is written with textContent or DOM attributes, never parsed as HTML, so nothing
// from a payload, an error or a tenant name can become markup or script.
"use strict";

(function () {
  const POLL_MS = 2000;
  const SVG = "http://www.w3.org/2000/svg";
  const body = document.body;
  const live = body.dataset.live;

  function cell(value) {
    const td = document.createElement("td");
    if (Array.isArray(value)) {
      const a = document.createElement("a");
      a.textContent = value[0];
      a.setAttribute("href", value[1]);
      td.appendChild(a);
    } else {
      td.textContent = value;
    }
    return td;
  }

  function table(id, rows) {
    const tbody = document.getElementById(id);
    if (!tbody) return;
    const fresh = document.createElement("tbody");
    fresh.id = id;
    for (const row of rows) {
      const tr = document.createElement("tr");
      for (const value of row) tr.appendChild(cell(value));
      fresh.appendChild(tr);
    }
    tbody.replaceWith(fresh);
  }

  function line(svg, values, max, cls) {
    if (values.length < 2) return;
    const w = 600, h = 150;
    const step = w / (values.length - 1);
    const points = values.map((v, i) => `${(i * step).toFixed(1)},${(h - (v / max) * (h - 10) + 5).toFixed(1)}`);
    const path = document.createElementNS(SVG, "polyline");
    path.setAttribute("points", points.join(" "));
    path.setAttribute("class", cls);
    svg.appendChild(path);
  }

  function chart(series) {
    const svg = document.getElementById("chart");
    if (!svg || !series) return;
    for (const old of svg.querySelectorAll("polyline")) old.remove();
    const depthMax = Math.max(1, ...series.depth);
    const rateMax = Math.max(1, ...series.done, ...series.admitted);
    line(svg, series.depth, depthMax, "depth");
    line(svg, series.done, rateMax, "done");
    line(svg, series.admitted, rateMax, "admitted");
  }

  function apply(model) {
    for (const [id, text] of Object.entries(model.fields || {})) {
      const el = document.getElementById(id);
      if (el) el.textContent = text;
    }
    for (const [id, rows] of Object.entries(model.tables || {})) table(id, rows);
    for (const [id, href] of Object.entries(model.links || {})) {
      const el = document.getElementById(id);
      if (el) el.setAttribute("href", href);
    }
    for (const [id, hidden] of Object.entries(model.hidden || {})) {
      const el = document.getElementById(id);
      if (el) el.hidden = hidden;
    }
    chart(model.chart);
  }

  async function refresh() {
    const status = document.getElementById("live-status");
    try {
      // Paged lists refresh the page they show (its filters and position are in the query).
      const paged = body.dataset.page === "jobs" || body.dataset.page === "tenants";
      const url = paged ? live + window.location.search : live;
      const response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (response.status === 401) {
        window.location.assign("/ui/login");
        return;
      }
      if (!response.ok) {
        if (status) status.textContent = `Live updates paused: the gateway answered ${response.status}.`;
        return;
      }
      apply(await response.json());
      if (status) status.textContent = `Updated ${new Date().toLocaleTimeString()}.`;
    } catch (err) {
      if (status) status.textContent = "Live updates paused: the gateway cannot be reached.";
    }
  }

  if (live) {
    refresh();
    window.setInterval(refresh, POLL_MS);
  }
})();
