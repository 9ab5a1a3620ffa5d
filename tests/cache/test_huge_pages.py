"""CPU tensors on transparent huge pages: the KV cache and the panel weights, where Linux grants
them; plain tensors elsewhere. Either way the values are the tensor's own."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from pagedserve.cache import huge_pages
from pagedserve.cache.cache_engine import CacheEngine
from pagedserve.cache.cache_spec import CacheSpec

BIG = (2048, 16, 3, 64)  # 24 MiB of float32: several huge pages

needs_thp = pytest.mark.skipif(
    not huge_pages.huge_pages_enabled(), reason="this host grants no transparent huge pages"
)


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            start, end = (int(value, 16) for value in span.groups())
            mapping = start <= address < end
        elif mapping and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize(
    ("text", "mode"),
    [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"), ("", None)],
)
def test_thp_mode_is_the_bracketed_word(tmp_path, text, mode):
    path = tmp_path / "enabled"
    path.write_text(text)
    assert huge_pages.thp_mode(path) == mode


def test_thp_mode_is_none_without_the_sysfs_file(tmp_path):
    assert huge_pages.thp_mode(tmp_path / "missing") is None


@needs_thp
def test_a_big_tensor_sits_on_huge_pages_once_written():
    tensor = huge_pages.zeros(BIG, torch.float32)
    assert tensor.shape == BIG and tensor.is_contiguous() and not tensor.any()
    assert tensor.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert anon_huge_kib(tensor.data_ptr()) >= 2048


@needs_thp
def test_the_tensor_keeps_its_mapping_alive():
    tensor = huge_pages.empty(BIG, torch.float32)
    tensor.fill_(1.5)
    gc.collect()
    assert tensor.sum().item() == 1.5 * tensor.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_copy_keeps_every_bit(dtype):
    source = torch.randn(BIG).to(dtype)
    copy = huge_pages.copy_to_huge_pages(source)
    assert copy.dtype == dtype and copy.shape == source.shape
    assert torch.equal(copy.view(torch.uint8), source.view(torch.uint8))


def test_small_tensors_and_a_switched_off_process_get_plain_tensors(monkeypatch):
    small = torch.ones(4, 4)
    assert huge_pages.copy_to_huge_pages(small) is small
    monkeypatch.setenv(huge_pages.ENV_SWITCH, "0")
    assert not huge_pages.huge_pages_enabled()
    big = torch.ones(BIG)
    assert huge_pages.copy_to_huge_pages(big) is big
    assert not huge_pages.zeros(BIG, torch.float32).any()


@needs_thp
def test_the_cpu_kv_cache_is_on_huge_pages_and_says_so():
    spec = CacheSpec(num_layers=2, num_kv_heads=3, head_dim=64, dtype="float32", block_size=16)
    engine = CacheEngine(spec, num_blocks=1024, device="cpu")  # 12 MiB per layer tensor
    assert engine.on_huge_pages and "(2 MiB pages)" in engine.describe(max_model_len=256)
    for cache in (*engine.key_caches, *engine.value_caches):
        assert not cache.any() and anon_huge_kib(cache.data_ptr()) >= 2048
