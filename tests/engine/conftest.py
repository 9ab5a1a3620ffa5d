"""Engine test helpers: tiny random HF models of four families, the default model, Hugging Face
greedy references (with their near-tie information) and a checked run-to-completion loop.

HF references always run with `sdpa` attention: `hf_greedy_reference` switches the model there and
back explicitly, because the engine switches a model it is given to "pagedserve".
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import pagedserve.engine.model_runner  # noqa: F401 - registers the "pagedserve" attention implementation
from pagedserve.configs import SamplingParams, load_engine_config
from pagedserve.configs.engine import DEFAULT_MODEL, ModelConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.model_loader import LoadedModel, load_model, resolve_model_path
from pagedserve.engine.module_swap import swap_children
from pagedserve.engine.packed_linear import PackedLinear
from pagedserve.engine.panel_linear import PanelLinear
from pagedserve.engine.skinny_linear import SkinnyLinear
from pagedserve.engine.widened_linear import WidenedLinear
from pagedserve.scheduler import SchedulerOutput

# A divergence from HF is accepted only where HF's own best two tokens are this close (logprob).
NEAR_TIE_LOGPROB_GAP = 1e-4
# Near-tie divergences accepted in one test session, at most: the escape is for a rare float
# reordering (none in recent CI runs), not a way for many comparisons to stop early.
MAX_NEAR_TIE_DIVERGENCES = 2
_near_tie_divergences: list[str] = []
TINY_VOCAB_SIZE = 1024  # token ids below it decode with the default model's tokenizer
TINY_MAX_MODEL_LEN = 512

TINY_COMMON = dict(  # every tiny model's shared fields
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=TINY_MAX_MODEL_LEN,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# family -> (model class, config); GQA and MHA, head_dim 16 and 32, 2-4 layers.
TINY_FAMILIES: dict[str, tuple[type, PretrainedConfig]] = {
    "llama-gqa": (
        LlamaForCausalLM,
        LlamaConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            **TINY_COMMON,
        ),
    ),
    "llama-mha": (
        LlamaForCausalLM,
        LlamaConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=32,
            **TINY_COMMON,
        ),
    ),
    "qwen2-gqa": (
        Qwen2ForCausalLM,
        Qwen2Config(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            use_sliding_window=False,
            **TINY_COMMON,
        ),
    ),
    "qwen3-gqa": (
        Qwen3ForCausalLM,
        Qwen3Config(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            use_sliding_window=False,
            **TINY_COMMON,
        ),
    ),
    "mistral-gqa": (
        MistralForCausalLM,
        MistralConfig(
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=None,
            **TINY_COMMON,
        ),
    ),
}


# ---- models ------------------------------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def single_intra_op_thread():
    """One intra-op thread: on a shared 2-core machine, OpenMP threads that wait on each other
    under contention make small forwards 10-40x slower (measured); restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The converted default model (converted from the shipped GGUF on first use, never downloaded)."""
    path, _ = resolve_model_path(DEFAULT_MODEL)
    return path


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path: Path):
    return AutoTokenizer.from_pretrained(default_model_path, local_files_only=True)


@pytest.fixture(scope="session")
def default_hf_model(default_model_path: Path) -> torch.nn.Module:
    """The default model in float32 as Hugging Face loads it, none of the loader's CPU swaps (fused
    norms, MLPs and attention, packed and skinny linears): what references of it run."""
    return AutoModelForCausalLM.from_pretrained(
        default_model_path, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@pytest.fixture(scope="session")
def default_loaded(default_model_path: Path) -> LoadedModel:
    """The default model in float32 as the loader serves it (its CPU swaps included), shared by
    every engine of the session; references run `default_hf_model`."""
    return load_model(ModelConfig(model=str(default_model_path), dtype="float32"), "cpu")


def make_tiny_model(family: str, tokenizer, seed: int = 0) -> LoadedModel:
    """A seeded random float32 model of `family`, wrapped as the engine's `LoadedModel`."""
    model_class, config = TINY_FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class(config.__class__.from_dict(config.to_dict())).float().eval()
    return LoadedModel(model, tokenizer, model.config, Path("."), TINY_MAX_MODEL_LEN)


