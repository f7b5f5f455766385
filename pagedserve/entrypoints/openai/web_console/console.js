// The web console: a chat page over /v1/chat/completions and a live view of the engine over /console/stats.
// Everything the model or a request writes is put into the page as text (textContent), never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "pagedserve-api-key";
const HISTORY_SECONDS = 300; // what the engine view's plots show
const MAX_STEPS = 400; // steps kept for the timeline
const TABLE_STEPS = 40; // steps listed in the table

// ---- the API, with the key when the server wants one ------------------------------------------------

let apiKey = sessionStorage.getItem(KEY_STORAGE) || "";

function headers(extra) {
  const all = Object.assign({}, extra || {});
  if (apiKey) all["Authorization"] = "Bearer " + apiKey;
  return all;
}

async function api(path, options) {
  const response = await fetch(path, Object.assign({}, options, { headers: headers((options || {}).headers) }));
  if (response.status === 401) {
    askForKey("The key was refused.");
    throw new Error("this server needs its API key");
  }
  return response;
}

function askForKey(message) {
  $("key-panel").hidden = false;
  $("key-error").textContent = apiKey ? message : "";
  $("api-key").focus();
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (_) {
    return response.status + " " + response.statusText;
  }
}

// Server-sent events from a fetch (EventSource cannot send the API key): calls onData with each event's data.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((line) => line.startsWith("data:")).map((line) => line.slice(5).trimStart()).join("\n");
      if (data && onData(data) === false) return;
    }
  }
}

// ---- markdown, built as DOM nodes ------------------------------------------------------------------

const INLINE = /(`+)([^`]+?)\1|\*\*([^*]+)\*\*|__([^_]+)__|\*([^*\s][^*]*?)\*|_([^_\s][^_]*?)_|\[([^\]]+)\]\(([^)\s]+)\)/g;

function appendInline(parent, text) {
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    if (match.index > last) parent.append(text.slice(last, match.index));
    const [, ticks, code, bold1, bold2, em1, em2, linkText, href] = match;
    let node;
    if (ticks) {
      node = document.createElement("code");
      node.textContent = code;
    } else if (bold1 || bold2) {
      node = document.createElement("strong");
      appendInline(node, bold1 || bold2);
    } else if (em1 || em2) {
      node = document.createElement("em");
      appendInline(node, em1 || em2);
    } else if (/^https?:\/\//i.test(href)) {
      node = document.createElement("a");
      node.href = href;
      node.rel = "noopener noreferrer nofollow";
      node.target = "_blank";
      node.textContent = linkText;
    } else {
      node = document.createTextNode(match[0]); // only web links become links
    }
    parent.append(node);
    last = match.index + match[0].length;
  }
  if (last < text.length) parent.append(text.slice(last));
}

