"""`Sampler`: picks each sequence's next token from its logits row, honouring its SamplingParams;
and scores prompt rows (prompt logprobs) with the same log-softmax.

Rows are independent: a seeded sequence draws from its own generator, so its output does not
depend on what else is in the batch, and an error in one row fails only that sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import Tensor

from pagedserve.configs import SamplingParams
from pagedserve.engine.outputs import TokenLogprob
from pagedserve.scheduler import ModelRunnerOutput


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence this step."""

    sequence_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None
    generator: torch.Generator | None = None  # set for seeded sequences
    banned_token_ids: list[int] = field(default_factory=list)  # EOS/stop ids while below min_tokens

    @property
    def needs_processing(self) -> bool:
        """False when plain argmax over the raw logits is the answer."""
        params = self.params
        return not (
            params.is_greedy
            and params.repetition_penalty == 1.0
            and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0
            and not params.logit_bias
            and params.allowed_token_ids is None
            and not params.bad_words_token_ids
            and not self.banned_token_ids
            and params.logprobs is None
        )


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_id: int
    logprob: TokenLogprob | None


@dataclass(slots=True)
class SampledBatch:
    """One step's sampling results split by outcome, keyed by sequence id."""

    token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob | None] = field(default_factory=dict)
    errors: dict[str, Exception] = field(default_factory=dict)  # these sequences have no token
    # Speculation: the drafts a sequence accepted (they precede its `token_ids` entry), and
    # their logprobs in order; empty without speculation
    accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)

    def runner_output(self) -> ModelRunnerOutput:
        """What the scheduler's update needs: each sequence's tokens (no errors)."""
        return ModelRunnerOutput(self.token_ids, self.accepted_draft_ids)

    @classmethod
    def split(
        cls, rows: list[SamplingRow], results: list[SampleResult | Exception]
    ) -> SampledBatch:
        return cls.split_runs(rows, [r if isinstance(r, Exception) else [r] for r in results])

    @classmethod
    def split_runs(
        cls, rows: list[SamplingRow], runs: list[list[SampleResult] | Exception]
    ) -> SampledBatch:
        """From one run of tokens per row: accepted drafts, then the sampled token."""
        batch = cls()
        for row, run in zip(rows, runs, strict=True):
            if isinstance(run, Exception):
                batch.errors[row.sequence_id] = run
                continue
            *accepted, last = run
            batch.token_ids[row.sequence_id] = last.token_id
            batch.logprobs[row.sequence_id] = last.logprob
            if accepted:
                batch.accepted_draft_ids[row.sequence_id] = [r.token_id for r in accepted]
                batch.draft_logprobs[row.sequence_id] = [r.logprob for r in accepted]
        return batch


class Sampler:
    def __init__(
        self,
        seed: int = 0,
        device: torch.device | str = "cpu",
        cpu_kernel: ModuleType | None = None,
    ) -> None:
        # For unseeded sequences; on the logits' device, as exponential_ requires.
        self._generator = torch.Generator(device=device).manual_seed(seed)
        # The CPU extension (cache/attention/cpu.py), whose argmax_rows greedy rows take.
        self.cpu_kernel = cpu_kernel

    def sample(self, logits: Tensor, rows: list[SamplingRow]) -> list[SampleResult | Exception]:
        """logits: [num_rows, vocab_size] float32, one row per entry of `rows` (same order)."""
        if not any(row.needs_processing for row in rows):
            return [SampleResult(t, None) for t in greedy_token_ids(logits, self.cpu_kernel)]
        results: list[SampleResult | Exception] = []
        for row_logits, row in zip(logits, rows, strict=True):
            try:
                results.append(self._sample_row(row_logits, row))
            except Exception as error:  # noqa: BLE001 - one sequence fails, the batch goes on
                results.append(error)
        return results

    def _sample_row(self, logits: Tensor, row: SamplingRow) -> SampleResult:
        params = row.params
        raw_logprobs = torch.log_softmax(logits, dim=-1) if params.logprobs is not None else None
        logits = self._apply_penalties(logits.clone(), row)
        if params.is_greedy:
            token_id = int(logits.argmax())
        else:
            probs = _filtered_probs(logits / params.temperature, params)
            # Exponential race == multinomial draw, with a fixed amount of randomness per step.
            noise = torch.empty_like(probs).exponential_(generator=row.generator or self._generator)
            token_id = int((probs / noise).argmax())
        logprob = None
        if raw_logprobs is not None:
            alternatives = top_alternatives(raw_logprobs, params.logprobs)
            logprob = TokenLogprob(token_id, float(raw_logprobs[token_id]), alternatives)
        return SampleResult(token_id, logprob)

    @staticmethod
    def _apply_penalties(logits: Tensor, row: SamplingRow) -> Tensor:
        params = row.params
        vocab_size = logits.shape[0]
        _exclude(logits, row)
        if params.logit_bias:
            ids = [i for i in params.logit_bias if i < vocab_size]
            logits[ids] += torch.tensor([params.logit_bias[i] for i in ids], dtype=logits.dtype)
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)))
            selected = logits[seen]
            penalty = params.repetition_penalty
            # A masked (-inf) logit stays -inf: a penalty below float32's range is 0 there,
            # and -inf * 0 would be NaN, which sampling then picks.
            scaled = torch.where(selected == float("-inf"), selected, selected * penalty)
            logits[seen] = torch.where(selected > 0, selected / penalty, scaled)
        if (params.presence_penalty or params.frequency_penalty) and row.output_token_ids:
            counts = torch.bincount(torch.tensor(row.output_token_ids), minlength=vocab_size)[
                :vocab_size
            ]
            logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        if row.banned_token_ids:  # EOS / stop ids while min_tokens is unmet
            before = logits[row.banned_token_ids]
            logits[row.banned_token_ids] = float("-inf")
            if not torch.isfinite(logits).any():
                # Nothing else is allowed: a grammar that can only end here. Its end wins over
                # min_tokens (the output is complete), rather than a step with no token at all.
                logits[row.banned_token_ids] = before
        excludes = params.allowed_token_ids is not None or params.bad_words_token_ids
        if excludes and not (logits > float("-inf")).any():
            raise NoTokenLeftError(
                "no token is left to sample: allowed_token_ids, bad_words and the output "
                "constraint exclude every one"
            )
        return logits