def tiny_linears_and_logits(tokenizer) -> tuple[torch.nn.Module, dict, torch.Tensor, torch.Tensor]:
    """A tiny float32 Llama before any swap: the model, its `nn.Linear`s by name, a 24-token
    probe and the probe's logits (what a swapped model must still give)."""
    model = make_tiny_model("llama-gqa", tokenizer).model
    linears = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    probe = torch.randint(0, model.config.vocab_size, (1, 24))
    with torch.inference_mode():
        return model, linears, probe, model(probe).logits


def make_engine(loaded: LoadedModel, **settings: object) -> LLMEngine:
    """An engine over a pre-loaded model; `settings` are flat CLI names (block_size, ...)."""
    settings.setdefault("dtype", "float32")
    settings.setdefault(
        "num_kv_blocks", 512
    )  # not the 512 MiB default budget: allocating it is slow
    settings.setdefault("device", "cpu")
    return LLMEngine(load_engine_config(cli=settings, environ={}), loaded=loaded)


# ---- Hugging Face references -------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """HF greedy output, plus per position the tokens within NEAR_TIE_LOGPROB_GAP of the best."""

    token_ids: list[int]
    near_tie_token_ids: list[frozenset[int]]
    top2_gaps: list[float]


def load_default_on_cpu(dtype: str) -> torch.nn.Module:
    """The default model as the loader serves it on this CPU in `dtype` (its CPU module swaps
    included), with SDPA attention so it runs outside the engine: for comparing logits."""
    config = ModelConfig(model=DEFAULT_MODEL, dtype=dtype)
    return load_model(config, "cpu", attn_implementation="sdpa").model


def mean_logit_errors(
    models: dict[str, torch.nn.Module], reference: torch.nn.Module, tokenizer
) -> dict[str, float]:
    """Per model, the mean absolute difference of its logits from `reference`'s on one real
    prompt (how close a bfloat16 variant stays to the float32 model)."""
    text = "The block table maps each logical block of a request to a physical block. " * 6
    input_ids = torch.tensor([tokenizer.encode(text)])
    with torch.inference_mode():
        expected = reference(input_ids).logits
        return {
            name: (model(input_ids).logits.float() - expected).abs().mean().item()
            for name, model in models.items()
        }


@contextlib.contextmanager
def hugging_face_linears(model: torch.nn.Module) -> Iterator[None]:
    """The model with `nn.Linear` where the loader put a `SkinnyLinear`, a float32 `PackedLinear`,
    a `PanelLinear` or a `WidenedLinear` (the same weights, in the layer's own dtype), so that a reference gets
    Hugging Face's linears; the loader's modules come back afterwards. (bfloat16 packed layers
    compute HF's bits already.) Fused norms, MLPs and attention stay: a reference of the default
    model runs `default_hf_model`, which has none."""
    originals: dict[int, torch.nn.Module] = {}
    inside_widened = {  # a widened layer's float32 modules go (and come back) with it
        id(inner)
        for module in model.modules()
        if isinstance(module, WidenedLinear)
        for inner in module.modules()
        if inner is not module
    }

    # A panel layer's fallback goes (and comes back) with it.
    inside_panels = {id(m.fallback) for m in model.modules() if isinstance(m, PanelLinear)}

    def to_linear(name: str, child: torch.nn.Module) -> torch.nn.Module | None:
        if id(child) in inside_widened or id(child) in inside_panels:
            return None
        if isinstance(child, PanelLinear):  # its fallback is the layer as the loader left it
            linear = plain_linear(child.fallback) or child.fallback
            originals[id(linear)] = child
            return linear
        return plain_linear(child)

    def plain_linear(child: torch.nn.Module) -> torch.nn.Module | None:
        bias = child.bias if isinstance(child, (SkinnyLinear, PackedLinear)) else None
        if isinstance(child, WidenedLinear):
            # The bf16 weight, exactly: its float32 copy rounds back to it.
            weight = getattr(child, "weight", None)
            if weight is None:
                weight = _parameter(_float32_weight(child.inner).to(torch.bfloat16))
            if child.inner.bias is not None:
                bias = _parameter(child.inner.bias.to(torch.bfloat16))
        elif isinstance(child, SkinnyLinear) or (
            isinstance(child, PackedLinear) and child.packed_weight.dtype == torch.float32
        ):
            weight = _float32_weight(child)
        else:
            return None
        linear = torch.nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
        linear.weight, linear.bias = weight, bias
        originals[id(linear)] = child
        return linear

    swap_children(model, to_linear)
    try:
        yield
    finally:
        swap_children(model, lambda name, child: originals.get(id(child)))


