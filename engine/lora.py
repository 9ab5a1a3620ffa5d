"""LoRA adapters served beside the base model (vLLM's `--enable-lora --lora-modules name=path`).

An adapter (a PEFT folder, read by engine/lora_adapter.py) adds to some of the model's linear
layers a low-rank term: y = x W^T + s (x A^T) B^T, A [r, in], B [out, r],
s = alpha / r (alpha / sqrt(r) with rsLoRA). The weights are never merged: one batch mixes
requests of the base model and of several adapters, each token's rows getting its own
request's term.

Each targeted layer is wrapped, after the CPU swaps, by a `LoRALinear` around whatever computes
it then (HF's `nn.Linear`, or a fused q/k/v or gate/up projection, whose output columns are the
parts side by side: one slice per part). Before each forward the model runner tells the shared
`LoRABatch` which adapter each of the step's token rows runs (`ScheduledRequest.lora`); a wrapper
then adds each adapter's term to its rows. The last decoder layer may run its output projections
on the logits rows only (engine/kept_rows.py): the batch knows those rows' adapters too.

Adapters may also be loaded and unloaded while serving (`--allow-runtime-lora-updating`, vLLM's
/v1/load_lora_adapter): on the engine thread, between two steps.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from pagedserve.configs import ModelConfig
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.fused_attention import FusedAttention
from pagedserve.engine.fused_mlp import FusedMLP
from pagedserve.engine.lora_adapter import LoRADelta, LoRAError, load_adapter
from pagedserve.scheduler import Request

logger = logging.getLogger(__name__)

# Projections that the CPU swaps fuse: the fused module's attribute, and each part's slice.
FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LoRABatch:
    """Which adapter each row of the step runs: the groups of rows of each adapter (index >= 1;
    0 is the base model, which adds nothing), for all token rows and for the kept logits rows."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._groups: dict[int, list[tuple[int, Tensor]]] = {}  # row count -> groups

    def set(self, token_adapters: Tensor, kept_rows: Tensor | None) -> None:
        """`token_adapters`: each token row's adapter; `kept_rows`: the rows the last layer keeps.
        A layer tells the two sets apart by its row count: kept rows are always fewer (a step
        that would keep every row keeps none, engine/kept_rows.py)."""
        self._groups = {token_adapters.numel(): _groups(token_adapters, self.device)}
        if kept_rows is not None:
            if kept_rows.numel() >= token_adapters.numel():
                raise RuntimeError("kept rows must be fewer than the step's rows")
            kept = token_adapters[kept_rows]
            self._groups[kept_rows.numel()] = _groups(kept, self.device)

    def clear(self) -> None:
        """A step in which no row runs an adapter."""
        self._groups = {}

    def groups_for(self, num_rows: int) -> list[tuple[int, Tensor]]:
        if not any(self._groups.values()):  # no adapter runs this step
            return []
        if num_rows not in self._groups:
            raise RuntimeError(f"a LoRA layer got {num_rows} rows; the step has no such row set")
        return self._groups[num_rows]


def _groups(adapters: Tensor, device: torch.device) -> list[tuple[int, Tensor]]:
    return [
        (int(index), torch.nonzero(adapters == index).flatten().to(device))
        for index in torch.unique(adapters).tolist()
        if index != 0
    ]


