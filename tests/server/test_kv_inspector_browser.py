"""The KV inspector page in a real headless browser: Debian's chromium (/usr/bin/chromium, installed by .ci/run)
driven by Playwright's Python package, against a real server on a tiny model. Never `playwright install`: it
downloads browsers. Screenshots go to $KVSERVE_TEST_ARTIFACTS (default: the test's tmp dir)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kv_workload import random_snapshots
from server_support import API_KEY, MODEL, RunningServer, hook_steps, make_engine

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.inspector_delta import diff_snapshots
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 20_000

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="Debian's chromium is not installed at /usr/bin/chromium "
    "(.ci/run installs it with apt-get install chromium)",
)


def _serve(model_dir: Path, api_key: str | None = None, delay_s: float = 0.0, **overrides: Any) -> RunningServer:
    engine: Any = make_engine(model_dir, **overrides)
    if delay_s:  # steps that take a little while, so that the page sees requests while they run
        engine = hook_steps(engine, lambda: time.sleep(delay_s))
    async_engine = AsyncLLMEngine(engine)
    settings = ServerSettings(served_model_names=(MODEL,), api_key=api_key)
    return RunningServer(build_app(async_engine, settings), async_engine).start()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture
def artifacts(tmp_path: Path) -> Path:
    path = Path(os.environ.get("KVSERVE_TEST_ARTIFACTS", tmp_path))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 1100})
    pg = context.new_page()
    pg.set_default_timeout(WAIT_MS)
    yield pg
    context.close()


def _watch_errors(pg: Any) -> list[str]:
    errors: list[str] = []
    pg.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    return errors


def _live(pg: Any, url: str) -> None:
    pg.goto(url)
    pg.wait_for_function("() => window.kvInspector && window.kvInspector.snapshot !== null")


def test_page_loads_without_console_errors(page: Any, tiny_model_dir: Path, artifacts: Path) -> None:
    server = _serve(tiny_model_dir)
    try:
        errors = _watch_errors(page)
        _live(page, server.base_url + "/")
        page.wait_for_selector("#status.ok")
        assert "blocks" in page.inner_text("#map-legend")
        assert page.inner_text("#capacity")  # the capacity plan is drawn
        _live(page, server.base_url + "/ui")
        page.screenshot(path=str(artifacts / "kv-inspector-idle.png"), full_page=True)
        assert errors == []
    finally:
        server.stop()


def test_a_100k_block_pool_stays_on_one_screen(page: Any, tiny_model_dir: Path) -> None:
    server = _serve(tiny_model_dir)
    try:
        errors = _watch_errors(page)
        _live(page, server.base_url + "/")
        layout = page.evaluate("""() => {
            const real = window.kvInspector.snapshot;
            const n = 100000;
            const states = "n" + "u".repeat(30000) + "c".repeat(20000) + "f".repeat(n - 50001);
            const blocks = [];
            for (let i = 1; i <= 50000; i++) blocks.push({id: i, state: states[i], ref_cnt: i <= 30000 ? 1 : 0,
                hash: null, evict_rank: i > 30000 ? i - 30001 : null, holders: [], token_ids: null});
            const started = performance.now();
            window.kvInspector.show(Object.assign({}, real, {block_states: states, blocks: blocks,
                pool: Object.assign({}, real.pool, {num_blocks: n}), time: real.time + 1}));
            return Object.assign({ms: performance.now() - started}, window.kvInspector.layout);
        }""")
        assert layout["per"] > 1 and layout["rows"] * layout["cell"] <= 360
        assert "100000 blocks" in page.inner_text("#map-legend") and "per cell" in page.inner_text("#map-legend")
        assert errors == []
    finally:
        server.stop()


def test_the_pages_delta_code_matches_the_servers(page: Any, tiny_model_dir: Path) -> None:
    """app.js's applyDelta, fed the deltas of a random workload, ends at the last snapshot, as apply_delta does."""
    snaps = json.loads(json.dumps(random_snapshots(tiny_model_dir, seed=3)))
    deltas = [
        {"seq": i + 1, "base": i, "time": float(i), **diff_snapshots(a, b), "events": []}
        for i, (a, b) in enumerate(zip(snaps, snaps[1:], strict=False))
    ]
    assert any("evict_order" in d for d in deltas) and any("request_order" in d for d in deltas)
    server = _serve(tiny_model_dir)
    try:
        _live(page, server.base_url + "/")
        states = page.evaluate(
            """([first, deltas]) => {
            const out = [];
            let snap = first;
            for (const d of deltas) { snap = window.kvInspector.applyDelta(snap, d); out.push(snap); }
            return out;
        }""",
            [snaps[0], deltas],
        )
        for state, snap in zip(states, snaps[1:], strict=True):
            assert {k: v for k, v in state.items() if k not in ("seq", "time")} == snap
    finally:
        server.stop()