def teacher_forced_shortfalls(
    model: torch.nn.Module, prompt: list[int], output: list[int], implementation: str = "sdpa"
) -> torch.Tensor:
    """How far below Hugging Face's best log-probability each engine token of `output` falls (0
    where it is HF's argmax), given the prompt and the engine's own earlier tokens: one forward
    pass of the whole sequence through `implementation`, with HF's linears.

    For outputs that may part from a free-running `generate` at a flipped rounding (a K/V cache in
    a smaller dtype, bfloat16 sums in another order) yet must stay HF's choices token by token."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        with torch.inference_mode(), hugging_face_linears(model):
            logits = model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]
    finally:
        model.set_attn_implementation(previous)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs[torch.arange(len(output)), torch.tensor(output)]
    return logprobs.max(dim=-1).values - chosen


def _float32_weight(module: torch.nn.Module) -> torch.nn.Parameter:
    """A float32 linear's plain weight, whichever module the loader made of it."""
    weight = getattr(module, "weight", None)
    if weight is None:  # an untied packed layer keeps only oneDNN's copy
        weight = _parameter(module.packed_weight.to_dense())
    return weight


def _parameter(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor, requires_grad=False)


def hf_greedy_reference(
    model: torch.nn.Module,
    prompt_token_ids: list[int],
    max_new_tokens: int,
    attn_implementation: str = "sdpa",
) -> Reference:
    """`model.generate` for one prompt, greedy, EOS disabled (so exactly `max_new_tokens` come back).

    EOS is disabled rather than banned: `min_new_tokens` would mask EOS's logit and change the
    argmax, while the engine's `ignore_eos=True` keeps sampling EOS like any other token.
    """
    (reference,) = _hf_greedy_batch(model, [prompt_token_ids], max_new_tokens, attn_implementation)
    return reference


def hf_greedy_references(
    model: torch.nn.Module, prompts: dict[str, list[int]], max_new_tokens: int
) -> dict[str, Reference]:
    """`hf_greedy_reference` of many prompts, those of similar lengths in one left-padded
    `model.generate` call (a group's longest prompt is at most twice its shortest plus 64 tokens,
    so padding never much more than doubles a group's prefill). Batched, the 20 prompts of
    test_greedy_equality took 31 s instead of 82 one at a time, every token the same (2-core Ice
    Lake); each row of a batch is computed as HF's batched generation computes it (masked padding,
    positions from the attention mask)."""
    groups: list[list[str]] = []
    for name in sorted(prompts, key=lambda name: len(prompts[name])):
        if not groups or len(prompts[name]) > 2 * len(prompts[groups[-1][0]]) + 64:
            groups.append([])
        groups[-1].append(name)
    references = {}
    for group in groups:
        batch = _hf_greedy_batch(model, [prompts[name] for name in group], max_new_tokens)
        references.update(zip(group, batch, strict=True))
    return {name: references[name] for name in prompts}


def _hf_greedy_batch(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    attn_implementation: str = "sdpa",
) -> list[Reference]:
    """One greedy `model.generate` call over `prompts`, left-padded to the longest."""
    width = max(len(prompt) for prompt in prompts)
    pad_token_id = 0
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    previous = model.config._attn_implementation
    previous_eos = model.generation_config.eos_token_id
    model.set_attn_implementation(attn_implementation)
    model.generation_config.eos_token_id = None  # a None in our config would fall back to it
    generation_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    try:
        with torch.inference_mode(), hugging_face_linears(model):
            out = model.generate(
                input_ids, attention_mask=attention_mask, generation_config=generation_config
            )
    finally:
        model.set_attn_implementation(previous)
        model.generation_config.eos_token_id = previous_eos
    assert out.sequences.shape[1] == width + max_new_tokens
    return [
        _reference(out.sequences[row, width:].tolist(), [step[row] for step in out.logits])
        for row in range(len(prompts))
    ]


