"""One short chat request to the default model (Gemma 3 270M) through the real server and SDK."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from server_support import RunningServer

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.engine import LLMEngine
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def gemma_server(default_engine: LLMEngine) -> Iterator[RunningServer]:
    engine = default_engine.sibling(kv_cache_memory_bytes=64 << 20, max_model_len=512)
    async_engine = AsyncLLMEngine(engine)
    settings = ServerSettings(served_model_names=(str(engine.config.served_model_name),))
    server = RunningServer(build_app(async_engine, settings), async_engine).start()
    yield server
    server.stop()


def test_default_model_chat(gemma_server):
    client = openai.OpenAI(base_url=f"{gemma_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="gemma-3-270m", max_tokens=8, temperature=0, messages=[{"role": "user", "content": "Say hello."}]
    )
    assert r.model == "gemma-3-270m" and r.choices[0].finish_reason in ("stop", "length")
    # Gemma's turn template: <bos><start_of_turn>user\nSay hello.<end_of_turn>\n<start_of_turn>model\n
    assert r.usage.prompt_tokens == 12 and 0 < r.usage.completion_tokens <= 8
