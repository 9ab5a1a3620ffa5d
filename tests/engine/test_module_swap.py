"""`swap_verified`, the mechanism behind every CPU fast path: an eligible submodule is replaced
only where the replacement agrees with it on the probe; one that disagrees is kept, and logged."""

from __future__ import annotations

import logging

from torch import nn

from pagedserve.engine.module_swap import swap_verified


def test_a_replacement_that_disagrees_leaves_the_original_and_is_logged(caplog):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    first, relu, second = model

    def replacement_for(child: nn.Module) -> nn.Module | None:
        return nn.Identity() if isinstance(child, nn.Linear) else None  # ReLU: not eligible

    def agrees(original: nn.Module, replacement: nn.Module) -> bool:
        return original is first  # pretend only the first linear's probe matched

    with caplog.at_level(logging.WARNING):
        assert swap_verified(model, replacement_for, agrees, "the test swap") == 1
    assert isinstance(model[0], nn.Identity) and model[1] is relu and model[2] is second
    assert "the test swap disagrees with 2; left as it is" in caplog.text