def _reference(token_ids: list[int], logits: list[torch.Tensor]) -> Reference:
    """The tokens and, at each position, the top-2 logprob gap and the near-tied best tokens."""
    assert len(token_ids) == len(logits)
    near_ties, gaps = [], []
    for row in logits:
        logprobs = torch.log_softmax(row.float(), dim=-1)
        top2 = logprobs.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        near_ties.append(
            frozenset((logprobs >= top2[0] - NEAR_TIE_LOGPROB_GAP).nonzero()[:, 0].tolist())
        )
    return Reference(token_ids, near_ties, gaps)


def assert_matches_reference(actual: list[int], reference: Reference, label: str) -> int | None:
    """Token-identical, or diverging only at a documented near-tie of the reference.

    Returns the diverging position (None if identical). A near-tie divergence is reported with a
    warning, never silently: the engine's token must be one of HF's near-tied best tokens there.
    """
    for position, (got, want) in enumerate(zip(actual, reference.token_ids, strict=False)):
        if got != want:
            gap = reference.top2_gaps[position]
            assert gap < NEAR_TIE_LOGPROB_GAP and got in reference.near_tie_token_ids[position], (
                f"{label}: engine diverges from HF at output position {position}: engine {got}, HF {want}, "
                f"HF top-2 logprob gap {gap:.3g} (not a near-tie)\n engine {actual}\n HF     {reference.token_ids}"
            )
            _near_tie_divergences.append(f"{label} @ {position}")
            assert len(_near_tie_divergences) <= MAX_NEAR_TIE_DIVERGENCES, (
                f"too many near-tie divergences this session: {_near_tie_divergences}"
            )
            warnings.warn(
                f"{label}: accepted near-tie divergence at position {position} (gap {gap:.2g})",
                stacklevel=2,
            )
            return position
    assert len(actual) == len(reference.token_ids), (
        f"{label}: {len(actual)} tokens, HF {len(reference.token_ids)}"
    )
    return None


# ---- running the engine ------------------------------------------------------------------------


@dataclass
class EngineRun:
    """What a run produced: keyed by request id for choice 0, by (request id, index) for the others."""

    token_ids: dict = field(default_factory=dict)
    texts: dict = field(default_factory=dict)
    finish_reasons: dict = field(default_factory=dict)
    stop_reasons: dict = field(default_factory=dict)  # vLLM's stop_reason of each finished choice
    prompt_logprobs: dict = field(default_factory=dict)  # key -> the entries, sent once
    plans: list[SchedulerOutput] = field(default_factory=list)
    max_ref_counts: list[int] = field(
        default_factory=list
    )  # highest block ref count after each step


def record_plans(engine: LLMEngine, run: EngineRun) -> None:
    """Keep every plan the scheduler makes (wraps this engine's `schedule`)."""
    schedule = engine.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        plan = schedule()
        run.plans.append(plan)
        return plan

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]


def run_to_completion(
    engine: LLMEngine, run: EngineRun | None = None, max_steps: int = 50_000
) -> EngineRun:
    """Step until nothing is left; check invariants every step and that every block is free at the end."""
    if run is None:
        run = EngineRun()
        record_plans(engine, run)
    block_manager = engine.block_manager
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for delta in engine.step():
            key = delta.request_id if delta.index == 0 else (delta.request_id, delta.index)
            run.token_ids.setdefault(key, []).extend(delta.new_token_ids)
            run.texts[key] = run.texts.get(key, "") + delta.new_text
            if delta.finished:
                run.finish_reasons[key] = delta.finish_reason
                run.stop_reasons[key] = delta.stop_reason
            if delta.prompt_logprobs is not None:
                assert key not in run.prompt_logprobs, f"{key}: prompt logprobs sent twice"
                run.prompt_logprobs[key] = delta.prompt_logprobs
        block_manager.check_invariants()
        run.max_ref_counts.append(max(block.ref_count for block in block_manager.pool.blocks))
    else:
        raise AssertionError(f"no completion after {max_steps} steps")
    assert not block_manager.tables, "a finished run left block tables behind"
    assert block_manager.num_free_blocks == block_manager.pool.num_blocks, "blocks leaked"
    return run


def greedy_params(max_tokens: int, **overrides: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **overrides)


def add_requests(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams) -> None:
    for request_id, prompt_token_ids in prompts.items():
        engine.add_request(request_id, prompt_token_ids, params)
