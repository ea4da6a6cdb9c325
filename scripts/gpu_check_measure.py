"""What scripts/gpu_check.py measures: kvserve's logits and greedy tokens against HF transformers' on the same
checkpoint, and the decode and prefill speed of both against the floor the machine sets.

Tolerances (stated in the report as well):
- float32: every logit within atol + rtol * |reference| of HF's float32 logits, atol = rtol = 1e-3 (a GPU's
  float32 kernels differ from HF's in summation order only; measured differences are reported beside it).
- bfloat16: HF's own bfloat16 run is the yardstick. Against the float32 truth, kvserve's mean |logit error| may be
  at most 2x HF bfloat16's on the same positions, and every position's logits keep a cosine >= 0.99 with the truth.
- greedy (float32): every token kvserve generates is HF float32's argmax at that position (teacher-forced over
  kvserve's own sequence, which is exactly what HF's greedy decoding would have produced), except near-ties: HF's
  logit for kvserve's token within 1e-3 of HF's maximum. Near-ties are counted, never hidden.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from kvserve.bench.floor import ModelCost
    from kvserve.bench.machine import Ceilings
    from kvserve.engine.engine import LLMEngine

FP32_ATOL = FP32_RTOL = 1e-3
BF16_ERROR_RATIO = 2.0
BF16_MIN_COSINE = 0.99
TIE_TOL = 1e-3
TOLERANCES = {
    "float32": {"atol": FP32_ATOL, "rtol": FP32_RTOL},
    "bfloat16": {"max_mean_abs_error_vs_hf_bf16": BF16_ERROR_RATIO, "min_cosine": BF16_MIN_COSINE},
    "greedy_near_tie": TIE_TOL,
}


def random_prompts(lengths: Sequence[int], vocab_size: int, seed: int) -> list[list[int]]:
    """Token-id prompts (from id 3: never a tiny config's pad, bos or eos); distinct seeds give distinct prompts,
    so no measurement is helped by another's prefix-cache blocks."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens: int, prompt_logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        prompt_logprobs=prompt_logprobs,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def generate(
    engine: LLMEngine, prompts: Sequence[list[int]], params: SamplingParams
) -> tuple[list[str], list[list[int]]]:
    """Run `prompts` together on `engine` to the end: their request ids and generated ids, in prompt order. A
    request that fails (its step raised: a kernel fault, say) raises here with the engine's message."""
    ids = submit(engine, prompts, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in _step(engine):
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return ids, [done[rid] for rid in ids]


def submit(engine: LLMEngine, prompts: Sequence[list[int]], params: SamplingParams) -> list[str]:
    """Queue the prompts under fresh request ids (unique on any engine, however many runs it has served)."""
    ids = [f"gc-{uuid.uuid4().hex[:16]}" for _ in prompts]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, list(prompt), params)
    return ids


def _step(engine: LLMEngine) -> list[Any]:
    """One engine step; a request that failed in it (its step raised: a kernel fault, say) raises here."""
    outputs = engine.step()
    for out in outputs:
        if out.error is not None:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
    return outputs


