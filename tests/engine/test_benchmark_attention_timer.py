"""The benchmarks' attention timer (benchmarks/attention_timer.py): every store and attention call
of a step is timed, and the CPU backend's decoder layers still call its kernel directly (a wrapped
backend would send them to the slower module path, so the benchmarks would time another engine)."""

from __future__ import annotations

import pytest

from pagedserve.benchmarks.attention_timer import time_attention
from pagedserve.cache.attention.cpu import CpuPagedAttention
from pagedserve.configs import SamplingParams
from pagedserve.engine.direct_layer import DirectDecoderLayer, use_direct_layers
from tests.engine.conftest import make_engine
from tests.engine.test_direct_layer import _fused

PROMPT = [3, 4, 5, 6, 7, 8, 9]
STEPS = 3  # the prompt's step, then two decode steps


def _run(engine) -> None:
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=STEPS, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_every_store_and_attention_call_is_timed_and_direct_layers_stay_direct(
    backend, default_tokenizer, monkeypatch
):
    loaded = _fused("llama-gqa", default_tokenizer)
    assert use_direct_layers(loaded.model) > 0
    engine = make_engine(loaded, attention_backend=backend)
    assert isinstance(engine.runner.backend, CpuPagedAttention) == (backend == "cpu")
    direct_calls: list[int] = []
    direct = DirectDecoderLayer._direct

    def counted(self, *args):
        direct_calls.append(1)
        return direct(self, *args)

    monkeypatch.setattr(DirectDecoderLayer, "_direct", counted)
    seconds: list[float] = []
    time_attention(engine, seconds.append)
    _run(engine)
    layers = loaded.model.model.layers
    direct_layers = sum(isinstance(layer, DirectDecoderLayer) for layer in layers)
    # The CPU backend's direct layers take their path in every step; others' never can.
    assert len(direct_calls) == (direct_layers * STEPS if backend == "cpu" else 0)
    assert len(seconds) == 2 * len(layers) * STEPS  # a store and an attention per layer and step
    assert all(s >= 0 for s in seconds) and sum(seconds) > 0
