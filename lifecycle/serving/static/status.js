// The status page: one EventSource on /v1/events, nothing else from the network.
// Typed events update what they say at once (a state, a component's bytes on the
// device, a refusal); each burst of events is followed by a status.snapshot, which
// redraws everything from what the worker holds now. Events are numbered (seq), and a
// pipeline's snapshot names the last one it shows: the worker reads it after events
// that may still be on their way, and those are not applied again on top of it.
"use strict";

const MAX_REFUSALS = 20;
const OCCUPANT_CHARS = 16; // what fits under a state's name in the diagram
const SWATCHES = ["#0969da", "#bf3989", "#1a7f37", "#9a6700", "#8250df", "#cf222e", "#0a7b83", "#6e7781"];
const shown = new Map(); // pipeline name -> {root, status, refusals}

function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

// the bytes held against the budget: "X on the device of a Y budget", or without one
// "X on the device, no device budget"
function onDevice(used, budget, shared) {
  const held = `${bytes(used)} on the device`;
  return budget === null ? `${held}, no device budget` : `${held} of a ${bytes(budget)} budget${shared}`;
}

// styles are set through the CSSOM: the page's security policy forbids style attributes
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "style") {
      for (const [property, setting] of Object.entries(value)) node.style.setProperty(property, setting);
    } else if (value !== null && value !== undefined) {
      node.setAttribute(key, value);
    }
  }
  for (const child of children) node.append(child);
  return node;
}

function pipeline(name) {
  let found = shown.get(name);
  if (found) return found;
  const root = document.getElementById("pipeline-template").content.firstElementChild.cloneNode(true);
  root.dataset.pipeline = name;
  root.querySelector(".name").textContent = name;
  const main = document.getElementById("pipelines");
  main.querySelector(".empty")?.remove();
  main.append(root);
  found = { root, status: null, refusals: [] };
  shown.set(name, found);
  return found;
}

// -- a snapshot: everything redrawn ---------------------------------------------------

// the worker: every pipeline it serves shares its phase and its device budget
function renderWorker(snapshot) {
  const count = snapshot.pipelines.length;
  const saved = snapshot.shared_bytes_saved ? `; sharing saves ${bytes(snapshot.shared_bytes_saved)}` : "";
  const worker = document.getElementById("worker");
  worker.dataset.phase = snapshot.phase;
  worker.dataset.resident = snapshot.resident_bytes;
  worker.textContent = `${snapshot.phase}: ${count} pipeline${count === 1 ? "" : "s"}, ` +
    `${onDevice(snapshot.resident_bytes, snapshot.budget, "")}${saved}`;
  const names = new Set(snapshot.pipelines.map((p) => p.name));
  for (const [name, view] of shown) {  // a pipeline removed from the worker leaves the page
    if (!names.has(name)) { view.root.remove(); shown.delete(name); }
  }
  snapshot.pipelines.forEach(renderStatus);
}

function renderStatus(status) {
  const view = pipeline(status.name);
  view.status = status;
  const phase = view.root.querySelector(".phase");
  phase.textContent = status.phase;
  phase.dataset.phase = status.phase;
  const state = view.root.querySelector(".pipeline-state");
  state.dataset.state = status.state;
  state.textContent = status.gate === "open" ? status.state : `${status.state}, requests wait: ${status.gate}`;
  renderComponents(view);
  renderBudget(view);
  renderQueue(view);
  renderTimeline(view);
}

function renderComponents(view) {
  const table = view.root.querySelector(".components");
  const rows = view.status.components.map((c) => labelled(table,
    el("tr", { "data-component": c.name },
      el("td", {}, c.name),
      el("td", { class: "state" }, el("span", { "data-state": c.state }, c.state)),
      el("td", { class: "users" }, c.users.join(", ") || "—"),
      el("td", { class: "shared" }, c.shared_with.join(", ") || "—"),
      el("td", {}, c.residency),
      el("td", {}, c.target || "—"),
      el("td", { class: "acceleration" }, acceleration(c)),
      el("td", { class: "bytes num", "data-resident": c.resident_bytes, "data-footprint": c.footprint },
        `${bytes(c.resident_bytes)} / ${bytes(c.footprint)}`))));
  table.querySelector("tbody").replaceChildren(...rows);
  renderDiagram(view);
}

