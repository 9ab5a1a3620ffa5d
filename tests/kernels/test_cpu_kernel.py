"""The C++ CPU kernel agrees with the torch reference on mixed batches over the layout space."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pagedserve.cache.attention import AttentionMetadata

# Decode with context, whole prefill, a first token, a prefill chunk after a cached prefix that
# spans several query tiles, and a short chunk after a prefix.
MIXED_QUERY_LENS = [1, 9, 1, 37, 3]
MIXED_SEQ_LENS = [37, 9, 1, 70, 20]


@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group_size", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_matches_reference_on_mixed_batch(
    cpu_backend, paged_batch, matches_reference, block_size, head_dim, group_size, dtype
):
    batch = paged_batch(
        MIXED_QUERY_LENS,
        MIXED_SEQ_LENS,
        num_heads=2 * group_size,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=block_size + head_dim,
    )
    matches_reference(cpu_backend, batch)


@pytest.mark.parametrize("group_size", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cpu_kernel_matches_reference_for_each_row_count_of_the_vector_path(
    cpu_backend, paged_batch, matches_reference, group_size, head_dim
):
    # Items of fewer than 8 rows per kv head (tokens x group size) take the vector path, whose
    # value pass runs up to 4 rows at a time and the rest (3, 2 or 1) in one more pass: group 1
    # gives 1, 2, 4, 5 and 7 rows, group 3 gives 3 and 6. Odd and even key counts both.
    query_lens = [1, 2, 4, 5, 7] if group_size == 1 else [1, 2]
    batch = paged_batch(
        query_lens,
        [length + 40 + index for index, length in enumerate(query_lens)],
        num_heads=2 * group_size,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=16,
        dtype=torch.bfloat16,
        seed=head_dim + group_size,
    )
    matches_reference(cpu_backend, batch)


# (query dtype, cache dtype): float32 rows read in place, every other cache widened a tile at a
# time, bfloat16 queries widened once. bfloat16 queries over a bfloat16 cache (or an fp8 one, with
# AVX512_VBMI) take tile_attention.h instead where the build has AVX512_BF16 (on the others they
# come here).
FLOAT_TILE_DTYPES = [
    (torch.float32, None),
    (torch.bfloat16, None),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float16),
    (torch.bfloat16, torch.float32),
]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("dtype", "kv_dtype"), FLOAT_TILE_DTYPES)
def test_cpu_kernel_matches_reference_for_each_row_count_of_the_float_tiles(
    cpu_backend, paged_batch, matches_reference, head_dim, dtype, kv_dtype
):
    # Items of at least a vector of rows per kv head (tokens x group size) take float_tiles.h,
    # whose rows are vector lanes: padded to whole vectors (AVX-512: 16 lanes, AVX2: 8), scored up
    # to 3 (AVX2: 2) vectors of rows at a time, their value pass 6 (AVX2: 2) rows at a time plus
    # the rest. Group 3 gives items of 18, 21, 33, 48 and 15 rows, over keys of several tiles, the
    # last one partial.
    query_lens = [6, 7, 11, 21]
    batch = paged_batch(
        query_lens,
        [length + 100 + 7 * index for index, length in enumerate(query_lens)],
        num_heads=6,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        kv_dtype=kv_dtype,
        seed=head_dim + 3,
    )
    matches_reference(cpu_backend, batch)


def test_cpu_kernel_matches_reference_in_float16(cpu_backend, paged_batch, matches_reference):
    batch = paged_batch(
        MIXED_QUERY_LENS,
        MIXED_SEQ_LENS,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
    )
    matches_reference(cpu_backend, batch)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_cpu_kernel_matches_reference_on_decode_only_batch(
    cpu_backend, paged_batch, matches_reference, num_threads
):
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        batch = paged_batch(
            [1] * 6,
            [300, 17, 1, 64, 65, 129],
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            block_size=16,
        )
        matches_reference(cpu_backend, batch)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_gives_a_request_the_same_bits_alone_as_in_a_batch(
    cpu_backend, paged_batch, dtype
):
    # Alone, a decode token's kv heads are separate tasks (to spread over the cores); in a batch
    # of many, each task takes all of a request's heads (contiguous K/V reads). Each row is the same
    # arithmetic either way, so the outputs must be identical, bit for bit.
    seq_lens = [300, 17, 1, 64, 65, 129, 40, 33]
    query, key_cache, value_cache, meta = paged_batch(
        [1] * len(seq_lens),
        seq_lens,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
        dtype=dtype,
    )
    batched = cpu_backend.forward(query, key_cache, value_cache, meta, 0.125)
    for request in range(len(seq_lens)):
        alone = AttentionMetadata(
            slot_mapping=meta.slot_mapping[request : request + 1],
            block_tables=meta.block_tables[request : request + 1],
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=meta.seq_lens[request : request + 1],
            max_query_len=1,
        )
        output = cpu_backend.forward(
            query[request : request + 1], key_cache, value_cache, alone, 0.125
        )
        assert torch.equal(output, batched[request : request + 1])


def test_cpu_kernel_handles_odd_head_dim_and_long_chunk(
    cpu_backend, paged_batch, matches_reference
):
    batch = paged_batch(
        [100],
        [130],
        num_heads=4,
        num_kv_heads=4,
        head_dim=40,
        block_size=7,
        seed=3,
    )
    matches_reference(cpu_backend, batch)


def test_cpu_kernel_rejects_int64_block_tables_with_clear_error(cpu_backend, paged_batch):
    query, key_cache, value_cache, meta = paged_batch(
        [1], [4], num_heads=2, num_kv_heads=2, head_dim=8, block_size=4
    )
    bad_meta = AttentionMetadata(
        meta.slot_mapping,
        meta.block_tables.long(),
        meta.query_start_loc,
        meta.seq_lens,
        meta.max_query_len,
    )
    with pytest.raises(RuntimeError, match="int32"):
        cpu_backend.forward(query, key_cache, value_cache, bad_meta, 1.0)


def test_cpu_kernel_rejects_seq_len_beyond_block_table(cpu_backend, paged_batch):
    query, key_cache, value_cache, meta = paged_batch(
        [1], [4], num_heads=2, num_kv_heads=2, head_dim=8, block_size=4
    )
    capacity = meta.block_tables.shape[1] * key_cache.shape[1]
    too_long = AttentionMetadata(
        meta.slot_mapping,
        meta.block_tables,
        meta.query_start_loc,
        torch.tensor([capacity + 1], dtype=torch.int32),
        meta.max_query_len,
    )
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        cpu_backend.forward(query, key_cache, value_cache, too_long, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_cpu_kernel_reads_strided_queries_in_place_with_the_bits_of_a_contiguous_float32_call(
    cpu_backend, paged_batch, dtype, kv_dtype
):
    # The model hands attention HF's [heads, tokens, head_dim] transposed to a [tokens, heads,
    # head_dim] view; the kernel reads it (and a bfloat16 one) in place, and must give the bits
    # that widening to a contiguous float32 copy and rounding the output afterwards give.
    query, key_cache, value_cache, meta = paged_batch(
        MIXED_QUERY_LENS,
        MIXED_SEQ_LENS,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        kv_dtype=kv_dtype or dtype,
    )
    strided = query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous() and torch.equal(strided, query)
    actual = cpu_backend.forward(strided, key_cache, value_cache, meta, 0.125)
    kernel_args = (key_cache, value_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens)
    kernel = cpu_backend._kernel
    expected = kernel.paged_attention(
        query.float().contiguous(), *kernel_args, 0.125, 0, 0.0, None
    ).to(dtype)
    assert actual.dtype == dtype and actual.is_contiguous()
    bf16_keys = kv_dtype is None or kernel.fp8_as_bf16  # bfloat16 rows, read or converted
    if kernel.bf16_dot_products and dtype == torch.bfloat16 and bf16_keys:
        # bfloat16 queries over bfloat16 keys take AVX512_BF16 dot products (unwidened keys):
        # the bits of a contiguous bfloat16 call, and a float32 query's result to bfloat16 rounding.
        contiguous = kernel.paged_attention(query.contiguous(), *kernel_args, 0.125, 0, 0.0, None)
        assert torch.equal(actual, contiguous)
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=2**-9)
    else:
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [5, 16])
def test_cpu_kernel_reads_a_cache_stored_in_a_smaller_dtype(
    cpu_backend, paged_batch, matches_reference, kv_dtype, dtype, block_size
):
    # `--kv-cache-dtype`: queries in the model's dtype over a cache stored in another one. Both
    # sides read the same stored values, so the query dtype's tolerance still applies.
    batch = paged_batch(
        MIXED_QUERY_LENS,
        MIXED_SEQ_LENS,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        block_size=block_size,
        dtype=dtype,
        kv_dtype=kv_dtype,
        seed=block_size,
    )
    matches_reference(cpu_backend, batch)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cpu_kernel_widens_a_smaller_cache_with_an_odd_head_size(
    cpu_backend, paged_batch, matches_reference, kv_dtype
):
    # head_dim 40 = two whole 16-lane vectors and a partial one: the widening's tail path.
    batch = paged_batch(
        [1, 20],
        [30, 45],
        num_heads=4,
        num_kv_heads=2,
        head_dim=40,
        block_size=7,
        kv_dtype=kv_dtype,
        seed=5,
    )
    matches_reference(cpu_backend, batch)


def test_cpu_kernel_widens_every_fp8_value_exactly(cpu_backend):
    # One key per request: softmax gives it weight 1, so the output is its value row, widened.
    # 4 requests x 64 dims cover all 256 fp8 bit patterns, NaNs (0x7f, 0xff) included.
    every_fp8 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    value_cache = every_fp8.view(4, 1, 1, 64)  # [num_blocks, block_size 1, kv_heads 1, 64]
    key_cache = torch.zeros_like(value_cache)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(4, dtype=torch.int64),
        block_tables=torch.tensor([[2], [0], [3], [1]], dtype=torch.int32),
        query_start_loc=torch.arange(5, dtype=torch.int32),
        seq_lens=torch.ones(4, dtype=torch.int32),
        max_query_len=1,
    )
    query = torch.randn(4, 1, 64)
    output = cpu_backend.forward(query, key_cache, value_cache, meta, 0.125)
    expected = value_cache.float().view(4, 64)[meta.block_tables[:, 0].long()]
    assert torch.equal(output.view(4, 64).isnan(), expected.isnan())
    assert torch.equal(output.view(4, 64).nan_to_num(), expected.nan_to_num())


def test_cpu_kernel_scores_every_fp8_key_value_exactly(cpu_backend):
    # Request r sees two keys: key 0 holds fp8 bit pattern r in dim 0, key 1 is zero; the query is
    # dim 0's unit vector (scale 1), so the scores are (k, 0) and the output, with values e0 and
    # e1, is (sigmoid(k), 1 - sigmoid(k)): a key decoded to any other value moves it. One request
    # per fp8 bit pattern, head size 64 (the table path's whole vectors); the two NaN patterns
    # (0x7f, 0xff) only have to stay out of the other rows (the value test decodes them).
    num_requests, head_dim = 256, 64
    key_cache = torch.zeros(num_requests, 2, 1, head_dim, dtype=torch.float8_e4m3fn)
    every_fp8 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    key_cache[:, 0, 0, 0] = every_fp8
    value_cache = torch.zeros_like(key_cache)
    value_cache[:, 0, 0, 0] = 1.0
    value_cache[:, 1, 0, 1] = 1.0
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(num_requests, dtype=torch.int64),
        block_tables=torch.randperm(num_requests, generator=torch.Generator().manual_seed(0))
        .int()
        .view(num_requests, 1),
        query_start_loc=torch.arange(num_requests + 1, dtype=torch.int32),
        seq_lens=torch.full((num_requests,), 2, dtype=torch.int32),
        max_query_len=1,
    )
    query = torch.zeros(num_requests, 1, head_dim)
    query[:, 0, 0] = 1.0
    output = cpu_backend.forward(query, key_cache, value_cache, meta, 1.0).view(num_requests, -1)
    keys = key_cache[meta.block_tables[:, 0].long(), 0, 0, 0].float()
    expected = torch.sigmoid(keys)
    finite = ~keys.isnan()
    assert finite.sum() == 254
    torch.testing.assert_close(output[finite, 0], expected[finite], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(output[finite, 1], 1 - expected[finite], rtol=1e-6, atol=1e-6)


def test_cpu_backend_falls_back_to_the_reference_for_heads_beyond_the_kernel(
    cpu_backend, paged_batch, matches_reference, caplog
):
    from pagedserve.cache.attention.cpu import MAX_HEAD_DIM

    batch = paged_batch(
        [1, 3], [5, 3], num_heads=2, num_kv_heads=1, head_dim=MAX_HEAD_DIM + 8, block_size=4
    )
    with caplog.at_level("WARNING", logger="pagedserve.cache.attention.cpu"):
        matches_reference(cpu_backend, batch)
    assert "slow torch reference" in caplog.text


def test_cpu_kernel_lets_other_threads_run_python_while_it_computes(cpu_backend, paged_batch):
    """The server's event loop (and /health) shares the process with the engine thread: a long
    prefill's attention must not hold the GIL. A thread that only sleeps and reads the clock
    stalls for a whole kernel call if the kernel keeps the GIL, and for milliseconds if not."""
    query, key_cache, value_cache, meta = paged_batch(
        [3072], [3072], num_heads=4, num_kv_heads=4, head_dim=64, block_size=16
    )
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel takes one core, the clock reader the other
    try:
        started = time.perf_counter()
        cpu_backend.forward(query, key_cache, value_cache, meta, 0.125)
        call_s = time.perf_counter() - started
        done = threading.Event()

        def compute() -> None:
            for _ in range(4):
                cpu_backend.forward(query, key_cache, value_cache, meta, 0.125)
            done.set()

        worker = threading.Thread(target=compute)
        longest_gap_s, last = 0.0, time.perf_counter()
        worker.start()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            longest_gap_s, last = max(longest_gap_s, now - last), now
        worker.join()
    finally:
        torch.set_num_threads(previous)
    assert longest_gap_s < call_s / 4, (
        f"stalled {longest_gap_s:.3f} s; one call takes {call_s:.3f} s"
    )


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group_size", [1, 3, 16])
@pytest.mark.parametrize(
    "options",
    [{}, {"sliding_window": 300}, {"softcap": 5.0}, {"sinks": "per head"}],
    ids=["plain", "window", "softcap", "sinks"],
)
def test_cpu_kernel_matches_reference_on_bfloat16_decode_tokens_of_every_length(
    cpu_backend, paged_batch, matches_reference, block_size, head_dim, group_size, options
):
    # bfloat16 decode tokens, the bulk of a serving step, at the block sizes the engine uses:
    # lengths below, at and past the kernel's key tiles and 16-key groups (and the 256-key chunks
    # an AMX decode path tried in the 29th session used), a window that starts mid-block, and a
    # prefill chunk beside them (a token of it alone in a work item is not a decode token).
    seq_lens = [1, 15, 16, 17, 255, 256, 257, 600]
    batch = _bfloat16_batch(
        paged_batch, [1] * len(seq_lens) + [5], [*seq_lens, 300], group_size, head_dim, block_size
    )
    matches_reference(cpu_backend, batch, **_resolve(options, group_size))


def _bfloat16_batch(paged_batch, query_lens, seq_lens, group_size, head_dim, block_size):
    """A bfloat16 batch over a bfloat16 cache with 2 kv heads of `group_size` query heads each."""
    return paged_batch(
        query_lens,
        seq_lens,
        num_heads=2 * group_size,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.bfloat16,
        seed=block_size + head_dim + group_size,
    )


def _resolve(options, group_size):
    """The parametrised options with "per head" sinks made a tensor for _bfloat16_batch's heads."""
    if options.get("sinks"):
        return {"sinks": torch.linspace(-2.0, 3.0, 2 * group_size)}
    return options


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group_size", [1, 3])
@pytest.mark.parametrize(
    "options",
    [{}, {"sliding_window": 100}, {"sliding_window": 20}, {"softcap": 2.0}, {"sinks": "per head"}],
    ids=["plain", "window", "short-window", "softcap", "sinks"],
)
def test_cpu_kernel_matches_reference_on_long_bfloat16_prefill_chunks(
    cpu_backend, paged_batch, matches_reference, block_size, head_dim, group_size, options
):
    # bfloat16 prefill chunks take tile_attention.h where the build has AVX512_BF16 (the float
    # tiles elsewhere): work items of up to 64 tokens, groups of 16 rows, keys packed 256 at a
    # time in spans of 32, and a group skips the spans and blocks none of its rows sees. A chunk
    # of 200 after 330 cached keys (three full items and a partial one, keys over three blocks;
    # the first groups of the third item see nothing of its last block, and a window leaves early
    # spans unseen by later rows), a whole prompt of 64 (an item's edge), 16 tokens after 17
    # (with group 1, the group's last row is the first key of the second span) and 40 after 130
    # (with group 1 and the 20-key window, the first key a group's first row sees is the last of
    # a span). At head_dim 64 AMX keeps a group's accumulators in tiles, at 128 not.
    batch = _bfloat16_batch(
        paged_batch, [200, 64, 16, 40], [530, 64, 33, 170], group_size, head_dim, block_size
    )
    matches_reference(cpu_backend, batch, **_resolve(options, group_size))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("sinks", [False, True])
