"""Replace submodules of a loaded Hugging Face model in place (the model classes stay HF's)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def is_bfloat16_cpu_model(model: nn.Module) -> bool:
    """Whether the model's (first) parameters are bfloat16 on the CPU: where the swaps apply."""
    parameter = next(model.parameters(), None)
    return (
        parameter is not None
        and parameter.device.type == "cpu"
        and parameter.dtype == torch.bfloat16
    )


def swap_children(model: nn.Module, replace: Callable[[str, nn.Module], nn.Module | None]) -> int:
    """Set each submodule to `replace(name, submodule)` where that is not None; returns how many.

    `replace` sees every submodule once, by its attribute name in its parent.
    """
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            replacement = replace(name, child)
            if replacement is not None:
                setattr(parent, name, replacement)
                swapped += 1
    return swapped
