"""The status page's HTML: tables rendered here (it reads without JavaScript), a stylesheet, and
one small inline script that polls ``status.json`` every second and redraws the summary, the
tables, the timeline and the charts (SVG line charts drawn by hand: no library, no build step).
The script asks for the whole status once, then ``?since=`` the cursor of the answer before, and
merges what comes into what it holds: the chart points after the first ``series.keep`` of its
own, and the new events after its own (``coordinator.cluster_status.Cursor``).

Every value reaches the page escaped (``html.escape`` here, ``textContent`` in the script), and
the Content-Security-Policy allows only this script and this stylesheet, by their hashes.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import html
from collections.abc import Mapping, Sequence
from typing import Any

from paramserve.coordinator.status.cluster_status import EVENTS_SHOWN, bytes_text

__all__ = ["CONTENT_SECURITY_POLICY", "SCRIPT", "STYLE", "render_page"]

POLL_MILLISECONDS = 1000
NO_SCRIPT_REFRESH_SECONDS = 5

STYLE = """
:root{--fg:#1d2330;--muted:#667085;--line:#d0d5dd;--bg:#f8f9fb;--card:#fff;--alive:#12805c;--joining:#b54708;
--lost:#c01048;--stopped:#475467;--accent:#1f6feb}
*{box-sizing:border-box}
body{margin:0;font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;color:var(--fg);background:var(--bg)}
header{display:flex;gap:1rem;align-items:baseline;padding:.7rem 1.2rem;background:#101828;color:#fff;flex-wrap:wrap}
header h1{font-size:1.1rem;margin:0}
header .meta{color:#d0d5dd;font-size:.85rem}
.badge{padding:.1rem .55rem;border-radius:1rem;font-size:.8rem;font-weight:600;background:#344054}
.badge.training{background:var(--alive)}.badge.recovering{background:var(--joining)}
body.stale .badge{background:var(--lost)}
main{padding:1rem 1.2rem;display:grid;gap:1rem}
section{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:.8rem 1rem;min-width:0}
h2{font-size:.95rem;margin:0 0 .6rem}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(210px,1fr));gap:1rem}
.cards dl{display:grid;grid-template-columns:auto 1fr;gap:.15rem .8rem;margin:0}
.cards dt{color:var(--muted)}.cards dd{margin:0;font-variant-numeric:tabular-nums;font-weight:600}
.charts{display:grid;grid-template-columns:repeat(auto-fit,minmax(320px,1fr));gap:1rem}
figure{margin:0}
figcaption{font-weight:600;font-size:.85rem;display:flex;justify-content:space-between;gap:.5rem}
figcaption .now{color:var(--muted);font-weight:400}
svg.chart{width:100%;height:150px;background:#fcfcfd;border:1px solid #eaecf0;border-radius:4px}
svg.chart polyline{fill:none;stroke-width:1.6}
svg.chart .s0{stroke:#1f6feb}svg.chart .s1{stroke:#12805c}svg.chart .s2{stroke:#c01048}svg.chart .s3{stroke:#b54708}
svg.chart text{font-size:10px;fill:var(--muted)}
svg.chart line.grid{stroke:#eaecf0}
svg.chart line.ev{stroke-width:1;stroke-dasharray:3 2}
.ev-lost{stroke:var(--lost)}.ev-recovered{stroke:var(--alive)}.ev-checkpoint{stroke:var(--accent)}.ev-error{stroke:#7a2e0e}
.legend{display:flex;gap:.8rem;font-size:.75rem;color:var(--muted)}
.legend .s0{color:#1f6feb}.legend .s1{color:#12805c}.legend .s2{color:#c01048}.legend .s3{color:#b54708}
.cluster{display:grid;grid-template-columns:minmax(0,1fr) minmax(0,1fr);gap:1rem;align-items:start}
@media (max-width:1000px){.cluster{grid-template-columns:1fr}}
.scroll{max-height:60vh;overflow:auto}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th,td{text-align:left;padding:.25rem .5rem;border-bottom:1px solid #eaecf0;white-space:nowrap}
th{position:sticky;top:0;background:var(--card);color:var(--muted);font-weight:600;font-size:.8rem}
td.num,th.num{text-align:right}
td.msg{white-space:normal}
.state{font-weight:600}
.state.alive,.state.serving{color:var(--alive)}.state.joining,.state.busy,.state.recovering{color:var(--joining)}
.state.lost,.state.unreachable{color:var(--lost)}.state.stopped,.state.unknown{color:var(--stopped)}
tr.worker-lost td,tr.ps-recovery-failed td,tr.error td{background:#fff1f3}
tr.worker-recovered td,tr.ps-recovered td{background:#ecfdf3}
tr.checkpoint td{background:#eff8ff}
.muted{color:var(--muted)}
"""

SCRIPT = """
"use strict";
(function () {
  const QUERY = document.body.dataset.query || "";
  const POLL = Number(document.body.dataset.poll) || 1000;
  const EVENTS = Number(document.body.dataset.events) || 100;
  const SVG = "http://www.w3.org/2000/svg";
  const CHARTS = [
    {id: "closures", series: [["scheduled_per_s", "scheduled"], ["done_per_s", "done"], ["failed_per_s", "failed"]]},
    {id: "queue", series: [["queued", "queued"], ["running", "running"]]},
    {id: "steps", series: [["steps_per_s", "steps/s"]]},
    {id: "samples", series: [["samples_per_s", "samples/s"]], empty: "report(samples=...) to chart samples/s"},
    {id: "loss", series: [["loss", "loss"]], empty: "report(loss=...) to chart the loss"},
  ];
  const MARKED = {"worker-lost": "ev-lost", "worker-recovered": "ev-recovered", "ps-recovering": "ev-lost",
    "ps-recovered": "ev-recovered", "ps-recovery-failed": "ev-error", "checkpoint": "ev-checkpoint",
    "error": "ev-error"};

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    if (cls) node.className = cls;
    return node;
  }
  function num(v) {
    if (v === null || v === undefined) return "\\u2014";
    if (typeof v !== "number") return String(v);
    if (Number.isInteger(v)) return v.toLocaleString("en-US");
    return Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 1 ? v.toFixed(2) : v.toPrecision(3);
  }
  function ago(then, now) {
    if (then === null || then === undefined) return "\\u2014";
    const s = Math.max(0, now - then);
    if (s < 60) return s.toFixed(1) + " s ago";
    if (s < 3600) return (s / 60).toFixed(0) + " min ago";
    return (s / 3600).toFixed(1) + " h ago";
  }
  function clock(t) { return new Date(t * 1000).toLocaleTimeString("en-GB"); }
  function bytes(n) {
    if (n === null || n === undefined) return "\\u2014";
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return i === 0 ? n + " B" : n.toFixed(1) + " " + units[i];
  }
  function duration(s) {
    if (s < 60) return s.toFixed(0) + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
    return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  }
  function setText(id, text) { const n = document.getElementById(id); if (n) n.textContent = text; }
  function fillRows(id, rows, make) {
    const body = document.getElementById(id);
    if (!body) return;
    const fresh = document.createDocumentFragment();
    for (const row of rows) fresh.appendChild(make(row));
    body.replaceChildren(fresh);
  }
  function cells(tr, values) {
    for (const [text, cls] of values) tr.appendChild(el("td", text, cls));
    return tr;
  }
  function last(values) {
    for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null) return values[i];
    return null;
  }

  function drawChart(svg, t, lines, events, empty) {
    const W = 480, H = 150, L = 44, R = 8, T = 8, B = 18;
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    svg.replaceChildren();
    const values = [];
    for (const line of lines) for (const v of line.values) if (v !== null) values.push(v);
    let drawn = 0;
    if (t.length < 2 || values.length < 2) {
      const msg = document.createElementNS(SVG, "text");
      msg.setAttribute("x", W / 2); msg.setAttribute("y", H / 2); msg.setAttribute("text-anchor", "middle");
      msg.textContent = values.length ? "collecting\\u2026" : (empty || "nothing yet");
      svg.appendChild(msg);
      svg.dataset.points = "0";
      return;
    }
    let lo = Math.min(0, ...values), hi = Math.max(...values);
    if (hi === lo) hi = lo + 1;
    const t0 = t[0], t1 = t[t.length - 1], span = Math.max(t1 - t0, 1e-9);
    const x = (v) => L + (W - L - R) * (v - t0) / span;
    const y = (v) => T + (H - T - B) * (1 - (v - lo) / (hi - lo));
    for (const [v, label] of [[hi, num(hi)], [lo, num(lo)]]) {
      const grid = document.createElementNS(SVG, "line");
      grid.setAttribute("class", "grid");
      grid.setAttribute("x1", L); grid.setAttribute("x2", W - R);
      grid.setAttribute("y1", y(v)); grid.setAttribute("y2", y(v));
      svg.appendChild(grid);
      const text = document.createElementNS(SVG, "text");
      text.setAttribute("x", L - 4); text.setAttribute("y", y(v) + 3); text.setAttribute("text-anchor", "end");
      text.textContent = label;
      svg.appendChild(text);
    }
    for (const [pos, label, anchor] of [[L, "-" + duration(span), "start"], [W - R, "now", "end"]]) {
      const text = document.createElementNS(SVG, "text");
      text.setAttribute("x", pos); text.setAttribute("y", H - 4); text.setAttribute("text-anchor", anchor);
      text.textContent = label;
      svg.appendChild(text);
    }
    for (const event of events) {
      const cls = MARKED[event.kind];
      if (!cls || event.time < t0 || event.time > t1) continue;
      const mark = document.createElementNS(SVG, "line");
      mark.setAttribute("class", "ev " + cls);
      mark.setAttribute("x1", x(event.time)); mark.setAttribute("x2", x(event.time));
      mark.setAttribute("y1", T); mark.setAttribute("y2", H - B);
      const title = document.createElementNS(SVG, "title");
      title.textContent = clock(event.time) + " " + event.kind + " " + event.subject;
      mark.appendChild(title);
      svg.appendChild(mark);
    }
    lines.forEach((line, index) => {
      let points = [];
      const flush = () => {
        if (points.length > 1) {
          const poly = document.createElementNS(SVG, "polyline");
          poly.setAttribute("class", "s" + index);
          poly.setAttribute("points", points.join(" "));
          svg.appendChild(poly);
          drawn += points.length;
        }
        points = [];
      };
      line.values.forEach((v, i) => {
        if (v === null) { flush(); return; }
        points.push(x(t[i]).toFixed(1) + "," + y(v).toFixed(1));
      });
      flush();
    });
    svg.dataset.points = String(drawn);
  }

  function chartFigure(id, title) {
    let figure = document.getElementById("chart-" + id);
    if (figure) return figure;
    figure = el("figure");
    figure.id = "chart-" + id;
    const caption = el("figcaption");
    caption.appendChild(el("span", title));
    caption.appendChild(el("span", "", "now"));
    figure.appendChild(caption);
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("class", "chart");
    figure.appendChild(svg);
    figure.appendChild(el("div", "", "legend"));
    document.getElementById("charts").appendChild(figure);
    return figure;
  }

  function drawCharts(s) {
    const series = s.series;
    const charts = CHARTS.slice();
    for (const name of Object.keys(series.metrics)) charts.push({id: "metric-" + name, title: name, metric: name});
    for (const chart of charts) {
      const figure = chartFigure(chart.id, chart.title);
      const lines = chart.metric !== undefined
        ? [{label: chart.metric, values: series.metrics[chart.metric]}]
        : chart.series.map(([key, label]) => ({label: label, values: series[key]}));
      drawChart(figure.querySelector("svg"), series.t, lines, s.events, chart.empty);
      const legend = figure.querySelector(".legend");
      legend.replaceChildren(...lines.map((line, i) => el("span", "\\u25cf " + line.label, "s" + i)));
      figure.querySelector(".now").textContent = lines.map((line) => num(last(line.values))).join(" / ");
    }
  }

  function render(s) {
    document.body.classList.remove("stale");
    const sum = s.summary;
    const badge = document.getElementById("state");
    badge.textContent = s.state;
    badge.className = "badge " + s.state;
    setText("updated", "updated " + clock(s.time) + ", up " + duration(s.time - s.started));
    for (const key of ["alive", "joining", "lost", "stopped", "total"]) setText("w-" + key, num(sum.workers[key]));
    for (const key of Object.keys(sum.closures)) setText("c-" + key, num(sum.closures[key]));
    setText("t-steps", num(sum.steps));
    setText("t-step", num(sum.step));
    setText("t-loss", num(sum.loss));
    setText("t-samples", num(sum.samples));
    setText("t-metrics", Object.entries(sum.metrics).map(([k, v]) => k + " " + num(v)).join(", ") || "\\u2014");
    setText("r-pulled", num(sum.rows.pulled));
    setText("r-cached", num(sum.rows.cached));
    setText("r-hit", num(sum.rows.hit_rate));
    setText("r-ages", Object.entries(sum.rows.ages).map(([k, v]) => k + ": " + num(v)).join(", ") || "\\u2014");
    fillRows("workers-body", s.workers, (w) => {
      const tr = el("tr");
      tr.dataset.address = w.address;
      tr.dataset.state = w.state;
      return cells(tr, [[w.address], [w.state, "state " + w.state], [w.device || "\u2014"],
        [num(w.running), "num"], [num(w.done), "num"],
        [num(w.failed), "num"], [num(w.retried), "num"], [ago(w.last_seen, s.time)], [ago(w.since, s.time)]]);
    });
    fillRows("servers-body", s.servers, (p) => {
      const tr = el("tr");
      tr.dataset.address = p.address;
      tr.dataset.state = p.state;
      const recovery = p.last_recovery ? p.last_recovery + " " + ago(p.last_recovery_time, s.time) : "\\u2014";
      return cells(tr, [[p.address], [p.state, "state " + p.state], [num(p.shards), "num"], [bytes(p.bytes), "num"],
        [p.memory == null ? "\u2014" : bytes(p.memory), "num"],
        [num(p.version), "num"], [num(p.pushes_per_s), "num"], [num(p.recoveries), "num"], [recovery]]);
    });
    fillRows("events-body", s.events.slice().reverse(), (e) => {
      const tr = el("tr", null, e.kind);
      tr.dataset.kind = e.kind;
      return cells(tr, [[clock(e.time)], [e.kind], [e.subject], [e.message, "msg"]]);
    });
    setText("workers-count", String(s.workers.length));
    setText("events-count", s.events_total > s.events.length
      ? "newest " + s.events.length + " of " + s.events_total : String(s.events_total));
    drawCharts(s);
  }

  // The status held: the answers merged so far (null: ask for the whole status).
  let held = null;
  function padded(values, length) {
    const out = values ? values.slice(0, length) : [];
    while (out.length < length) out.push(null);
    return out;
  }
  function merge(s) {
    if (s.since === null) return s;  // the whole status
    if (held === null || s.since !== held.cursor) throw new Error("an answer to another cursor");
    const keep = s.series.keep, fresh = s.series.t.length, series = {keep: 0, metrics: {}};
    for (const key of Object.keys(s.series)) {
      if (key !== "keep" && key !== "metrics") series[key] = padded(held.series[key], keep).concat(s.series[key]);
    }
    const names = new Set(Object.keys(held.series.metrics).concat(Object.keys(s.series.metrics)));
    for (const name of names) {
      series.metrics[name] = padded(held.series.metrics[name], keep).concat(padded(s.series.metrics[name], fresh));
    }
    s.series = series;
    s.events = held.events.concat(s.events).slice(-EVENTS);
    return s;
  }

  function poll() {
    const since = held ? (QUERY ? "&" : "?") + "since=" + encodeURIComponent(held.cursor) : "";
    fetch("status.json" + QUERY + since, {cache: "no-store"})
      .then((r) => (r.ok ? r.json() : Promise.reject(new Error("HTTP " + r.status))))
      .then((s) => { held = merge(s); render(held); })
      .catch((err) => {
        held = null;  // the next answer is the whole status
        document.body.classList.add("stale");
        setText("updated", "not updating: " + err.message);
      })
      .finally(() => setTimeout(poll, document.hidden ? 5 * POLL : POLL));  // a background tab: less often
  }
  poll();
})();
"""


def _hash(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; script-src '{_hash(SCRIPT)}'; style-src '{_hash(STYLE)}'; connect-src 'self'; "
    "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
"""Only this page's own script and stylesheet run; it fetches only from its own origin."""

CHART_TITLES = (
    ("closures", "Closures per second"),
    ("queue", "Queued and running closures"),
    ("steps", "Steps per second"),
    ("samples", "Samples per second"),
    ("loss", "Loss"),
)


def render_page(status: Mapping[str, Any], *, query: str = "", poll_ms: int = POLL_MILLISECONDS) -> str:
    """The whole page for ``status`` (``cluster_status.build_status``); ``query`` is appended to
    the script's requests (the key)."""
    e = html.escape
    summary = status["summary"]
    now = float(status["time"])
    charts = "".join(
        f'<figure id="chart-{name}"><figcaption><span>{e(title)}</span><span class="now"></span></figcaption>'
        f'<svg class="chart" viewBox="0 0 480 150" data-points="0"></svg><div class="legend"></div></figure>'
        for name, title in CHART_TITLES
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>paramserve: {e(status["state"])}</title><link rel="icon" href="data:,">
<noscript><meta http-equiv="refresh" content="{NO_SCRIPT_REFRESH_SECONDS}"></noscript>
<style>{STYLE}</style></head>
<body data-query="{e(query)}" data-poll="{int(poll_ms)}" data-events="{EVENTS_SHOWN}">
<header><h1>paramserve</h1><span id="state" class="badge {e(status["state"])}">{e(status["state"])}</span>
<span id="updated" class="meta">updated {_clock(now)}, up {_duration(now - float(status["started"]))}</span></header>
<main>
<section class="cards" id="summary">{_summary(summary)}</section>
<section><h2>Training</h2><noscript><p class="muted">The charts need JavaScript; the tables below
refresh every {NO_SCRIPT_REFRESH_SECONDS} s without it.</p></noscript>
<div class="charts" id="charts">{charts}</div></section>
<section id="servers"><h2>Parameter servers ({len(status["servers"])})</h2>
<div class="scroll">{_servers(status["servers"], now)}</div></section>
<div class="cluster">
<section id="workers"><h2>Workers (<span id="workers-count">{summary["workers"]["total"]}</span>)</h2>
<div class="scroll">{_workers(status["workers"], now)}</div></section>
<section id="events"><h2>Events (<span id="events-count">{status["events_total"]}</span>)</h2>
<div class="scroll">{_events(status["events"])}</div></section>
</div>
</main>
<script>{SCRIPT}</script>
</body></html>
"""


def _summary(summary: Mapping[str, Any]) -> str:
    w, c = summary["workers"], summary["closures"]
    metrics = ", ".join(f"{name} {_num(value)}" for name, value in summary["metrics"].items()) or "\u2014"
    rows = summary["rows"]
    ages = ", ".join(f"{age}: {_num(count)}" for age, count in rows["ages"].items()) or "\u2014"
    cards = [
        ("Workers", [(k, f"w-{k}", w[k]) for k in ("alive", "joining", "lost", "stopped", "total")]),
        ("Closures", [(k, f"c-{k}", c[k]) for k in ("scheduled", "queued", "running", "done", "failed", "retried")]),
        (
            "Training",
            [
                ("steps run", "t-steps", summary["steps"]),
                ("step reported", "t-step", summary["step"]),
                ("loss", "t-loss", summary["loss"]),
                ("samples", "t-samples", summary["samples"]),
                ("metrics", "t-metrics", metrics),
            ],
        ),
        (
            "Row cache",
            [
                ("rows pulled", "r-pulled", rows["pulled"]),
                ("rows cached", "r-cached", rows["cached"]),
                ("hit rate", "r-hit", rows["hit_rate"]),
                ("staleness (steps: rows)", "r-ages", ages),
            ],
        ),
    ]
    return "".join(
        f"<div><h2>{title}</h2><dl>"
        + "".join(f'<dt>{label}</dt><dd id="{ident}">{html.escape(_num(value))}</dd>' for label, ident, value in rows)
        + "</dl></div>"
        for title, rows in cards
    )


def _table(body_id: str, headers: Sequence[tuple[str, bool]], rows: str) -> str:
    head = "".join(f'<th class="num">{h}</th>' if numeric else f"<th>{h}</th>" for h, numeric in headers)
    return f'<table><thead><tr>{head}</tr></thead><tbody id="{body_id}">{rows}</tbody></table>'


def _workers(workers: Sequence[Mapping[str, Any]], now: float) -> str:
    e = html.escape
    rows = "".join(
        f'<tr data-address="{e(w["address"])}" data-state="{e(w["state"])}"><td>{e(w["address"])}</td>'
        f'<td class="state {e(w["state"])}">{e(w["state"])}</td><td>{e(w["device"] or "—")}</td>'
        + "".join(f'<td class="num">{_num(w[k])}</td>' for k in ("running", "done", "failed", "retried"))
        + f"<td>{_ago(w['last_seen'], now)}</td><td>{_ago(w['since'], now)}</td></tr>"
        for w in workers
    )
    headers = [("worker", False), ("state", False), ("device", False), ("running", True), ("done", True)]
    headers += [("failed", True)]
    headers += [("retried", True), ("last seen", False), ("since", False)]
    return _table("workers-body", headers, rows)


def _servers(servers: Sequence[Mapping[str, Any]], now: float) -> str:
    e = html.escape
    rows = ""
    for p in servers:
        recovery = f"{p['last_recovery']} {_ago(p['last_recovery_time'], now)}" if p["last_recovery"] else "\u2014"
        rows += (
            f'<tr data-address="{e(p["address"])}" data-state="{e(p["state"])}"><td>{e(p["address"])}</td>'
            f'<td class="state {e(p["state"])}">{e(p["state"])}</td><td class="num">{_num(p["shards"])}</td>'
            f'<td class="num">{bytes_text(p["bytes"]) if p["bytes"] is not None else "—"}</td>'
            f'<td class="num">{bytes_text(p["memory"]) if p["memory"] is not None else "—"}</td>'
            f'<td class="num">{_num(p["version"])}</td><td class="num">{_num(p["pushes_per_s"])}</td>'
            f'<td class="num">{_num(p["recoveries"])}</td><td>{e(recovery)}</td></tr>'
        )
    headers = [("server", False), ("state", False), ("shards", True), ("bytes", True), ("memory", True)]
    headers += [("version", True)]
    headers += [("pushes/s", True), ("recoveries", True), ("last recovery", False)]
    return _table("servers-body", headers, rows)


def _events(events: Sequence[Mapping[str, Any]]) -> str:
    e = html.escape
    rows = "".join(
        f'<tr class="{e(v["kind"])}" data-kind="{e(v["kind"])}"><td>{_clock(v["time"])}</td><td>{e(v["kind"])}</td>'
        f'<td>{e(v["subject"])}</td><td class="msg">{e(v["message"])}</td></tr>'
        for v in reversed(events)
    )
    return _table("events-body", [("time", False), ("event", False), ("about", False), ("what", False)], rows)


def _num(value: Any) -> str:
    if value is None:
        return "\u2014"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if float(value).is_integer():
        return f"{int(value):,}"
    magnitude = abs(value)
    return f"{value:.0f}" if magnitude >= 100 else f"{value:.2f}" if magnitude >= 1 else f"{value:.3g}"


def _ago(then: float | None, now: float) -> str:
    if then is None:
        return "\u2014"
    seconds = max(0.0, now - then)
    if seconds < 60:
        return f"{seconds:.1f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _clock(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S")


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"
