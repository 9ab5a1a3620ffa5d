"""`RejectionSampler`: verifies a step's n-gram drafts so that output is exactly what sampling
without them would give (token-identical when greedy, the same distribution otherwise).

A request with K drafts has K + 1 logits rows: row j is the model's next-token distribution after
the context plus drafts[:j]. Position by position, with that position's own sampling state (its
history for the penalties, min_tokens' bans):
- greedy: draft j is accepted iff it is the argmax; the first mismatch's argmax (or, all
  accepted, row K's argmax: the bonus token) ends the run;
- random: an n-gram draft is deterministic (q = one-hot), so speculative sampling's rule
  "accept with min(1, p/q)" accepts draft j with probability p(draft), and on rejection draws from
  the residual max(p - q, 0), which is p with the draft zeroed. Either way the emitted token is
  distributed as p. All accepted, row K samples the bonus token from its p.
Rows without drafts go to the plain `Sampler` unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from pagedserve.engine.outputs import TokenLogprob
from pagedserve.engine.sampler import (
    Sampler,
    SampleResult,
    SamplingRow,
    _filtered_probs,
    greedy_token_ids,
    top_alternatives,
)


class RejectionSampler:
    def __init__(self, sampler: Sampler, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.sampler = sampler
        # Acceptance draws of unseeded requests (seeded ones use their own generator).
        self._generator = torch.Generator(device=device).manual_seed(seed + 1)

    def verify(
        self, logits: Tensor, rows: list[SamplingRow], drafts: list[tuple[int, ...]]
    ) -> list[list[SampleResult] | Exception]:
        """logits: [sum(1 + len(d)), vocab] in `rows` order; one run of emitted tokens per row."""
        offsets, offset = [], 0
        for row_drafts in drafts:
            offsets.append(offset)
            offset += 1 + len(row_drafts)
        plain = [i for i, row_drafts in enumerate(drafts) if not row_drafts]
        runs: list[list[SampleResult] | Exception] = [[] for _ in rows]
        if plain:
            results = self.sampler.sample(
                logits[[offsets[i] for i in plain]], [rows[i] for i in plain]
            )
            for i, result in zip(plain, results, strict=True):
                runs[i] = result if isinstance(result, Exception) else [result]
        for i, row_drafts in enumerate(drafts):
            if not row_drafts:
                continue
            try:
                runs[i] = self._verify_row(
                    logits[offsets[i] : offsets[i] + 1 + len(row_drafts)], rows[i], row_drafts
                )
            except Exception as error:  # noqa: BLE001 - one request fails, the batch goes on
                runs[i] = error
        return runs

    def _verify_row(
        self, logits: Tensor, row: SamplingRow, drafts: tuple[int, ...]
    ) -> list[SampleResult]:
        if not row.needs_processing:  # plain argmax (bans only shrink as the output grows)
            run = []
            for j, token_id in enumerate(greedy_token_ids(logits, self.sampler.cpu_kernel)):
                run.append(SampleResult(token_id, None))
                if j == len(drafts) or token_id != drafts[j]:
                    break
            return run
        run = []
        for j in range(len(drafts) + 1):
            draft = drafts[j] if j < len(drafts) else None
            token_id = self._sample_position(logits[j], _row_at(row, drafts[:j]), draft)
            run.append(SampleResult(token_id, _logprob(logits[j], token_id, row)))
            if token_id != draft:
                break
        return run

    def _sample_position(self, logits: Tensor, row: SamplingRow, draft: int | None) -> int:
        """The token at one position: `draft` if accepted, else a draw from the residual."""
        params = row.params
        logits = Sampler._apply_penalties(logits.clone(), row)
        if params.is_greedy:
            return int(logits.argmax())
        probs = _filtered_probs(logits / params.temperature, params)
        probs = probs / probs.sum()  # top-p / min-p zero tokens without renormalising
        generator = row.generator or self._generator
        if draft is not None:
            if float(torch.rand((), generator=generator, device=probs.device)) < float(
                probs[draft]
            ):
                return draft
            probs = probs.clone()
            probs[draft] = 0.0  # the residual max(p - onehot(draft), 0), unnormalised
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return int((probs / noise).argmax())


def _row_at(row: SamplingRow, drafts_before: tuple[int, ...]) -> SamplingRow:
    """`row`'s sampling state at the position after `drafts_before` were accepted."""
    if not drafts_before:
        return row
    num_output = len(row.output_token_ids) + len(drafts_before)
    return dataclasses.replace(
        row,
        output_token_ids=[*row.output_token_ids, *drafts_before],
        banned_token_ids=row.banned_token_ids if num_output < row.params.min_tokens else [],
    )


def _logprob(logits: Tensor, token_id: int, row: SamplingRow) -> TokenLogprob | None:
    """As the Sampler reports it: from the raw logits, with the top alternatives if asked."""
    num_top = row.params.logprobs
    if num_top is None:
        return None
    raw = torch.log_softmax(logits, dim=-1)
    return TokenLogprob(token_id, float(raw[token_id]), top_alternatives(raw, num_top))
