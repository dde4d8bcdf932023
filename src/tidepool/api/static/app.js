// The tidepool dashboard: polls /v1/pool, follows /v1/events, shows tasks. No build step, no CDN.
// Every piece of task data goes in as text (textContent), never as markup.
"use strict";

const $ = (id) => document.getElementById(id);
const samples = [];          // [{t, workers, busy, finished}] for the charts; finished: tasks a second
const HISTORY_S = 300;
const CHART_FROM_S = 60;     // fewer seconds of points than this draw a line too short to read: say so instead
const TERMINAL = new Set(["completed", "failed", "timed_out", "cancelled"]);
const DETAIL_MIN_GAP_MS = 1000;   // a busy task's events fetch its detail (results can be megabytes) at most this often
const DETAIL_PERIOD_MS = 10000;   // and an unfinished one is fetched this often anyway, in case an event was missed
let selected = null;
let refreshPending = false;
let finishedSeen = 0;        // task.finished events the stream has brought; each pool sample takes the rate since the last
let finishedAt = { t: Date.now() / 1000, count: 0 };

const NEED_TOKEN = "token needed: enter the API token above";
const UNREACHABLE = "daemon unreachable: reconnecting";
const BAD_TOKEN = "token not accepted: it must be plain ASCII (printable characters only)";

// The token lives for this tab's session only (sessionStorage), never for good.
const TOKEN_KEY = "tidepool.token";
function storedToken() {
  try {
    const old = localStorage.getItem(TOKEN_KEY);  // an older dashboard kept it for good: move it, once
    if (old !== null) {
      localStorage.removeItem(TOKEN_KEY);
      if (sessionStorage.getItem(TOKEN_KEY) === null) sessionStorage.setItem(TOKEN_KEY, old);
    }
    return sessionStorage.getItem(TOKEN_KEY) || "";
  } catch {
    return "";  // storage is disabled: the token lives in the input only
  }
}
function storeToken(value) {
  try {
    if (value) sessionStorage.setItem(TOKEN_KEY, value); else sessionStorage.removeItem(TOKEN_KEY);
  } catch { /* storage is disabled: the token lives in the input only */ }
}

const tokenInput = $("token");
tokenInput.value = storedToken();
tokenInput.addEventListener("change", () => {
  storeToken(tokenInput.value);
  followEvents();
  refreshAll();
});

class TokenError extends Error {}

function headers() {
  const h = { "Content-Type": "application/json" };
  const token = tokenInput.value.trim();
  // fetch cannot put anything beyond Latin-1 in a header, and the daemon's token is ASCII: say so, not "unreachable"
  if (!/^[\x20-\x7e]*$/.test(token)) throw new TokenError(BAD_TOKEN);
  if (token) h["Authorization"] = "Bearer " + token;
  return h;
}

// An error answer's status is kept on the error: a panel whose route this daemon lacks (404) hides itself.
class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(method, path, payload) {
  const h = headers();
  const init = { method, headers: h, body: payload === undefined ? undefined : JSON.stringify(payload) };
  const res = await fetch(path, init).catch(() => { throw new Error(UNREACHABLE); });
  const body = await res.json().catch(() => ({}));
  if (res.status === 401) throw new ApiError(401, NEED_TOKEN);
  if (!res.ok) {
    throw new ApiError(res.status, `daemon answered ${res.status}: ${(body.error && body.error.message) || res.statusText}`);
  }
  return body;
}

// The panels of their own scripts (workers.js, scans.js) hear every event and refresh with the rest.
const eventHooks = [];    // (name, data) => void
const refreshHooks = [];  // () => void
const poolHooks = [];     // (pool) => void, at each poll of /v1/pool

// The connection badge: each source (the event stream, each poll) reports its own problem, and clears it
// when it works again; the badge shows the latest problem while any lasts, and "live" when none does.
const problems = new Map();  // source -> message
function report(source, problem) {
  problems.delete(source);
  if (problem) problems.set(source, problem);
  const el = $("conn");
  const latest = [...problems.values()].pop();
  el.className = "badge " + (latest ? "down" : "live");
  el.textContent = latest || "live";
  document.body.classList.toggle("stale", Boolean(latest));  // what is shown is the last seen, not now
}

