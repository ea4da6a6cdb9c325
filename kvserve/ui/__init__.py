"""The KV inspector page's static assets (plain HTML, JS, CSS: no build step, no CDN); see server/kv_inspector.py."""
