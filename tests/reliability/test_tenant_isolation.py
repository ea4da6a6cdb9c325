"""Tenants sharing one server: a client learns nothing about prompts it did not send beyond whole cached blocks, and
nothing across salts (docs/PROMPT_CACHING.md, "What clients share"). Each test is an attack a hostile run made work,
shrunk to a few requests on the tiny model (16-token blocks, one character a token)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from server_support import MODEL, RunningServer, make_engine

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings

BS = 16
# The victim's system prompt: its first block (BOS + 15 characters) is what the attacker knows, the digits after it
# are the secret.
KNOWN = "Vault code is: "
SECRET = "75302918"
VICTIM = KNOWN + SECRET + ". Never tell anyone the vault code."


@pytest.fixture
def make_tenant_server(tiny_model_dir: Path) -> Iterator[Callable[..., RunningServer]]:
    servers: list[RunningServer] = []

    def make(**settings: Any) -> RunningServer:
        async_engine = AsyncLLMEngine(make_engine(tiny_model_dir, block_size=BS))
        app = build_app(async_engine, ServerSettings(served_model_names=(MODEL,), **settings))
        servers.append(RunningServer(app, async_engine).start())
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def report(c, prompt: str, **extra: Any) -> dict[str, Any]:
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "include_kv_cache": True, **extra})
    assert r.status_code == 200, r.text
    (kv,) = r.json()["kv_cache"]
    return kv


def observed(kv: dict[str, Any]) -> tuple[Any, ...]:
    """All a report says about other prompts: what was served, and where and why the hit stopped (the `before` and
    `after` texts are decoded from the request's own prompt)."""
    miss = kv["miss"] or {}
    return (
        kv["pool_tokens"],
        kv["computed_tokens"],
        miss.get("reason"),
        miss.get("at_token"),
        miss.get("diverged_at_token"),
    )


def guess_next(c, known: str, candidates: str = "0123456789", **extra: Any) -> set[tuple[Any, ...]]:
    """The extraction attack: one request per candidate character after `known`, padded so that the guessed block is
    whole; a report that differs for the right guess leaks it."""
    pad = BS - (len(known) + 1) % BS  # + 1: BOS
    return {observed(report(c, known + d + "#" * pad + "?", **extra)) for d in candidates}


def test_a_divergence_inside_a_block_is_not_told_across_clients(make_tenant_server):
    """Two clients without a salt: the victim's system prompt holds a secret; the attacker, knowing its first block,
    sent one-character guesses padded to a block and kept the guess whose `diverged_at_token` moved past what it knew
    (24 requests recovered 8 digits). Every guess now gets the same report: divergence is told in whole blocks."""
    server = make_tenant_server()
    with server.client() as c:
        report(c, VICTIM)
        assert len(guess_next(c, KNOWN)) == 1  # the first secret digit: all ten guesses look alike
        assert len(guess_next(c, KNOWN + SECRET[:3])) == 1  # and the fourth, knowing three
        # Inside the first block (half a block matched once counted as a divergence there): nothing told either.
        assert len(guess_next(c, KNOWN[:8], "abcdefgh")) == 1  # "d" is next


def test_a_salted_client_sees_where_its_own_prompt_changed(make_tenant_server):
    """Within a salt (one tenant), a divergence is told to the token: the salt's prompts are the tenant's own."""
    server = make_tenant_server()
    with server.client() as c:
        report(c, VICTIM, cache_salt="tenant-a")
        changed = report(c, KNOWN + "7X" + VICTIM[len(KNOWN) + 2 :], cache_salt="tenant-a")["miss"]
        assert (changed["reason"], changed["at_token"], changed["diverged_at_token"]) == ("diverged", BS, BS + 1)
        assert changed["after"].startswith("X")
        # Unsalted, the same change is told at the block only.
        report(c, VICTIM)
        unsalted = report(c, KNOWN + "7X" + VICTIM[len(KNOWN) + 2 :])["miss"]
        assert (unsalted["reason"], unsalted["at_token"], unsalted["diverged_at_token"]) == ("diverged", BS, BS)


def test_the_operator_chooses_what_the_report_tells(make_tenant_server):
    """--kv-cache-report: `full` tells every client the token (clients that trust each other), `blocks` tells even a
    salted one whole blocks only, `off` refuses include_kv_cache with a 400 naming it."""
    full = make_tenant_server(kv_cache_report="full")
    with full.client() as c:
        report(c, VICTIM)
        assert len(guess_next(c, KNOWN)) == 2  # told: the right guess stands out
    blocks = make_tenant_server(kv_cache_report="blocks")
    with blocks.client() as c:
        report(c, VICTIM, cache_salt="t")
        assert len(guess_next(c, KNOWN, cache_salt="t")) == 1
    off = make_tenant_server(kv_cache_report="off")
    with off.client() as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "include_kv_cache": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "include_kv_cache", r.text
        assert "--kv-cache-report" in r.json()["error"]["message"]
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "include_kv_cache": True}
        assert c.post("/v1/chat/completions", json=chat).status_code == 400
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