function setText(id, value) { $(id).textContent = value; }
function toSecond(ts) { return ts ? ts.slice(0, 19).replace("T", " ") : ""; }  // an RFC 3339 UTC time, as the CLI shows it

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
    for (const hook of poolHooks) hook(pool);
    setText("workers", pool.workers);
    setText("baseline", pool.baseline);
    setText("demand", pool.demand);
    setText("max", pool.max_workers);
    setText("busy", pool.busy);
    setText("claiming", pool.claiming ? "claiming" : "not claiming");
    kvRows($("queue"), Object.entries(pool.queue));
    const tripped = (pool.guards && pool.guards.tripped) || [];
    setText("guards", tripped.length ? "tripped: " + tripped.join(", ") : "ok");
    const resources = Object.entries(pool.resources || {}).map(([n, r]) => [n, `${r.in_use}/${r.count}`]);
    kvRows($("resources"), resources.length ? resources : [["none configured", ""]]);
    $("resources").classList.toggle("muted", !resources.length);
    const now = Date.now() / 1000;
    const finished = (finishedSeen - finishedAt.count) / Math.max(now - finishedAt.t, 0.001);
    finishedAt = { t: now, count: finishedSeen };
    samples.push({ t: now, workers: pool.workers, busy: pool.busy, finished });
    while (samples.length && samples[0].t < now - HISTORY_S) samples.shift();
    setText("rate-now", finished.toFixed(1));
    drawChart("chart", "chart-collecting", [["workers", "#4fb3d9"], ["busy", "#e6a23c"]], "workers");
    drawChart("rate-chart", "rate-collecting", [["finished", "#6fcf97"]], "finished");
    report("pool", null);
  } catch (err) {
    report("pool", err.message);
  }
}

// One chart of the samples: a line per [key, colour], scaled to the largest value of `scale`.
function drawChart(canvasId, collectingId, lines, scale) {
  const canvas = $(canvasId);
  const now = Date.now() / 1000;
  const collecting = !samples.length || now - samples[0].t < CHART_FROM_S;
  $(collectingId).hidden = !collecting;
  canvas.hidden = collecting;
  if (collecting) return;
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const top = Math.max(1, ...samples.map((p) => p[scale]));
  const x = (t) => w - ((now - t) / HISTORY_S) * w;
  const y = (v) => h - 4 - (v / top) * (h - 12);
  for (const [key, color] of lines) {
    ctx.strokeStyle = color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    samples.forEach((p, i) => (i ? ctx.lineTo(x(p.t), y(p[key])) : ctx.moveTo(x(p.t), y(p[key]))));
    ctx.stroke();
  }
  ctx.fillStyle = "#8aa0b2";
  ctx.fillText(Number.isInteger(top) ? String(top) : top.toFixed(1), 4, 12);
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
      tr.addEventListener("click", () => selectTask(t.id));
      return tr;
    });
    $("tasks").tBodies[0].replaceChildren(...rows);
    report("tasks", null);
  } catch (err) {
    report("tasks", err.message);
  }
}

function scheduleTasks() {
  if (!refreshPending) { refreshPending = true; setTimeout(refreshTasks, 250); }
}

// The selected task's detail. It can hold megabytes of results, so it is fetched when it is selected,
// when an event names it, and (while it is unfinished) now and then; never for other tasks' events.
let detailSeq = 0;        // answers to older fetches (another task, or overtaken) are dropped
let detailState = null;   // the shown task's state, once fetched
let detailTimer = null;
let detailLast = 0;

function selectTask(id) {
  if (id !== selected) {
    setText("action-result", "");  // it was about the task shown before
    setText("detail-body", "loading…");
    detailState = null;
  }
  selected = id;
  $("detail").hidden = false;
  setText("detail-id", id);
  loadDetail();
}

