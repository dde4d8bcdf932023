// The Scans view: each scan (GET /v1/scans) with its steps as a row of job states; a step opens its task in
// the task detail, a scan its jobs, what its steps found (its scope) and each step's results. Refreshed by the
// scan.* events and a periodic fetch. A daemon without the route (404) shows no view. Uses app.js's api,
// report, selectTask, resultBlocks, toSecond, downloadLink, artifactHref and $; data goes in as text only.
"use strict";

const SCANS_PERIOD_MS = 5000;
const SCANS_LIMIT = 20;
let scansShown = true;    // false after a 404: polling stops
let scansTimer = null;
let selectedScan = null;
let scanSeq = 0;          // answers to older fetches of the scan detail are dropped
const endedSteps = new Map();  // task id -> the task, once it has ended: its results no longer change

function td(text, className) {
  const cell = document.createElement("td");
  cell.textContent = text;
  if (className) cell.className = className;
  return cell;
}

// One job as a chip: its step's name, coloured and titled by its state; a click opens its task, if it has one.
function jobChip(job) {
  const chip = document.createElement(job.task_id ? "button" : "span");
  chip.className = "job job-" + job.state;
  chip.dataset.index = job.index;
  chip.dataset.state = job.state;
  chip.textContent = job.step;
  chip.title = `step ${job.index} ${job.step}: ${job.state}` + (job.task_id ? " (open its task)" : "");
  if (job.task_id) {
    chip.addEventListener("click", (event) => { event.stopPropagation(); openTask(job.task_id); });
  }
  return chip;
}

function openTask(id) {
  selectTask(id);
  $("detail").scrollIntoView({ block: "nearest" });
}

function scanRow(scan) {
  const tr = document.createElement("tr");
  tr.dataset.id = scan.id;
  const steps = document.createElement("td"), chips = document.createElement("div");
  chips.className = "jobs";
  chips.append(...scan.jobs.map(jobChip));
  steps.appendChild(chips);
  tr.append(td(scan.id), td(scan.profile), td(scan.state, "state state-" + scan.state), steps,
    td(scan.organization || ""), td(toSecond(scan.created_at)));
  tr.addEventListener("click", () => selectScan(scan.id));
  return tr;
}

// A scan's row is built again only when the scan changed: a click on a step is not lost to a refresh that would
// replace its button between mousedown and mouseup.
function showScans(scans) {
  const tbody = $("scans").tBodies[0];
  const built = new Map([...tbody.rows].map((tr) => [tr.dataset.id, tr]));
  const rows = scans.map((scan) => {
    const seen = JSON.stringify(scan), tr = built.get(scan.id);
    if (tr && tr.dataset.seen === seen) return tr;
    const fresh = scanRow(scan);
    fresh.dataset.seen = seen;
    return fresh;
  });
  if (rows.length !== tbody.rows.length || rows.some((tr, i) => tbody.rows[i] !== tr)) tbody.replaceChildren(...rows);
}

async function refreshScans() {
  scansTimer = null;
  try {
    const { scans } = await api("GET", `/v1/scans?limit=${SCANS_LIMIT}`);
    scansShown = true;
    $("scans-panel").hidden = false;
    $("scans-empty").hidden = scans.length > 0;
    $("scans").hidden = scans.length === 0;
    showScans(scans);
    const shown = scans.find((s) => s.id === selectedScan);
    if (shown) showScan(shown);
    report("scans", null);
  } catch (err) {
    if (err.status === 404) {  // no scans here: not a problem of the connection
      scansShown = false;
      $("scans-panel").hidden = true;
      report("scans", null);
    } else {
      report("scans", err.message);
    }
  }
}

function scheduleScans() {
  if (scansShown && !scansTimer) scansTimer = setTimeout(refreshScans, 250);
}

function selectScan(id) {
  if (id !== selectedScan) $("scan-jobs").tBodies[0].replaceChildren();
  selectedScan = id;
  $("scan-detail").hidden = false;
  $("scan-id").textContent = id;
  loadScan();
}

async function loadScan() {
  const id = selectedScan, seq = ++scanSeq;
  try {
    const scan = await api("GET", "/v1/scans/" + encodeURIComponent(id));
    if (seq !== scanSeq) return;
    showScan(scan);
    const steps = await Promise.all(scan.jobs.filter((job) => job.task_id).map((job) => stepTask(job)));
    if (seq === scanSeq) showStepResults(steps);
  } catch (err) {
    if (seq === scanSeq) $("scan-state").textContent = err.message;
  }
}

function showScan(scan) {
  const found = Object.keys(scan.scope || {}).length;
  $("scan-scope").textContent = found ? JSON.stringify(scan.scope, null, 2) : "nothing yet";
  $("scan-state").textContent = scan.state;
  $("scan-state").className = "state state-" + scan.state;
  $("scan-jobs").tBodies[0].replaceChildren(...scan.jobs.map((job) => {
    const tr = document.createElement("tr");
    tr.dataset.index = job.index;
    const error = job.error ? `${job.error.code}: ${job.error.message}` : "";
    const files = document.createElement("td");
    for (const name of Object.keys(job.artifacts || {})) {  // its latest task's, the newest attempt's of each
      files.append(downloadLink(artifactHref(job.task_id, name), name), " ");
    }
    tr.append(td(String(job.index)), td(job.step), td(job.state, "job-state job-" + job.state),
      td(String(job.attempts ?? "")), td(error), td(job.task_id || "not created yet"), files);
    if (job.task_id) tr.addEventListener("click", () => openTask(job.task_id));
    else tr.className = "inert";
    return tr;
  }));
}

async function stepTask(job) {
  const ended = endedSteps.get(job.task_id);
  if (ended) return { job, task: ended };
  const task = await api("GET", "/v1/tasks/" + encodeURIComponent(job.task_id));
  if (TERMINAL.has(task.state)) endedSteps.set(task.id, task);
  return { job, task };
}

function showStepResults(steps) {
  const blocks = steps.flatMap(({ job, task }) => {
    const head = document.createElement("h3");
    head.textContent = `step ${job.index} ${job.step}: ${task.state}`;
    return [head, ...resultBlocks(task.results)];
  });
  $("scan-results").replaceChildren(...blocks);
}

function scanOf(data) {
  try {
    return JSON.parse(data).scan_id;
  } catch {
    return null;
  }
}

eventHooks.push((name, data) => {
  if (name.startsWith("scan.") || name === "stream.gap") scheduleScans();
  if (selectedScan && name.startsWith("scan.") && scanOf(data) === selectedScan) loadScan();
});
refreshHooks.push(refreshScans);  // a new token: asked again, 404 or not
refreshScans();
setInterval(() => { if (scansShown) refreshScans(); }, SCANS_PERIOD_MS);