class LogitsTap:
    """Records the float32 logits kvserve computes for every position of every sequence: the prompt's rows
    (asked for with prompt_logprobs=0) and each sampled row. It wraps the runner's `execute`, because the
    engine's API hands out top-k logprobs only and a full-vocabulary comparison needs the rows themselves."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.rows: dict[str, dict[int, torch.Tensor]] = {}  # user request id -> position -> logits
        self._inner = engine.core.runner.execute
        engine.core.runner.execute = self._execute  # type: ignore[method-assign]

    def close(self) -> None:
        self.engine.core.runner.execute = self._inner  # type: ignore[method-assign]

    def _group(self, sequence_id: str) -> str:
        return self.engine.core.requests.user_request_id(sequence_id)

    def _execute(self, out: Any) -> Any:
        result = self._inner(out)
        for sequence_id, (first, logits) in result.prompt_logits.items():
            rows = self.rows.setdefault(self._group(sequence_id), {})
            for j, row in enumerate(logits.float()):
                rows.setdefault(first + j, row)  # a recompute after preemption repeats rows: keep the first
        sampled = result.logits.float().clone()  # a view of a buffer the next step overwrites: copied now
        for request, row in zip(result.sample_requests, sampled):
            self.rows.setdefault(self._group(request.request_id), {})[request.num_tokens - 1] = row
        return result

    def logits(self, request_id: str, length: int, vocab_size: int) -> torch.Tensor:
        """[length, vocab] logits of positions 0..length-1; a missing position is an error (the tap cannot see it)."""
        rows = self.rows.get(request_id, {})
        missing = [p for p in range(length) if p not in rows]
        if missing:
            raise RuntimeError(
                f"the logits tap saw no row for positions {missing[:8]} of {request_id} "
                f"(saw {len(rows)}): has the runner's output changed shape?"
            )
        return torch.stack([rows[p][:vocab_size] for p in range(length)])


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """HF's float32 logits [len(ids), vocab] of one unpadded sequence, on the model's device (where the comparisons
    run too: Gemma's 262k-entry vocabulary makes a few hundred positions' logits gigabytes)."""
    device = next(model.parameters()).device
    return model(torch.tensor([ids], device=device)).logits[0].float()


def compare(test: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """The error figures of `test` logits against `ref` logits ([positions, vocab], float32)."""
    diff = (test - ref).abs()
    excess = diff - (FP32_ATOL + FP32_RTOL * ref.abs())
    cosine = torch.nn.functional.cosine_similarity(test, ref, dim=-1)
    return {
        "max_abs": diff.max().item(),
        "mean_abs": diff.mean().item(),
        "max_abs_ref": ref.abs().max().item(),
        "worst_excess_over_fp32_tolerance": excess.max().item(),
        "min_cosine": cosine.min().item(),
        "argmax_agreement": (test.argmax(-1) == ref.argmax(-1)).float().mean().item(),
    }


@dataclass(slots=True)
class LogitsCase:
    """A batch of prompts generated together, teacher-forced through HF afterwards."""

    prompts: list[list[int]]
    continuation: int


def check_logits(
    engine: LLMEngine,
    dtype: str,
    case: LogitsCase,
    reference: torch.nn.Module,
    hf_same_dtype: torch.nn.Module,
    vocab_size: int,
) -> dict[str, Any]:
    """kvserve's logits over each prompt (prefill, chunked as the engine's token budget says) and over its greedy
    continuation (decode steps, batched) against HF's, teacher-forced over the same tokens."""
    tap = LogitsTap(engine)
    try:
        request_ids, continuations = generate(engine, case.prompts, greedy(case.continuation, prompt_logprobs=0))
    finally:
        tap.close()
    kv, ref, same = [], [], []
    for rid, prompt, cont in zip(request_ids, case.prompts, continuations):
        ids = prompt + cont
        kv.append(tap.logits(rid, len(ids) - 1, vocab_size))
        ref.append(hf_logits(reference, ids[:-1]))
        if dtype != "float32":
            same.append(hf_logits(hf_same_dtype, ids[:-1]))
    kv_all, ref_all = torch.cat(kv), torch.cat(ref)
    result: dict[str, Any] = {
        "requests": len(case.prompts),
        "prompt_lengths": [len(p) for p in case.prompts],
        "continuation": case.continuation,
        "positions": kv_all.shape[0],
        "kvserve_vs_hf_float32": compare(kv_all, ref_all),
    }
    if dtype == "float32":
        result["tolerance"] = TOLERANCES["float32"]
        result["passed"] = result["kvserve_vs_hf_float32"]["worst_excess_over_fp32_tolerance"] <= 0
    else:
        baseline = compare(torch.cat(same), ref_all)
        ratio = result["kvserve_vs_hf_float32"]["mean_abs"] / max(baseline["mean_abs"], 1e-12)
        result.update(
            {"hf_bf16_vs_hf_float32": baseline, "error_ratio_vs_hf_bf16": ratio, "tolerance": TOLERANCES["bfloat16"]}
        )
        result["passed"] = (
            ratio <= BF16_ERROR_RATIO and result["kvserve_vs_hf_float32"]["min_cosine"] >= BF16_MIN_COSINE
        )
    return result