// "compile blocks, int8_dynamic": what compiles and quantizes the component, or a dash
function acceleration(c) {
  const parts = [];
  if (c.compile !== "off") parts.push(`compile ${c.compile}`);
  if (c.quantization !== "off") parts.push(c.quantization);
  return parts.join(", ") || "—";
}

// each cell named by its column's heading: a phone shows a row as lines of "heading value"
function labelled(table, row) {
  const headings = [...table.querySelectorAll("thead th")].map((th) => th.textContent);
  row.querySelectorAll("td").forEach((td, i) => td.setAttribute("data-label", headings[i]));
  return row;
}

function renderDiagram(view) {
  for (const node of view.root.querySelectorAll(".diagram .state")) {
    const here = view.status.components.filter((c) => c.state === node.dataset.state);
    const names = here.map((c) => c.name).join(", ");
    node.classList.toggle("occupied", here.length > 0);
    node.querySelector(".occupants").textContent =
      names.length <= OCCUPANT_CHARS ? names : `${here.length} components`;
    node.querySelector("title").textContent = `${node.dataset.state}: ${names || "none"}`;
  }
}

function renderBudget(view) {
  const status = view.status;
  const used = status.components.reduce((sum, c) => sum + c.resident_bytes, 0);
  const all = status.components.reduce((sum, c) => sum + c.footprint, 0);
  const scale = Math.max(status.budget ?? all, used, 1);
  const bar = view.root.querySelector(".bar");
  bar.dataset.used = used;
  bar.dataset.limit = status.budget ?? "";
  bar.replaceChildren(...status.components.map((c, i) => el("span", {
    "data-component": c.name,
    title: `${c.name}: ${bytes(c.resident_bytes)}`,
    style: { width: `${(100 * c.resident_bytes / scale).toFixed(2)}%`, background: swatch(i) },
  })));
  const shared = shown.size > 1 ? " shared by every pipeline" : "";
  view.root.querySelector(".figures").textContent = onDevice(used, status.budget, shared);
  view.root.querySelector(".shares").replaceChildren(...status.components.map((c, i) =>
    el("li", { style: { "--swatch": swatch(i) } },
      `${c.name}: ${bytes(c.resident_bytes)} (footprint ${bytes(c.footprint)})`)));
  const waiting = status.waiting.map((w) =>
    el("li", { "data-request-id": w.request_id },
      `${w.request_id} waits to enter ${w.stage} (needs ${w.components.join(", ")})`));
  view.root.querySelector(".waiting").replaceChildren(...(waiting.length ? waiting : [none()]));
}

function renderQueue(view) {
  const status = view.status;
  view.root.querySelector(".queued tbody").replaceChildren(...status.queued.map((q) =>
    el("tr", { "data-request-id": q.id },
      el("td", { class: "id" }, q.id), el("td", {}, q.priority ?? "—"), el("td", {}, q.endpoint),
      el("td", { class: "num" }, q.items), el("td", { class: "num" }, `${q.queued_s.toFixed(2)} s`))));
  // a batch's id is its requests' ids joined by "+": it wraps between them (or, for one
  // long id, anywhere), so that stage and step stay in view however many requests it holds
  view.root.querySelector(".running tbody").replaceChildren(...status.running.map((r) =>
    el("tr", { "data-batch-id": r.id },
      el("td", { class: "id" }, ...r.request_ids.flatMap((id, i) => i ? ["+", el("wbr"), id] : [id])),
      el("td", { class: "stage" }, r.stage ?? "—"),
      el("td", { class: "step num" },
        `${r.step ?? "—"} / ${r.steps}` + (r.skipped ? ` (${r.skipped} skipped)` : "")))));
}