function renderMarkdown(container, text) {
  container.replaceChildren();
  const lines = text.split("\n");
  let paragraph = [];
  let list = null;
  const flush = () => {
    if (paragraph.length) {
      const p = document.createElement("p");
      appendInline(p, paragraph.join("\n"));
      container.append(p);
      paragraph = [];
    }
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*(```|~~~)\s*([\w+-]*)/);
    if (fence) {
      flush();
      const code = [];
      for (i++; i < lines.length && !lines[i].trimStart().startsWith(fence[1]); i++) code.push(lines[i]);
      const pre = document.createElement("pre");
      const element = document.createElement("code");
      if (fence[2]) element.dataset.language = fence[2];
      element.textContent = code.join("\n");
      pre.append(element);
      container.append(pre);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
    if (heading) {
      flush();
      const h = document.createElement("h" + Math.min(6, heading[1].length + 2));
      appendInline(h, heading[2]);
      container.append(h);
    } else if (item) {
      if (paragraph.length) flush();
      const ordered = /\d/.test(item[1]);
      if (!list || (list.tagName === "OL") !== ordered) {
        list = document.createElement(ordered ? "ol" : "ul");
        container.append(list);
      }
      const li = document.createElement("li");
      appendInline(li, item[2]);
      list.append(li);
    } else if (!line.trim()) {
      flush();
    } else {
      list = null;
      paragraph.push(line);
    }
  }
  flush();
}

// ---- chat ----------------------------------------------------------------------------------------------

const conversation = []; // {role, content} of the turns so far
let inFlight = null; // the AbortController of the answer being streamed

function addMessage(role, text) {
  const element = document.createElement("div");
  element.className = "message " + role;
  const body = document.createElement("div");
  body.className = "body";
  if (role === "assistant") renderMarkdown(body, text);
  else body.textContent = text;
  element.append(body);
  $("conversation").append(element);
  element.scrollIntoView({ block: "end" });
  return element;
}

function numberSetting(id, parse) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const value = parse(raw);
  return Number.isFinite(value) ? value : undefined;
}

function chatRequest() {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const body = { model: $("model").value, messages, stream: true, stream_options: { include_usage: true } };
  const settings = { temperature: numberSetting("temperature", parseFloat), top_p: numberSetting("top-p", parseFloat),
    top_k: numberSetting("top-k", (v) => parseInt(v, 10)), max_tokens: numberSetting("max-tokens", (v) => parseInt(v, 10)),
    seed: numberSetting("seed", (v) => parseInt(v, 10)) };
  for (const [name, value] of Object.entries(settings)) if (value !== undefined) body[name] = value;
  return body;
}

function shellQuote(text) {
  return "'" + text.replace(/'/g, "'\\''") + "'";
}

function showCurl(body) {
  const lines = ["curl " + shellQuote(location.origin + "/v1/chat/completions"), "  -H 'Content-Type: application/json'"];
  if (apiKey) lines.push('  -H "Authorization: Bearer $PAGEDSERVE_API_KEY"');
  lines.push("  -d " + shellQuote(JSON.stringify(body)));
  $("curl").textContent = lines.join(" \\\n");
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(event) {
  event.preventDefault();
  const text = $("message").value;
  if (!text.trim() || inFlight) return;
  $("message").value = "";
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const body = chatRequest();
  showCurl(body);
  const answer = addMessage("assistant", "");
  const meta = document.createElement("div");
  meta.className = "meta";
  answer.append(meta);
  const controller = (inFlight = new AbortController());
  setBusy(true);
  const started = performance.now();
  let firstTokenAt = null;
  let content = "";
  let deltas = 0; // content events: a token each, while no usage has come (a stopped answer gets none)
  let usage = null;
  let finish = null;
  let pending = false;
  const redraw = () => {
    pending = false;
    renderMarkdown(answer.querySelector(".body"), content);
    answer.scrollIntoView({ block: "end" });
  };
  try {
    const response = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json" }, signal: controller.signal });
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, (data) => {
      if (data === "[DONE]") return false;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = (choice.delta && choice.delta.content) || "";
        if (delta) {
          if (firstTokenAt === null) firstTokenAt = performance.now();
          content += delta;
          deltas += 1;
          if (!pending) {
            pending = true;
            requestAnimationFrame(redraw);
          }
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    });
    redraw();
    conversation.push({ role: "assistant", content });
    meta.textContent = describeAnswer(started, firstTokenAt, usage || { completion_tokens: deltas }, finish);
  } catch (error) {
    redraw();
    if (controller.signal.aborted) {
      if (content) conversation.push({ role: "assistant", content });
      meta.textContent = "stopped · " + describeAnswer(started, firstTokenAt, usage || { completion_tokens: deltas }, null);
    } else {
      answer.classList.add("error");
      meta.textContent = "error: " + error.message;
      conversation.pop(); // the user's turn got no answer: it is not part of the conversation
    }
  } finally {
    inFlight = null;
    setBusy(false);
  }
}

function describeAnswer(started, firstTokenAt, usage, finish) {
  const now = performance.now();
  const parts = [];
  if (firstTokenAt !== null) parts.push("TTFT " + ((firstTokenAt - started) / 1000).toFixed(2) + " s");
  if (usage && usage.completion_tokens) {
    parts.push(usage.completion_tokens + " tokens");
    if (firstTokenAt !== null && usage.completion_tokens > 1 && now > firstTokenAt) {
      parts.push(((usage.completion_tokens - 1) / ((now - firstTokenAt) / 1000)).toFixed(1) + " tokens/s");
    }
  }
  if (finish) parts.push("finish: " + finish);
  return parts.join(" · ");
}

function stop() {
  if (inFlight) inFlight.abort();
}

function newChat() {
  stop();
  conversation.length = 0;
  $("conversation").replaceChildren();
}

async function loadModels() {
  try {
    const response = await api("/v1/models");
    if (!response.ok) throw new Error(await errorMessage(response));
    const models = (await response.json()).data;
    $("model").replaceChildren(...models.map((model) => {
      const option = document.createElement("option");
      option.value = option.textContent = model.id;
      return option;
    }));
    $("server-status").textContent = models.length ? models[0].id + " · context " + models[0].max_model_len + " tokens" : "";
    $("key-panel").hidden = true;
    await adaptToRunner();
  } catch (error) {
    $("server-status").textContent = error.message;
  }
}

// A server with runner pooling (an embedding or a classification model) serves no chat: the page keeps to the engine
// view and says what the server offers instead, by the tasks its model runs.
let servesChat = true;
const TASK_ROUTES = {embed: "/v1/embeddings", classify: "/classify", score: "/v1/score, /v1/rerank"};

async function adaptToRunner() {
  const response = await api("/console/server");
  if (!response.ok) throw new Error(await errorMessage(response));
  const facts = await response.json();
  servesChat = facts.runner !== "pooling";
  $("tab-chat").disabled = !servesChat;
  if (!servesChat) {
    const kind = facts.tasks.includes("classify") ? "classification model" : "embedding model";
    const routes = facts.tasks.map((task) => TASK_ROUTES[task]).join(", ");
    $("tab-chat").title = `This server runs a ${kind}: no chat.`;
    $("server-status").textContent += ` · ${kind}: POST ${routes} (no chat)`;
    showTab("engine");
  }
}

// ---- the engine view -----------------------------------------------------------------------------------

const samples = []; // {time, running, waiting, kv, promptTps, genTps, ttft, itl}
const steps = []; // step descriptions, oldest first
let statsStarted = false;

async function followStats() {
  statsStarted = true;
  for (;;) {
    try {
      const response = await api("/console/stats");
      if (!response.ok) throw new Error(await errorMessage(response));
      $("server-status").classList.remove("error");
      await readEvents(response, (data) => {
        takeSample(JSON.parse(data));
      });
    } catch (error) {
      $("server-status").textContent = "engine stats: " + error.message;
      $("server-status").classList.add("error");
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

function sum(values) {
  return values.reduce((a, b) => a + b, 0);
}

function takeSample(sample) {
  const engines = sample.engines;
  const running = sum(engines.map((e) => e.running));
  const waiting = sum(engines.map((e) => e.waiting));
  const kv = engines.length ? sum(engines.map((e) => e.kv_cache_usage)) / engines.length : 0;
  const hitRates = engines.map((e) => e.prefix_cache_hit_rate).filter((v) => v !== null);
  samples.push({ time: sample.time, running, waiting, kv, promptTps: sample.prompt_tokens_per_s, genTps: sample.generation_tokens_per_s,
    ttft: sample.ttft_s, itl: sample.itl_s });
  while (samples.length && samples[0].time < sample.time - HISTORY_SECONDS) samples.shift();
  for (const step of sample.steps) steps.push(step);
  if (steps.length > MAX_STEPS) steps.splice(0, steps.length - MAX_STEPS);
  $("stat-running").textContent = running;
  $("stat-waiting").textContent = waiting;
  $("stat-kv").textContent = (100 * kv).toFixed(1) + " %";
  $("stat-prefix").textContent = hitRates.length ? (100 * sum(hitRates) / hitRates.length).toFixed(1) + " %" : "–";
  $("stat-preemptions").textContent = sum(engines.map((e) => e.preemptions));
  $("stat-prompt-tps").textContent = sample.prompt_tokens_per_s.toFixed(0);
  $("stat-gen-tps").textContent = sample.generation_tokens_per_s.toFixed(1);
  $("ttft-window").textContent = "last " + sample.latency_window_s + " s";
  if (!$("engine-view").hidden) drawEngineView();
}

function drawEngineView() {
  const last = (key, q) => samples.map((s) => (s[key] && s[key][q] !== null ? s[key][q] : NaN));
  drawLines($("plot-requests"), [[samples.map((s) => s.running), "--running"], [samples.map((s) => s.waiting), "--waiting"]], (v) => v.toFixed(0));
  drawLines($("plot-kv"), [[samples.map((s) => 100 * s.kv), "--decode"]], (v) => v.toFixed(0) + " %", 100);
  drawLines($("plot-throughput"), [[samples.map((s) => s.promptTps), "--prompt"], [samples.map((s) => s.genTps), "--decode"]], (v) => v.toFixed(0));
  drawLines($("plot-ttft"), [[last("ttft", "p50"), "--p50"], [last("ttft", "p99"), "--p99"]], (v) => v.toFixed(2));
  drawLines($("plot-itl"), [[last("itl", "p50"), "--p50"], [last("itl", "p99"), "--p99"]], (v) => v.toFixed(3));
  drawTimeline();
  fillStepTable();
}

function color(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

function prepareCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const context = canvas.getContext("2d");
  context.setTransform(ratio, 0, 0, ratio, 0, 0);
  context.clearRect(0, 0, width, height);
  context.font = "11px system-ui, sans-serif";
  return { context, width, height };
}

// Lines over the samples' times, the y axis from 0 to the largest value (or fixedMax), labelled with format.
function drawLines(canvas, series, format, fixedMax) {
  const { context, width, height } = prepareCanvas(canvas);
  const finite = series.flatMap(([values]) => values.filter(Number.isFinite));
  const max = fixedMax || Math.max(1e-9, ...finite);
  const top = 14;
  const plotHeight = height - top - 4;
  context.fillStyle = color("--muted");
  context.fillText(format(max), 2, 10);
  context.strokeStyle = color("--line");
  context.beginPath();
  context.moveTo(0, height - 4);
  context.lineTo(width, height - 4);
  context.stroke();
  if (samples.length < 2) return;
  // The axis grows with the history, from half a minute up to HISTORY_SECONDS.
  const newest = samples[samples.length - 1].time;
  const span = Math.min(HISTORY_SECONDS, Math.max(30, newest - samples[0].time));
  const x = (time) => ((time - (newest - span)) / span) * width;
  for (const [values, colorName] of series) {
    context.strokeStyle = color(colorName);
    context.lineWidth = 1.5;
    context.beginPath();
    let drawing = false;
    values.forEach((value, index) => {
      if (!Number.isFinite(value)) {
        drawing = false;
        return;
      }
      const px = x(samples[index].time);
      const py = top + plotHeight * (1 - value / max);
      if (drawing) context.lineTo(px, py);
      else context.moveTo(px, py);
      drawing = true;
    });
    context.stroke();
  }
}

function drawTimeline() {
  const tokens = prepareCanvas($("timeline"));
  const times = prepareCanvas($("step-times"));
  const barWidth = 4;
  const shown = steps.slice(-Math.floor(tokens.width / barWidth));
  const maxTokens = Math.max(1, ...shown.map((s) => s.decode_tokens + s.prefill_tokens));
  const maxSeconds = Math.max(1e-6, ...shown.map((s) => Math.max(s.seconds, s.stall_limit_s || 0)));
  tokens.context.fillStyle = times.context.fillStyle = color("--muted");
  tokens.context.fillText(maxTokens + " tokens", 2, 10);
  times.context.fillText((1000 * maxSeconds).toFixed(0) + " ms", 2, 10);
  const decode = color("--decode");
  const prompt = color("--prompt");
  const limit = color("--limit");
  shown.forEach((step, index) => {
    const x = tokens.width - (shown.length - index) * barWidth;
    const scale = (tokens.height - 14) / maxTokens;
    const decodeHeight = step.decode_tokens * scale;
    const promptHeight = step.prefill_tokens * scale;
    tokens.context.fillStyle = decode;
    tokens.context.fillRect(x, tokens.height - decodeHeight, barWidth - 1, decodeHeight);
    tokens.context.fillStyle = prompt;
    tokens.context.fillRect(x, tokens.height - decodeHeight - promptHeight, barWidth - 1, promptHeight);
    const timeScale = (times.height - 14) / maxSeconds;
    times.context.fillStyle = step.stall_limit_s !== null && step.seconds > step.stall_limit_s ? limit : color("--muted");
    times.context.fillRect(x, times.height - step.seconds * timeScale, barWidth - 1, step.seconds * timeScale);
    if (step.stall_limit_s !== null) {
      times.context.fillStyle = limit;
      times.context.fillRect(x, times.height - step.stall_limit_s * timeScale - 1, barWidth, 2);
    }
  });
}

function hue(text) {
  let hash = 0;
  for (const character of text) hash = (hash * 31 + character.charCodeAt(0)) | 0;
  return Math.abs(hash) % 360;
}

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function fillStepTable() {
  const rows = steps.slice(-TABLE_STEPS).reverse().map((step) => {
    const row = document.createElement("tr");
    cell(row, step.number);
    cell(row, step.engine);
    cell(row, step.decode_tokens);
    cell(row, step.prefill_tokens);
    const over = step.stall_limit_s !== null && step.seconds > step.stall_limit_s;
    cell(row, (1000 * step.seconds).toFixed(1) + " ms", over ? "over-limit" : "");
    cell(row, step.stall_limit_s === null ? "–" : (1000 * step.stall_limit_s).toFixed(1) + " ms");
    const chunks = cell(row, "");
    for (const chunk of step.chunks) {
      const span = document.createElement("span");
      span.className = "chunk";
      span.style.borderLeftColor = "hsl(" + hue(chunk.request_id) + " 70% 50%)";
      span.title = chunk.request_id;
      span.textContent = chunk.request_id.slice(0, 14) + ": " + chunk.start + "–" + (chunk.start + chunk.tokens) + " of " + chunk.of;
      if (chunk.prompt) {
        const text = document.createElement("span");
        text.className = "prompt-text";
        text.textContent = " “" + chunk.prompt + "”";
        span.append(text);
      }
      chunks.append(span);
    }
    return row;
  });
  $("steps").tBodies[0].replaceChildren(...rows);
}

// ---- tabs and start-up ---------------------------------------------------------------------------------

function showTab(name) {
  if (!servesChat) name = "engine";
  $("chat-view").hidden = name !== "chat";
  $("engine-view").hidden = name !== "engine";
  $("tab-chat").classList.toggle("active", name === "chat");
  $("tab-engine").classList.toggle("active", name === "engine");
  if (name === "engine") {
    if (!statsStarted) followStats();
    drawEngineView();
  }
  history.replaceState(null, "", name === "engine" ? "#engine" : "#chat");
}

function useKey() {
  apiKey = $("api-key").value.trim();
  sessionStorage.setItem(KEY_STORAGE, apiKey);
  $("key-error").textContent = "";
  loadModels();
}

document.addEventListener("DOMContentLoaded", () => {
  $("tab-chat").addEventListener("click", () => showTab("chat"));
  $("tab-engine").addEventListener("click", () => showTab("engine"));
  $("composer").addEventListener("submit", send);
  $("message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) send(event);
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("copy-curl").addEventListener("click", () => navigator.clipboard && navigator.clipboard.writeText($("curl").textContent));
  $("key-use").addEventListener("click", useKey);
  $("api-key").addEventListener("keydown", (event) => {
    if (event.key === "Enter") useKey();
  });
  window.addEventListener("hashchange", () => showTab(location.hash === "#engine" ? "engine" : "chat"));
  window.addEventListener("resize", () => {
    if (!$("engine-view").hidden) drawEngineView();
  });
  loadModels();
  showTab(location.hash === "#engine" ? "engine" : "chat");
});