def test_playground_requests_share_the_system_prompts_blocks(page: Any, tiny_model_dir: Path, artifacts: Path) -> None:
    server = _serve(tiny_model_dir, delay_s=0.1)
    try:
        errors = _watch_errors(page)
        _live(page, server.base_url + "/")
        page.fill("textarea[name=system]", "You are a terse assistant; shared prefix.")
        page.fill("input[name=max_tokens]", "120")
        page.fill("textarea[name=user]", "first")
        page.click("#send")
        page.fill("textarea[name=user]", "second")
        page.click("#send")
        page.wait_for_function(
            "() => (window.kvInspector.snapshot || {blocks: []}).blocks.some(b => b.state === 's' && b.ref_cnt === 2)"
        )
        assert "max ref 2" in page.inner_text("#map-legend")
        shared = page.evaluate("() => window.kvInspector.snapshot.blocks.find(b => b.state === 's').id")
        layout = page.evaluate("() => window.kvInspector.layout")
        assert layout["per"] == 1
        page.click(
            "#map",
            position={
                "x": (shared % layout["cols"]) * layout["cell"] + 3,
                "y": (shared // layout["cols"]) * layout["cell"] + 3,
            },
        )
        page.wait_for_function("() => document.getElementById('block-detail').textContent.includes('text ')")
        assert f"block {shared}: shared" in page.inner_text("#block-detail")
        page.click("tr.req")  # highlights its blocks
        page.screenshot(path=str(artifacts / "kv-inspector-shared.png"), full_page=True)
        frames = page.evaluate("() => window.kvInspector.frames")
        assert frames["snapshot"] == 1 and frames["delta"] >= 3  # one full snapshot, then only deltas
        assert errors == []
    finally:
        server.stop()


def test_preemption_shows_in_the_events_log(page: Any, tiny_model_dir: Path, artifacts: Path) -> None:
    server = _serve(tiny_model_dir, delay_s=0.05, num_gpu_blocks_override=12, max_model_len=40)  # 11 usable blocks
    try:
        _live(page, server.base_url + "/")
        with server.client() as client:

            def send(prompt: str) -> None:
                client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 30, "ignore_eos": True})

            # Both fit at admission (3 blocks each) and outgrow the pool while decoding (10 blocks each).
            threads = [threading.Thread(target=send, args=(p * 8,)) for p in "ab"]
            for thread in threads:
                thread.start()
            try:
                page.wait_for_selector("#events li.preempted")
            finally:
                for thread in threads:
                    thread.join(60)
        assert "PREEMPTED" in page.inner_text("#events")
        page.check("#engine-only")  # the log without the stored / evicted blocks: the preemption stays in view
        assert page.is_visible("#events li.preempted") and not page.is_visible("#events li.block_stored")
        page.screenshot(path=str(artifacts / "kv-inspector-preemption.png"), full_page=True)
    finally:
        server.stop()


def test_playground_abort_frees_its_blocks(page: Any, tiny_model_dir: Path) -> None:
    server = _serve(tiny_model_dir, delay_s=0.1)
    try:
        _live(page, server.base_url + "/")
        page.fill("input[name=max_tokens]", "150")
        page.click("#send")
        page.wait_for_function("() => window.kvInspector.snapshot.requests.length === 1")
        page.click("#abort")
        page.wait_for_selector("#events li.aborted")
        page.wait_for_function(
            "() => window.kvInspector.snapshot.requests.length === 0 && "
            "![...window.kvInspector.snapshot.block_states].some(s => s === 'u' || s === 's')"
        )
    finally:
        server.stop()


def test_api_key_guards_the_data_not_the_page(page: Any, tiny_model_dir: Path) -> None:
    server = _serve(tiny_model_dir, api_key=API_KEY)
    try:
        page.goto(server.base_url + "/")
        page.wait_for_selector("#key-dialog[open]")
        statuses = page.evaluate("""async () => Promise.all(['v1/kv/snapshot', 'v1/kv/stream'].map(
            async (u) => (await fetch(u)).status))""")
        assert statuses == [401, 401]
        page.fill("#key-input", API_KEY)
        page.click("#key-form button")
        page.wait_for_function("() => window.kvInspector.snapshot !== null")
        assert page.evaluate("() => sessionStorage.getItem('kvserve.apiKey')") == API_KEY
        assert API_KEY not in page.url
    finally:
        server.stop()


def test_the_offload_tier_panel_lists_the_prefixes_it_holds(page: Any, tiny_model_dir: Path, artifacts: Path) -> None:
    import httpx

    plain = _serve(tiny_model_dir)
    try:
        _live(page, plain.base_url + "/")
        assert page.locator("#tier-panel").is_hidden()  # no tier, no panel
    finally:
        plain.stop()
    server = _serve(tiny_model_dir, kv_offloading_size="8MiB")
    try:
        errors = _watch_errors(page)
        body = {"model": MODEL, "prompt": list(range(10, 10 + 40)), "max_tokens": 4, "temperature": 0}
        assert httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).status_code == 200
        _live(page, server.base_url + "/")
        page.wait_for_selector("#tier-panel:not([hidden]) tbody tr")
        cells = page.inner_text("#tier tbody tr").split("\t")
        assert cells[1:] == ["10", "40", "10"]  # 40 prompt + 4 output tokens: 10 full blocks, all in the pool too
        page.screenshot(path=str(artifacts / "kv-inspector-tier.png"), full_page=True)
        assert errors == []
    finally:
        server.stop()
