"""Per-layer attention options (sliding window, logit soft-capping, attention sinks): the torch
reference agrees with transformers' own eager attention, and every backend agrees with the
reference (Triton under TRITON_INTERPRET=1)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from transformers.models.gemma2.modeling_gemma2 import (
    eager_attention_forward as gemma2_eager_attention,
)
from transformers.models.gpt_oss.modeling_gpt_oss import (
    eager_attention_forward as gpt_oss_eager_attention,
)

from pagedserve.cache.attention import TorchPagedAttention, get_attention_backend
from pagedserve.cache.attention.torch_ref import gather_request_kv

# A decode deep past the window, a whole prefill longer than the window, a first token, and a
# chunk after a prefix that spans several query tiles and crosses the window's edge.
QUERY_LENS = [1, 23, 1, 37]
SEQ_LENS = [61, 23, 1, 70]
OPTION_CASES = {
    "window": {"sliding_window": 7},
    "window-of-one": {"sliding_window": 1},
    "softcap": {"softcap": 0.5},
    "sinks": {"sinks": "random"},
    "all": {"sliding_window": 9, "softcap": 2.0, "sinks": "random"},
}
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 32


def _options(case: str, device: str = "cpu") -> dict[str, object]:
    options = dict(OPTION_CASES[case])
    if options.get("sinks") == "random":
        options["sinks"] = torch.linspace(-2.0, 3.0, NUM_HEADS, device=device)
    return options


def _hf_dense_attention(batch, scale: float, options: dict[str, object]) -> torch.Tensor:
    """Each request through transformers' eager attention with an explicit additive mask."""
    query, key_cache, value_cache, meta = batch
    outputs = []
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        q = query[starts[i] : starts[i + 1]]  # [q_len, H, D]
        k = gather_request_kv(key_cache, meta.block_tables[i], seq_len)
        v = gather_request_kv(value_cache, meta.block_tables[i], seq_len)
        q_pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if options.get("sliding_window"):
            visible &= k_pos > q_pos - options["sliding_window"]
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
        module = torch.nn.Module()
        module.num_key_value_groups, module.training = NUM_HEADS // NUM_KV_HEADS, False
        module.sinks = options.get("sinks")
        args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask)
        if module.sinks is not None:
            if options.get("softcap") is not None:
                pytest.skip("no transformers family combines sinks with soft-capping")
            out, _ = gpt_oss_eager_attention(module, *args, scaling=scale, dropout=0.0)
        else:
            out, _ = gemma2_eager_attention(
                module, *args, scaling=scale, dropout=0.0, softcap=options.get("softcap")
            )
        outputs.append(out[0])
    return torch.cat(outputs)


def _batch(paged_batch, block_size: int, device: str = "cpu"):
    return paged_batch(
        QUERY_LENS,
        SEQ_LENS,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=block_size,
        device=device,
        seed=block_size,
    )


@pytest.mark.parametrize("case", [c for c in OPTION_CASES if c != "all"])
def test_reference_options_equal_transformers_eager_attention(paged_batch, case):
    batch = _batch(paged_batch, block_size=5)
    options = _options(case)
    expected = _hf_dense_attention(batch, 0.125, options)
    actual = TorchPagedAttention().forward(*batch, 0.125, **options)
    assert (actual - expected).abs().max().item() < 1e-5


def test_reference_options_change_the_output(paged_batch):
    # Guards the comparison above: each option must matter on this batch.
    batch = _batch(paged_batch, block_size=5)
    plain = TorchPagedAttention().forward(*batch, 0.125)
    for case in OPTION_CASES:
        changed = TorchPagedAttention().forward(*batch, 0.125, **_options(case))
        assert (changed - plain).abs().max().item() > 1e-2, case


@pytest.mark.parametrize("case", list(OPTION_CASES))
@pytest.mark.parametrize("block_size", [1, 16])
def test_cpu_backend_options_match_reference(
    cpu_backend, paged_batch, matches_reference, case, block_size
):
    matches_reference(cpu_backend, _batch(paged_batch, block_size), **_options(case))


@pytest.mark.parametrize("case", list(OPTION_CASES))
@pytest.mark.parametrize("block_size", [1, 16])
def test_triton_backend_options_match_reference(paged_batch, matches_reference, case, block_size):
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = get_attention_backend("triton", torch.device(device))
    matches_reference(backend, _batch(paged_batch, block_size, device), **_options(case, device))


def _window_poisoned_batch(paged_batch, window: int, device: str):
    """The block-size-4 batch on `device`, with every block a request's window excludes pointed
    at a spare block full of NaN (how freed sliding-window blocks look in a table)."""
    query, key_cache, value_cache, meta = _batch(paged_batch, block_size=4, device=device)
    used = set(meta.block_tables.flatten().tolist())
    null_block = next(b for b in range(key_cache.shape[0]) if b not in used)
    tables = meta.block_tables.clone()
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        first_query = seq_len - (starts[i + 1] - starts[i])
        tables[i, : max(0, first_query - window + 1) // 4] = null_block
    assert (tables == null_block).any()
    key_cache[null_block], value_cache[null_block] = float("nan"), float("nan")
    return query, key_cache, value_cache, dataclasses.replace(meta, block_tables=tables)


def test_window_reads_no_block_outside_it(paged_batch, cpu_backend):
    # Freed sliding-window blocks are table entries pointing at a null block: pointing every block
    # a request's window excludes at a spare block full of NaN must not change any backend's output.
    window = 7
    expected = TorchPagedAttention().forward(
        *_batch(paged_batch, block_size=4), 0.125, sliding_window=window
    )
    backends = [(TorchPagedAttention(), "cpu"), (cpu_backend, "cpu")]
    if importlib.util.find_spec("triton") is not None:
        # Triton runs natively where there is a GPU (TRITON_INTERPRET is off there), else
        # interpreted on the CPU.
        device = "cuda" if torch.cuda.is_available() else "cpu"
        backends.append((get_attention_backend("triton", torch.device(device)), device))
    for backend, device in backends:
        poisoned = _window_poisoned_batch(paged_batch, window, device)
        actual = backend.forward(*poisoned, 0.125, sliding_window=window)
        assert (actual.cpu() - expected).abs().max().item() < 1e-5, backend.name


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    ("dtype", "kv_dtype"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.float8_e4m3fn)],
)
def test_cpu_kernel_options_match_reference_at_compiled_head_sizes(
    cpu_backend, paged_batch, matches_reference, head_dim, dtype, kv_dtype
):
    # 64 and 128 take the kernel's compile-time paths; bfloat16 and fp8 caches are widened per
    # tile (the prefill chunks' float tiles, the decode tokens' vector path).
    batch = paged_batch(
        QUERY_LENS,
        SEQ_LENS,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=head_dim,
        block_size=5,
        dtype=dtype,
        kv_dtype=kv_dtype,
        seed=head_dim,
    )
    matches_reference(cpu_backend, batch, **_options("all"))