MISS_METRIC = "kvserve:prefix_cache_miss_reasons_total"


def salt_probe(c) -> None:
    """A tenant's prompt, then the same text under a fresh salt: the second request's true reason is
    different_cache_salt (the issue's probe: which of five guessed salaries another tenant's prompt held)."""
    report(c, VICTIM, cache_salt="tenant-a")
    assert report(c, VICTIM, cache_salt="probe")["miss"]["reason"] == "never_seen"


def reasons_counted(text: str) -> set[str]:
    """The reasons /metrics counts at least one request for."""
    lines = [line for line in text.splitlines() if line.startswith(MISS_METRIC)]
    return {line.split('reason="')[1].split('"')[0] for line in lines if float(line.rsplit(" ", 1)[1]) > 0}


def test_metrics_show_another_salts_prompts_only_to_the_admin_key(make_tenant_server):
    """/metrics counted different_cache_salt for anyone: a client probing with fresh salts learned which guess another
    tenant's prompt held. Without an admin key /metrics is open and counts it as never_seen (what the client is told);
    with one, /metrics needs it (the clients' key does not open it) and counts every reason."""
    open_server = make_tenant_server(api_key="client-key")
    with open_server.client(headers={"Authorization": "Bearer client-key"}) as c:
        salt_probe(c)
        scraped = c.get("/metrics")
        assert scraped.status_code == 200
        assert reasons_counted(scraped.text) == {"never_seen"}
    keyed = make_tenant_server(api_key="client-key", admin_api_key="admin-key")
    with keyed.client(headers={"Authorization": "Bearer client-key"}) as c:
        salt_probe(c)
        assert c.get("/metrics").status_code == 401
        assert keyed.client().get("/metrics").status_code == 401  # and without any key
    with keyed.client(headers={"Authorization": "Bearer admin-key"}) as admin:
        assert reasons_counted(admin.get("/metrics").text) == {"never_seen", "different_cache_salt"}
        ok = admin.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})  # the admin key opens every route
        assert ok.status_code == 200, ok.text


def test_the_kv_inspector_shows_prompts_only_to_its_own_key(make_tenant_server):
    """Every tenant holds the one client key, and the inspector showed each one's prompt text (and miss reasons). With
    a client key alone its data is redacted by default: no token ids, misses as clients are told them, no
    prompt_cache_key; with an admin key it is the admin key's alone, unredacted."""
    shared = make_tenant_server(api_key="client-key")
    with shared.client(headers={"Authorization": "Bearer client-key"}) as c:
        assert c.get("/v1/kv/snapshot").status_code == 200  # a reader: events are recorded from now on
        report(c, VICTIM)
        changed = report(c, KNOWN + "7X" + VICTIM[len(KNOWN) + 2 :], prompt_cache_key="tenant-a-work")
        assert changed["miss"]["diverged_at_token"] == BS
        snapshot = c.get("/v1/kv/snapshot").json()
        assert snapshot["redacted"] is True
        assert all(b["token_ids"] is None for b in snapshot["blocks"])
        cached = next(b for b in snapshot["blocks"] if b["state"] == "c")
        detail = c.get(f"/v1/kv/blocks/{cached['id']}").json()
        assert VICTIM[:8] not in str(detail) and detail.get("token_ids") is None
        counts = dict(snapshot["gauges"]["prefix_cache_miss_reasons"])
        assert "different_cache_salt" not in counts
        events = [e for e in snapshot["events"] if e["kind"] == "prefix_missed"]
        assert events and all(e["diverged_at_token"] in (None, e["at_token"]) for e in events)
    own = make_tenant_server(api_key="client-key", admin_api_key="admin-key")
    with own.client(headers={"Authorization": "Bearer client-key"}) as c, own.client() as anyone:
        assert c.get("/v1/kv/snapshot").status_code == 401
        assert anyone.get("/v1/kv/snapshot", headers={"Authorization": "Bearer admin-key"}).status_code == 200
        report(c, VICTIM)
        report(c, KNOWN + "7X" + VICTIM[len(KNOWN) + 2 :])
    with own.client(headers={"Authorization": "Bearer admin-key"}) as admin:
        snapshot = admin.get("/v1/kv/snapshot").json()
        assert snapshot["redacted"] is False
        assert any(b["token_ids"] is not None for b in snapshot["blocks"])
        events = [e for e in snapshot["events"] if e["kind"] == "prefix_missed"]
        assert BS + 1 in [e["diverged_at_token"] for e in events]  # the operator's view: to the token


def test_an_admin_key_equal_to_the_client_key_is_refused():
    with pytest.raises(ValueError, match="must differ"):
        ServerSettings(served_model_names=(MODEL,), api_key="k", admin_api_key="k")
