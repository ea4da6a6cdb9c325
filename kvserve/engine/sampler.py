"""Turns one row of logits per request into the next token, with vLLM's sampling semantics.

Order (as vLLM): penalties -> min_tokens blocking -> grammar mask -> temperature -> top-k -> top-p -> min-p
-> sample. Greedy rows take the argmax of the penalized (and masked) logits. Reported logprobs are the raw model
logprobs (log_softmax of the logits as given, before any mask), as vLLM's default "raw_logprobs".

Structured output: a row whose request carries a grammar matcher gets its allowed tokens from one packed bitmask
per step (filled by the matchers, kvserve/structured/matcher.py) and every other token set to -inf. Only
constrained rows are touched: a batch without them allocates nothing, and an unconstrained row's logits, and so
its token, are the same with or without constrained neighbours. Two interactions are settled here: min_tokens
does not block the stop tokens of a row whose grammar allows nothing else (the grammar is complete; blocking
would leave no candidate), and a row with no finite candidate falls back to the best token its grammar allows,
never to one it forbids.

Everything is a batched tensor op with per-row parameters; Python loops run over requests, never
over the vocabulary. For a large vocabulary the costly parts are avoided:
  * top-k / top-p never sort the whole row: the cut-off is found in `torch.topk` of a window that
    widens (64 -> 2048) only for rows whose nucleus does not fit in it, then by an O(V) bucket
    select, so top_p=0.9 on a peaked distribution costs one small topk;
  * penalties touch only the tokens a row has seen (O(tokens), not O(rows x vocab));
  * sampling is inverse-CDF with one uniform number per row (cumsum + searchsorted), not a full
    row of random numbers. A seeded request draws that number from its own generator, so it gets the
    same tokens whatever else is in the batch and wherever its row is; unseeded rows share one
    batch-level draw from the sampler's generator.

On a GPU the greedy and plain sampling paths never wait for the device until the end of the step, when the ids and
every logprob tensor come back together (one host sync, engine/host_transfer.fetch_to_host): fix-ups for NaN and
-inf rows are computed for every row instead of being looked for, and small per-row tensors go through pinned
memory (docs/CUDA.md lists what still syncs: top-k/top-p, penalties, grammars).

Never an id outside the vocabulary, whatever the parameters or the model do to the logits: NaN (a
penalty or temperature that overflows, a broken model) would make every comparison false and the
inverse-CDF search return the vocabulary size, which the next step's embedding lookup cannot take.
So NaN counts as -inf (never chosen), +inf as the largest finite float, a row left with no finite
candidate takes the argmax of the raw logits, and the final ids are checked. The checks ride on
reductions the sampler makes anyway (argmax, the row max); only a row that needs fixing is copied.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.engine.host_transfer import fetch_to_host, host_to_device, to_device
from kvserve.outputs import Logprob
from kvserve.structured.matcher import apply_token_bitmask_, fill_step_bitmask

if TYPE_CHECKING:
    from kvserve.sampling_params import SamplerRow, SamplingParams
    from kvserve.structured.matcher import MaskSource

# max(dim=-1) of a [rows, V] float32 tensor: (values, indices), the first maximum's index, NaN preferred.
RowMax = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

_NEG_INF = float("-inf")
# Width of the first topk window used to find top-p cut-offs.
_TOP_P_WINDOW = 64
_TOP_P_WIDE_WINDOW = 2048  # the second try; after it, `_bucket_cut`
# `_bucket_cut` keeps 23 - 16 = 7 mantissa bits: 128 buckets per octave, 16,257 buckets in all.
_BUCKET_SHIFT = 16


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None  # raw logprob of the sampled token, if logprobs were asked
    rank: int | None  # 1-based rank of the sampled token among the raw logprobs
    # Top-n (n = params.logprobs) in descending order, then the sampled token if not among them.
    top_logprobs: dict[int, float] | None


class Sampler:
    """Samples one token per row. Holds only a generator for unseeded rows (seeded by `seed`)."""

    def __init__(self, eos_token_ids: Sequence[int], seed: int | None = None, row_max: RowMax | None = None) -> None:
        self.eos_token_ids = list(eos_token_ids)
        # The native kernels' max(dim=-1) (NativeKernels.row_max: the same values and indices, the rows across the
        # threads) for greedy rows on the CPU; None: torch's.
        self.row_max = row_max
        self._generator = torch.Generator()  # for unseeded rows; seeded requests bring their own
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[SamplerRow],
        matchers: Sequence[MaskSource | None] | None = None,
    ) -> list[SampledToken]:
        """`logits` is [S, V] float32, row i belonging to `requests[i]`; `matchers[i]`, if given and not None, is
        row i's grammar. Unconstrained rows of `logits` are not modified; constrained rows may be masked in place
        (the runner's buffer, consumed here: a copy of a whole batch would cost more than the masks)."""
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [{len(requests)}, V], got {list(logits.shape)}")
        if matchers is not None and len(matchers) != len(requests):
            raise ValueError(f"{len(matchers)} matchers for {len(requests)} rows")
        params = [r.sampling_params for r in requests]
        want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(_rows(logits, want_lp), dim=-1) if want_lp else None

        grammar = fill_step_bitmask(matchers, logits.shape[1]) if matchers is not None else None
        raw = logits
        logits = self._penalized(logits, requests, grammar)
        if grammar is not None:
            with torch.inference_mode():  # the runner's logits buffer is an inference tensor
                apply_token_bitmask_(logits, *grammar)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        rand = [i for i, p in enumerate(params) if not p.is_greedy]
        parts = []
        if greedy:
            parts.append((greedy, _greedy(_rows(logits, greedy), _rows(raw, greedy), self.row_max)))
        if rand:
            parts.append(
                (
                    rand,
                    self._sample(
                        _rows(logits, rand),
                        _rows(raw, rand),
                        [params[i] for i in rand],
                        [requests[i].generator for i in rand],
                    ),
                )
            )
        token_ids = _merge_rows(parts, len(requests), logits.device)
        if grammar is not None:
            _keep_to_grammar_(token_ids, raw, *grammar)
        num_top = [params[i].logprobs or 0 for i in want_lp]
        lp = _logprob_tensors(token_ids, want_lp, raw_logprobs, num_top) if raw_logprobs is not None else None
        # The step's one host sync: the ids and every logprob tensor come back together.
        ids_host, *lp_host = fetch_to_host([token_ids, *(lp or ())])
        assert ids_host is not None
        ids = ids_host.tolist()
        _check_in_vocab(ids, logits.shape[1])
        out = [SampledToken(t, None, None, None) for t in ids]
        if lp is not None:
            _fill_logprobs(out, want_lp, lp_host, num_top)
        return out

    # -- logits processing ----------------------------------------------------------------------

    def _penalized(
        self,
        logits: torch.Tensor,
        requests: Sequence[SamplerRow],
        grammar: tuple[torch.Tensor, list[int]] | None = None,
    ) -> torch.Tensor:
        """Penalties and min_tokens blocking, on a copy (only made when some row needs it). A constrained row
        (in `grammar`'s rows) whose grammar allows only tokens min_tokens would block keeps them: its output is
        complete, and the grammar wins."""
        pen = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
        block_rows: list[int] = []
        block_cols: list[int] = []
        constrained = set(grammar[1]) if grammar is not None else set()
        for i, r in enumerate(requests):
            p = r.sampling_params
            if len(r.output_token_ids) < p.min_tokens:
                blocked = set(p.stop_token_ids or ())
                if not p.ignore_eos:  # with ignore_eos, eos does not stop, so it needs no blocking
                    blocked.update(self.eos_token_ids)
                if grammar is not None and i in constrained and not _allows_other_than(grammar[0][i], blocked):
                    continue
                block_rows += [i] * len(blocked)
                block_cols += sorted(blocked)
        if pen:
            logits = apply_penalties(logits, requests)  # a copy
        elif block_rows:
            logits = logits.clone()
        if block_rows:
            logits[block_rows, block_cols] = _NEG_INF
        return logits

    def _sample(
        self,
        logits: torch.Tensor,
        raw: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Works in probability space on `exp((x - max) / T)` (max = 1, unnormalized): top-k/top-p
        and min-p become one threshold per row, and no softmax division is needed."""
        device = logits.device
        # On a GPU nothing here waits for the device: the non-finite fix-ups run on every row instead of being
        # looked for (a host sync); on the CPU, where looking is cheaper than fixing, they run only when needed.
        sync_free = _sync_free(device)
        temps = to_device([p.temperature for p in params], torch.float32, device).unsqueeze(1)
        probs = logits / temps  # a new tensor, so everything below may work in place
        peak = probs.amax(dim=-1, keepdim=True)  # NaN if the row has a NaN, +inf if it has a +inf
        hopeless = None
        if sync_free or not bool(torch.isfinite(peak).all()):
            _sanitize_(probs)
            peak = probs.amax(dim=-1, keepdim=True)
            hopeless = torch.isneginf(peak.squeeze(1))  # no finite candidate left in the row
            peak.masked_fill_(hopeless.unsqueeze(1), 0.0)  # so that -inf - peak is not NaN
        probs.sub_(peak).exp_()
        threshold = top_k_top_p_threshold(probs, params)
        # min-p after top-k/top-p, as in vLLM; they never remove the most likely token (prob 1 here),
        # so p >= min_p * p_max is simply p >= min_p.
        min_p = to_device([p.min_p for p in params], torch.float32, device)
        threshold = torch.maximum(threshold, min_p)
        if any(p.top_k_enabled or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            probs.masked_fill_(probs < threshold.unsqueeze(1), 0.0)
        cdf = probs.cumsum_(dim=-1)
        total = cdf[:, -1:].contiguous()
        u = host_to_device(self._uniforms(generators), device).to(cdf.dtype)
        picked = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True)
        # u * total may round up to total: fall back to the last token with non-zero probability.
        last = torch.searchsorted(cdf, total, right=False)
        ids = torch.minimum(picked, last).squeeze(1)
        if hopeless is not None and sync_free:
            ids = torch.where(hopeless, _raw_argmax(raw), ids)
        elif hopeless is not None and bool(hopeless.any()):
            ids[hopeless] = _raw_argmax(raw[hopeless])
        return ids

    def _uniforms(self, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One U[0, 1) per row, drawn on the CPU so that results do not depend on the logits'
        device: from the request's generator if seeded, else from one batch draw."""
        u = torch.rand(len(generators), generator=self._generator, dtype=torch.float64)
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand(1, generator=g, dtype=torch.float64, device=g.device).item()
        return u


def _sync_free(device: torch.device) -> bool:
    """Whether the sampler avoids asking the device about the data (each question is a host sync): on a GPU.
    On the CPU a question costs nothing, and the fix-ups it lets the sampler skip cost passes over the logits."""
    return device.type != "cpu"


def _allows_other_than(bitmask_row: torch.Tensor, token_ids: set[int]) -> bool:
    """Whether a packed bitmask row allows some token outside `token_ids`."""
    words: dict[int, int] = {}
    for token_id in token_ids:
        word, bit = divmod(token_id, 32)
        if word < bitmask_row.numel():
            words[word] = words.get(word, 0) | (1 << bit)
    for word, bits in words.items():
        if (int(bitmask_row[word]) & 0xFFFFFFFF) & ~bits:
            return True
    rest = bitmask_row.clone()
    rest[list(words)] = 0
    return bool(rest.any())


def _keep_to_grammar_(token_ids: torch.Tensor, raw: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: a constrained row's token that its grammar forbids (only possible when the row kept no finite
    candidate and fell back to the raw logits) becomes the allowed token with the best raw logit (NaN and -inf
    counting as the lowest finite value, so an allowed token always wins over a forbidden one)."""
    index = torch.tensor(rows, dtype=torch.long)
    chosen = token_ids[rows].cpu()
    words = bitmask[index, chosen >> 5]
    allowed = ((words >> (chosen & 31).to(words.dtype)) & 1).bool()
    if bool(allowed.all()):
        return
    for j in (~allowed).nonzero().flatten().tolist():
        r = rows[j]
        row = torch.nan_to_num(raw[r].float(), nan=-3.0e38, posinf=3.0e38, neginf=-3.0e38).unsqueeze(0)
        apply_token_bitmask_(row, bitmask[r : r + 1], [0])
        token_ids[r] = int(row.argmax())


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`t[rows]`, without a copy when `rows` is every row in order (and with the index sent without a sync)."""
    if len(rows) == t.shape[0] and rows == list(range(len(rows))):
        return t
    return t.index_select(0, to_device(rows, torch.int64, t.device))


def _merge_rows(parts: list[tuple[list[int], torch.Tensor]], num_rows: int, device: torch.device) -> torch.Tensor:
    """One [num_rows] id tensor from the parts' rows (greedy and sampled); a part holding every row is returned
    as it is."""
    if len(parts) == 1 and len(parts[0][0]) == num_rows:
        return parts[0][1]
    token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
    for rows, ids in parts:
        token_ids.index_copy_(0, to_device(rows, torch.int64, device), ids)
    return token_ids


def _sanitize_(logits: torch.Tensor) -> torch.Tensor:
    """In place: NaN -> -inf (never chosen), +inf -> the largest finite value (still the favourite, but
    `x - max` stays a number), -inf kept (a blocked token stays blocked)."""
    return torch.nan_to_num_(logits, nan=_NEG_INF, posinf=torch.finfo(logits.dtype).max, neginf=_NEG_INF)


def _raw_argmax(raw: torch.Tensor) -> torch.Tensor:
    """The fallback for rows whose processed logits kept no finite candidate: the model's own favourite
    (NaN ignored; a row of nothing but NaN and -inf gives token 0, which is at least a real token)."""
    return _sanitize_(raw.clone()).argmax(dim=-1)


def _greedy(logits: torch.Tensor, raw: torch.Tensor, row_max: RowMax | None = None) -> torch.Tensor:
    """Argmax per row. torch's argmax prefers NaN, and a row of -inf gives index 0 whatever it means, so
    rows whose chosen value is NaN or -inf are redone on sanitized copies (or the raw fallback). On a GPU,
    `_greedy_sync_free` does the same without asking the device which rows are bad. row_max: a replacement for
    max(dim=-1) giving the same values and indices (the native kernels', 0.74 against 2.07 ms on 32 x 262,144:
    scripts/ab_kernel_shapes.py)."""
    if _sync_free(logits.device):
        return _greedy_sync_free(logits, raw)
    # max(dim) gives argmax's index (the first maximum; NaN preferred) with its value, and on CPU it is ~4x
    # faster than argmax (2.7 against 10.2 ms on a 32 x 262,144 step: a tenth of the step)
    chosen, ids = logits.max(dim=-1) if row_max is None else row_max(logits)
    bad = (torch.isnan(chosen) | torch.isneginf(chosen)).nonzero().flatten()
    if bad.numel():
        fixed = _sanitize_(logits[bad])  # fancy indexing copies: the caller's tensor is untouched
        redo = fixed.argmax(dim=-1)
        hopeless = torch.isneginf(fixed.gather(1, redo.unsqueeze(1)).squeeze(1))
        if bool(hopeless.any()):
            redo[hopeless] = _raw_argmax(raw[bad][hopeless])
        ids[bad] = redo
    return ids


def _greedy_sync_free(logits: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """`_greedy` without a host sync: the sanitized argmax and the raw fallback are computed for every row and
    chosen per row with torch.where (two more passes over the logits, cheap on a GPU; the same ids)."""
    # max(dim) gives argmax's index (the first maximum; NaN preferred) with its value, and on CPU it is ~4x
    # faster than argmax (2.7 against 10.2 ms on a 32 x 262,144 step: a tenth of the step)
    chosen, ids = logits.max(dim=-1)
    bad = torch.isnan(chosen) | torch.isneginf(chosen)
    fixed = _sanitize_(logits.clone())
    redo = fixed.argmax(dim=-1)
    hopeless = torch.isneginf(fixed.gather(1, redo.unsqueeze(1)).squeeze(1))
    redo = torch.where(hopeless, _raw_argmax(raw), redo)
    return torch.where(bad, redo, ids)


def _check_in_vocab(ids: list[int], vocab: int) -> None:
    """The last guard: an id outside the vocabulary would fail the next step's embedding lookup for the
    whole batch, so a bug that lets one through fails this step (and the engine isolates the request)."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RuntimeError(f"the sampler produced token id {bad[0]} outside the vocabulary (0..{vocab - 1})")


def apply_penalties(logits: torch.Tensor, requests: Sequence[SamplerRow]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens; presence/frequency over output tokens.

    Touches only the tokens each row has seen: (row, token) pairs become flat keys
    `row * V + token`, counted with one `torch.unique`, so the cost is O(tokens), not O(rows x V).
    Returns a new tensor."""
    vocab = logits.shape[1]
    device = logits.device
    params = [r.sampling_params for r in requests]
    pen = [i for i, p in enumerate(params) if p.has_penalties]
    out = logits.clone()
    flat = out.view(-1)

    def keys(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        key = [i * vocab + t for i, s in zip(pen, seqs) for t in s]
        unique, counts = torch.unique(torch.tensor(key, dtype=torch.long, device=device), return_counts=True)
        return unique, counts

    seen, _ = keys([requests[i].prompt_token_ids + requests[i].output_token_ids for i in pen])
    if seen.numel():
        rep = torch.tensor([p.repetition_penalty for p in params], device=device)[seen // vocab]
        vals = flat[seen]
        flat[seen] = torch.where(vals > 0, vals / rep, vals * rep)
    generated, counts = keys([requests[i].output_token_ids for i in pen])
    if generated.numel():
        row = generated // vocab
        freq = torch.tensor([p.frequency_penalty for p in params], device=device)[row]
        pres = torch.tensor([p.presence_penalty for p in params], device=device)[row]
        flat[generated] -= freq * counts.to(flat.dtype) + pres
    return out


def top_k_top_p_threshold(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Per row, the smallest (unnormalized) probability that top-k and top-p keep; 0 for rows
    without them. Ties with it are kept.

    top-p acts on the distribution renormalized over the top-k survivors, as vLLM does: keep the
    smallest prefix (by descending probability) whose mass reaches top_p, at least one token.
    Nothing is sorted whole: the cut-off is looked for in a `topk` window (64, then 2048), and rows
    whose nucleus is wider still go through `_bucket_cut`, which is O(V)."""
    vocab = probs.shape[1]
    device = probs.device
    threshold = torch.zeros(probs.shape[0], device=device, dtype=probs.dtype)
    # top_k >= vocab is no top-k at all.
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    rows = [i for i, p in enumerate(params) if ks[i] < vocab or p.top_p < 1.0]
    if not rows:
        return threshold
    # Every top-k row's survivors fit in the first window; only top-p may need to widen it.
    first = min(vocab, max([ks[i] for i in rows if ks[i] < vocab] + [_TOP_P_WINDOW]))
    widths = [first] + ([_TOP_P_WIDE_WINDOW] if first < _TOP_P_WIDE_WINDOW <= vocab // 4 else [])
    for width in widths:
        sub = _rows(probs, rows)
        k = torch.tensor([ks[i] for i in rows], device=device)
        # top_p = 1 keeps every top-k survivor, whatever rounding does to the running mass.
        top_p = torch.tensor([params[i].top_p if params[i].top_p < 1.0 else math.inf for i in rows], device=device)
        vals = torch.topk(sub, width, dim=-1).values  # descending
        in_k = torch.arange(width, device=device).unsqueeze(0) < k.unsqueeze(1)
        vals.masked_fill_(~in_k, 0.0)
        # Mass to renormalize by: the top-k survivors (all inside the window), else the whole row.
        k_fits = k <= width
        norm = vals.sum(dim=-1) if bool(k_fits.all()) else torch.where(k_fits, vals.sum(dim=-1), sub.sum(dim=-1))
        mass_before = vals.cumsum(dim=-1).sub_(vals)
        n_keep = (in_k & (mass_before < (top_p * norm).unsqueeze(1))).sum(dim=-1).clamp_min(1)
        decided = (n_keep < width) | k_fits
        cut = vals.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1)
        done = decided.nonzero().flatten().tolist()
        threshold[[rows[j] for j in done]] = cut[done]
        rows = [rows[j] for j in (~decided).nonzero().flatten().tolist()]
        if not rows:
            return threshold
    # Left: top-p rows (top-k off) whose nucleus is wider than the last window.
    sub = _rows(probs, rows)
    top_p = torch.tensor([params[i].top_p for i in rows], device=device, dtype=probs.dtype)
    threshold[rows] = _bucket_cut(sub, top_p * sub.sum(dim=-1))
    return threshold


def _bucket_cut(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Exact top-p cut-off of wide nuclei without sorting the rows (radix-select style): bucket the
    probabilities (in [0, 1]) by the top bits of their float32 pattern, which orders non-negative
    floats like their values (exponent, then 7 mantissa bits: 1/128 octave per bucket), find from
    the buckets' sums the bucket where the running mass reaches `target`, and order only its
    members."""
    device = probs.device
    one = 0x3F800000  # the bits of 1.0f; bucket 0 holds the largest probabilities
    nb = (one >> _BUCKET_SHIFT) + 1
    bits = probs.float().view(torch.int32)
    bucket = torch.sub(one, bits).bitwise_right_shift_(_BUCKET_SHIFT).long()
    mass = torch.zeros(probs.shape[0], nb, device=device, dtype=probs.dtype).scatter_add_(1, bucket, probs)
    ones = torch.ones((), dtype=torch.long, device=device).expand_as(bucket)
    sizes = torch.zeros(probs.shape[0], nb, device=device, dtype=torch.long).scatter_add_(1, bucket, ones)
    cum = mass.cumsum(dim=-1)
    j = (cum < target.unsqueeze(1)).sum(dim=-1).clamp_max(nb - 1)  # first bucket reaching target
    before = torch.where(j > 0, cum.gather(1, (j - 1).clamp_min(0).unsqueeze(1)).squeeze(1), 0.0)
    members = bucket == j.unsqueeze(1)
    count = sizes.gather(1, j.unsqueeze(1)).squeeze(1)
    # Padding (-1 -> 0 mass) sorts last; a row with no member keeps everything (threshold 0).
    vals = torch.topk(torch.where(members, probs, -1.0), max(int(count.max()), 1), dim=-1).values.clamp_min_(0.0)
    mass_before = vals.cumsum(dim=-1).sub_(vals).add_(before.unsqueeze(1))
    in_bucket = torch.arange(vals.shape[1], device=device).unsqueeze(0) < count.unsqueeze(1)
    n_keep = (in_bucket & (mass_before < target.unsqueeze(1))).sum(dim=-1).clamp_min(1)
    return vals.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1)


def _logprob_tensors(
    token_ids: torch.Tensor, rows: list[int], logprobs: torch.Tensor, num_top: list[int]
) -> list[torch.Tensor | None]:
    """On the logits' device, for the rows asking for logprobs: the sampled tokens' raw logprobs, their ranks, and
    the top-n values and ids (None without any top-n), for `_fill_logprobs` once they are on the host."""
    sampled = _rows(token_ids.unsqueeze(1), rows)
    sampled_lp = logprobs.gather(1, sampled)
    ranks = torch.count_nonzero(logprobs > sampled_lp, dim=-1).add_(1)
    max_top = max(num_top)
    top_vals, top_ids = torch.topk(logprobs, max_top, dim=-1) if max_top else (None, None)
    return [sampled_lp.squeeze(1), ranks, top_vals, top_ids]


def _fill_logprobs(
    out: list[SampledToken], rows: list[int], host: list[torch.Tensor | None], num_top: list[int]
) -> None:
    """Raw logprob and rank of each sampled token, and the top-n of its row, from `_logprob_tensors`' tensors
    brought to the host."""
    sampled_lp, ranks, top_vals, top_ids = (None if t is None else t.tolist() for t in host)
    assert sampled_lp is not None and ranks is not None
    for j, i in enumerate(rows):
        tok = out[i]
        tok.logprob, tok.rank = sampled_lp[j], ranks[j]
        top: dict[int, float] = {}
        if top_ids is not None and top_vals is not None:
            top = dict(zip(top_ids[j][: num_top[j]], top_vals[j][: num_top[j]]))
        top.setdefault(tok.token_id, tok.logprob)
        tok.top_logprobs = top


def prompt_logprobs(logits: torch.Tensor, next_token_ids: Sequence[int], num_top: int) -> list[dict[int, Logprob]]:
    """Logprobs of prompt tokens: row j of `logits` (position j) judges `next_token_ids[j]`
    (the token at position j + 1). Each dict holds that token first (with its rank), then the top
    `num_top` tokens. Works on any chunk of positions, so chunked prefill can call it per chunk;
    the caller prepends None for the first prompt token. `decoded_token` is left to the caller."""
    if logits.shape[0] != len(next_token_ids):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(next_token_ids)} next tokens")
    if not next_token_ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(next_token_ids), device=lp.device).unsqueeze(1)
    tok_lp = lp.gather(1, ids)
    ranks = torch.count_nonzero(lp > tok_lp, dim=-1).add_(1).tolist()
    tok_lp_list = tok_lp.squeeze(1).tolist()
    if num_top:
        top_vals, top_ids = torch.topk(lp, num_top, dim=-1)
        tv, ti = top_vals.tolist(), top_ids.tolist()
    result = []
    for j, tid in enumerate(next_token_ids):
        entry = {tid: Logprob(tok_lp_list[j], ranks[j])}
        if num_top:
            for r, (t, v) in enumerate(zip(ti[j], tv[j]), start=1):
                entry.setdefault(t, Logprob(v, r))
        result.append(entry)
    return result
