"""The load server's status page (``GET /``), for operators: the resident models with
their memory, leases, pins and expiry, the loads in flight with live progress, and the
budget used.

One HTML document with its style and script inline, no third-party asset, no build step.
The document holds no data, so it is served without the token; its script asks the API
(``GET /models`` each second, ``GET /models/{id}/events`` for each load in flight) with
the token the operator types in, kept in ``sessionStorage`` (this tab only) and sent as
``Authorization: Bearer``: without it the page shows nothing but the form. The
Content-Security-Policy allows exactly the inline script and style (by their SHA-256)
and requests to this server; every value from the API is written as text, never HTML.
"""

from __future__ import annotations

import base64
import hashlib

from aiohttp import web

__all__ = ["CONTENT_SECURITY_POLICY", "status_page"]

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin-top: 1em; }
th, td { border-bottom: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
#note { color: #a00; }
"""

_SCRIPT = r"""
"use strict";
const KEY = "aiogguf-token";
const base = location.pathname.endsWith("/") ? location.pathname : location.pathname + "/";
const followed = new Set();
const rows = new Map();
const $ = (id) => document.getElementById(id);

function headers() {
  const token = sessionStorage.getItem(KEY);
  return token ? { Authorization: "Bearer " + token } : {};
}
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return (i ? n.toFixed(n < 10 ? 2 : 1) : String(n)) + " " + units[i];
}
function percent(m) {
  if (m.state === "ready") return "100%";
  if (!m.bytes_total) return m.state === "loading" ? "0%" : "";
  return Math.floor((100 * m.bytes_done) / m.bytes_total) + "%";
}
function keepAlive(s) {
  return s === -1 ? "forever" : s + " s";
}
const COLUMNS = [
  ["id", (m) => m.id.slice(0, 12)],
  ["path", (m) => m.path],
  ["state", (m) => m.state + (m.queued ? " (queued)" : "")],
  ["progress", percent],
  ["size", (m) => bytes(m.size) + (m.size_vram ? " + " + bytes(m.size_vram) + " device" : "")],
  ["leases", (m) => String(m.leases)],
  ["pinned", (m) => (m.pinned ? "pinned" : "")],
  ["keep_alive", (m) => keepAlive(m.keep_alive)],
  ["expires_at", (m) => m.expires_at || ""],
  ["reload_s", (m) => m.reload_s.toFixed(2) + " s"],
];
function show(m) {
  let row = rows.get(m.id);
  if (!row) {
    row = document.createElement("tr");
    row.dataset.id = m.id;
    for (const [name] of COLUMNS) {
      const cell = document.createElement("td");
      cell.className = name;
      row.appendChild(cell);
    }
    $("models").appendChild(row);
    rows.set(m.id, row);
  }
  COLUMNS.forEach(([, value], i) => { row.children[i].textContent = value(m); });
  row.dataset.state = m.state;
}
function note(text) { $("note").textContent = text; }
function clear() {
  for (const row of rows.values()) row.remove();
  rows.clear();
  $("budget").textContent = "";
}
async function follow(id) {
  // A load in flight, as its event stream tells it: one snapshot per progress event.
  followed.add(id);
  try {
    const response = await fetch(base + "models/" + id + "/events", { headers: headers() });
    if (!response.ok) return;
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let text = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      text += decoder.decode(value, { stream: true });
      let end;
      while ((end = text.indexOf("\n\n")) >= 0) {
        const event = text.slice(0, end);
        text = text.slice(end + 2);
        if (event.startsWith("data: ")) show(JSON.parse(event.slice(6)));
      }
    }
  } catch (err) {
    note("event stream of " + id.slice(0, 12) + " ended: " + err);
  } finally {
    followed.delete(id);
  }
}
async function refresh() {
  let response;
  try {
    response = await fetch(base + "models", { headers: headers() });
  } catch (err) {
    note("the server did not answer: " + err);
    return;
  }
  if (response.status === 401) {
    clear();
    note("this server needs its token: type it above");
    return;
  }
  if (!response.ok) { note("GET models: HTTP " + response.status); return; }
  const body = await response.json();
  note("");
  const seen = new Set();
  for (const m of body.models) {
    seen.add(m.id);
    show(m);
    if (m.state === "loading" && !followed.has(m.id)) follow(m.id);
  }
  for (const [id, row] of rows) if (!seen.has(id)) { row.remove(); rows.delete(id); }
  const b = body.budget;
  $("budget").textContent =
    b.models + (b.max_models ? " of " + b.max_models : "") + " models, " +
    bytes(b.bytes) + (b.max_loaded_bytes ? " of " + bytes(b.max_loaded_bytes) : "") +
    " held; default keep_alive " + keepAlive(b.keep_alive);
}
$("auth").addEventListener("submit", (event) => {
  event.preventDefault();
  const token = $("token").value.trim();
  if (token) sessionStorage.setItem(KEY, token); else sessionStorage.removeItem(KEY);
  $("token").value = "";
  clear();
  refresh();
});
refresh();
setInterval(refresh, 1000);
"""


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        f"script-src {_sha256(_SCRIPT)}",
        f"style-src {_sha256(_STYLE)}",
        "connect-src 'self'",
        "img-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)

_COLUMN_NAMES = (
    "id",
    "path",
    "state",
    "progress",
    "size",
    "leases",
    "pinned",
    "keep_alive",
    "expires_at",
    "reload_s",
)

_PAGE = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>aiogguf serve</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>aiogguf serve</h1>
<form id="auth">
<label>Token <input id="token" type="password" autocomplete="off"></label>
<button type="submit">Use</button>
</form>
<p id="note"></p>
<p id="budget"></p>
<table>
<thead><tr>{"".join(f"<th>{name}</th>" for name in _COLUMN_NAMES)}</tr></thead>
<tbody id="models"></tbody>
</table>
<script>{_SCRIPT}</script>
</body>
</html>
"""

_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


async def status_page(request: web.Request) -> web.Response:
    """The status page: the same document for everyone, data only through the API."""
    return web.Response(text=_PAGE, content_type="text/html", headers=_HEADERS)