class NoTokenLeftError(ValueError):
    """A row whose request's exclusions (with its grammar's mask) leave no token to sample."""


def _exclude(logits: Tensor, row: SamplingRow) -> None:
    """-inf for what the request rules out: every token but `allowed_token_ids`, and the last
    token of each bad word whose other tokens end the output."""
    params = row.params
    if params.allowed_token_ids is not None:
        allowed = torch.tensor(params.allowed_token_ids)
        kept = logits[allowed]
        logits.fill_(float("-inf"))
        logits[allowed] = kept
    for word in params.bad_words_token_ids:
        *start, last = word
        if not start or tuple(row.output_token_ids[-len(start) :]) == tuple(start):
            logits[last] = float("-inf")


def top_alternatives(logprobs: Tensor, num_top: int) -> tuple[tuple[int, float], ...]:
    """The `num_top` most likely (token id, logprob) of one row, best first; tied values in
    token-id order, as greedy breaks ties, so a greedy token tied for the top is listed first
    (ties are common in bfloat16, and `topk` leaves their order open)."""
    if not num_top:
        return ()
    top = logprobs.topk(num_top)
    pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
    return tuple(sorted(pairs, key=lambda pair: (-pair[1], pair[0])))


def takes_only_argmax(
    rows: list[SamplingRow], matchers: Sequence[object | None], num_logits_rows: int
) -> bool:
    """Whether the step takes only argmaxes (greedy rows with nothing to apply, no grammar, draft
    or prompt-logprob rows): its logits stay in the model's dtype, which argmax_rows reads exactly
    (widening 64 x 49,152 bfloat16 logits took ~0.9 ms a decode step). Others compute in float32."""
    return (
        num_logits_rows == len(rows)
        and all(matcher is None for matcher in matchers)
        and not any(row.needs_processing for row in rows)
    )


def greedy_token_ids(logits: Tensor, cpu_kernel: ModuleType | None = None) -> list[int]:
    """Each row's argmax (the first of tied maxima, as `argmax`).

    On the CPU, the extension's `argmax_rows` where it is loaded: a maximum pass, then a scan for
    its first position (greedy.cpp); 64 x 49k float32 logits took 0.40 ms against 2.4 ms for
    `max(dim=-1)`, which tracks an index beside every value (2-core Zen 4). Elsewhere
    `max(dim=-1)`, which computes argmax's indices in about a third of argmax's time."""
    if (
        cpu_kernel is not None
        and logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.is_contiguous()
        and logits.shape[1] > 0
    ):
        return cpu_kernel.argmax_rows(logits).tolist()
    return logits.max(dim=-1).indices.tolist()


def score_prompt_rows(
    logits: Tensor, target_token_ids: list[int], num_top: list[int]
) -> list[TokenLogprob]:
    """Logprob, rank and top alternatives of each row's target token (the next prompt token).

    logits: [num_rows, vocab_size] float32, raw (the model's own distribution: no penalties,
    as the prompt was given, not sampled). Only the small per-row results leave this function.
    """
    if not target_token_ids:
        return []
    logprobs = torch.log_softmax(logits, dim=-1)  # [num_rows, vocab_size]
    targets = torch.tensor(target_token_ids, device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])  # [num_rows, 1]
    # An int32 sum of the comparison: over twice as fast as the default int64 one (measured).
    ranks = ((logprobs > chosen).sum(dim=1, dtype=torch.int32) + 1).tolist()
    max_top = max(num_top)
    top_ids: list[list[int]] = [[] for _ in target_token_ids]
    top_values: list[list[float]] = [[] for _ in target_token_ids]
    if max_top:
        top = logprobs.topk(max_top, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    return [
        TokenLogprob(
            token_id,
            value,
            tuple(zip(ids[:k], values[:k], strict=True)),
            rank,
        )
        for token_id, value, ids, values, k, rank in zip(
            target_token_ids,
            chosen[:, 0].tolist(),
            top_ids,
            top_values,
            num_top,
            ranks,
            strict=True,
        )
    ]


def _filtered_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Softmax restricted by top-k, top-p (nucleus) and min-p. The most likely token always stays:
    every filter keeps it, so no setting can leave a row with nothing to draw."""
    # A logit that overflowed to +inf (a repetition penalty near 0 divides, as does a temperature
    # near GREEDY_TEMPERATURE) would turn the softmax into NaN: such tokens share the probability.
    logits = logits.clamp(max=torch.finfo(logits.dtype).max)
    if 0 < params.top_k < logits.shape[0]:
        kth_value = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth_value, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # drop a token when the tokens strictly more likely already reach top_p
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= params.top_p
        drop[0] = False  # a top_p below float32's smallest subnormal rounds to 0 in the comparison
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs
