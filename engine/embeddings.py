"""Embeddings: the final hidden state of a prompt's last token (`SamplingParams.embed`), what
/v1/embeddings returns (last-token pooling, as vLLM pools decoder-only models such as
Qwen3-Embedding).

An embedding request is an ordinary request of one token: its prompt runs through the paged
cache like any other (prefix cache, chunked prefill, preemption, batched with generation), and
the step that computes its last prompt token, which samples its one token, is the step that
finishes it. That token's row is a logits row, so its hidden state is the final norm's output
at that row: a forward hook on the model's final norm keeps those rows in the steps that have
any, and their final deltas carry them out. The sampled token itself is discarded by the server.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pagedserve.engine.outputs import RequestDelta
from pagedserve.scheduler import SchedulerOutput


def normalized(values: Sequence[float]) -> list[float]:
    """`values` scaled to unit L2 norm (left as they are if all zero), as vLLM's pooler returns
    a decoder model's embeddings by default."""
    norm = math.sqrt(math.fsum(value * value for value in values)) or 1.0
    return [value / norm for value in values]


def final_norm(model: nn.Module) -> nn.Module | None:
    """The norm whose output the LM head reads (`model.model.norm` in Hugging Face's decoder
    models), or None where the model has none by that name."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    return norm if isinstance(norm, nn.Module) else None


class FinalHiddenStates:
    """Taps the final norm of `model` for the rows of the sequences a step embeds."""

    def __init__(self, model: nn.Module) -> None:
        norm = final_norm(model)
        self.available = norm is not None
        # Per armed step: the final norm's output row of each sequence to embed (None: not
        # armed), and the kept states until the step's deltas take them.
        self._rows: dict[str, int] | None = None
        self._all_tokens = False  # the norm sees every token (else only the logits rows)
        self._logits_indices: Tensor | None = None
        self._states: dict[tuple[str, int], Tensor] = {}  # (request id, choice index) ->
        if norm is not None:
            norm.register_forward_hook(self._keep)

    def arm(
        self,
        plan: SchedulerOutput,
        sequence_ids: Collection[str],
        logits_indices: Tensor,
        all_tokens: bool,
    ) -> None:
        """Before a forward: keep the rows of `sequence_ids` (sampling sequences of `plan`).
        `all_tokens`: the norm runs over every token of the step, not only the logits rows."""
        if not sequence_ids:
            self._rows = None
            return
        rows, row = {}, 0
        for scheduled in plan.requests:  # logits rows: each sampling sequence's, then drafts'
            if scheduled.needs_sample:
                if scheduled.sequence_id in sequence_ids:
                    rows[scheduled.sequence_id] = row
                row += 1 + len(scheduled.draft_token_ids)
        self._rows, self._all_tokens, self._logits_indices = rows, all_tokens, logits_indices

    def disarm(self) -> None:
        self._rows = None

    def _keep(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if self._rows is None:
            return
        tensor = output[0] if isinstance(output, tuple) else output
        hidden = tensor.reshape(-1, tensor.shape[-1])
        for sequence_id, row in self._rows.items():
            index = int(self._logits_indices[row]) if self._all_tokens else row
            # The sequence id is "<request id>#<choice index>" (engine/llm_engine.py).
            request_id, _, choice = sequence_id.rpartition("#")
            state = hidden[index].detach().to(torch.float32, copy=True).cpu()
            self._states[(request_id, int(choice))] = state
        self._rows = None

    def attach(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """The step's deltas, each final one of an embedded sequence carrying its state. Every
        such sequence finishes in the step that computed it (one token): nothing is kept after."""
        if not self._states:
            return deltas
        states, self._states = self._states, {}
        return [
            dataclasses.replace(delta, embedding=tuple(state.tolist()))
            if delta.finished
            and delta.error is None
            and (state := states.get((delta.request_id, delta.index))) is not None
            else delta
            for delta in deltas
        ]