def test_cpu_kernel_rescales_what_a_row_accumulated_when_its_maximum_climbs(
    cpu_backend, paged_batch, matches_reference, head_dim, sinks
):
    # Scores that rise with the key's position, by 30 logits over 300 keys: each row's maximum
    # passes the reference its probabilities were taken against again and again, so what it had
    # accumulated must be rescaled each time (the tile path moves its reference only past a
    # margin of ln 256; a missed rescale leaves early keys weighted up to 256x too much). With
    # sinks, each row's first reference is its sink's logit (3), which the scores pass later.
    seq_len, num_kv_heads, group_size = 300, 2, 3
    query, key_cache, value_cache, meta = paged_batch(
        [seq_len],
        [seq_len],
        num_heads=num_kv_heads * group_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=torch.bfloat16,
        seed=head_dim,
    )
    # Query rows of ones, keys of 0.8 * p / head_dim plus a little noise: score = 0.125 * q . k
    # = 0.1 * p (+ noise).
    query.fill_(1.0)
    for position in range(seq_len):
        block, offset = meta.block_tables[0, position // 16], position % 16
        noise = 0.1 * key_cache[block, offset].float()
        key_cache[block, offset] = (noise + 0.8 * position / head_dim).to(torch.bfloat16)
    options = {"sinks": torch.full((num_kv_heads * group_size,), 3.0)} if sinks else {}
    matches_reference(cpu_backend, (query, key_cache, value_cache, meta), **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_kernel_lets_no_stale_slot_into_a_result(cpu_backend, paged_batch, dtype, block_size):
    # Slots past a request's length (the tail of its last block, and blocks it does not own) hold
    # whatever an earlier request left, NaN included. Tiled paths read whole groups of slots and
    # mask the extra keys: their probability is 0, and 0 * NaN would still be NaN in a sum.
    query_lens, seq_lens = [1, 37, 50, 5], [45, 37, 90, 21]
    query, key_cache, value_cache, meta = paged_batch(
        query_lens,
        seq_lens,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        block_size=block_size,
        dtype=dtype,
        seed=11,
    )
    expected = cpu_backend.forward(query, key_cache, value_cache, meta, 0.125)
    stale = torch.ones(key_cache.shape[:2], dtype=torch.bool)  # [num_blocks, block_size]
    for request, seq_len in enumerate(seq_lens):
        for position in range(seq_len):
            block = meta.block_tables[request, position // block_size]
            stale[block, position % block_size] = False
    nan = torch.tensor(float("nan"), dtype=dtype)
    key_cache[stale], value_cache[stale] = nan, nan
    actual = cpu_backend.forward(query, key_cache, value_cache, meta, 0.125)
    assert not actual.isnan().any()
    assert torch.equal(actual, expected)


def test_native_build_uses_bf16_products_fp8_tables_and_amx_tiles_where_the_cpu_has_them(
    cpu_backend,
):
    # A native build on a CPU with AVX512_BF16 scores bfloat16 keys by vdpbf16ps and runs bfloat16
    # prefill items as tile products (tile_attention.h), on AMX tiles where the CPU has AMX_BF16
    # and Linux grants the tile state (5.16 and later): a build that silently lost either path
    # would still pass every accuracy test, only slower.
    from pagedserve.cache.attention.cpu_features import host_cpu_flags

    native = cpu_backend.isa == "native"
    assert cpu_backend._kernel.bf16_dot_products is (native and "avx512_bf16" in host_cpu_flags())
    # fp8 rows are converted to bfloat16 by byte-table lookups where the build has AVX512_VBMI.
    assert cpu_backend._kernel.fp8_as_bf16 is (native and "avx512vbmi" in host_cpu_flags())
    amx_host = native and "amx_bf16" in host_cpu_flags()
    if not amx_host:
        assert cpu_backend._kernel.amx_tiles is False
    elif _linux_version() >= (5, 16):
        assert cpu_backend._kernel.amx_tiles is True


def _linux_version() -> tuple[int, int]:
    import platform

    major, minor = platform.release().split(".")[:2]
    return int(major), int(minor)


def _amd_zen5_or_later() -> bool:
    from pagedserve.cache.attention.cpu_features import host_cpu_family, host_cpu_vendor

    family = host_cpu_family()
    return host_cpu_vendor() == "AuthenticAMD" and family is not None and family >= 0x1A


def test_float32_decode_prefetches_by_head_on_amd_and_key_by_key_elsewhere(cpu_backend):
    # The order that measured faster on each vendor's cores (paged_attention.cpp,
    # float_prefetch_by_head); every build of a host takes the host's order. Results do not
    # depend on it, so only this says which order runs.
    from pagedserve.cache.attention.cpu_features import host_cpu_vendor

    vendor = host_cpu_vendor()  # "" where /proc/cpuinfo gives none (the kernel then: key order)
    expected = vendor in ("AuthenticAMD", "HygonGenuine")
    assert cpu_backend._kernel.float_prefetch_by_head is expected


def test_decode_prefetch_on_zen5_and_later_goes_into_l1_a_block_apart(cpu_backend):
    # prefetcht0, with the next tile's blocks interleaved, measured faster on AMD family 1Ah
    # (Zen 5); prefetcht1 in position order elsewhere (paged_attention.cpp, prefetch_into_l1 and
    # prefetch_blocks_interleaved). Every build of a host takes the host's plan.
    expected = _amd_zen5_or_later()
    assert cpu_backend._kernel.prefetch_into_l1 is expected
    assert cpu_backend._kernel.prefetch_blocks_interleaved is expected
