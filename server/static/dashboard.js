// pagedserve dashboard: polls GET /v1/engine/state and draws the block pool, the block tables,
// the last plan and the queue/throughput history. Plain JavaScript, no dependencies. Every text
// that comes from the server (request ids) is set with textContent, never as HTML.
import { RATE_WINDOW_S, drawCharts, latestRates, record } from "./charts.js";
import { $, el, formatNumber, ownerColour, ownerColours, shortId } from "./util.js";

const POLL_MS = 500; // 2 Hz: the engine thread answers between two steps
const RETRY_MS = 2000;
const MAX_ROWS = 80; // request rows drawn; more are summarised
const DENSE_ABOVE_BLOCKS = 2048;

const ui = {
  selected: null, // request id whose blocks are highlighted
  paused: false,
  state: null,
  numBlocksDrawn: -1,
  blockEls: [],
  blockKeys: [],
  apiKey: null,
  timer: null,
  inFlight: false,
};
window.pagedserveDashboard = ui; // for tests and the curious (read-only use)

function readApiKey() {
  const match = /(?:^#|&)key=([^&]*)/.exec(window.location.hash);
  if (match) {
    sessionStorage.setItem("pagedserve-api-key", decodeURIComponent(match[1]));
    history.replaceState(null, "", window.location.pathname); // keep the key out of the URL bar
  }
  return sessionStorage.getItem("pagedserve-api-key");
}

// ---- polling ------------------------------------------------------------------------------

async function poll() {
  ui.timer = null;
  if (ui.paused || ui.inFlight) return;
  ui.inFlight = true;
  let delay = RETRY_MS;
  let state = null;
  try {
    const headers = ui.apiKey ? { Authorization: `Bearer ${ui.apiKey}` } : {};
    const response = await fetch("v1/engine/state", { headers, cache: "no-store" });
    if (response.ok) {
      state = await response.json();
      delay = POLL_MS;
    } else {
      await showHttpError(response);
    }
  } catch (error) {
    setStatus("error", "server unreachable");
    showNotice(`Cannot reach the server (${error.message}); retrying.`);
  } finally {
    ui.inFlight = false;
  }
  try {
    if (state !== null) {
      showNotice(null);
      setStatus("live", "live");
      // a bug in render reaches the console as an uncaught error, as it should
      render({ ...state, blocks: expandBlocks(state.blocks) });
    }
  } finally {
    schedulePoll(delay);
  }
}

function schedulePoll(delay) {
  if (ui.timer === null && !ui.paused) ui.timer = setTimeout(poll, delay);
}

async function showHttpError(response) {
  let message = `HTTP ${response.status}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) {
    // not JSON: keep the status line
  }
  setStatus("error", response.status === 401 ? "needs API key" : `error ${response.status}`);
  showNotice(message, response.status === 401);
}

function setStatus(kind, text) {
  $("status-pill").className = `pill ${kind}`;
  $("status-text").textContent = text;
}

function showNotice(text, askForKey = false) {
  $("notice").classList.toggle("hidden", text === null);
  if (text !== null) $("notice-text").textContent = text;
  $("key-form").classList.toggle("hidden", !askForKey);
}

// ---- render -------------------------------------------------------------------------------

// The state sends the pool columnar (one list per field, indexed by block id: a third of the
// bytes, and far less work for the server); the page draws it block by block.
function expandBlocks(columns) {
  return columns.state.map((state, blockId) => ({
    block_id: blockId,
    state,
    ref_count: columns.ref_count[blockId],
    owner_ids: columns.owner_ids[blockId],
    is_hashed: columns.is_hashed[blockId],
  }));
}

function render(state) {
  ui.state = state;
  const requests = [...state.running, ...state.waiting];
  if (ui.selected !== null && !requests.some((r) => r.sequence_id === ui.selected)) ui.selected = null;
  record(state);
  renderHeader(state);
  renderCards(state);
  renderPool(state);
  renderPlan(state);
  renderRequests(state);
  renderInspector(state);
  drawCharts();
  drawArrows();
  document.body.dataset.ready = "1";
}

function renderHeader(state) {
  $("model").textContent = `${state.model} · ${formatNumber(state.num_blocks)} blocks × ${state.block_size} tokens` +
    (state.enable_prefix_caching ? " · prefix caching on" : " · prefix caching off");
  const time = new Date(state.time * 1000).toLocaleTimeString();
  $("step-meta").textContent = `step ${formatNumber(state.num_steps)} · snapshot ${time}`;
}

function countBlocks(state) {
  const counts = { free: 0, cached: 0, in_use: 0, shared: 0 };
  for (const block of state.blocks) {
    counts[block.state] += 1;
    if (block.ref_count > 1) counts.shared += 1;
  }
  return counts;
}

function renderCards(state) {
  const counts = countBlocks(state);
  const stats = state.stats;
  $("c-running").textContent = formatNumber(state.running.length);
  $("c-waiting").textContent = formatNumber(state.waiting.length);
  $("c-used").textContent = formatNumber(counts.in_use);
  $("c-used-hint").textContent = `of ${formatNumber(state.num_blocks)} (${formatNumber((100 * counts.in_use) / state.num_blocks, 1)}%)`;
  $("c-cached").textContent = formatNumber(counts.cached);
  $("c-shared").textContent = formatNumber(counts.shared);
  const rates = latestRates();
  $("c-tps").textContent = rates ? formatNumber(rates.gen, 1) : "–";
  $("c-tps-hint").textContent = rates ? `+ ${formatNumber(rates.prompt, 0)} prompt tok/s` : `over the last ${RATE_WINDOW_S} s`;
  const queries = stats.prefix_cache_queries;
  $("c-hits").textContent = queries ? `${formatNumber((100 * stats.prefix_cache_hits) / queries, 1)}%` : "–";
  $("c-preempt").textContent = formatNumber(stats.num_preemptions);
}

function buildPool(numBlocks) {
  const pool = $("pool");
  pool.replaceChildren();
  pool.classList.toggle("dense", numBlocks > DENSE_ABOVE_BLOCKS);
  ui.blockEls = [];
  ui.blockKeys = [];
  const fragment = document.createDocumentFragment();
  for (let id = 0; id < numBlocks; id++) {
    const node = el("i", "block free");
    node.dataset.blockId = String(id);
    node.appendChild(el("b"));
    fragment.appendChild(node);
    ui.blockEls.push(node);
    ui.blockKeys.push("");
  }
  pool.appendChild(fragment);
  pool.dataset.numBlocks = String(numBlocks);
  ui.numBlocksDrawn = numBlocks;
}

function renderPool(state) {
  if (ui.numBlocksDrawn !== state.num_blocks) buildPool(state.num_blocks);
  const selected = ui.selected;
  $("pool").classList.toggle("has-selection", selected !== null);
  $("pool-meta").textContent = `· ${formatNumber(state.num_blocks)} blocks of ${state.block_size} tokens (${formatNumber(state.num_blocks * state.block_size)} slots)`;
  for (const block of state.blocks) {
    const owner = block.owner_ids.length ? block.owner_ids[0] : "";
    const isSelected = selected !== null && block.owner_ids.includes(selected);
    const key = `${block.state}|${block.ref_count}|${block.is_hashed}|${block.owner_ids.join(",")}|${isSelected}`;
    if (ui.blockKeys[block.block_id] === key) continue; // unchanged: no DOM work
    ui.blockKeys[block.block_id] = key;
    const node = ui.blockEls[block.block_id];
    let className = `block ${block.state}`;
    if (block.ref_count > 1) className += " shared";
    if (block.is_hashed) className += " hashed";
    if (isSelected) className += " selected";
    node.className = className;
    const colours = block.state === "in_use" ? ownerColours(owner) : null;
    node.style.background = colours ? colours.bg : "";
    node.style.color = colours ? colours.fg : "";
    node.firstChild.textContent = block.ref_count > 1 ? String(block.ref_count) : "";
    node.title = describeBlock(block);
  }
}

function describeBlock(block) {
  const what = { free: "free", cached: "cached-free (hash kept)", in_use: "in use" }[block.state];
  let text = `Block ${block.block_id}: ${what}, ref count ${block.ref_count}`;
  if (block.owner_ids.length) text += `, owners ${block.owner_ids.join(", ")}`;
  if (block.is_hashed) text += ", hash registered in the prefix cache";
  return text;
}

function renderPlan(state) {
  const plan = state.last_plan;
  const bar = $("plan");
  const legend = $("plan-legend");
  bar.replaceChildren();
  legend.replaceChildren();
  if (!plan) {
    $("plan-meta").textContent = "· no step yet";
    return;
  }
  const numDecodes = plan.requests.filter((r) => r.num_new_tokens === 1 && r.start_position > 0).length;
  const numChunks = plan.requests.length - numDecodes;
  $("plan-meta").textContent = `· ${formatNumber(plan.num_batched_tokens)} of ${formatNumber(plan.token_budget)} budget tokens: ${numDecodes} decodes, ${numChunks} prompt chunks` +
    (plan.num_block_copies ? `, ${plan.num_block_copies} copy-on-write copies` : "");
  for (const entry of plan.requests) {
    const seg = el("span", "seg");
    seg.style.width = `${(100 * entry.num_new_tokens) / Math.max(plan.token_budget, 1)}%`;
    seg.style.background = ownerColour(entry.sequence_id);
    seg.title = `${entry.sequence_id}: ${entry.num_new_tokens} tokens from position ${entry.start_position}` +
      (entry.needs_sample ? " (samples a token)" : " (prompt chunk, no sample)");
    seg.addEventListener("click", () => select(entry.sequence_id));
    bar.appendChild(seg);
  }
  for (const entry of plan.requests.slice(0, 12)) {
    const item = el("span");
    const swatch = el("i");
    swatch.style.background = ownerColour(entry.sequence_id);
    item.append(swatch, `${shortId(entry.sequence_id)} ${entry.num_new_tokens}`);
    legend.appendChild(item);
  }
  if (plan.requests.length > 12) legend.appendChild(el("span", "", `+${plan.requests.length - 12} more`));
}

function renderRequests(state) {
  const list = $("requests");
  const requests = [...state.running, ...state.waiting];
  $("requests-meta").textContent = `· ${state.running.length} running, ${state.waiting.length} waiting`;
  const shared = new Set(state.blocks.filter((b) => b.ref_count > 1).map((b) => b.block_id));
  const rows = requests.slice(0, MAX_ROWS).map((request) => requestRow(request, state.block_size, shared));
  if (requests.length > MAX_ROWS) rows.push(el("div", "more", `+${requests.length - MAX_ROWS} more requests`));
  if (!requests.length) rows.push(el("div", "more", "No requests right now: send one and watch it take blocks."));
  list.replaceChildren(...rows);
}

function requestRow(request, blockSize, shared) {
  const row = el("div", "request-row");
  row.dataset.sequenceId = request.sequence_id;
  row.dataset.status = request.status;
  if (request.sequence_id === ui.selected) row.classList.add("selected");
  const colour = ownerColour(request.sequence_id);
  const head = el("div", "head");
  const chip = el("span", "chip");
  chip.style.background = colour;
  const rid = el("span", "rid", request.sequence_id);
  rid.title = request.sequence_id;
  const numTokens = request.num_prompt_tokens + request.num_output_tokens;
  const nums = el("span", "nums",
    `prompt ${request.num_prompt_tokens} · out ${request.num_output_tokens} · computed ${request.num_computed_tokens}` +
    (request.num_cached_tokens > 0 ? ` · cached ${request.num_cached_tokens}` : "") +
    (request.num_preemptions ? ` · preempted ×${request.num_preemptions}` : ""));
  head.append(chip, rid, el("span", `badge ${request.status}`, request.status), nums);
  const progress = el("div", "progress");
  const done = el("span");
  done.style.width = `${(100 * request.num_computed_tokens) / Math.max(numTokens, 1)}%`;
  done.style.background = colour;
  progress.appendChild(done);
  row.append(head, progress, blockTableRow(request, blockSize, shared, colour));
  row.addEventListener("click", () => select(request.sequence_id));
  return row;
}

function blockTableRow(request, blockSize, shared, colour) {
  const table = el("div", "table-row");
  if (!request.block_table.length) {
    table.appendChild(el("span", "empty-table", request.status === "running" ? "no blocks" : "no blocks while waiting (a preempted request recomputes)"));
    return table;
  }
  request.block_table.forEach((blockId, logical) => {
    const cell = el("span", "cell");
    cell.dataset.blockId = String(blockId);
    if (shared.has(blockId)) cell.classList.add("shared");
    const first = logical * blockSize;
    cell.title = `logical block ${logical} (positions ${first}–${first + blockSize - 1}) → physical block ${blockId}`;
    const physical = el("span", "physical", blockId);
    physical.style.background = colour;
    physical.style.color = ownerColours(request.sequence_id).fg;
    cell.append(el("span", "logical", `${logical} →`), physical);
    table.appendChild(cell);
  });
  return table;
}

function select(requestId) {
  ui.selected = ui.selected === requestId ? null : requestId;
  if (ui.state) render(ui.state);
}

function renderInspector(state) {
  const box = $("inspector");
  const request = [...state.running, ...state.waiting].find((r) => r.sequence_id === ui.selected);
  box.classList.toggle("hidden", !request || !request.block_table.length);
  if (!request || !request.block_table.length) return;
  const input = $("pos-input");
  const numSlots = request.block_table.length * state.block_size;
  input.max = String(numSlots - 1);
  const pos = Math.min(Math.max(parseInt(input.value, 10) || 0, 0), numSlots - 1);
  const logical = Math.floor(pos / state.block_size);
  const offset = pos % state.block_size;
  const block = request.block_table[logical];
  $("pos-result").textContent =
    `${shortId(request.sequence_id)}: pos ${pos} → table[${pos} // ${state.block_size}] = table[${logical}] = block ${block}, ` +
    `offset ${pos} % ${state.block_size} = ${offset}, slot ${block} × ${state.block_size} + ${offset} = ${block * state.block_size + offset}`;
}

// ---- arrows: the selected request's table cells → its blocks in the pool --------------------

function drawArrows() {
  const svg = $("arrows");
  for (const path of svg.querySelectorAll("path.link")) path.remove();
  if (ui.selected === null) return;
  const row = [...document.querySelectorAll(".request-row")].find((r) => r.dataset.sequenceId === ui.selected);
  if (!row) return;
  const origin = $("layout").getBoundingClientRect();
  const list = $("requests").getBoundingClientRect();
  const colour = ownerColour(ui.selected);
  for (const cell of row.querySelectorAll(".cell")) {
    const target = ui.blockEls[Number(cell.dataset.blockId)];
    if (!target) continue;
    const from = cell.getBoundingClientRect();
    if (from.bottom < list.top || from.top > list.bottom) continue; // scrolled out of the list
    const to = target.getBoundingClientRect();
    const x1 = from.left - origin.left;
    const y1 = from.top + from.height / 2 - origin.top;
    const x2 = to.right - origin.left + 2;
    const y2 = to.top + to.height / 2 - origin.top;
    const bend = Math.max(40, (x1 - x2) / 2);
    const path = document.createElementNS("http://www.w3.org/2000/svg", "path");
    path.setAttribute("class", "link");
    path.setAttribute("d", `M ${x1} ${y1} C ${x1 - bend} ${y1}, ${x2 + bend} ${y2}, ${x2} ${y2}`);
    path.setAttribute("stroke", colour);
    path.setAttribute("marker-end", "url(#arrowhead)");
    svg.appendChild(path);
  }
}

// ---- wiring -------------------------------------------------------------------------------

function onPoolHover(event) {
  const node = event.target.closest ? event.target.closest(".block") : null;
  if (!node || !ui.state) return;
  const block = ui.state.blocks[Number(node.dataset.blockId)];
  if (block) $("block-info").textContent = describeBlock(block);
}

function onPoolClick(event) {
  const node = event.target.closest ? event.target.closest(".block") : null;
  if (!node || !ui.state) return;
  const block = ui.state.blocks[Number(node.dataset.blockId)];
  if (!block || !block.owner_ids.length) return;
  select(block.owner_ids[0]);
  const row = [...document.querySelectorAll(".request-row")].find((r) => r.dataset.sequenceId === ui.selected);
  if (row) {
    row.scrollIntoView({ block: "nearest" });
    drawArrows();
  }
}

function start() {
  ui.apiKey = readApiKey();
  $("pool").addEventListener("mouseover", onPoolHover);
  $("pool").addEventListener("click", onPoolClick);
  $("pause").addEventListener("click", () => {
    ui.paused = !ui.paused;
    $("pause").textContent = ui.paused ? "Resume" : "Pause";
    if (ui.paused) {
      clearTimeout(ui.timer);
      ui.timer = null;
      setStatus("paused", "paused");
    } else {
      schedulePoll(0);
    }
  });
  $("key-save").addEventListener("click", () => {
    ui.apiKey = $("key-input").value.trim() || null;
    if (ui.apiKey) sessionStorage.setItem("pagedserve-api-key", ui.apiKey);
    schedulePoll(0);
  });
  $("pos-input").addEventListener("input", () => ui.state && renderInspector(ui.state));
  $("requests").addEventListener("scroll", drawArrows, { passive: true });
  window.addEventListener("resize", () => {
    drawCharts();
    drawArrows();
  });
  poll();
}

document.addEventListener("DOMContentLoaded", start);