class LoRALinear(nn.Module):
    """`base`'s output plus, on each adapter's rows, that adapter's terms for the parts it targets
    (`slices`: the parts' output columns)."""

    def __init__(self, base: nn.Module, batch: LoRABatch, slices: Sequence[tuple[int, int]]):
        super().__init__()
        self.base = base
        self.batch = batch
        self.slices = tuple(slices)
        self.deltas: dict[int, list[LoRADelta | None]] = {}  # adapter index -> per slice
        # adapter index -> its parts' A stacked [sum of ranks, in] (one matmul for all parts),
        # and per part (output columns, its rows of the product, B)
        self._stacked: dict[int, tuple[Tensor, list[tuple[int, int, int, int, Tensor]]]] = {}

    def add(self, adapter: int, part: int, delta: LoRADelta) -> None:
        if part >= len(self.slices):  # q_proj of a fused layer another adapter took whole
            raise LoRAError("an adapter targets a part of a projection another targets whole")
        start, end = self.slices[part]
        if delta.b.shape[0] != end - start:
            raise LoRAError(f"lora_B has {delta.b.shape[0]} rows; the layer has {end - start}")
        if delta.a.shape[1] != self.base.in_features:
            raise LoRAError(
                f"lora_A has {delta.a.shape[1]} columns; the layer has {self.base.in_features}"
            )
        parts = self.deltas.setdefault(adapter, [None] * len(self.slices))
        parts[part] = delta
        present = [(bounds, d) for bounds, d in zip(self.slices, parts, strict=True) if d]
        ranks = [0, *itertools.accumulate(d.a.shape[0] for _, d in present)]
        pieces = [
            (start, end, low, high, d.b)
            for ((start, end), d), low, high in zip(present, ranks[:-1], ranks[1:], strict=True)
        ]
        self._stacked[adapter] = (torch.cat([d.a for _, d in present]), pieces)

    def remove(self, adapter: int) -> None:
        self.deltas.pop(adapter, None)
        self._stacked.pop(adapter, None)

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        groups = self.batch.groups_for(x.shape[:-1].numel())
        if not groups:
            return y
        rows_in, rows_out = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        for adapter, rows in groups:
            if adapter not in self._stacked:
                continue
            a, pieces = self._stacked[adapter]
            every_row = rows.numel() == rows_in.shape[0]  # the whole step runs this adapter
            low_rank = (rows_in if every_row else rows_in.index_select(0, rows)) @ a.T
            for start, end, low, high, b in pieces:
                term = low_rank[:, low:high] @ b.T
                if every_row:
                    rows_out[:, start:end] += term
                else:
                    rows_out[rows, start:end] += term
        return y

    def extra_repr(self) -> str:
        return f"slices={list(self.slices)}, adapters={sorted(self.deltas)}"


