// The tidepool dashboard: polls /v1/pool, follows /v1/events, shows tasks. No build step, no CDN.
"use strict";

const $ = (id) => document.getElementById(id);
const samples = [];          // [{t, workers, busy}] for the chart
const HISTORY_S = 300;
let selected = null;
let refreshPending = false;

const tokenInput = $("token");
tokenInput.value = localStorage.getItem("tidepool.token") || "";
tokenInput.addEventListener("change", () => {
  localStorage.setItem("tidepool.token", tokenInput.value);
  followEvents();
});

function headers() {
  const h = { "Content-Type": "application/json" };
  if (tokenInput.value) h["Authorization"] = "Bearer " + tokenInput.value;
  return h;
}

const NEED_TOKEN = "token needed: enter the API token above";
const UNREACHABLE = "daemon unreachable: reconnecting";

async function api(method, path) {
  const res = await fetch(path, { method, headers: headers() }).catch(() => { throw new Error(UNREACHABLE); });
  const body = await res.json().catch(() => ({}));
  if (res.status === 401) throw new Error(NEED_TOKEN);
  if (!res.ok) throw new Error((body.error && body.error.message) || res.statusText);
  return body;
}

function setText(id, value) { $(id).textContent = value; }

function kvRows(table, entries) {
  table.replaceChildren(...entries.map(([k, v]) => {
    const tr = document.createElement("tr");
    for (const cell of [k, v]) { const td = document.createElement("td"); td.textContent = cell; tr.appendChild(td); }
    return tr;
  }));
}

async function refreshPool() {
  try {
    const pool = await api("GET", "/v1/pool");
    setText("node", pool.node_id + (pool.draining ? " (draining)" : ""));
    setText("workers", pool.workers);
    setText("baseline", pool.baseline);
    setText("demand", pool.demand);
    setText("max", pool.max_workers);
    setText("busy", pool.busy);
    setText("claiming", pool.claiming ? "claiming" : "not claiming");
    kvRows($("queue"), Object.entries(pool.queue));
    const tripped = (pool.guards && pool.guards.tripped) || [];
    setText("guards", tripped.length ? "tripped: " + tripped.join(", ") : "ok");
    kvRows($("resources"), Object.entries(pool.resources || {}).map(([n, r]) => [n, `${r.in_use}/${r.count}`]));
    samples.push({ t: Date.now() / 1000, workers: pool.workers, busy: pool.busy });
    while (samples.length && samples[0].t < Date.now() / 1000 - HISTORY_S) samples.shift();
    drawChart();
  } catch (err) {
    setConn("down", err.message);
  }
}

function drawChart() {
  const canvas = $("chart");
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, now = Date.now() / 1000;
  ctx.clearRect(0, 0, w, h);
  const top = Math.max(1, ...samples.map((p) => p.workers));
  const x = (t) => w - ((now - t) / HISTORY_S) * w;
  const y = (v) => h - 4 - (v / top) * (h - 12);
  for (const [key, color] of [["workers", "#4fb3d9"], ["busy", "#e6a23c"]]) {
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    samples.forEach((p, i) => (i ? ctx.lineTo(x(p.t), y(p[key])) : ctx.moveTo(x(p.t), y(p[key]))));
    ctx.stroke();
  }
  ctx.fillStyle = "#8aa0b2";
  ctx.fillText(String(top), 4, 12);
}

async function refreshTasks() {
  refreshPending = false;
  try {
    const page = await api("GET", "/v1/tasks?limit=50");
    const rows = page.tasks.map((t) => {
      const tr = document.createElement("tr");
      tr.dataset.id = t.id;
      // the stored progress is the last one written before the end; a completed task is simply done
      const progress = t.state === "completed" ? "100%" :
        t.progress && t.progress.fraction != null ? Math.round(t.progress.fraction * 100) + "%" : "";
      const cells = [t.id, t.type, t.state, t.phase || "", progress, `${t.attempt}/${t.max_attempts}`, t.node_id || ""];
      cells.forEach((c, i) => {
        const td = document.createElement("td");
        td.textContent = c;
        if (i === 2) td.className = "state state-" + t.state;
        tr.appendChild(td);
      });
      tr.addEventListener("click", () => showTask(t.id));
      return tr;
    });
    $("tasks").tBodies[0].replaceChildren(...rows);
    if (selected) showTask(selected);
  } catch (err) {
    setConn("down", err.message);
  }
}

