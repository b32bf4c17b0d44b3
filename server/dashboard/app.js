/* The dashboard's script: polls the coordinator's JSON API
 * (docs/dashboard-api.md) and draws what it says. No library and no build
 * step; the charts are SVG and the rank maps canvas pixels drawn here.
 *
 * Whatever the API returns is data, never markup: the page is built with
 * createElement and textContent only, never from HTML text, so a host
 * name or an alert message cannot inject anything.
 *
 * Authentication: an /api call answered 401 or 403 shows the login form;
 * its token is POSTed once to /login (Authorization: Bearer), which sets a
 * session cookie; the token itself is not kept. A page opened as
 * .../#token=TOKEN logs in with it at once and takes it out of the
 * address bar first. */
"use strict";

(function () {
  const POLL_MS = 1000;
  /* Rank tables over this many ranks are fetched less often (one a
   * second per 10,000 ranks, at most every 10 s): each is a pass over the
   * whole rank table on the coordinator's loop. */
  const RANKS_PER_SECOND = 10000;
  const LIST_MAX = 20;
  const MAP_MAX_HEIGHT = 480;

  const $ = (id) => document.getElementById(id);

  const S = {
    timer: null,
    busy: false, // a poll is under way
    stopped: true, // not polling: logged out, or not started
    job: null,
    ranks: null,
    ranksAt: 0,
    hist: null,
    plan: null,
    buffers: null,
    startUnix: 0, // the coordinator's start, on this browser's clock
    lastOk: 0,
  };

  /* ---- words and numbers ---- */

  const STATE_WORDS = {
    WAITING: "waiting for ranks",
    RUNNING: "running",
    COMPLETED: "completed",
    FAILED: "failed",
  };
  const STATUS_WORDS = {
    NEVER_ATTACHED: "not attached yet",
    ATTACHED: "attached",
    LOST: "lost",
    DETACHED: "finished (detached)",
  };
  const ROOT_WORDS = {
    NONE: "no training state yet",
    IDLE: "between steps (idle)",
    FORWARD_BACKWARD: "training (forward and backward)",
    SUMMON_FULL_PARAMS: "gathering the full parameters",
  };
  const ALERT_WORDS = {
    STALL: "Stall",
    DESYNC: "Desync",
    STRAGGLER: "Straggler",
    LOST: "Rank lost",
    ILLEGAL_TRANSITION: "Illegal state change",
  };

  function fmtInt(n) {
    return Number(n).toLocaleString("en-US", { maximumFractionDigits: 0 });
  }

  function fmtSig(x, digits) {
    if (x === null || x === undefined || !isFinite(x)) return "-";
    if (x !== 0 && (Math.abs(x) >= 1e6 || Math.abs(x) < 1e-3))
      return x.toExponential(digits - 1);
    return Number(x.toPrecision(digits)).toLocaleString("en-US", {
      maximumFractionDigits: 6,
    });
  }

  function fmtBytes(b) {
    if (!b) return "-";
    const units = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (b >= 1024 && i < units.length - 1) {
      b /= 1024;
      i++;
    }
    return (i === 0 ? b : b.toFixed(b >= 100 ? 0 : 1)) + " " + units[i];
  }

  function fmtDuration(s) {
    if (s === null || s === undefined || !isFinite(s)) return "-";
    s = Math.max(0, s);
    if (s < 60) return (s < 10 ? s.toFixed(1) : Math.round(s)) + " s";
    const m = Math.floor(s / 60);
    if (m < 60) return m + " min " + Math.floor(s % 60) + " s";
    const h = Math.floor(m / 60);
    if (h < 48) return h + " h " + (m % 60) + " min";
    return Math.floor(h / 24) + " days " + (h % 24) + " h";
  }

  function fmtRate(x) {
    if (x === null || x === undefined || !isFinite(x)) return "-";
    if (x >= 1e9) return (x / 1e9).toFixed(2) + " billion";
    if (x >= 1e6) return (x / 1e6).toFixed(2) + " million";
    return fmtInt(Math.round(x));
  }

  function fmtClock(unixMs) {
    return new Date(unixMs).toLocaleTimeString([], {
      hour: "2-digit",
      minute: "2-digit",
      second: "2-digit",
    });
  }

  /* ---- the DOM, text only ---- */

  function el(tag, text, className) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (className) e.className = className;
    return e;
  }

  function setText(id, text) {
    const e = $(id);
    if (e.textContent !== text) e.textContent = text;
  }

  function row(cells) {
    const tr = document.createElement("tr");
    for (const c of cells) {
      if (c instanceof Node) tr.appendChild(c);
      else tr.appendChild(el("td", c));
    }
    return tr;
  }

  /* ---- talking to the coordinator ---- */

  class AuthError extends Error {
    constructor(status) {
      super("HTTP " + status);
      this.status = status;
    }
  }

  async function api(path) {
    const r = await fetch(path, {
      credentials: "same-origin",
      cache: "no-store",
      headers: { Accept: "application/json" },
    });
    if (r.status === 401 || r.status === 403) throw new AuthError(r.status);
    if (!r.ok) {
      let msg = "HTTP " + r.status;
      try {
        const j = await r.json();
        if (j && typeof j.error === "string") msg = j.error;
      } catch (e) {
        /* not JSON: the status says it */
      }
      throw new Error(msg);
    }
    return r.json();
  }

  function showLogin(message) {
    stop();
    $("login-section").hidden = false;
    const err = $("auth-error");
    err.hidden = !message;
    err.textContent = message || "";
    setStatus("Not logged in.", true);
    $("token").focus();
  }

  function hideLogin() {
    $("login-section").hidden = true;
    $("auth-error").hidden = true;
    $("auth-error").textContent = "";
  }

  async function login(raw) {
    const token = (raw || "").trim();
    if (!token) {
      showLogin("Paste a token first.");
      return;
    }
    if (!/^[\x21-\x7e]+$/.test(token)) {
      showLogin(
        "That is not a token: a token is one word of printable characters " +
          "(no spaces or line breaks inside)."
      );
      return;
    }
    let r;
    try {
      r = await fetch("/login", {
        method: "POST",
        credentials: "same-origin",
        cache: "no-store",
        headers: { Authorization: "Bearer " + token },
      });
    } catch (e) {
      showLogin("Cannot reach the coordinator to log in (" + e.message + ").");
      return;
    }
    if (r.ok) {
      $("token").value = "";
      hideLogin();
      start();
    } else if (r.status === 401) {
      showLogin(
        "The coordinator refused this token (401): it is not in its token " +
          "file. Check that you pasted the whole token."
      );
    } else if (r.status === 403) {
      showLogin(
        "This token may not read the dashboard (403): use a reader or admin " +
          "token."
      );
    } else if (r.status === 429 || r.status === 503) {
      showLogin(
        "The coordinator is too busy to log you in now (" +
          r.status +
          "); try again in a moment."
      );
    } else {
      showLogin("Logging in failed: the coordinator answered HTTP " + r.status + ".");
    }
  }

  /* ---- polling ---- */

  function setStatus(text, bad) {
    const s = $("status-line");
    s.textContent = text;
    s.classList.toggle("stale", !!bad);
  }

  function stop() {
    S.stopped = true;
    if (S.timer !== null) clearTimeout(S.timer);
    S.timer = null;
  }

  function start() {
    stop();
    S.stopped = false;
    tick();
  }

  function schedule(ms) {
    if (S.stopped) return;
    if (S.timer !== null) clearTimeout(S.timer);
    S.timer = setTimeout(tick, ms);
  }

  function ranksDue(now) {
    const world = S.job ? S.job.world_size : 0;
    const every = Math.min(10000, POLL_MS * Math.max(1, Math.ceil(world / RANKS_PER_SECOND)));
    return !S.ranks || now - S.ranksAt >= every - 100;
  }

  async function tick() {
    S.timer = null;
    if (S.stopped || S.busy) return;
    /* a hidden tab asks nothing; visibilitychange starts it again */
    if (document.hidden) return;
    S.busy = true;
    try {
      await poll();
    } finally {
      S.busy = false;
    }
  }

  async function poll() {
    const t0 = Date.now();
    try {
      const job = await api("/api/v1/job");
      S.job = job;
      S.startUnix = job.now_unix_ms - job.uptime_ms;
      renderJob(job);
      const work = [loadHistory()];
      if (ranksDue(t0)) work.push(loadRanks(t0));
      if (!S.plan) work.push(loadPlan());
      if (!S.buffers) work.push(loadBuffers());
      await Promise.all(work);
      S.lastOk = Date.now();
      setStatus("Updated " + fmtClock(S.lastOk) + ".", false);
    } catch (e) {
      if (e instanceof AuthError) {
        showLogin(
          e.status === 403
            ? "This session may not read the dashboard (403): log in with a reader or admin token."
            : null
        );
        return;
      }
      const since = S.lastOk ? " since " + fmtClock(S.lastOk) : "";
      setStatus("No answer from the coordinator" + since + " (" + e.message + "); retrying.", true);
      schedule(2 * POLL_MS);
      return;
    }
    schedule(Math.max(200, POLL_MS - (Date.now() - t0)));
  }

  async function loadRanks(now) {
    S.ranks = await api("/api/v1/ranks");
    S.ranksAt = now;
    drawRankMaps();
  }

  const HIST_COLS = [
    "t_ms", "state", "incarnation", "step", "loss", "steps_per_s",
    "tokens_per_s", "step_p50_ms", "step_p99_ms", "attached", "open_alerts",
  ];

  async function loadHistory() {
    const h0 = S.hist;
    let h = await api(
      h0 && h0.t_ms.length ? "/api/v1/history?since=" + h0.t_ms[h0.t_ms.length - 1] : "/api/v1/history"
    );
    /* the coordinator thinned its samples, or restarted: start over */
    if (h0 && (h.period_ms !== h0.period_ms || h.now_ms < h0.now_ms)) {
      S.hist = null;
      h = await api("/api/v1/history");
    }
    const fresh = !S.hist;
    if (fresh) {
      S.hist = { period_ms: h.period_ms, now_ms: h.now_ms };
      for (const c of HIST_COLS) S.hist[c] = [];
    }
    S.hist.period_ms = h.period_ms;
    S.hist.now_ms = h.now_ms;
    if (h.count > 0 || fresh) {
      for (const c of HIST_COLS) if (Array.isArray(h[c])) S.hist[c].push(...h[c]);
      drawCharts();
    }
    setText("history-period", fmtDuration(h.period_ms / 1000));
  }

  async function loadPlan() {
    S.plan = await api("/api/v1/plan");
    renderPlan(S.plan);
  }

  async function loadBuffers() {
    const all = [];
    let first = 0;
    for (let page = 0; page < 1000; page++) {
      const b = await api("/api/v1/buffers?first=" + first);
      all.push(...b.buffers);
      if (b.next === null || b.next === undefined) break;
      first = b.next;
    }
    S.buffers = all;
    renderBuffers();
  }

  /* ---- the job ---- */

  function renderJob(j) {
    document.title = (STATE_WORDS[j.state] || j.state) + " - " + j.model + " - shardplane";
    setText("model", j.model);
    const st = $("state");
    st.className = "state state-" + j.state;
    st.textContent = STATE_WORDS[j.state] || j.state;
    setText("healthy", j.healthy ? "healthy" : "needs attention");

    const p = j.progress;
    const total = p.total_steps;
    const pct = total ? Math.min(100, (100 * p.step) / total) : 0;
    $("progress-bar").style.width = pct.toFixed(2) + "%";
    document.querySelector(".progress").setAttribute("aria-valuenow", pct.toFixed(0));
    setText(
      "progress-text",
      total
        ? "step " + fmtInt(p.step) + " of " + fmtInt(total) + " (" + pct.toFixed(1) + " %)"
        : "step " + fmtInt(p.step) + " (total not reported)"
    );
    setText("tokens-per-s", fmtRate(j.tokens_per_s) + " tokens/s");
    setText("steps-per-s", fmtSig(p.steps_per_s, 3));
    setText("loss", p.loss === null ? "not reported" : fmtSig(p.loss, 4));
    setText("eta", p.eta_s === null ? "unknown" : fmtDuration(p.eta_s));
    const rk = j.ranks;
    let att = fmtInt(rk.attached) + " of " + fmtInt(j.world_size);
    if (rk.lost) att += ", " + fmtInt(rk.lost) + " lost";
    setText("ranks-attached", att);
    setText("uptime", fmtDuration(j.uptime_ms / 1000));
    setText("incarnation", j.restarts ? fmtInt(j.restarts) + " (incarnation " + j.incarnation + ")" : "none");
    setText(
      "loop-pause",
      "Coordinator loop: longest pause " + fmtInt(j.loop_pause_max_ms) + " ms"
    );
    renderWhy(j.why);
    renderAlerts(j);
  }

  function fillRanks(ul, list, n, words, host) {
    const items = [];
    if (!n) {
      items.push(el("li", "none", "none"));
    } else {
      for (const r of list.slice(0, LIST_MAX)) {
        const li = el("li", "rank " + r);
        const h = host(r);
        if (h) li.title = "on " + h;
        items.push(li);
      }
      if (n > LIST_MAX)
        items.push(el("li", "... and " + fmtInt(n - LIST_MAX) + " more (" + words + ")"));
    }
    ul.replaceChildren(...items);
  }

  function hostOf(rank) {
    const R = S.ranks;
    if (!R || rank < R.first || rank >= R.first + R.count) return "";
    const h = R.host[rank - R.first];
    return h >= 0 ? R.hosts[h] : "";
  }

  function renderWhy(w) {
    const v = $("verdict");
    v.textContent = w.headline;
    v.className = "verdict " + (w.healthy ? "good" : "bad");
    const lines = w.lines.filter((l) => l !== w.headline);
    $("verdict-lines").replaceChildren(...lines.map((l) => el("li", l)));
    fillRanks($("culprits"), w.culprits, w.n_culprits, w.culprits_text, hostOf);
    fillRanks($("victims"), w.victims, w.n_victims, w.victims_text, hostOf);
  }

  function cut(text, n) {
    return text.length > n ? text.slice(0, n - 3) + "..." : text;
  }

  function renderAlerts(j) {
    const rows = j.open_alerts.map((a) => {
      const tr = row([
        el("td", ALERT_WORDS[a.kind] || a.kind, "kind"),
        fmtDuration(a.age_s),
        a.n_culprits ? a.culprits_text : "none",
        a.n_victims ? cut(a.victims_text, 120) : "none",
        a.message,
      ]);
      tr.className = "kind-" + a.kind;
      return tr;
    });
    $("alerts").tBodies[0].replaceChildren(...rows);
    $("alerts").hidden = rows.length === 0;
    $("alerts-none").hidden = rows.length !== 0;
    setText("alerts-total", fmtInt(j.alerts_total));
    $("recent-alerts").tBodies[0].replaceChildren(
      ...j.recent_alerts.map((a) =>
        row([
          fmtClock(S.startUnix + a.time_ms),
          ALERT_WORDS[a.kind] || a.kind,
          a.n_culprits ? a.culprits_text : "-",
          a.message,
        ])
      )
    );
  }

  /* ---- charts (SVG) ---- */

  const SVG = "http://www.w3.org/2000/svg";

  function svgEl(tag, attrs, text) {
    const e = document.createElementNS(SVG, tag);
    for (const k in attrs) e.setAttribute(k, String(attrs[k]));
    if (text !== undefined) e.textContent = text;
    return e;
  }

  /* About n round values covering [lo, hi]. */
  function niceTicks(lo, hi, n) {
    if (!(hi > lo)) {
      const d = Math.abs(lo) * 0.1 || 1;
      lo -= d;
      hi += d;
    }
    const raw = (hi - lo) / n;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || 10 * mag;
    const ticks = [];
    for (let t = Math.floor(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(t);
    if (ticks[0] > lo) ticks.unshift(ticks[0] - step);
    if (ticks[ticks.length - 1] < hi) ticks.push(ticks[ticks.length - 1] + step);
    return ticks;
  }

  /* series: [{ys, color, label}] over xs (ms on the coordinator's clock);
   * null values leave a gap. */
  function drawChart(svg, xs, series, fmtY) {
    const W = Math.max(200, svg.clientWidth || 400);
    const H = Math.max(120, svg.clientHeight || 200);
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    const padL = 58, padR = 12, padT = 16, padB = 22;
    const kids = [];
    let lo = Infinity, hi = -Infinity;
    for (const s of series)
      for (const y of s.ys)
        if (y !== null && isFinite(y)) {
          lo = Math.min(lo, y);
          hi = Math.max(hi, y);
        }
    if (!xs.length || lo === Infinity) {
      kids.push(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "No data yet"));
      svg.replaceChildren(...kids);
      return;
    }
    const ticks = niceTicks(lo, hi, 4);
    const y0 = ticks[0], y1 = ticks[ticks.length - 1];
    const x0 = xs[0], x1 = Math.max(xs[xs.length - 1], x0 + 1000);
    const X = (x) => padL + ((x - x0) / (x1 - x0)) * (W - padL - padR);
    const Y = (y) => padT + (1 - (y - y0) / (y1 - y0 || 1)) * (H - padT - padB);
    for (const t of ticks) {
      kids.push(svgEl("line", { x1: padL, x2: W - padR, y1: Y(t), y2: Y(t), class: "grid" }));
      kids.push(svgEl("text", { x: padL - 6, y: Y(t) + 4, "text-anchor": "end" }, fmtY(t)));
    }
    kids.push(svgEl("line", { x1: padL, x2: padL, y1: padT, y2: H - padB, class: "axis" }));
    kids.push(svgEl("line", { x1: padL, x2: W - padR, y1: H - padB, y2: H - padB, class: "axis" }));
    const nx = Math.max(2, Math.min(6, Math.floor((W - padL - padR) / 110)));
    for (let i = 0; i <= nx; i++) {
      const x = x0 + ((x1 - x0) * i) / nx;
      kids.push(
        svgEl("text", { x: X(x), y: H - 6, "text-anchor": i === 0 ? "start" : i === nx ? "end" : "middle" },
          fmtClock(S.startUnix + x))
      );
    }
    /* a restart of the workers: a new incarnation from this sample on */
    const inc = S.hist ? S.hist.incarnation : [];
    for (let i = 1; i < xs.length && i < inc.length; i++)
      if (inc[i] !== inc[i - 1])
        kids.push(svgEl("line", { x1: X(xs[i]), x2: X(xs[i]), y1: padT, y2: H - padB, class: "restart" }));
    series.forEach((s, k) => {
      let d = "";
      let pen = false;
      for (let i = 0; i < xs.length; i++) {
        const y = s.ys[i];
        if (y === null || y === undefined || !isFinite(y)) {
          pen = false;
          continue;
        }
        d += (pen ? "L" : "M") + X(xs[i]).toFixed(1) + " " + Y(y).toFixed(1);
        pen = true;
      }
      if (d) kids.push(svgEl("path", { d: d, fill: "none", stroke: s.color, "stroke-width": 1.8 }));
      if (series.length > 1)
        kids.push(svgEl("text", { x: W - padR - 4 - 90 * (series.length - 1 - k), y: 11, "text-anchor": "end", fill: s.color }, s.label));
      const last = [...s.ys].reverse().find((y) => y !== null && isFinite(y));
      if (last !== undefined && series.length === 1)
        kids.push(svgEl("text", { x: W - padR, y: 11, "text-anchor": "end" }, "now " + fmtY(last)));
    });
    svg.replaceChildren(...kids);
  }

  function drawCharts() {
    const h = S.hist;
    if (!h) return;
    const xs = h.t_ms;
    drawChart($("chart-loss"), xs, [{ ys: h.loss, color: "#2f6fdf", label: "loss" }], (v) => fmtSig(v, 3));
    const sec = (a) => a.map((v) => (v ? v / 1000 : null));
    drawChart(
      $("chart-step"),
      xs,
      [
        { ys: sec(h.step_p50_ms), color: "#2e8b57", label: "median" },
        { ys: sec(h.step_p99_ms), color: "#d97706", label: "slowest 1 %" },
      ],
      (v) => fmtSig(v, 3) + " s"
    );
    drawChart($("chart-tokens"), xs, [{ ys: h.tokens_per_s, color: "#7c3aed", label: "tokens/s" }], fmtRate);
  }

  /* ---- rank maps (canvas) ---- */

  function rgb(hex) {
    const v = parseInt(hex.slice(1), 16);
    return [(v >> 16) & 255, (v >> 8) & 255, v & 255];
  }

  /* A colour as the canvas's bytes read as one little-endian word. */
  function pack(c) {
    return ((255 << 24) | (c[2] << 16) | (c[1] << 8) | c[0]) >>> 0;
  }

  function mix(a, b, t) {
    return [0, 1, 2].map((i) => Math.round(a[i] + (b[i] - a[i]) * t));
  }

  const C = {
    grey: rgb("#d1d5db"),
    lost: rgb("#7f1d1d"),
    detached: rgb("#93c5fd"),
    idle: rgb("#a7d7b8"),
    fb: rgb("#2e8b57"),
    summon: rgb("#0f766e"),
    ink: rgb("#1d2330"),
    good: rgb("#2e8b57"),
    warn: rgb("#eab308"),
    bad: rgb("#c8102e"),
    worse: rgb("#5b0a16"),
  };

  /* green, through yellow, to red, for t in [0, 1]: one of 64 colours,
   * made once (a map colours 100,000 cells) */
  const HEAT = [];
  for (let k = 0; k < 64; k++) {
    const t = k / 63;
    HEAT.push(t < 0.5 ? mix(C.good, C.warn, t * 2) : mix(C.warn, C.bad, (t - 0.5) * 2));
  }
  function heat(t) {
    if (!(t > 0)) return HEAT[0];
    return HEAT[Math.min(63, Math.round(t * 63))];
  }

  /* The canvas word of a colour and of its victim's darker shade, kept
   * per colour (every colour a map uses is one of a few constants). */
  const WORDS = new Map();
  function words(c) {
    let w = WORDS.get(c);
    if (w === undefined) {
      w = [pack(c), pack(mix(c, C.ink, 0.45))];
      WORDS.set(c, w);
    }
    return w;
  }

  function stateColour(status, state) {
    if (status === "NEVER_ATTACHED") return C.grey;
    if (status === "LOST") return C.lost;
    if (status === "DETACHED") return C.detached;
    if (state === "FORWARD_BACKWARD") return C.fb;
    if (state === "SUMMON_FULL_PARAMS") return C.summon;
    return C.idle;
  }

  function swatch(colour, label, extra) {
    const item = el("span");
    const sw = el("span", null, "swatch" + (extra ? " " + extra : ""));
    if (colour) sw.style.background = "rgb(" + colour.join(",") + ")";
    item.append(sw, document.createTextNode(label));
    return item;
  }

  /* The heat map's colour of rank i (i within the page) and its legend,
   * by the chosen measure. */
  function heatMode() {
    const R = S.ranks;
    const mode = $("heat-by").value;
    const status = (i) => R.status_names[R.status[i]];
    const attached = R.status_names.indexOf("ATTACHED");
    const att = (i) => R.status[i] === attached;
    if (mode === "heard") {
      const thr = (S.job && S.job.stall_threshold_ms) || 10000;
      return {
        colour: (i) => (R.heard_ms_ago[i] < 0 || !att(i) ? stateColour(status(i), "") : heat(R.heard_ms_ago[i] / thr)),
        legend: [
          [C.good, "just heard from"],
          [C.warn, "quiet " + fmtDuration(thr / 2000)],
          [C.bad, "quiet " + fmtDuration(thr / 1000) + " or more (the stall threshold)"],
          [C.grey, "not attached"],
        ],
      };
    }
    if (mode === "behind") {
      let max = 0, min = Infinity;
      for (let i = 0; i < R.count; i++)
        if (att(i)) {
          max = Math.max(max, R.step[i]);
          min = Math.min(min, R.step[i]);
        }
      const span = Math.max(3, max - Math.min(min, max));
      return {
        colour: (i) => (att(i) ? heat((max - R.step[i]) / span) : stateColour(status(i), "")),
        legend: [
          [C.good, "at the furthest step (" + fmtInt(max) + ")"],
          [C.warn, fmtInt(Math.round(span / 2)) + " steps behind"],
          [C.bad, fmtInt(span) + " or more behind"],
          [C.grey, "not attached"],
        ],
      };
    }
    if (mode === "straggler") {
      return {
        colour: (i) => {
          const s = R.straggler[i];
          if (!att(i) || !s) return stateColour(status(i), "");
          return heat((s - 1) / 0.3);
        },
        legend: [
          [C.good, "as fast as the median rank (1.0) or faster"],
          [C.warn, "1.15 times slower"],
          [C.bad, "1.3 times slower or more (a straggler)"],
          [C.grey, "no steps timed yet"],
        ],
      };
    }
    const tab = R.status_names.map((st) => R.state_names.map((rs) => stateColour(st, rs)));
    return {
      colour: (i) => tab[R.status[i]][R.state[i]] || C.grey,
      legend: [
        [C.fb, ROOT_WORDS.FORWARD_BACKWARD],
        [C.idle, ROOT_WORDS.IDLE],
        [C.summon, ROOT_WORDS.SUMMON_FULL_PARAMS],
        [C.grey, STATUS_WORDS.NEVER_ATTACHED],
        [C.detached, STATUS_WORDS.DETACHED],
        [C.lost, STATUS_WORDS.LOST],
      ],
    };
  }

  /* Cells as large as fit the width and MAP_MAX_HEIGHT (1 px at least). */
  function mapLayout(canvas, n) {
    const w = Math.max(100, canvas.parentElement.clientWidth);
    let s = 28;
    for (; s > 1; s--) {
      const cols = Math.max(1, Math.floor(w / s));
      if (Math.ceil(n / cols) * s <= MAP_MAX_HEIGHT) break;
    }
    const cols = Math.max(1, Math.min(n, Math.floor(w / s)));
    const rows = Math.max(1, Math.ceil(n / cols));
    const dpr = Math.max(1, Math.round(window.devicePixelRatio || 1));
    canvas.style.width = cols * s + "px";
    canvas.style.height = rows * s + "px";
    canvas.width = cols * s * dpr;
    canvas.height = rows * s * dpr;
    return { s, cols, rows, dpr, n };
  }

  /* Draws n cells, colour(i) each; victims (flag(i) & 2) marked with a
   * dark corner, or darker when cells are small; culprits (flag & 1)
   * outlined in red, larger than the cell when it is small. */
  function drawMap(canvas, n, colour, flags) {
    const L = mapLayout(canvas, n);
    const ctx = canvas.getContext("2d");
    const cs = L.s * L.dpr;
    const gap = L.s >= 8 ? L.dpr : 0;
    const img = ctx.createImageData(canvas.width, canvas.height);
    const px = new Uint32Array(img.data.buffer);
    const W = canvas.width;
    const dark = pack(C.ink);
    const culprits = [];
    for (let i = 0; i < n; i++) {
      const f = flags(i);
      const word = words(colour(i))[f & 2 && L.s < 6 ? 1 : 0];
      const x = (i % L.cols) * cs, y = Math.floor(i / L.cols) * cs;
      for (let yy = 0; yy < cs - gap; yy++) {
        const at = (y + yy) * W + x;
        px.fill(word, at, at + cs - gap);
        if (f & 2 && L.s >= 6 && yy < cs / 2) px.fill(dark, at, at + Math.floor(cs / 2) - yy);
      }
      if (f & 1) culprits.push(i);
    }
    ctx.putImageData(img, 0, 0);
    ctx.strokeStyle = "#c8102e";
    for (const i of culprits) {
      const x = (i % L.cols) * cs, y = Math.floor(i / L.cols) * cs;
      if (L.s >= 8) {
        ctx.lineWidth = 3 * L.dpr;
        ctx.strokeRect(x + 1.5 * L.dpr, y + 1.5 * L.dpr, cs - gap - 3 * L.dpr, cs - gap - 3 * L.dpr);
      } else {
        ctx.lineWidth = 2 * L.dpr;
        const r = 4 * L.dpr;
        ctx.strokeRect(x - r, y - r, cs + 2 * r, cs + 2 * r);
      }
    }
    return L;
  }

  function legend(id, items, marks) {
    const parts = items.map(([c, label]) => swatch(c, label));
    if (marks) parts.push(swatch(null, "culprit (outlined)", "culprit"), swatch(null, "victim (dark corner or darker)", "victim"));
    $(id).replaceChildren(...parts);
  }

  const maps = { heat: null, mem: null };

  function drawRankMaps() {
    const R = S.ranks;
    if (!R) return;
    const flags = (i) => R.culprit[i] | (R.victim[i] << 1);
    const mode = heatMode();
    maps.heat = drawMap($("heatmap"), R.count, mode.colour, flags);
    legend("heat-legend", mode.legend, true);
    let counts = {};
    for (let i = 0; i < R.count; i++) {
      const k = R.status_names[R.status[i]];
      counts[k] = (counts[k] || 0) + 1;
    }
    setText(
      "ranks-summary",
      fmtInt(R.count) + " ranks on " + fmtInt(R.hosts.length) + " hosts: " +
        Object.keys(counts).map((k) => fmtInt(counts[k]) + " " + (STATUS_WORDS[k] || k)).join(", ")
    );
    drawMemory();
  }

  function memRatio(i) {
    const R = S.ranks;
    const peak = R.mem_peak_bytes[i] || R.mem_bytes[i];
    const pred = R.mem_predicted_bytes[i];
    return peak && pred ? peak / pred : null;
  }

  const MEM_WARN = [];
  for (let k = 0; k < 16; k++) MEM_WARN.push(mix(C.warn, rgb("#f97316"), k / 15));

  function memColour(i) {
    const r = memRatio(i);
    if (r === null) return C.grey;
    if (r <= 0.8) return C.good;
    if (r <= 1.0) return MEM_WARN[Math.round(((r - 0.8) / 0.2) * 15)];
    if (r <= 1.1) return C.bad;
    return C.worse;
  }

  function drawMemory() {
    const R = S.ranks;
    maps.mem = drawMap($("memmap"), R.count, memColour, (i) => R.culprit[i]);
    legend("mem-legend", [
      [C.good, "peak at most 80 % of predicted"],
      [C.warn, "80-100 %"],
      [C.bad, "over the prediction (up to 110 %)"],
      [C.worse, "more than 110 %"],
      [C.grey, "not reported"],
    ]);
    let top = -1, topPeak = 0, over = 0, reporting = 0;
    for (let i = 0; i < R.count; i++) {
      const peak = R.mem_peak_bytes[i] || R.mem_bytes[i];
      if (!peak) continue;
      reporting++;
      if (peak > topPeak) {
        topPeak = peak;
        top = i;
      }
      const r = memRatio(i);
      if (r !== null && r > 1) over++;
    }
    if (top < 0) {
      setText("mem-summary", "No rank has reported its memory yet.");
      return;
    }
    const pred = R.mem_predicted_bytes[top];
    setText(
      "mem-summary",
      "Highest peak: " + fmtBytes(topPeak) + " on rank " + (R.first + top) +
        (pred ? " (" + Math.round((100 * topPeak) / pred) + " % of its predicted " + fmtBytes(pred) + ")" : "") +
        ". " + fmtInt(over) + " of " + fmtInt(reporting) + " reporting ranks are over their prediction."
    );
  }

  function rankAt(L, canvas, ev) {
    if (!L) return -1;
    const b = canvas.getBoundingClientRect();
    const col = Math.floor((ev.clientX - b.left) / L.s);
    const r = Math.floor((ev.clientY - b.top) / L.s);
    if (col < 0 || col >= L.cols || r < 0) return -1;
    const i = r * L.cols + col;
    return i < L.n ? i : -1;
  }

  function rankWords(i, memory) {
    const R = S.ranks;
    const rank = R.first + i;
    const st = R.status_names[R.status[i]];
    const lines = ["rank " + rank + (hostOf(rank) ? " on " + hostOf(rank) : "")];
    lines.push(
      (STATUS_WORDS[st] || st) + (st === "ATTACHED" ? ", " + (ROOT_WORDS[R.state_names[R.state[i]]] || "") : "")
    );
    lines.push("step " + fmtInt(R.step[i]));
    if (R.heard_ms_ago[i] >= 0) lines.push("last heard " + fmtDuration(R.heard_ms_ago[i] / 1000) + " ago");
    const peak = R.mem_peak_bytes[i], pred = R.mem_predicted_bytes[i];
    if (R.mem_bytes[i] || peak)
      lines.push(
        "memory " + fmtBytes(R.mem_bytes[i]) + " now, peak " + fmtBytes(peak) +
          (pred ? " of " + fmtBytes(pred) + " predicted (" + Math.round((100 * (peak || R.mem_bytes[i])) / pred) + " %)" : "")
      );
    else if (memory) lines.push("memory not reported");
    if (R.straggler[i]) lines.push("straggler score " + R.straggler[i].toFixed(2) + " (own step time / median)");
    if (R.culprit[i]) lines.push("CULPRIT: named by the verdict or an open alert");
    if (R.victim[i]) lines.push("victim: held up or failed by a culprit");
    return lines.join("\n");
  }

  function hover(canvasId, tipId, which, memory) {
    const canvas = $(canvasId), tip = $(tipId);
    canvas.addEventListener("mousemove", (ev) => {
      const i = rankAt(maps[which], canvas, ev);
      if (i < 0 || !S.ranks) {
        tip.hidden = true;
        return;
      }
      tip.textContent = rankWords(i, memory);
      tip.hidden = false;
      const wrap = canvas.parentElement.getBoundingClientRect();
      let x = ev.clientX - wrap.left + 14, y = ev.clientY - wrap.top + 14;
      if (x + tip.offsetWidth > wrap.width) x = Math.max(0, x - tip.offsetWidth - 28);
      tip.style.left = x + "px";
      tip.style.top = y + "px";
    });
    canvas.addEventListener("mouseleave", () => (tip.hidden = true));
  }

  /* ---- plan and buffers ---- */

  const STRATEGY_WORDS = {
    FULL_SHARD: (p) => "parameters, gradients and optimizer state are split across all " + fmtInt(p.world_size) + " ranks",
    SHARD_GRAD_OP: (p) => "gradients and optimizer state are split across all " + fmtInt(p.world_size) + " ranks; parameters stay whole from forward to backward",
    NO_SHARD: (p) => "every one of the " + fmtInt(p.world_size) + " ranks keeps everything (plain data parallel)",
    HYBRID_SHARD: (p) => "split within groups of " + fmtInt(p.shard_group_size) + " ranks, the " + fmtInt(p.replicas) + " groups replicas of each other",
  };

  function renderPlan(p) {
    const how = STRATEGY_WORDS[p.strategy];
    const mp = p.mixed_precision;
    let text = p.strategy + ": " + (how ? how(p) : "") + ". ";
    text += fmtInt(p.n_units) + " units, " + fmtInt(p.numel) + " parameter elements in all, " + fmtInt(p.shard_numel) + " on each rank. ";
    text += mp.enabled
      ? "Mixed precision: gathered as " + (mp.param_dtype || "stored") + ", gradients reduced as " + (mp.reduce_dtype || mp.param_dtype || "stored") + ", buffers as " + (mp.buffer_dtype || "they are") + "."
      : "No mixed precision.";
    text += " Plan " + p.plan_version + ".";
    setText("plan-summary", text);
    $("plan").tBodies[0].replaceChildren(
      ...p.units.map((u) =>
        row([
          String(u.index),
          u.module === "" ? "(root)" : u.module,
          u.type,
          el("td", fmtInt(u.numel), "num"),
          el("td", fmtInt(u.shard_numel), "num"),
          u.dtype || "-",
          u.param_dtype || "-",
          u.reduce_dtype || "-",
          u.buffer_dtype || "unchanged",
          u.full_precision ? "yes" : "no",
        ])
      )
    );
  }

  const BUFFER_ROWS_MAX = 2000;

  function renderBuffers() {
    const all = S.buffers || [];
    const q = $("buffer-filter").value.trim();
    const shown = q ? all.filter((b) => b.fqn.includes(q)) : all;
    const units = S.plan ? S.plan.units : [];
    $("buffers").tBodies[0].replaceChildren(
      ...shown.slice(0, BUFFER_ROWS_MAX).map((b) => {
        const owner = units[b.owner_unit];
        return row([
          b.fqn,
          b.shape.length ? "[" + b.shape.join(", ") + "]" : "scalar",
          b.original_dtype || "-",
          el("td", b.compute_dtype || "-", b.cast ? "cast" : ""),
          b.persistent ? "yes" : "no",
          "unit " + b.owner_unit + (owner ? " (" + (owner.module || "root") + ")" : ""),
        ]);
      })
    );
    const casts = all.filter((b) => b.cast).length;
    setText(
      "buffers-summary",
      (shown.length > BUFFER_ROWS_MAX ? "showing " + fmtInt(BUFFER_ROWS_MAX) + " of " : "") +
        fmtInt(shown.length) + (q ? " matching" : "") + " of " + fmtInt(all.length) +
        " buffers; " + fmtInt(casts) + " computed in another dtype than the spec's"
    );
  }

  /* ---- start ---- */

  function debounce(fn, ms) {
    let t = null;
    return () => {
      if (t !== null) clearTimeout(t);
      t = setTimeout(() => {
        t = null;
        fn();
      }, ms);
    };
  }

  function init() {
    $("login").addEventListener("submit", (ev) => {
      ev.preventDefault();
      login($("token").value);
    });
    $("heat-by").addEventListener("change", drawRankMaps);
    $("buffer-filter").addEventListener("input", debounce(renderBuffers, 150));
    hover("heatmap", "rank-tip", "heat", false);
    hover("memmap", "mem-tip", "mem", true);
    window.addEventListener(
      "resize",
      debounce(() => {
        drawRankMaps();
        drawCharts();
      }, 200)
    );
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden && !S.stopped && !S.busy && S.timer === null) tick();
    });
    /* #token=...: the token leaves the address bar (and the history)
     * before anything else happens */
    const frag = new URLSearchParams(location.hash.replace(/^#/, ""));
    const token = frag.get("token");
    if (token !== null) {
      history.replaceState(null, "", location.pathname + location.search);
      login(token);
    } else {
      start();
    }
  }

  init();
})();