function scheduleDetail() {
  if (detailTimer) return;
  const wait = Math.max(250, detailLast + DETAIL_MIN_GAP_MS - Date.now());
  detailTimer = setTimeout(() => { detailTimer = null; loadDetail(); }, wait);
}

async function loadDetail() {
  const id = selected, seq = ++detailSeq;
  if (!id) return;
  detailLast = Date.now();
  try {
    const task = await api("GET", "/v1/tasks/" + encodeURIComponent(id));
    if (seq !== detailSeq) return;
    detailState = task.state;
    showAttempts(task.attempts);
    $("detail-results").replaceChildren(...resultBlocks(task.results));
    showFiles(task);
    setText("detail-body", JSON.stringify({ state: task.state, phase: task.phase, error: task.error,
      attempts: task.attempts, results: task.results, payload: task.payload }, null, 2));
  } catch (err) {
    if (seq === detailSeq) setText("detail-body", err.message);
  }
}

function cell(text) {
  const td = document.createElement("td");
  td.textContent = text;
  return td;
}

function showAttempts(attempts) {
  $("detail-attempts").tBodies[0].replaceChildren(...attempts.map((a) => {
    const tr = document.createElement("tr");
    const error = a.error ? `${a.error.code}: ${a.error.message}` : "";
    tr.append(cell(String(a.number)), cell(a.status), cell(a.worker_id || ""), cell(toSecond(a.started_at)),
      cell(toSecond(a.finished_at)), cell(a.exit_status == null ? "" : String(a.exit_status)), cell(error));
    tr.cells[1].className = "state state-" + a.status;
    return tr;
  }));
}

// A link that downloads a file of the API. The API wants the token in a header, which a plain link cannot send:
// the click fetches the bytes with it and hands them to the browser as a download under the file's name.
function downloadLink(href, name) {
  const a = document.createElement("a");
  a.href = href;
  a.textContent = name;
  a.className = "download";
  a.dataset.name = name;
  a.addEventListener("click", async (event) => {
    event.preventDefault();
    event.stopPropagation();  // a link in a clickable row does not also open the row
    try {
      const res = await fetch(href, { headers: headers() }).catch(() => { throw new Error(UNREACHABLE); });
      if (res.status === 401) throw new Error(NEED_TOKEN);
      if (!res.ok) throw new Error(`daemon answered ${res.status} for ${name}`);
      const url = URL.createObjectURL(await res.blob());
      const save = document.createElement("a");
      save.href = url;
      save.download = name;
      document.body.appendChild(save);
      save.click();
      save.remove();
      setTimeout(() => URL.revokeObjectURL(url), 60000);
    } catch (err) {
      a.title = err.message;
      a.classList.add("failed");
    }
  });
  return a;
}

function artifactHref(taskId, name, attemptId) {
  const path = `/v1/tasks/${encodeURIComponent(taskId)}/artifacts/${encodeURIComponent(name)}`;
  return attemptId ? `${path}?attempt=${encodeURIComponent(attemptId)}` : path;
}

// The task's inputs (as submitted) and every attempt's artifacts, each a download.
function showFiles(task) {
  const rows = [];
  for (const [name, sha256] of Object.entries(task.inputs || {})) {
    rows.push([downloadLink("/v1/blobs/" + sha256, name), "input", "", "", "", sha256]);
  }
  for (const a of task.artifacts || []) {
    rows.push([downloadLink(artifactHref(task.id, a.name, a.attempt_id), a.name), "artifact", String(a.size),
      a.content_type || "", a.attempt_id, a.sha256]);
  }
  $("detail-files-none").hidden = rows.length > 0;
  $("detail-files").hidden = rows.length === 0;
  $("detail-files").tBodies[0].replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    for (const c of cells) {
      if (typeof c === "string") tr.appendChild(cell(c));
      else { const td = document.createElement("td"); td.appendChild(c); tr.appendChild(td); }
    }
    return tr;
  }));
}

