"""CPU feature decisions, from injected flags so every CPU's answer is tested on any host."""

from __future__ import annotations

from pagedserve.cache.attention.cpu_features import missing_native_bf16, vector_isa

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
