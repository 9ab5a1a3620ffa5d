// Small helpers shared by the dashboard's modules: DOM, number formats, owner colours.

export const $ = (id) => document.getElementById(id);

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = String(text);
  return node;
}

// A stable colour per sequence: hash the id onto the hue circle. `fg` is black or white,
// whichever reads better on that background (by its luminance).
const colourCache = new Map();
export function ownerColour(sequenceId) {
  return ownerColours(sequenceId).bg;
}
export function ownerColours(sequenceId) {
  let colours = colourCache.get(sequenceId);
  if (colours) return colours;
  let hash = 2166136261;
  for (let i = 0; i < sequenceId.length; i++) {
    hash ^= sequenceId.charCodeAt(i);
    hash = Math.imul(hash, 16777619);
  }
  const hue = ((hash >>> 0) % 3600) / 10;
  const [r, g, b] = hslToRgb(hue, 0.68, 0.58);
  const luminance = 0.2126 * r + 0.7152 * g + 0.0722 * b;
  colours = { bg: `hsl(${hue.toFixed(1)}, 68%, 58%)`, fg: luminance > 0.5 ? "#0d1117" : "#ffffff" };
  if (colourCache.size > 5000) colourCache.clear();
  colourCache.set(sequenceId, colours);
  return colours;
}
function hslToRgb(hue, saturation, lightness) {
  const k = (n) => (n + hue / 30) % 12;
  const a = saturation * Math.min(lightness, 1 - lightness);
  const f = (n) => lightness - a * Math.max(-1, Math.min(k(n) - 3, 9 - k(n), 1));
  return [f(0), f(8), f(4)];
}

export function formatNumber(value, digits = 0) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  return Number(value).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

export function shortId(sequenceId) {
  return sequenceId.length > 14 ? `${sequenceId.slice(0, 6)}…${sequenceId.slice(-6)}` : sequenceId;
}
