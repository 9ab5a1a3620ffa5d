// The dashboard's history (queue lengths, token counters per snapshot) and its two charts.

import { $, formatNumber } from "./util.js";

export const HISTORY_S = 300; // charts show the last 5 minutes
export const RATE_WINDOW_S = 5;

const history = []; // {t, running, waiting, gen, prompt}, one per snapshot

export function record(state) {
  const last = history[history.length - 1];
  if (last && state.time <= last.t) return; // the same snapshot twice (or a clock step back)
  history.push({
    t: state.time,
    running: state.running.length,
    waiting: state.waiting.length,
    gen: state.stats.num_generation_tokens,
    prompt: state.stats.num_prompt_tokens,
  });
  while (history.length && history[0].t < state.time - HISTORY_S - RATE_WINDOW_S) history.shift();
}

// Tokens/s at each sample, over the preceding RATE_WINDOW_S seconds.
function rateSeries() {
  const series = [];
  let start = 0;
  for (let i = 1; i < history.length; i++) {
    const now = history[i];
    while (start < i - 1 && history[start + 1].t <= now.t - RATE_WINDOW_S) start++;
    const then = history[start];
    const seconds = now.t - then.t;
    if (seconds <= 0) continue;
    series.push({ t: now.t, gen: (now.gen - then.gen) / seconds, prompt: (now.prompt - then.prompt) / seconds });
  }
  return series;
}

export function latestRates() {
  const series = rateSeries();
  return series.length ? series[series.length - 1] : null;
}

export function drawCharts() {
  const now = history.length ? history[history.length - 1].t : 0;
  drawChart($("chart-queues"), history, now, [
    ["running", "--running"],
    ["waiting", "--waiting"],
  ]);
  drawChart($("chart-throughput"), rateSeries(), now, [
    ["gen", "--gen"],
    ["prompt", "--prompt"],
  ]);
}

// The smallest 4 x (1, 2 or 5 x 10^k) at or above `value`: gridlines at round numbers.
function niceMax(value) {
  const quarter = Math.max(value, 1) / 4;
  const magnitude = 10 ** Math.floor(Math.log10(quarter));
  for (const step of [1, 2, 5, 10]) if (step * magnitude >= quarter) return 4 * step * magnitude;
  return 40 * magnitude;
}

function drawChart(canvas, points, now, lines) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const styles = getComputedStyle(document.documentElement);
  const left = 44, right = 22, top = 8, bottom = 20;
  const plotW = width - left - right, plotH = height - top - bottom;
  const visible = points.filter((p) => p.t >= now - HISTORY_S);
  const yMax = niceMax(Math.max(1, ...visible.flatMap((p) => lines.map(([key]) => p[key]))));
  ctx.font = "11px ui-sans-serif, system-ui, sans-serif";
  ctx.fillStyle = styles.getPropertyValue("--dim");
  ctx.strokeStyle = styles.getPropertyValue("--border");
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = top + plotH - (plotH * i) / 4;
    ctx.beginPath();
    ctx.moveTo(left, y);
    ctx.lineTo(left + plotW, y);
    ctx.stroke();
    ctx.textAlign = "right";
    ctx.fillText(formatNumber((yMax * i) / 4, yMax < 4 ? 2 : 0), left - 6, y + 4);
  }
  ctx.textAlign = "center";
  for (let minutes = 5; minutes >= 0; minutes--) {
    const x = left + plotW - (plotW * minutes * 60) / HISTORY_S;
    ctx.fillText(minutes ? `−${minutes} min` : "now", x, height - 5);
  }
  for (const [key, colourVar] of lines) {
    ctx.strokeStyle = styles.getPropertyValue(colourVar);
    ctx.lineWidth = 1.8;
    ctx.beginPath();
    visible.forEach((p, i) => {
      const x = left + plotW - (plotW * (now - p.t)) / HISTORY_S;
      const y = top + plotH - (plotH * p[key]) / yMax;
      if (i === 0) ctx.moveTo(x, y);
      else ctx.lineTo(x, y);
    });
    ctx.stroke();
  }
}
