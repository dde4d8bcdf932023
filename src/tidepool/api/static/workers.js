// The Workers panel: a gateway's remote workers (GET /v1/workers), each with the buttons that enable, drain
// or revoke it. A daemon without the route (404) shows no panel. Uses app.js's api, report, toSecond and $;
// data goes in as text only.
"use strict";

const REMOTE_PERIOD_MS = 5000;
const REMOTE_MIN_GAP_MS = 1000;  // leases and endings of a busy gateway refresh the live counts at most this often
let remoteShown = true;          // false after a 404: this daemon serves no registry, so polling it stops
let remoteTimer = null;
let servesWorkers = false;   // the node is a gateway (GET /v1/pool says): its panel shows while the registry is empty
let lastWorkers = [];

function liveCount(w) {
  return Array.isArray(w.live) ? w.live.length : Number(w.live || 0);
}

// What an operator may do to a worker in each state: revoked is final.
function actionsFor(state) {
  if (state === "revoked") return [];
  return [state === "enabled" ? "disable" : "enable", "revoke"];
}

const WORKER_COLUMNS = ["id", "state", "live", "max", "organizations", "types", "tags", "issuer", "last-seen",
  "address"];

// The CA its identity is bound to, by the first 12 hex digits of its fingerprint (the title holds them all);
// "-" until its next certificate binds it.
function shortIssuer(issuer) {
  return issuer ? issuer.slice(0, 12) : "-";
}

function workerCells(w) {
  return [w.id, w.state, String(liveCount(w)), String(w.max_concurrent_tasks), (w.organizations || []).join(", "),
    (w.task_types || []).join(", "), (w.tags || ["*"]).join(", "), shortIssuer(w.issuer), toSecond(w.last_seen),
    w.address || ""];
}

// A row is built once per worker and state (its buttons depend on the state) and its figures are updated in
// place: a click on a button is never lost to a refresh replacing the button between mousedown and mouseup.
function workerRow(w) {
  const tr = document.createElement("tr");
  tr.dataset.id = w.id;
  tr.dataset.state = w.state;
  for (const column of WORKER_COLUMNS) {
    const td = document.createElement("td");
    td.className = column === "state" ? "state state-" + w.state : column;
    tr.appendChild(td);
  }
  const buttons = document.createElement("td");
  for (const action of actionsFor(w.state)) {
    const b = document.createElement("button");
    b.textContent = action;
    b.className = action;
    b.addEventListener("click", () => changeWorker(w.id, action));
    buttons.append(b, " ");
  }
  tr.appendChild(buttons);
  return tr;
}

function fillWorker(tr, w) {
  workerCells(w).forEach((text, i) => { if (tr.cells[i].textContent !== text) tr.cells[i].textContent = text; });
  const issuer = tr.cells[WORKER_COLUMNS.indexOf("issuer")];
  if (issuer.title !== (w.issuer || "")) issuer.title = w.issuer || "";
  return tr;
}

function showWorkers(workers) {
  const tbody = $("remote-workers").tBodies[0];
  const built = new Map([...tbody.rows].map((tr) => [tr.dataset.id, tr]));
  const rows = workers.map((w) => {
    const tr = built.get(w.id);
    return fillWorker(tr && tr.dataset.state === w.state ? tr : workerRow(w), w);
  });
  if (rows.length !== tbody.rows.length || rows.some((tr, i) => tbody.rows[i] !== tr)) tbody.replaceChildren(...rows);
}

async function refreshRemote() {
  remoteTimer = null;
  try {
    const { workers } = await api("GET", "/v1/workers");
    remoteShown = true;
    lastWorkers = workers;
    showPanel();
    showWorkers(workers);
    report("remote", null);
  } catch (err) {
    if (err.status === 404) {  // no registry here: not a problem of the connection
      remoteShown = false;
      $("remote").hidden = true;
      report("remote", null);
    } else {
      report("remote", err.message);
    }
  }
}

// A node that is no gateway shows the panel only when its store's registry has workers (a fleet's gateway
// shares it); a gateway shows it always, saying so while no worker has called.
function showPanel() {
  $("remote").hidden = !servesWorkers && lastWorkers.length === 0;
  $("remote-empty").hidden = lastWorkers.length > 0;
  $("remote-workers").hidden = lastWorkers.length === 0;
}

function scheduleRemote(wait) {
  if (remoteShown && !remoteTimer) remoteTimer = setTimeout(refreshRemote, wait);
}

async function changeWorker(id, action) {
  if (action === "revoke" && !window.confirm(`Revoke worker ${id}? Its running attempts are cancelled and its ` +
      "certificate is refused from now on. A revoked worker cannot be enabled again.")) {
    return;
  }
  const path = "/v1/workers/" + encodeURIComponent(id);
  let text;
  try {
    const w = action === "revoke" ? await api("POST", path + "/revoke")
      : await api("PATCH", path, { state: action === "enable" ? "enabled" : "disabled" });
    text = `${w.id}: ${w.state}`;
  } catch (err) {
    text = `${action} ${id} refused: ${err.message}`;
  }
  $("remote-result").textContent = text;
  refreshRemote();
}

eventHooks.push((name) => {
  if (name === "worker.enrolled" || name === "worker.state" || name === "stream.gap") scheduleRemote(250);
  else if (name === "task.leased" || name === "task.finished") scheduleRemote(REMOTE_MIN_GAP_MS);
});
refreshHooks.push(refreshRemote);  // a new token: asked again, 404 or not
poolHooks.push((pool) => {
  if (Boolean(pool.gateway) === servesWorkers) return;
  servesWorkers = Boolean(pool.gateway);
  if (remoteShown) showPanel();
});
refreshRemote();
setInterval(() => { if (remoteShown) refreshRemote(); }, REMOTE_PERIOD_MS);
