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
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from pagedserve.configs import ModelConfig
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.fused_attention import FusedAttention
from pagedserve.engine.fused_mlp import FusedMLP
from pagedserve.engine.lora_adapter import LoRADelta, LoRAError, load_adapter

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
    """The served adapters, numbered 1.. in the order given, wrapped into `model`."""

    def __init__(self, model: nn.Module, modules: dict[str, Path], max_rank: int) -> None:
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        self.batch = LoRABatch(device)
        self.index = {name: i for i, name in enumerate(modules, start=1)}
        self.ranks: dict[str, int] = {}  # the weights live in the wrappers only
        for name, path in modules.items():
            adapter = load_adapter(name, Path(path), max_rank, dtype)
            for module, delta in adapter.deltas.items():
                layer, part = self._layer(model, module)
                moved = LoRADelta(delta.a.to(device), delta.b.to(device))
                layer.add(self.index[name], part, moved)
            self.ranks[name] = adapter.rank

    def set_step(self, rows: Sequence[tuple[str | None, int]], kept: Tensor | None) -> None:
        """Before a forward: each request of the step as (its adapter or None, its number of
        rows); `kept`: the rows the last layer keeps (engine/kept_rows.py), if any."""
        if not any(lora for lora, _ in rows):  # a base-model step: no row map to build
            self.batch.clear()
            return
        indices = torch.tensor([self.index[lora] if lora else 0 for lora, _ in rows])
        token_adapters = torch.repeat_interleave(indices, torch.tensor([n for _, n in rows]))
        self.batch.set(token_adapters, None if kept is None else kept.cpu())

    def _layer(self, model: nn.Module, module: str) -> tuple[LoRALinear, int]:
        """The wrapper computing `module` (wrapping it on first use), and the part it is there."""
        parent_path, _, leaf = module.rpartition(".")
        try:
            parent = model.get_submodule(parent_path)
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
    if name is not None and (adapters is None or name not in adapters.index):
        served = ", ".join(adapters.index) if adapters else "none (--lora-modules)"
        raise InvalidRequestError(f"no LoRA adapter {name!r}; served: {served}", "lora")


def load_lora_adapters(config: ModelConfig, model: nn.Module) -> LoRAAdapters | None:
    """The adapters `config` serves, wrapped into `model`; None without any."""
    if any(isinstance(module, LoRALinear) for module in model.modules()):
        # Its wrappers follow another engine's steps: they would add terms to the wrong rows.
        raise LoRAError("this model object already serves another engine's LoRA adapters")
    if not config.lora_adapters:
        return None
    modules = {name: Path(path) for name, path in config.lora_adapters.items()}
    adapters = LoRAAdapters(model, modules, config.max_lora_rank)
    ranks = adapters.ranks
    logger.info("LoRA adapters: %s", ", ".join(f"{name} (rank {ranks[name]})" for name in ranks))
    return adapters


def _part_slices(parent: nn.Module, attribute: str, out_features: int) -> list[tuple[int, int]]:
    """The output columns of each part of a projection the CPU swaps fused."""
    sizes = parent.split_sizes if attribute == "qkv_proj" else [out_features // 2] * 2
    bounds = [0, *itertools.accumulate(sizes)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))
