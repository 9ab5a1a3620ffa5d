"""get_attention_backend picks the right backend, fails loudly, and falls back only with a warning."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedserve.cache.attention import TorchPagedAttention, get_attention_backend

CPU = torch.device("cpu")


def test_auto_backend_on_cpu_is_the_cpu_kernel(cpu_backend):
    assert get_attention_backend("auto", CPU).name == "cpu"


def test_torch_backend_is_the_reference():
    assert isinstance(get_attention_backend("torch", CPU), TorchPagedAttention)


def test_unknown_backend_name_raises_value_error():
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", CPU)


def test_triton_on_cpu_without_interpreter_raises_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        get_attention_backend("triton", CPU)


def test_auto_falls_back_to_reference_with_warning_when_kernel_build_fails(monkeypatch, caplog):
    from pagedserve.cache.attention import cpu

    def failing_build(isa=None):
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(cpu, "load_cpu_kernel", failing_build)
    with caplog.at_level(logging.WARNING, logger="pagedserve.cache.attention"):
        backend = get_attention_backend("auto", CPU)
    assert isinstance(backend, TorchPagedAttention)
    assert "compiler exploded" in caplog.text


def test_explicit_cpu_backend_raises_when_kernel_build_fails(monkeypatch):
    from pagedserve.cache.attention import cpu

    monkeypatch.setattr(
        cpu, "load_cpu_kernel", lambda isa=None: (_ for _ in ()).throw(RuntimeError("no cc"))
    )
    with pytest.raises(RuntimeError, match="no cc"):
        get_attention_backend("cpu", CPU)
