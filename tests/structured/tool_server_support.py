"""A tiny-model server for the structured-output and tool tests: a character-level random checkpoint with room for
tool prompts (2048 positions), a chat template that renders tools, tool results and assistant calls in the
Hermes / Qwen format, and the hermes parser with auto tool choice on (as `vllm serve --enable-auto-tool-choice
--tool-call-parser hermes` would run a Qwen checkpoint). Its fixtures are re-exported by this folder's conftest.py."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))

from server_support import RunningServer, make_engine
from tiny_models import build_tiny_hf_model
from tiny_tokenizer import write_char_tokenizer

from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.server.app import build_app
from kvserve.server.context import ServerSettings

MODEL = "tiny-tools"
MAX_MODEL_LEN = 2048

# Hermes / Qwen shape, kept short (one token per character): tools in the system turn, calls as <tool_call> JSON,
# results as <tool_response>.
TOOLS_TEMPLATE = (
    "{%- if tools %}<system>{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n' }}{% endif %}"
    "Tools:{% for t in tools %}{{ '\\n' + t.function | tojson }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and tools %}"
    "{%- elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>\n"
    "{%- elif m.tool_calls %}<assistant>{{ m.content or '' }}{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}\n"
    "{%- else %}<{{ m.role }}>{{ m.content }}\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<assistant>{% endif %}"
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 6}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# tool_choice auto with the text constrained to two Hermes blocks: the random model "decides" to call two tools.
TWO_HERMES_CALLS = {
    "structured_outputs": {
        "regex": (
            r'Checking\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "c", '
            r'"days": [1-7]\}\}</tool_call><tool_call>\{"name": "get_time", "arguments": \{"zone": "[A-Z]{3}"\}\}'
            r"</tool_call>"
        )
    }
}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # extra_body: no whitespace to wander in


def build_tools_model(path: Path) -> Path:
    build_tiny_hf_model("llama_gqa", max_position_embeddings=MAX_MODEL_LEN).save_pretrained(path)
    write_char_tokenizer(path)
    return path


def start_server(model_dir: Path, **settings: Any) -> RunningServer:
    engine = make_engine(model_dir, chat_template=TOOLS_TEMPLATE, num_gpu_blocks_override=2048)
    async_engine = AsyncLLMEngine(engine)
    config = ServerSettings(served_model_names=(MODEL,), **settings)
    return RunningServer(build_app(async_engine, config), async_engine).start()


def sdk(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def tools_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tools_model(tmp_path_factory.mktemp("tiny_tools"))


@pytest.fixture(scope="module")
def tools_server(tools_model_dir: Path) -> Iterator[RunningServer]:
    """One server per test module: auto tool choice on, the hermes parser."""
    server = start_server(tools_model_dir, enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tools_client(tools_server: RunningServer) -> openai.OpenAI:
    return sdk(tools_server)
