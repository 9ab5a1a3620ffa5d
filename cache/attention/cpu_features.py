"""What the host CPU can compute natively: its vector ISA, whether it has bf16 dot products, and
whether torch's BLAS (MKL) runs its fast code paths on it.

Read from the `flags`, `vendor_id` and `cpu family` lines of /proc/cpuinfo (Linux x86). Every
decision takes the flags or vendor as an argument, so tests can ask what another CPU would get on
any host.
"""

from __future__ import annotations

import functools
import platform

# Either gives torch's bf16 matmuls a native path (oneDNN); without both they are emulated
# through float32 conversions, 3-4x slower than float32 itself (issue 14, Zen 2).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def host_cpu_flags() -> frozenset[str]:
    """The host's CPU feature flags (empty where /proc/cpuinfo has none, e.g. not Linux)."""
    value = _cpuinfo_value(("flags", "Features"))
    return frozenset(value.split()) if value else frozenset()


@functools.cache
def host_cpu_vendor() -> str:
    """The host's CPU vendor id, e.g. GenuineIntel or AuthenticAMD ("" where none is given)."""
    return _cpuinfo_value(("vendor_id",)).strip()


@functools.cache
def host_cpu_family() -> int | None:
    """The host's CPU family number (e.g. 25 for AMD's Zen 4, 26 for Zen 5; None where
    /proc/cpuinfo gives none)."""
    value = _cpuinfo_value(("cpu family",)).strip()
    return int(value) if value.isdigit() else None


def _cpuinfo_value(keys: tuple[str, ...]) -> str:
    """The value of the first /proc/cpuinfo line that starts with one of `keys` ("" if none)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(keys):
                    return line.split(":", 1)[1]
    except OSError:
        pass
    return ""


def vector_isa(flags: frozenset[str]) -> str:
    """The widest x86 vector ISA the flags name, with the extensions that matter for LLMs."""
    if "avx512f" in flags:
        extras = [name for name in ("avx512_vnni", "avx512_bf16", "amx_bf16") if name in flags]
        return "+".join(["AVX-512", *(name.upper() for name in extras)])
    if "avx2" in flags:
        return "AVX2+FMA" if "fma" in flags else "AVX2"
    return "AVX" if "avx" in flags else (platform.machine() or "unknown")


def missing_native_bf16(flags: frozenset[str]) -> tuple[str, ...]:
    """The bf16 features the CPU lacks, all of them, when it has none of them; else ()."""
    if any(name in flags for name in NATIVE_BF16_FLAGS):
        return ()
    return NATIVE_BF16_FLAGS
