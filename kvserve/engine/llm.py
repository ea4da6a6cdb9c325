"""LLM: the offline API, shaped like vLLM's `LLM(model=...).generate(prompts, params)` and `.chat(messages)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from kvserve.model.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """Generate for a batch of prompts with continuous batching; outputs come back in prompt order."""

    def __init__(self, model: str | None = None, engine: LLMEngine | None = None, **engine_args: Any) -> None:
        self.engine = engine or LLMEngine.from_config(EngineConfig.parse(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt] | dict[str, Any] | Sequence[dict[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None:
            params_list = [SamplingParams() for _ in prompt_list]
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts: "
                    "pass one, or one per prompt"
                )
        for params in params_list:
            self._check_grammar(params)
        ids = []
        try:
            for prompt, params in zip(prompt_list, params_list):
                rid = str(next(self._ids))
                # Only the finished outputs are wanted: the engine then builds no output for a step in between.
                final_only = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                self.engine.add_request(rid, prompt, final_only, cache_salt=cache_salt)
                ids.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of OpenAI-style messages) or to a list of them, rendered by
        the model's chat template (or `chat_template`), as vLLM's LLM.chat. `tools` (OpenAI function tools) are
        passed to the template, which renders them if it knows how; to force a call, constrain the output with
        `SamplingParams(structured_outputs=...)` (kvserve.structured.tool_schemas builds the schema)."""
        conversations = _normalize_conversations(messages)
        tokenizer = self.engine.tokenizer
        prompts: list[Prompt] = [
            _render_chat(tokenizer, conversation, add_generation_prompt, chat_template, tools)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, cache_salt=cache_salt)

    def _check_grammar(self, params: SamplingParams) -> None:
        """Compile a request's constraint before queueing anything, so that a bad schema, regex or grammar is a
        ValueError naming the field here (as in vLLM), not an error output later; the engine then hits the cache."""
        if params.structured_outputs is not None:
            self.engine.grammar.compile(params.structured_outputs)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while len(finished) < len(ids):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[rid] for rid in ids]


def _normalize_conversations(messages: Any) -> list[list[dict[str, Any]]]:
    """One conversation (a list of message dicts) or a list of them, as vLLM's LLM.chat takes."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages must be a non-empty list of messages, or a list of such lists")
    if all(isinstance(m, dict) for m in messages):
        return [list(messages)]
    if all(
        isinstance(c, Sequence) and not isinstance(c, str) and all(isinstance(m, dict) for m in c) for c in messages
    ):
        return [list(c) for c in messages]
    raise ValueError("messages must be a list of message dicts, or a list of such lists")


def _render_chat(
    tokenizer: Tokenizer,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    chat_template: str | None,
    tools: list[dict[str, Any]] | None,
) -> str:
    """The prompt text of one conversation; tools go to the template only when given (a template that never
    heard of tools renders as before)."""
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "chat_template": chat_template}
    if tools is not None:
        kwargs["tools"] = tools
    text: str = tokenizer.apply_chat_template(conversation, **kwargs)
    return text


def _normalize_prompts(prompts: Any) -> list[Prompt]:
    """Accept a string, a token-id list, vLLM's {"prompt"| "prompt_token_ids"} dicts, or a list of them."""
    if isinstance(prompts, str) or isinstance(prompts, dict):
        prompts = [prompts]
    elif isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        prompts = [list(prompts)]
    out: list[Prompt] = []
    for p in prompts:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                out.append(list(p["prompt_token_ids"]))
            elif "prompt" in p:
                out.append(p["prompt"])
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(p, str):
            out.append(p)
        elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
            out.append(list(p))
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")
    return out