function scheduleTasks() {
  if (!refreshPending) { refreshPending = true; setTimeout(refreshTasks, 250); }
}

async function showTask(id) {
  selected = id;
  $("detail").hidden = false;
  setText("detail-id", id);
  try {
    const task = await api("GET", "/v1/tasks/" + id);
    setText("detail-body", JSON.stringify({ state: task.state, phase: task.phase, error: task.error,
      attempts: task.attempts, results: task.results, payload: task.payload }, null, 2));
  } catch (err) {
    setText("detail-body", err.message);
  }
}

async function act(action) {
  if (!selected) return;
  try {
    const res = await api("POST", `/v1/tasks/${selected}/${action}`);
    setText("action-result", `${action}: ${res.state}`);
  } catch (err) {
    setText("action-result", `${action} refused: ${err.message}`);
  }
  scheduleTasks();
}
$("cancel").addEventListener("click", () => act("cancel"));
$("retry").addEventListener("click", () => act("retry"));

function setConn(kind, text) {
  const el = $("conn");
  el.className = "badge " + kind;
  el.textContent = text;
  document.body.classList.toggle("stale", kind === "down");  // what is shown is the last seen, not now
}

// Server-sent events over fetch, so the bearer token can go in a header (EventSource cannot send one).
let streamAbort = null;
let lastEventId = null;
async function followEvents() {
  if (streamAbort) streamAbort.abort();
  const abort = new AbortController();
  streamAbort = abort;
  while (!abort.signal.aborted) {
    try {
      const h = headers();
      if (lastEventId) h["Last-Event-ID"] = lastEventId;
      const res = await fetch("/v1/events", { headers: h, signal: abort.signal });
      if (res.status === 401) {  // retrying cannot help: a new token restarts the stream
        setConn("down", NEED_TOKEN);
        return;
      }
      if (!res.ok) throw new Error("events: " + res.status);
      setConn("live", "live");
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          handleFrame(buffer.slice(0, cut));
          buffer = buffer.slice(cut + 2);
        }
      }
    } catch (err) {
      if (abort.signal.aborted) return;
      setConn("down", UNREACHABLE);
    }
    await new Promise((r) => setTimeout(r, 1000));
  }
}

function handleFrame(frame) {
  for (const line of frame.split("\n")) {
    if (line.startsWith("id: ")) lastEventId = line.slice(4);
    if (line.startsWith("event: task.") || line.startsWith("event: worker.")) scheduleTasks();
  }
}

refreshPool();
async function refreshSchedules() {
  try {
    const { schedules } = await api("GET", "/v1/schedules");
    $("schedules").tBodies[0].replaceChildren(...schedules.map((s) => {
      const tr = document.createElement("tr");
      const when = s.cron ? `${s.cron} (${s.timezone})` : `every ${s.every_s}s`;
      const last = s.last_task_id ? `${s.last_task_state || ""}` : "";
      for (const cell of [s.name, s.type, when, s.paused ? "paused" : s.next_run_at || "", s.last_run_at || "", last]) {
        const td = document.createElement("td");
        td.textContent = cell;
        tr.appendChild(td);
      }
      if (s.last_task_id) tr.addEventListener("click", () => showTask(s.last_task_id));
      return tr;
    }));
  } catch (err) {
    setConn("down", err.message);
  }
}

refreshTasks();
refreshSchedules();
setInterval(refreshSchedules, 5000);
setInterval(refreshPool, 1000);
setInterval(refreshTasks, 3000);
followEvents();
