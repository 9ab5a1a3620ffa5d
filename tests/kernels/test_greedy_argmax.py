"""The CPU extension's argmax_rows (greedy.cpp) against torch's max(dim=-1).indices, which the
sampler used before: the same index for every row, ties, NaN, infinities and signed zeros
included, in float32 and bfloat16, for each ISA build the host runs."""

from __future__ import annotations

import pytest
import torch

from pagedserve.configs import SamplingParams
from pagedserve.engine.sampler import Sampler, SamplingRow, greedy_token_ids

NAN, INF = float("nan"), float("inf")


def _expected(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().max(dim=-1).indices


@pytest.fixture
def kernel(cpu_backend):
    return cpu_backend._kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 15, 16, 63, 64, 65, 1000, 49152])
def test_argmax_rows_matches_torch_on_random_rows(kernel, dtype, vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=generator).to(dtype)
    assert torch.equal(kernel.argmax_rows(logits), _expected(logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_takes_the_first_tie_and_the_first_nan_as_torch_does(kernel, dtype):
    vocab = 200  # past a vector loop of 64 and into the scalar tail
    rows = []
    for position in (0, 17, 64, 130, 199):  # a tie: the maximum at `position` and once later
        row = torch.zeros(vocab)
        row[position] = 5.0
        row[min(position + 70, vocab - 1)] = 5.0
        rows.append(row)
    nan_row = torch.arange(vocab, dtype=torch.float32)
    nan_row[[90, 150]] = NAN  # a NaN wins over the larger values after it, as in torch
    rows.append(nan_row)
    tail_nan = torch.zeros(vocab)
    tail_nan[vocab - 1] = NAN
    rows.append(tail_nan)
    rows.append(torch.full((vocab,), -INF))  # nothing above -inf: index 0
    infinite = torch.zeros(vocab)
    infinite[[33, 66]] = INF
    rows.append(infinite)
    zeros = torch.zeros(vocab)
    zeros[:10] = -1.0
    zeros[10] = -0.0  # -0.0 == 0.0: the first zero is the first maximum
    rows.append(zeros)
    logits = torch.stack(rows).to(dtype)
    got = kernel.argmax_rows(logits)
    assert torch.equal(got, _expected(logits))
    assert got[:5].tolist() == [0, 17, 64, 130, 199]
    assert got[5:].tolist() == [90, vocab - 1, 0, 33, 10]


def test_argmax_rows_rejects_what_it_cannot_read(kernel):
    with pytest.raises(RuntimeError, match="contiguous 2-D"):
        kernel.argmax_rows(torch.zeros(4, 8)[:, ::2])
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.argmax_rows(torch.zeros(2, 8, dtype=torch.float16))


def test_sampler_picks_the_same_greedy_tokens_with_the_kernel_as_without(kernel):
    logits = torch.randn(16, 3000, generator=torch.Generator().manual_seed(0))
    logits[3, 100] = logits[3, 2000] = 50.0  # a tie
    assert (
        greedy_token_ids(logits, kernel) == greedy_token_ids(logits) == _expected(logits).tolist()
    )
    rows = [
        SamplingRow("r", SamplingParams(temperature=0.0), [5], [], 2, None, []) for _ in range(16)
    ]
    with_kernel = [r.token_id for r in Sampler(cpu_kernel=kernel).sample(logits, rows)]
    assert with_kernel == [r.token_id for r in Sampler().sample(logits, rows)]
    assert with_kernel[3] == 100