def _judge_greedy(
    reference: torch.nn.Module, prompt: list[int], tokens: list[int]
) -> tuple[dict[str, Any], torch.Tensor]:
    """Each generated token against HF float32's argmax at its position, teacher-forced over this sequence; also
    HF's logits at those positions ([len(tokens), vocab])."""
    logits = hf_logits(reference, prompt + tokens[:-1])[len(prompt) - 1 :]
    chosen = torch.tensor(tokens, device=logits.device)
    gap = logits.max(-1).values - logits.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    exact = int((logits.argmax(-1) == chosen).sum())
    ties = int(((gap > 0) & (gap <= TIE_TOL)).sum())
    return {"exact": exact, "near_ties": ties, "wrong": len(tokens) - exact - ties, "max_gap": gap.max().item()}, logits


def check_greedy(
    engine: LLMEngine, preempting: LLMEngine, prompts: list[list[int]], new_tokens: int, reference: torch.nn.Module
) -> dict[str, Any]:
    """The prompts batched on `preempting` (a cache too small for all: preemption by recompute is forced) against
    each prompt run alone on `engine`, and both against HF float32's greedy choice at every position. A batched
    sequence may leave its solo twin only at a near-tie of HF's logits (float32 reductions differ with the batch's
    shape); after that the two are not compared."""
    params = greedy(new_tokens)
    before = preempting.core.scheduler.num_preemptions
    _, batched = generate(preempting, prompts, params)
    preemptions = preempting.core.scheduler.num_preemptions - before
    alone = [generate(engine, [p], params)[1][0] for p in prompts]
    totals = {"exact": 0, "near_ties": 0, "wrong": 0}
    divergences, max_gap = [], 0.0
    for i, (prompt, a, b) in enumerate(zip(prompts, batched, alone)):
        judged, logits = _judge_greedy(reference, prompt, a)
        for key in totals:
            totals[key] += judged[key]
        max_gap = max(max_gap, judged["max_gap"])
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is not None:
            gap = (logits[first, a[first]] - logits[first, b[first]]).abs().item()
            divergences.append({"request": i, "position": first, "hf_logit_gap": gap, "near_tie": gap <= TIE_TOL})
    return {
        "requests": len(prompts),
        "new_tokens": new_tokens,
        "num_blocks": preempting.core.pool.num_blocks,
        "preemptions": preemptions,
        "tokens": totals,
        "batched_vs_alone_divergences": divergences,
        "max_gap": max_gap,
        "tolerance": {"near_tie": TIE_TOL},
        "passed": preemptions > 0 and totals["wrong"] == 0 and all(d["near_tie"] for d in divergences),
    }


# -- speed ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Floors:
    """What the machine allows for one model: its costs over the measured ceilings."""

    cost: ModelCost
    ceilings: Ceilings

    def decode_tok_s(self, batch: int, context: int) -> float:
        return batch / (self.cost.decode_floor_ms(self.ceilings, batch, context) / 1e3)

    def prefill_tok_s(self, batch: int, prompt_len: int) -> float:
        compute_s = batch * self.cost.prefill_flops(prompt_len) / (self.ceilings.matmul_gflops * 1e9)
        memory_s = self.cost.weight_bytes_per_step / (self.ceilings.bandwidth_gbps * 1e9)
        return batch * prompt_len / max(compute_s, memory_s)


