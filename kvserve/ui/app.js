// kvserve KV cache inspector: reads /v1/kv/stream (fetch streaming, so the API key goes in a header) and draws the
// block map, requests, prefix tree, events, gauges and capacity plan. Plain JS, no build step, no external assets.
"use strict";
(function () {
  const KEY_STORE = "kvserve.apiKey";
  const MAX_EVENTS = 300;
  const MAX_TREE_NODES = 400;
  const MAX_TABLE_CELLS = 64;
  const COLORS = { f: "#2a313a", u: "#3b82f6", s: "#f59e0b", c: "#10b981", n: "#000000" };
  const PRIORITY = { s: 4, u: 3, c: 2, f: 1, n: 0 };  // an aggregated cell shows its "busiest" state
  const $ = (id) => document.getElementById(id);
  const state = { snapshot: null, blocks: new Map(), selected: null, pinned: null, layout: null,
                  events: [], tokensPerS: 0, reply: null, pinnedText: "", stream: null,
                  replica: null, replicas: [], switching: false,  // the replica shown (null: the server's default)
                  frames: { snapshot: 0, delta: 0 } };  // frames received, by kind
  window.kvInspector = state;  // for tests and for the curious, in the console

  // ---- the API key ----
  const requiresKey = document.body.dataset.requiresKey === "true";
  function apiKey() { return sessionStorage.getItem(KEY_STORE) || ""; }
  function headers(extra) {
    const h = Object.assign({}, extra || {});
    if (apiKey()) h["Authorization"] = "Bearer " + apiKey();
    return h;
  }
  function askForKey() {
    return new Promise((resolve) => {
      const dialog = $("key-dialog");
      $("key-form").onsubmit = () => {
        sessionStorage.setItem(KEY_STORE, $("key-input").value.trim());
        resolve();
      };
      if (!dialog.open) dialog.showModal();
    });
  }
  function setStatus(text, cls) { const el = $("status"); el.textContent = text; el.className = "status " + (cls || ""); }

  // ---- replicas (--data-parallel-size N: the page shows one at a time) ----
  function replicaQuery() { return state.replica ? "?replica=" + encodeURIComponent(state.replica) : ""; }
  async function loadReplicas() {
    try {
      const resp = await fetch("v1/kv/replicas", { headers: headers(), cache: "no-store" });
      if (resp.ok) showReplicas(await resp.json());
    } catch (err) { /* the stream's own request reports what is wrong */ }
  }
  function showReplicas(list) {
    state.replicas = list;
    $("replica").replaceChildren(...list.map((r) => {
      const option = document.createElement("option");
      option.value = r.name;
      option.textContent = r.name + (r.up ? "" : " (down)");
      return option;
    }));
    if (state.replica) $("replica").value = state.replica;
    $("replica-picker").hidden = list.length < 2;
  }
  function switchReplica(name) {  // a full snapshot of the other replica first, then its deltas
    state.replica = name;
    state.switching = true;
    state.snapshot = null; state.blocks = new Map(); state.selected = null; state.pinned = null;
    state.tokensPerS = 0; state.events = [];
    $("events").replaceChildren();
    $("block-detail").textContent = "Hover or click a block.";
    setStatus("switching to " + name + "…");
    if (state.stream) state.stream.abort();
  }
  $("replica").addEventListener("change", (ev) => switchReplica(ev.target.value));

  // ---- the stream ----
  async function connect() {
    for (;;) {
      if (requiresKey && !apiKey()) await askForKey();
      try {
        await loadReplicas();
        state.switching = false;
        state.stream = new AbortController();
        const resp = await fetch("v1/kv/stream" + replicaQuery(), { headers: headers(), cache: "no-store",
                                                                    signal: state.stream.signal });
        if (resp.status === 401) { sessionStorage.removeItem(KEY_STORE); setStatus("API key refused", "err"); continue; }
        if (resp.status === 404 && state.replica) { state.replica = null; continue; }  // gone: the default one
        if (!resp.ok || !resp.body) throw new Error("HTTP " + resp.status);
        state.replica = resp.headers.get("X-Kvserve-Replica") || state.replica;
        if (state.replica) $("replica").value = state.replica;
        setStatus(state.replicas.length > 1 ? "live · showing " + state.replica : "live", "ok");
        await readSSE(resp.body, onMessage);
        if (!state.switching) setStatus("stream ended; reconnecting…", "err");
      } catch (err) {
        if (!state.switching) setStatus("disconnected (" + err.message + "); retrying…", "err");
      }
      if (!state.switching) await new Promise((r) => setTimeout(r, 1000));
    }
  }
  async function readSSE(body, handle) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const chunk = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        let event = "message", data = "";
        for (const line of chunk.split("\n")) {
          if (line.startsWith("event:")) event = line.slice(6).trim();
          else if (line.startsWith("data:")) data += line.slice(5).trim();
        }
        if (data) handle(event, data);
      }
    }
  }
  function onMessage(event, data) {
    const payload = JSON.parse(data);
    if (event in state.frames) state.frames[event]++;
    if (event === "snapshot") onSnapshot(payload);
    else if (event === "delta") onDelta(payload);
  }

  // ---- snapshot and deltas (format: docs/UI.md; kvserve/engine/inspector_delta.py is the reference) ----
  function applyOrder(old, delta) {
    if (!delta) return old.slice();
    const gone = new Set(delta.removed);
    return old.filter((x) => !gone.has(x)).concat(delta.appended);
  }
  const evictOrders = new WeakMap();  // a blocks array -> its eviction order (each delta needs the previous one's)
  function evictOrder(blocks) {
    let order = evictOrders.get(blocks);
    if (!order) {
      order = blocks.filter((b) => b.evict_rank !== null).sort((a, b) => a.evict_rank - b.evict_rank).map((b) => b.id);
      evictOrders.set(blocks, order);
    }
    return order;
  }
  function applyKeyed(old, changed, order, key) {
    const entries = new Map(old.map((e) => [e[key], e]));
    for (const e of changed || []) entries.set(e[key], e);
    return applyOrder(old.map((e) => e[key]), order).map((k) => entries.get(k));
  }
  const NOT_STATE = new Set(["seq", "base", "time", "events", "block_states", "blocks", "requests", "prefix_cache",
                             "blocks_removed", "evict_order", "request_order", "prefix_order"]);
  // The snapshot `delta` leads to from `snap` (a new object; `snap` is not modified): what the server's
  // apply_delta does, so that the page's state after any run of deltas is the latest snapshot.
  function applyDelta(snap, delta) {
    const out = Object.assign({}, snap);
    for (const k of Object.keys(delta)) if (!NOT_STATE.has(k)) out[k] = delta[k];
    if (delta.block_states) {
      const states = snap.block_states.split("");
      for (const [id, st] of delta.block_states) states[id] = st;
      out.block_states = states.join("");
    }
    const blocks = new Map(snap.blocks.map((b) => [b.id, b]));
    for (const id of delta.blocks_removed || []) blocks.delete(id);
    for (const b of delta.blocks || []) blocks.set(b.id, b);
    const order = applyOrder(evictOrder(snap.blocks), delta.evict_order);
    const ranks = new Map(order.map((id, rank) => [id, rank]));
    const ranked = (e, id) => {
      const rank = ranks.has(id) ? ranks.get(id) : null;
      return e.evict_rank === rank ? e : Object.assign({}, e, { evict_rank: rank });
    };
    out.blocks = [...blocks.keys()].sort((a, b) => a - b).map((id) => ranked(blocks.get(id), id));
    evictOrders.set(out.blocks, order);
    out.requests = applyKeyed(snap.requests, delta.requests, delta.request_order, "seq_id");
    out.prefix_cache = applyKeyed(snap.prefix_cache, delta.prefix_cache, delta.prefix_order, "block_id")
      .map((n) => ranked(n, n.block_id));
    out.seq = delta.seq;
    out.time = delta.time;
    return out;
  }
  function onDelta(delta) {
    if (!state.snapshot || delta.base !== state.snapshot.seq) {  // a gap: start again from a full snapshot
      state.stream && state.stream.abort();
      return;
    }
    show(applyDelta(state.snapshot, delta));
    for (const e of delta.events || []) onEvent(e);
  }
  function onSnapshot(snap) {
    state.events = [];
    $("events").replaceChildren();
    for (const e of snap.events || []) onEvent(e);
    delete snap.events;  // the log keeps them; the state is the snapshot proper
    show(snap);
  }
  function show(snap) {
    const prev = state.snapshot;
    if (prev) {
      const dt = snap.time - prev.time;
      const dtok = snap.gauges.generation_tokens_total - prev.gauges.generation_tokens_total;
      if (dt > 0) state.tokensPerS = dtok / dt;
    }
    state.snapshot = snap;
    state.blocks = new Map(snap.blocks.map((b) => [b.id, b]));
    renderGauges(snap);
    renderMap();
    renderRequests(snap);
    renderPrefix(snap);
    renderTier(snap);
    if (state.pinned !== null) showDetail(state.pinned);
  }

  function gauge(label, value) {
    const d = document.createElement("div");
    d.className = "gauge";
    d.innerHTML = "<b></b><span></span>";
    d.firstChild.textContent = value;
    d.lastChild.textContent = label;
    return d;
  }
  function offloadGauges(g) {  // the KV offload tier (docs/KV_OFFLOAD.md), when the server has one
    const o = g.offload;
    if (!o) return [];
    return [
      gauge("offload tier (" + o.medium + ")" + (o.available ? "" : " FAILED"),
            o.num_blocks + " blocks, " + (o.bytes_used / 1048576).toFixed(1) + " / " +
            (o.capacity_bytes / 1048576).toFixed(0) + " MiB"),
      gauge("restored blocks", o.restored_blocks),
      gauge("tier hit tokens", g.external_prefix_cache_hits_tokens)];
  }
  function renderGauges(snap) {
    const g = snap.gauges, c = snap.capacity;
    $("gauges").replaceChildren(
      gauge("KV usage", (100 * g.kv_cache_usage).toFixed(1) + "%"),
      gauge("prefix hit rate", (100 * g.prefix_cache_hit_rate).toFixed(1) + "%"),
      gauge("running", g.num_running), gauge("waiting", g.num_waiting),
      gauge("tokens/s", state.tokensPerS.toFixed(1)), gauge("preemptions", g.num_preemptions),
      gauge("free blocks", snap.pool.num_free_blocks + " / " + snap.pool.num_usable_blocks),
      ...offloadGauges(g));
    $("capacity").replaceChildren(
      gauge("KV cache groups", groupsText(snap.kv_cache_groups || [])),
      gauge("blocks a request at max-model-len", c.blocks_per_request),
      gauge("KV dtype", c.kv_cache_dtype), gauge("bytes / token", c.bytes_per_token),
      gauge("blocks (incl. null)", c.num_blocks), gauge("block size", c.block_size), gauge("tokens", c.num_tokens),
      gauge("max-model-len", c.max_model_len), gauge("max concurrency at max-model-len", c.max_concurrency + "x"),
      gauge("KV memory", c.total_bytes >= 1048576 ? (c.total_bytes / 1048576).toFixed(1) + " MiB"
                                                  : (c.total_bytes / 1024).toFixed(1) + " KiB"));
  }

  // The KV cache groups (docs/KV_CACHE.md): "1 full + 5 sliding 512", each with the blocks it holds now.
  function groupsText(groups) {
    const kinds = new Map();
    for (const g of groups) {
      const name = g.sliding_window ? "sliding " + g.sliding_window : "full";
      const k = kinds.get(name) || { n: 0, held: 0 };
      k.n += 1; k.held += g.blocks_held;
      kinds.set(name, k);
    }
    return [...kinds].map(([name, k]) => k.n + " " + name + " (" + k.held + " held)").join(" + ") || "-";
  }
  function heldIds(r) {  // every block id a request's tables point at, the null block's aside
    const ids = [];
    for (const table of r.group_block_ids || [r.block_ids]) for (const id of table) if (id !== 0) ids.push(id);
    return ids;
  }

  // ---- block map ----
  function layoutFor(n, width) {
    let cell = 14, per = 1;
    let cols = Math.max(1, Math.floor(width / cell));
    while (Math.ceil(n / per / cols) * cell > 360) {  // too tall: smaller cells, then several blocks per cell
      if (cell > 5) { cell -= 1; cols = Math.max(1, Math.floor(width / cell)); } else { per *= 2; }
    }
    return { cell, per, cols, rows: Math.ceil(n / per / cols) };
  }
  function renderMap() {
    const snap = state.snapshot;
    if (!snap) return;
    const canvas = $("map");
    const states = snap.block_states;
    const width = canvas.clientWidth || 960;
    const L = layoutFor(states.length, width);
    state.layout = L;
    const dpr = window.devicePixelRatio || 1;
    canvas.width = width * dpr;
    canvas.height = L.rows * L.cell * dpr;
    canvas.style.height = L.rows * L.cell + "px";
    const ctx = canvas.getContext("2d");
    ctx.scale(dpr, dpr);
    const highlight = new Set(state.selected ? heldIds(state.selected) : []);
    const counts = { f: 0, u: 0, s: 0, c: 0, n: 0 };
    let maxRef = 0;
    for (let i = 0; i < states.length; i++) counts[states[i]]++;
    for (const b of snap.blocks) if (b.ref_cnt > maxRef) maxRef = b.ref_cnt;
    ctx.font = Math.max(7, L.cell - 5) + "px sans-serif";
    ctx.textAlign = "center"; ctx.textBaseline = "middle";
    const ncells = Math.ceil(states.length / L.per);
    for (let cellIndex = 0; cellIndex < ncells; cellIndex++) {
      let best = "n", hl = false;
      const start = cellIndex * L.per, end = Math.min(states.length, start + L.per);
      for (let i = start; i < end; i++) {
        if (PRIORITY[states[i]] > PRIORITY[best]) best = states[i];
        if (highlight.has(i)) hl = true;
      }
      const x = (cellIndex % L.cols) * L.cell, y = Math.floor(cellIndex / L.cols) * L.cell;
      ctx.fillStyle = COLORS[best];
      ctx.fillRect(x, y, L.cell - 1, L.cell - 1);
      if (hl) { ctx.strokeStyle = "#f43f5e"; ctx.lineWidth = 2; ctx.strokeRect(x + 1, y + 1, L.cell - 3, L.cell - 3); }
      if (L.per === 1 && best === "s" && L.cell >= 11) {
        ctx.fillStyle = "#000";
        ctx.fillText(String(state.blocks.get(start).ref_cnt), x + L.cell / 2, y + L.cell / 2);
      }
    }
    $("map-legend").textContent = states.length + " blocks" + (L.per > 1 ? " (" + L.per + " per cell)" : "") +
      " · used " + counts.u + " · shared " + counts.s + (counts.s ? " (max ref " + maxRef + ")" : "") +
      " · cached " + counts.c + " · free " + counts.f;
  }
  function blockAt(ev) {
    const L = state.layout, snap = state.snapshot;
    if (!L || !snap) return null;
    const rect = $("map").getBoundingClientRect();
    const col = Math.floor((ev.clientX - rect.left) / L.cell), row = Math.floor((ev.clientY - rect.top) / L.cell);
    if (col < 0 || col >= L.cols || row < 0) return null;
    const start = (row * L.cols + col) * L.per;
    return start < snap.block_states.length ? start : null;
  }
  function describeBlock(id) {
    const snap = state.snapshot, bs = snap.pool.block_size;
    const st = snap.block_states[id];
    const names = { f: "free", u: "used", s: "shared", c: "cached (evictable)", n: "null block (never allocated)" };
    const b = state.blocks.get(id);
    const lines = ["block " + id + ": " + names[st]];
    if (b) {
      lines.push("ref_cnt " + b.ref_cnt + (b.hash ? " · hash " + b.hash : "") +
                 (b.evict_rank !== null ? " · evicted after " + b.evict_rank + " other cached block(s)" : ""));
      if (b.holders.length) {
        const spans = b.holders.map((h) => {
          const r = snap.requests.find((q) => q.request_id === h && q.block_ids.includes(id));
          const i = r ? r.block_ids.indexOf(id) : -1;
          return h + (i >= 0 ? " [tokens " + i * bs + "–" + ((i + 1) * bs - 1) + "]" : "");
        });
        lines.push("held by " + spans.join(", "));
      }
      if (snap.redacted) lines.push("token text hidden (--ui-redact-text)");
      else if (state.pinned === id) lines.push(state.pinnedText || "click: loading its tokens…");
      else lines.push("click for its tokens and text");
    }
    return lines.join("\n");
  }
  function showDetail(start) {
    const L = state.layout;
    if (start === null || !L) return;
    if (L.per === 1) { $("block-detail").textContent = describeBlock(start); return; }
    const states = state.snapshot.block_states, end = Math.min(states.length, start + L.per);
    const counts = {};
    for (let i = start; i < end; i++) counts[states[i]] = (counts[states[i]] || 0) + 1;
    $("block-detail").textContent = "blocks " + start + "–" + (end - 1) + ": " + JSON.stringify(counts);
  }
  $("map").addEventListener("mousemove", (ev) => { if (state.pinned === null) showDetail(blockAt(ev)); });
  $("map").addEventListener("click", async (ev) => {
    const id = blockAt(ev);
    state.pinned = state.pinned === id ? null : id;
    state.pinnedText = "";
    showDetail(id);
    if (state.pinned === null || state.layout.per !== 1 || state.snapshot.redacted) return;
    try {
      const resp = await fetch("v1/kv/blocks/" + id + replicaQuery(), { headers: headers() });
      const d = await resp.json();
      if (state.pinned !== id) return;
      const spans = d.held.map((h) => h.request_id + " tokens " + h.start + "–" + (h.end - 1)).join(", ");
      state.pinnedText = (spans ? spans + "\n" : "") + "token ids " + JSON.stringify(d.token_ids) +
        "\ntext " + JSON.stringify(d.text);
      showDetail(id);
    } catch (err) { state.pinnedText = "could not load the block: " + err.message; }
  });
  window.addEventListener("resize", renderMap);

  // ---- requests ----
  function renderRequests(snap) {
    const table = document.createElement("table");
    table.innerHTML = "<tr><th>request</th><th>status</th><th>prompt / out</th><th>hit</th><th>age</th>" +
                      "<th>preempt</th><th>block table</th></tr>";
    // Requests of one prompt_cache_key next to each other (a stable sort: otherwise in the engine's order).
    const rows = [...snap.requests].sort((a, b) => (a.prompt_cache_key || "").localeCompare(b.prompt_cache_key || ""));
    for (const r of rows) {
      const tr = document.createElement("tr");
      tr.className = "req" + (state.selected && state.selected.seq_id === r.seq_id ? " selected" : "");
      tr.dataset.requestId = r.request_id;
      const hit = r.restored_tokens ? r.prefix_hit_tokens + " (" + r.restored_tokens + " restored)" : r.prefix_hit_tokens;
      const cells = [r.request_id + (r.prompt_cache_key ? " · key " + r.prompt_cache_key : ""), r.status,
                     r.num_prompt_tokens + " / " + r.num_output_tokens,
                     r.prefix_miss ? hit + " · " + r.prefix_miss.reason.replace(/_/g, " ") : hit,
                     r.age_s.toFixed(1) + "s", r.num_preemptions];
      for (const text of cells) { const td = document.createElement("td"); td.textContent = text; tr.appendChild(td); }
      const td = document.createElement("td");
      const groups = snap.kv_cache_groups || [];
      const tables = r.group_block_ids || [r.block_ids];
      tables.forEach((table, g) => {  // one strip per KV cache group; a sliding group's dropped entries are skipped
        const strip = document.createElement("div");
        strip.className = "btable";
        if (tables.length > 1) {
          const label = document.createElement("span");
          const spec = groups[g] || {};
          label.textContent = "g" + g + (spec.sliding_window ? " (" + spec.sliding_window + ")" : "") + ": ";
          strip.appendChild(label);
        }
        const live = table.filter((id) => id !== 0);
        if (live.length < table.length) strip.appendChild(document.createTextNode((table.length - live.length) + " dropped "));
        for (const id of live.slice(0, MAX_TABLE_CELLS)) {
          const i = document.createElement("i");
          i.textContent = id;
          i.style.background = COLORS[snap.block_states[id]];
          strip.appendChild(i);
        }
        if (live.length > MAX_TABLE_CELLS) strip.appendChild(document.createTextNode("+" + (live.length - MAX_TABLE_CELLS)));
        td.appendChild(strip);
      });
      tr.appendChild(td);
      tr.onclick = () => {
        state.selected = state.selected && state.selected.seq_id === r.seq_id ? null : r;
        renderRequests(state.snapshot);
        renderMap();
      };
      table.appendChild(tr);
    }
    if (state.selected) state.selected = snap.requests.find((q) => q.seq_id === state.selected.seq_id) || null;
    $("requests").replaceChildren(snap.requests.length ? table : document.createTextNode("No requests."));
  }

  // ---- prefix tree ----
  function renderPrefix(snap) {
    const nodes = snap.prefix_cache.slice(0, MAX_TREE_NODES);
    const byHash = new Map(nodes.map((n) => [n.hash, Object.assign({ children: [] }, n)]));
    const roots = [];
    for (const n of byHash.values()) {
      const parent = n.parent && byHash.get(n.parent);
      if (parent) parent.children.push(n); else roots.push(n);
    }
    const build = (list) => {
      const ul = document.createElement("ul");
      for (const n of list) {
        const li = document.createElement("li");
        li.textContent = "#" + n.block_id + " " + n.hash.slice(0, 8) + " · hits " + n.hits + " · ref " + n.ref_cnt +
          (n.evict_rank !== null ? " · evict #" + n.evict_rank : "");
        if (n.children.length) li.appendChild(build(n.children));
        ul.appendChild(li);
      }
      return ul;
    };
    const root = document.createElement("div");
    root.className = "tree";
    root.appendChild(document.createTextNode(snap.prefix_cache.length + " cached blocks" +
      (snap.prefix_cache.length > MAX_TREE_NODES ? " (first " + MAX_TREE_NODES + " shown)" : "")));
    root.appendChild(build(roots));
    $("prefix").replaceChildren(root);
  }

  // ---- the offload tier's prefixes (docs/KV_OFFLOAD.md) ----
  function renderTier(snap) {
    const t = snap.offload_tier;
    $("tier-panel").hidden = !t;
    if (!t) return;
    const head = document.createElement("p");
    head.textContent = t.num_blocks + " blocks in the tier (" + t.medium + "), " + t.indexed_blocks +
      " of them known to this server (stored or restored here), in " + t.prefixes.length +
      (t.prefixes.length === 64 ? "+" : "") + " prefixes:";
    const table = document.createElement("table");
    table.innerHTML = "<thead><tr><th>prefix</th><th>blocks</th><th>tokens</th><th>also in the pool</th></tr></thead>";
    const body = document.createElement("tbody");
    for (const p of t.prefixes) {
      const tr = document.createElement("tr");
      for (const v of [p.root.slice(0, 8), p.blocks, p.tokens, p.in_pool]) {
        const td = document.createElement("td");
        td.textContent = v;
        tr.appendChild(td);
      }
      body.appendChild(tr);
    }
    table.appendChild(body);
    $("tier").replaceChildren(head, table);
  }

  // ---- events ----
  function describeEvent(e) {
    switch (e.kind) {
      case "block_stored": if (e.medium) return "offload tier (" + e.medium + ") stored " + e.block_hash.slice(0, 8);
        return "stored block " + e.block_id + " " + e.block_hash.slice(0, 8) +
        (e.parent_block_hash ? " ← " + e.parent_block_hash.slice(0, 8) : " (first block)");
      case "block_removed": if (e.medium) return "offload tier (" + e.medium + ") dropped " + e.block_hash.slice(0, 8);
        return "evicted block " + e.block_id + " " + e.block_hash.slice(0, 8);
      case "all_blocks_cleared": return "prefix cache cleared";
      case "preempted": return "PREEMPTED " + e.request_id + ": " + e.tokens_lost + " tokens lost, " +
        e.blocks_freed + " blocks freed";
      case "aborted": return "ABORTED " + e.request_id + ": " + e.blocks_freed + " blocks freed";
      case "admission_refused": return "admission refused " + e.request_id + ": needs " + e.blocks_needed +
        " blocks, " + e.blocks_free + " free";
      case "prefix_missed": return "prefix miss " + e.request_id + ": " + e.reason.replace(/_/g, " ") +
        " at token " + e.at_token + " of " + e.prompt_tokens +
        (e.diverged_at_token !== null ? " (diverged at token " + e.diverged_at_token + ")" : "");
      default: return e.kind;
    }
  }
  function onEvent(e) {
    state.events.push(e);
    if (state.events.length > MAX_EVENTS) state.events.shift();
    const li = document.createElement("li");
    li.className = e.kind;
    li.textContent = new Date(e.time * 1000).toLocaleTimeString() + " " + describeEvent(e);
    const list = $("events");
    list.prepend(li);
    while (list.children.length > MAX_EVENTS) list.lastChild.remove();
  }

  // ---- playground ----
  async function send(ev) {
    ev.preventDefault();
    const f = ev.target.elements;
    const body = {
      messages: [{ role: "system", content: f.system.value }, { role: "user", content: f.user.value }],
      max_tokens: Number(f.max_tokens.value), temperature: Number(f.temperature.value), stream: f.stream.checked,
    };
    const controller = new AbortController();
    state.reply = controller;
    $("abort").disabled = false;
    const out = $("reply");
    out.textContent = "";
    try {
      const resp = await fetch("v1/chat/completions", { method: "POST", signal: controller.signal,
        headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body) });
      if (!resp.ok) { out.textContent = "HTTP " + resp.status + ": " + await resp.text(); return; }
      if (!body.stream) { out.textContent = (await resp.json()).choices[0].message.content; return; }
      await readStreamedChat(resp.body, out);
    } catch (err) {
      out.textContent += err.name === "AbortError" ? "\n[aborted]" : "\n[" + err.message + "]";
    } finally {
      if (state.reply === controller) { state.reply = null; $("abort").disabled = true; }
    }
  }
  async function readStreamedChat(body, out) {
    await readSSE(body, (event, data) => {
      if (data === "[DONE]") return;
      const delta = JSON.parse(data).choices[0].delta;
      if (delta && delta.content) out.textContent += delta.content;
    });
  }
  $("engine-only").addEventListener("change", (ev) => $("events").classList.toggle("engine-only", ev.target.checked));
  $("playground").addEventListener("submit", send);
  $("abort").addEventListener("click", () => { if (state.reply) state.reply.abort(); });

  state.show = show;  // draws a given snapshot (tests feed large synthetic pools through it)
  state.applyDelta = applyDelta;  // pure: tests check it against the server's apply_delta
  connect();
})();