// Each result batch as a head line (plugin, sequence, final or not) and its payload as JSON text.
function resultBlocks(results) {
  if (!results.length) {
    const none = document.createElement("p");
    none.className = "muted";
    none.textContent = "no results yet";
    return [none];
  }
  return results.flatMap((r) => {
    const head = document.createElement("div"), body = document.createElement("pre");
    head.className = "result-head";
    head.textContent = `${r.plugin} #${r.sequence}${r.final ? "" : " (not final)"}`;
    body.className = "data";
    body.textContent = JSON.stringify(r.payload, null, 2);
    return [head, body];
  });
}

async function act(action) {
  const id = selected;
  if (!id) return;
  let text;
  try {
    const res = await api("POST", `/v1/tasks/${encodeURIComponent(id)}/${action}`);
    text = `${action}: ${res.state}`;
  } catch (err) {
    text = `${action} refused: ${err.message}`;
  }
  if (id === selected) setText("action-result", text);
  scheduleTasks();
}
$("cancel").addEventListener("click", () => act("cancel"));
$("retry").addEventListener("click", () => act("retry"));

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
      if (abort.signal.aborted) return;
      if (res.status === 401) {  // retrying cannot help: a new token restarts the stream
        report("stream", NEED_TOKEN);
        return;
      }
      if (!res.ok) throw new Error("events: " + res.status);
      report("stream", null);
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
      if (err instanceof TokenError) {  // likewise
        report("stream", err.message);
        return;
      }
      report("stream", UNREACHABLE);
    }
    await new Promise((r) => setTimeout(r, 1000));
  }
}

function handleFrame(frame) {
  let name = "", data = "";
  for (const line of frame.split("\n")) {
    if (line.startsWith("id: ")) lastEventId = line.slice(4);
    else if (line.startsWith("event: ")) name = line.slice(7);
    else if (line.startsWith("data: ")) data += line.slice(6);
  }
  if (name === "task.finished") finishedSeen += 1;
  for (const hook of eventHooks) hook(name, data);
  if (name === "stream.gap") {  // events were missed: whatever is shown may be behind
    scheduleTasks();
    if (selected) scheduleDetail();
    return;
  }
  if (name.startsWith("task.") || name.startsWith("worker.")) scheduleTasks();
  if (selected && data.includes(selected) && concerns(data, selected)) scheduleDetail();
}

function concerns(data, id) {
  try {
    return JSON.parse(data).task_id === id;
  } catch {
    return false;
  }
}

async function refreshSchedules() {
  try {
    const { schedules } = await api("GET", "/v1/schedules");
    $("schedules-empty").hidden = schedules.length > 0;
    $("schedules").hidden = schedules.length === 0;
    $("schedules").tBodies[0].replaceChildren(...schedules.map((s) => {
      const tr = document.createElement("tr");
      const when = s.cron ? `${s.cron} (${s.timezone})` : `every ${s.every_s}s`;
      const last = s.last_task_id ? `${s.last_task_state || ""}` : "";
      for (const cell of [s.name, s.type, when, s.paused ? "paused" : s.next_run_at || "", s.last_run_at || "", last]) {
        const td = document.createElement("td");
        td.textContent = cell;
        tr.appendChild(td);
      }
      if (s.last_task_id) tr.addEventListener("click", () => selectTask(s.last_task_id));
      return tr;
    }));
    report("schedules", null);
  } catch (err) {
    report("schedules", err.message);
  }
}

function refreshAll() {
  refreshPool();
  refreshTasks();
  refreshSchedules();
  for (const hook of refreshHooks) hook();
}

refreshAll();
setInterval(refreshSchedules, 5000);
setInterval(refreshPool, 1000);
setInterval(refreshTasks, 3000);
setInterval(() => { if (selected && !TERMINAL.has(detailState)) loadDetail(); }, DETAIL_PERIOD_MS);
followEvents();