def kvserve_speed(
    engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int, vocab_size: int, seed: int
) -> dict[str, Any]:
    """One static batch through the engine. A step that computed prompt tokens counts as prefill time, a step
    that computed none as decode time: decode tok/s is tokens of pure decode steps over their time."""
    prompts = random_prompts([prompt_len] * batch, vocab_size, seed)
    generate(engine, random_prompts([8] * batch, vocab_size, seed + 1), greedy(3))  # warm-up: compiles, captures
    submit(engine, prompts, greedy(new_tokens))
    prefill_s = decode_s = 0.0
    decode_tokens = steps = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        prompt_before, gen_before = engine.core.num_prompt_tokens_total, engine.core.num_generation_tokens_total
        t = time.perf_counter()
        _step(engine)
        spent = time.perf_counter() - t
        steps += 1
        if engine.core.num_prompt_tokens_total > prompt_before:
            prefill_s += spent
        else:
            decode_s += spent
            decode_tokens += engine.core.num_generation_tokens_total - gen_before
    total_s = time.perf_counter() - start
    return {
        "prefill_tok_s": batch * prompt_len / prefill_s,
        "decode_tok_s": decode_tokens / decode_s,
        "decode_step_ms": 1e3 * decode_s / max(decode_tokens / batch, 1),
        "steps": steps,
        "output_tok_s": batch * new_tokens / total_s,
        "total_s": total_s,
    }


@torch.inference_mode()
def hf_speed(
    model: torch.nn.Module, batch: int, prompt_len: int, new_tokens: int, vocab_size: int, seed: int
) -> dict[str, Any]:
    """HF `generate` on one static batch (equal-length prompts: no padding). Prefill time is a 1-token generate;
    decode time is a `new_tokens` generate minus it."""
    device = next(model.parameters()).device
    ids = torch.tensor(random_prompts([prompt_len] * batch, vocab_size, seed), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(n: int) -> float:
        sync()
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n)  # type: ignore[operator]
        sync()
        return time.perf_counter() - t

    run(2)  # warm-up
    first = run(1)
    whole = run(new_tokens)
    decode_s = max(whole - first, 1e-9)
    return {
        "prefill_tok_s": batch * prompt_len / first,
        "decode_tok_s": batch * (new_tokens - 1) / decode_s,
        "decode_step_ms": 1e3 * decode_s / (new_tokens - 1),
        "output_tok_s": batch * new_tokens / whole,
        "total_s": whole,
    }


def speed_row(
    batch: int, prompt_len: int, new_tokens: int, floors: Floors, kv: dict[str, Any] | None, hf: dict[str, Any] | None
) -> dict[str, Any]:
    """One batch size, side by side: each implementation's figures, the floors, and the ratios that matter."""
    context = prompt_len + new_tokens // 2
    row: dict[str, Any] = {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "floor_decode_tok_s": floors.decode_tok_s(batch, context),
        "floor_prefill_tok_s": floors.prefill_tok_s(batch, prompt_len),
        "kvserve": kv,
        "hf": hf,
    }
    for figures in (kv, hf):
        if figures is not None:
            figures["decode_x_floor"] = row["floor_decode_tok_s"] / figures["decode_tok_s"]
            figures["prefill_x_floor"] = row["floor_prefill_tok_s"] / figures["prefill_tok_s"]
    if kv is not None and hf is not None:
        row["kvserve_over_hf_decode"] = kv["decode_tok_s"] / hf["decode_tok_s"]
        row["kvserve_over_hf_output"] = kv["output_tok_s"] / hf["output_tok_s"]
    return row


def check_layouts(
    engine: LLMEngine, uniform: LLMEngine, prompts: Sequence[list[int]], new_tokens: int
) -> dict[str, Any]:
    """Greedy ids of `prompts` (past the sliding window) on the hybrid layout (`engine`: KV cache groups, per-group
    block tables through the attention kernels, out-of-window blocks given back) against the uniform layout
    (`uniform`: --disable-hybrid-kv-cache-manager) on the same device: the same attention over the same keys, so
    identical token for token."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    _, hybrid = generate(engine, prompts, params)
    _, plain = generate(uniform, prompts, params)
    first = [next((i for i, (a, b) in enumerate(zip(h, u)) if a != b), None) for h, u in zip(hybrid, plain)]
    return {
        "groups": engine.core.layout.describe(),
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "identical": sum(f is None for f in first),
        "first_divergence": first,
        "passed": all(f is None for f in first),
    }
