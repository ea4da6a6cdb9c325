"""LLM: the offline API, shaped like vLLM's `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]


class LLM:
    """Generate for a batch of prompts with continuous batching; outputs come back in prompt order."""

    def __init__(self, model: str | None = None, engine: LLMEngine | None = None, **engine_args: Any) -> None:
        self.engine = engine or LLMEngine.from_config(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt] | dict | Sequence[dict],
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
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts: pass one, or one per prompt"
                )
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

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while len(finished) < len(ids):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[rid] for rid in ids]


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
