"""CPU feature decisions, from injected flags so every CPU's answer is tested on any host."""

from __future__ import annotations

from pagedserve.cache.attention.cpu_features import (
    host_cpu_family,
    host_cpu_flags,
    host_cpu_vendor,
    missing_native_bf16,
    vector_isa,
)

ZEN2 = frozenset({"avx", "avx2", "fma", "f16c"})
SAPPHIRE_RAPIDS = ZEN2 | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16"}


def test_vector_isa_names_the_widest_vectors_and_the_bf16_extensions():
    assert vector_isa(ZEN2) == "AVX2+FMA"
    assert vector_isa(SAPPHIRE_RAPIDS) == "AVX-512+AVX512_VNNI+AVX512_BF16+AMX_BF16"
    assert vector_isa(frozenset({"avx512f"})) == "AVX-512"


def test_missing_native_bf16_names_both_features_only_when_neither_is_present():
    assert missing_native_bf16(ZEN2) == ("avx512_bf16", "amx_bf16")
    assert missing_native_bf16(SAPPHIRE_RAPIDS) == ()
    assert missing_native_bf16(ZEN2 | {"avx512_bf16"}) == ()
    assert missing_native_bf16(ZEN2 | {"amx_bf16"}) == ()


def test_the_host_vendor_comes_from_cpuinfo_without_whitespace():
    vendor = host_cpu_vendor()
    assert vendor == vendor.strip()
    with open("/proc/cpuinfo") as cpuinfo:
        assert vendor in cpuinfo.read()


def test_the_host_family_is_cpuinfos_cpu_family_number():
    with open("/proc/cpuinfo") as cpuinfo:
        lines = [line for line in cpuinfo if line.startswith("cpu family")]
    expected = int(lines[0].split(":", 1)[1]) if lines else None
    assert host_cpu_family() == expected


def test_isa_builds_need_their_features_and_native_is_always_runnable():
    from pagedserve.cache.attention.cpu import host_runnable_isas

    assert host_runnable_isas(ZEN2 | {"bmi2"}) == ["native", "avx2"]
    assert host_runnable_isas(SAPPHIRE_RAPIDS | {"bmi2", "avx512cd", "avx512dq", "avx512vl"}) == [
        "native",
        "avx2",
        "avx512",
    ]
    assert host_runnable_isas(frozenset()) == ["native"]


def test_the_isa_setting_is_checked_and_defaults_to_native(monkeypatch):
    import pytest

    from pagedserve.cache.attention.cpu import ISA_ENV, requested_isa

    monkeypatch.delenv(ISA_ENV, raising=False)
    assert requested_isa() == "native"
    monkeypatch.setenv(ISA_ENV, "AVX2")
    assert requested_isa() == "avx2"
    monkeypatch.setenv(ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_ISA='sse2' is not one of"):
        requested_isa()


def test_each_isa_build_vectorises_at_its_register_width(cpu_backend):
    lanes = {"avx2": 8, "avx512": 16}.get(cpu_backend.isa)
    if lanes is None:  # native: whatever the host's widest registers are
        lanes = 16 if "avx512f" in host_cpu_flags() or "avx2" not in host_cpu_flags() else 8
    assert cpu_backend._kernel.vector_lanes == lanes