class LoRAAdapters:
    """The served adapters, wrapped into `model`. Each load gets a number never used again (1, 2,
    ...; 0 is the base model), and a request is bound to its adapter's number when it is queued
    (`resolve`): an adapter unloaded or replaced at run time keeps serving the requests bound to
    it until the last one ends (`drop_retired`), and their prefix-cache salt (their number,
    scheduler/request.py) never matches blocks another load computed."""

    def __init__(self, model: nn.Module, max_rank: int) -> None:
        self.model, self.max_rank = model, max_rank
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.batch = LoRABatch(self.device)
        self.numbers: dict[str, int] = {}  # served name -> its load's number (engine thread)
        # served name -> folder, for other threads (/v1/models): replaced whole, never changed
        self.paths: dict[str, str] = {}
        self.ranks: dict[str, int] = {}  # the weights live in the wrappers only
        self.retiring: set[int] = set()  # unloaded or replaced, perhaps still running requests
        self._last_number = 0

    def load(self, name: str, path: Path | str, replace: bool = False) -> None:
        """Serve the PEFT folder `path` as `name` (a new load replaces the old one's number only
        with `replace`); raises LoRAError, serving what it served before, if it cannot."""
        if name in self.numbers and not replace:
            raise LoRAError(f"LoRA adapter {name!r} is already loaded")
        adapter = load_adapter(name, Path(path), self.max_rank, self.dtype)
        self._last_number += 1
        number = self._last_number
        try:
            for module, delta in adapter.deltas.items():
                layer, part = self._layer(module)
                layer.add(number, part, LoRADelta(delta.a.to(self.device), delta.b.to(self.device)))
        except BaseException:  # also out of memory: no term of a half-made load stays behind
            self._drop(number)
            raise
        if name in self.numbers:
            self.retiring.add(self.numbers[name])
        self.numbers[name], self.ranks[name] = number, adapter.rank
        self.paths = {**self.paths, name: str(path)}

    def unload(self, name: str) -> None:
        """Stop serving `name` to new requests; raises KeyError if it is not served."""
        self.retiring.add(self.numbers.pop(name))
        del self.ranks[name]
        self.paths = {other: path for other, path in self.paths.items() if other != name}

    def resolve(self, name: str | None) -> int:
        """The number of the load a new request of adapter `name` runs (0: the base model);
        raises InvalidRequestError if `name` is no longer served (unloaded since validation)."""
        if name is None:
            return 0
        if name not in self.numbers:
            raise InvalidRequestError(f"LoRA adapter {name!r} has been unloaded", "lora")
        return self.numbers[name]

    def drop_retired(self, requests: Iterable[Request]) -> None:
        """Free the terms of every retired load that none of `requests` (all unfinished) runs."""
        if not self.retiring:
            return
        unused = self.retiring - {request.lora for request in requests}
        for number in unused:
            self._drop(number)
        self.retiring -= unused

    def set_step(self, rows: Sequence[tuple[int, int]], kept: Tensor | None) -> None:
        """Before a forward: each request of the step as (its load's number, 0 for the base
        model; its number of rows); `kept`: the rows the last layer keeps
        (engine/kept_rows.py), if any."""
        if not any(number for number, _ in rows):  # a base-model step: no row map to build
            self.batch.clear()
            return
        numbers = torch.tensor([number for number, _ in rows])
        token_adapters = torch.repeat_interleave(numbers, torch.tensor([n for _, n in rows]))
        self.batch.set(token_adapters, None if kept is None else kept.cpu())

    def _drop(self, number: int) -> None:
        for module in self.model.modules():
            if isinstance(module, LoRALinear):
                module.remove(number)

    def _layer(self, module: str) -> tuple[LoRALinear, int]:
        """The wrapper computing `module` (wrapping it on first use), and the part it is there."""
        parent_path, _, leaf = module.rpartition(".")
        try:
            parent = self.model.get_submodule(parent_path)
        except AttributeError:
            raise LoRAError(f"LoRA target {module} is not in the model") from None
        # A projection the CPU swaps fused is a part (an output slice) of the fused one; a
        # model's own fused projection (Phi-3's) is one slice, and has no parts to target.
        fused = isinstance(parent, (FusedAttention, FusedMLP)) and leaf in FUSED_PARTS
        attribute, part = FUSED_PARTS[leaf] if fused else (leaf, 0)
        current = getattr(parent, attribute, None)
        if isinstance(current, LoRALinear):
            return current, part
        if not isinstance(current, nn.Module) or not hasattr(current, "out_features"):
            raise LoRAError(f"LoRA target {module} is not a linear layer of the model")
        width = current.out_features
        slices = _part_slices(parent, attribute, width) if fused else [(0, width)]
        wrapper = LoRALinear(current, self.batch, slices)
        setattr(parent, attribute, wrapper)
        return wrapper, part


def check_lora(name: str | None, adapters: LoRAAdapters | None) -> None:
    """Raises InvalidRequestError (param `lora`) unless `name` is None or a served adapter."""
    if name is not None and (adapters is None or name not in adapters.paths):
        served = ", ".join(adapters.paths) if adapters else "none (--enable-lora)"
        raise InvalidRequestError(f"no LoRA adapter {name!r}; served: {served or 'none'}", "lora")


def load_lora_adapters(config: ModelConfig, model: nn.Module) -> LoRAAdapters | None:
    """The adapters `config` serves, wrapped into `model` (none yet where adapters are only
    loaded at run time); None without --enable-lora."""
    if any(isinstance(module, LoRALinear) for module in model.modules()):
        # Its wrappers follow another engine's steps: they would add terms to the wrong rows.
        raise LoRAError("this model object already serves another engine's LoRA adapters")
    if not config.enable_lora:
        return None
    adapters = LoRAAdapters(model, config.max_lora_rank)
    for name, path in config.lora_adapters.items():
        adapters.load(name, Path(path))
    served = ", ".join(f"{name} (rank {rank})" for name, rank in adapters.ranks.items())
    logger.info("LoRA adapters: %s", served or "none yet")
    return adapters


def _part_slices(parent: nn.Module, attribute: str, out_features: int) -> list[tuple[int, int]]:
    """The output columns of each part of a projection the CPU swaps fused."""
    sizes = parent.split_sizes if attribute == "qkv_proj" else [out_features // 2] * 2
    bounds = [0, *itertools.accumulate(sizes)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))