function renderTimeline(view) {
  const bars = view.status.timeline;
  const gantt = view.root.querySelector(".gantt");
  if (!bars.length) { gantt.replaceChildren(none()); return; }
  const start = Math.min(...bars.map((b) => b.start));
  const span = Math.max(...bars.map((b) => b.stop)) - start || 1;
  const lanes = [];
  view.status.components.forEach((c, i) => {
    const lane = el("div", { class: "lane", "data-component": c.name });
    for (const b of bars.filter((bar) => bar.component === c.name)) {
      lane.append(el("span", {
        title: `${c.name} ${b.prefetched ? "prefetched, " : ""}resident ${(b.stop - b.start).toFixed(3)} s${b.request_id ? ` (${b.request_id})` : ""}`,
        style: {
          left: `${(100 * (b.start - start) / span).toFixed(2)}%`,
          width: `${(100 * (b.stop - b.start) / span).toFixed(2)}%`,
          background: swatch(i),
        },
      }));
    }
    lanes.push(el("span", {}, c.name), lane);
  });
  gantt.replaceChildren(...lanes);
  view.root.querySelector(".moves-figure").textContent =
    `${bars.length} resident intervals over the last ${span.toFixed(2)} s of moves`;
}

function none() { return el("li", { class: "none" }, "none"); }

function swatch(index) { return SWATCHES[index % SWATCHES.length]; }

// -- a typed event: what it says, at once ------------------------------------------------

// the component an event changes; none when the snapshot shown already holds the event
// (an older move applied to a newer snapshot could show two components where one fits)
function changed(view, seq, name) {
  if (!view.status || seq <= view.status.seq) return undefined;
  return view.status.components.find((c) => c.name === name);
}

function onEvent(name, seq, event) {
  const view = pipeline(name);
  if (event.type === "lifecycle.transition") {
    const c = changed(view, seq, event.component);
    if (c) { c.state = event.dest; renderComponents(view); }
  } else if (event.type === "residency.moved") {
    const c = changed(view, seq, event.component);
    if (c) {
      c.resident_bytes = event.direction === "onload" ? event.bytes : 0;
      renderComponents(view);
      renderBudget(view);
    }
  } else if (event.type === "lifecycle.refused" && !event.may_wait) {
    event.codes.forEach((code, i) => addRefusal(view, {
      code, component: event.component, trigger: event.trigger, request: event.request_id,
      message: event.messages[i] ?? "", fix: event.hints?.[i] ?? "",
    }));
  } else if (event.type === "residency.waited" && event.outcome === "refused") {
    addRefusal(view, {
      code: "residency.memory_budget", component: event.components.join(", "), trigger: "onload",
      request: event.request_id, message: `waited ${event.seconds} s to enter stage ${event.stage}`, fix: "",
    });
  }
}

function addRefusal(view, refusal) {
  view.refusals.unshift(refusal);
  view.refusals.length = Math.min(view.refusals.length, MAX_REFUSALS);
  const items = view.refusals.map((r) => el("li", { "data-code": r.code },
    el("code", {}, r.code),
    el("span", { class: "where" }, ` ${r.component} · ${r.trigger}${r.request ? ` · ${r.request}` : ""}`),
    el("p", { class: "message" }, r.message),
    ...(r.fix ? [el("p", { class: "fix" }, `fix: ${r.fix}`)] : [])));
  view.root.querySelector(".refusal-list").replaceChildren(...items);
}

// -- the stream ------------------------------------------------------------------------------

function connect() {
  const connection = document.getElementById("connection");
  const say = (state, text) => { connection.dataset.state = state; connection.textContent = text; };
  const source = new EventSource("/v1/events");
  source.onopen = () => {
    // a new stream replays the recent refusals: start their list afresh
    for (const view of shown.values()) view.refusals = [];
    say("live", "live");
  };
  source.onerror = () => say("lost", "connection lost: reconnecting");
  source.onmessage = (message) => {
    const data = JSON.parse(message.data);
    if (data.type === "status.snapshot") renderWorker(data);
    else if (data.type === "stream.overflowed") say("lost", "fell behind: reconnecting");
    else onEvent(data.pipeline, data.seq, data.event);
  };
}

connect();
