"""LoRA adapters through the real engine on the default model: one batch mixing the base model
and two adapters gives each request Hugging Face's greedy tokens for its own model (the HF
model's targeted linears adding the same low-rank terms), adapters never share prefix-cache
blocks with the base model, and what cannot be served is refused by name."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import Phi3Config, Phi3ForCausalLM

from pagedserve.configs import SamplingParams, load_engine_config
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.lora import LoRAError
from pagedserve.engine.model_loader import LoadedModel
from tests.engine.conftest import (
    TINY_COMMON,
    TINY_MAX_MODEL_LEN,
    assert_matches_reference,
    hf_greedy_reference,
    make_engine,
    run_to_completion,
)

MAX_NEW_TOKENS = 10
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {  # name -> (layers, projections, rank, alpha, rsLoRA)
    "sql": ((0, 1, 29), ALL_PROJECTIONS, 8, 16, False),
    "chat": (range(30), ("q_proj", "v_proj"), 4, 8, True),
}


def _part(projection: str) -> str:
    return "mlp" if projection.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"


def _module(model: nn.Module, layer: int, projection: str) -> nn.Linear:
    return getattr(getattr(model.model.layers[layer], _part(projection)), projection)


def _path(layer: int, projection: str) -> str:
    return f"model.layers.{layer}.{_part(projection)}.{projection}"


def write_adapter(
    folder: Path, model: nn.Module, spec, seed: int, extra: dict | None = None, **config
) -> dict:
    """A PEFT LoRA folder of random A and B (plus `extra` tensors, by key); returns module path
    -> (A, B, scale)."""
    layers, projections, rank, alpha, rslora = spec
    generator = torch.Generator().manual_seed(seed)
    tensors, terms = {}, {}
    for layer in layers:
        for projection in projections:
            linear = _module(model, layer, projection)
            a = torch.randn(rank, linear.in_features, generator=generator) * 0.1
            b = torch.randn(linear.out_features, rank, generator=generator) * 0.1
            key = f"base_model.model.{_path(layer, projection)}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
            terms[_path(layer, projection)] = (a, b, alpha / (rank**0.5 if rslora else rank))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors | (extra or {}), folder / "adapter_model.safetensors")
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": rslora}
    settings |= {"target_modules": list(projections), "bias": "none"} | config
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return terms


class ReferenceLoRA(nn.Module):
    """HF's linear plus the adapter's term, computed the plain way (the reference)."""

    def __init__(self, linear: nn.Linear, a: torch.Tensor, b: torch.Tensor, scale: float):
        super().__init__()
        self.linear, self.a, self.b, self.scale = linear, a, b, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + (x @ self.a.T) @ (self.b * self.scale).T


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, default_hf_model) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: (root / name, write_adapter(root / name, default_hf_model, spec, seed))
        for seed, (name, spec) in enumerate(ADAPTERS.items())
    }


def _engine(default_model_path: Path, modules: list[str], **settings) -> LLMEngine:
    cli = {"model": str(default_model_path), "dtype": "float32", "device": "cpu"}
    cli |= {"num_kv_blocks": 128, "enable_lora": True, "lora_modules": modules} | settings
    return LLMEngine(load_engine_config(cli=cli, environ={}))


@pytest.fixture(scope="module")
def engine(default_model_path, adapters) -> LLMEngine:
    return _engine(default_model_path, [f"{name}={path}" for name, (path, _) in adapters.items()])


def _reference(
    default_hf_model, terms: dict | None, prompt: list[int], max_new_tokens=MAX_NEW_TOKENS
):
    model = default_hf_model
    if terms:
        model = copy.deepcopy(default_hf_model)
        for path, (a, b, scale) in terms.items():
            parent, _, leaf = path.rpartition(".")
            owner = model.get_submodule(parent)
            setattr(owner, leaf, ReferenceLoRA(getattr(owner, leaf), a, b, scale))
    return hf_greedy_reference(model, prompt, max_new_tokens)


def test_a_mixed_batch_gives_each_request_its_own_models_tokens(engine, adapters, default_hf_model):
    prompts = {
        None: engine.tokenizer.encode("The capital of France is"),
        "sql": engine.tokenizer.encode("Write a query that lists every user:"),
        "chat": engine.tokenizer.encode("Tell me a joke about cats."),
    }
    for lora, prompt in prompts.items():  # together, prefill and decode rows mixed
        for other in dict.fromkeys((None, lora)):
            params = SamplingParams(
                temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, lora=other
            )
            engine.add_request(f"{lora}-{other}", prompt, params)
    run = run_to_completion(engine)
    for lora, prompt in prompts.items():
        terms = adapters[lora][1] if lora else None
        reference = _reference(default_hf_model, terms, prompt)
        assert_matches_reference(run.token_ids[f"{lora}-{lora}"], reference, f"lora {lora}")
        if lora:  # the adapter changes the output: the same prompt on the base model differs
            assert run.token_ids[f"{lora}-None"] != run.token_ids[f"{lora}-{lora}"]


def test_an_adapter_never_shares_cached_blocks_with_the_base_model(engine):
    prompt = engine.tokenizer.encode("A long shared prefix. " * 12)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    cached = {}
    for request_id, lora in (("base", None), ("sql-1", "sql"), ("sql-2", "sql"), ("chat", "chat")):
        engine.add_request(request_id, prompt, SamplingParams(**{**_fields(params), "lora": lora}))
        deltas = []
        while engine.has_unfinished_requests():
            deltas += engine.step()
        cached[request_id] = max(delta.num_cached_prompt_tokens for delta in deltas)
    assert cached["base"] == 0 and cached["sql-1"] == 0 and cached["chat"] == 0
    assert cached["sql-2"] > 0  # the same adapter does share


def _fields(params: SamplingParams) -> dict:
    return {"temperature": params.temperature, "max_tokens": params.max_tokens}


def test_a_request_naming_an_unknown_adapter_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'nope'") as error:
        engine.add_request("x", [1, 2, 3], SamplingParams(lora="nope"))
    assert error.value.param == "lora" and not engine.has_unfinished_requests()


A_64 = torch.zeros(8, 64)
B_576 = torch.zeros(576, 8)  # o_proj's rows, with A_64's columns of another width


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 128}, "max-lora-rank"),
        # Layers that do not run the step's token rows, or are no linear layers, and weights
        # the loader would otherwise drop.
        ({"extra": {"base_model.model.lm_head.lora_A.weight": A_64}}, "only a decoder layer"),
        (
            {
                "extra": {
                    "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight": A_64
                }
            },
            "only a decoder layer",
        ),
        (
            {"extra": {"base_model.model.model.embed_tokens.lora_embedding_A": A_64}},
            "weights not supported",
        ),
        (
            {"extra": {"base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight": B_576}},
            "weights not supported",  # a lora_B without its lora_A
        ),
        # Shapes of another model.
        (
            {
                "extra": {
                    "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight": A_64,
                    "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight": B_576,
                }
            },
            "lora_A has 64 columns",
        ),
    ],
)
def test_adapters_the_engine_cannot_compute_are_refused(
    tmp_path, default_model_path, default_hf_model, config, message
):
    spec = ((0,), ("q_proj",), 8, 8, False)
    write_adapter(tmp_path / "bad", default_hf_model, spec, 0, **config)
    with pytest.raises(LoRAError, match=message):
        _engine(default_model_path, [f"bad={tmp_path / 'bad'}"])


def test_a_model_that_fuses_its_own_projections_takes_adapters_on_them(tmp_path, default_tokenizer):
    # Phi-3's qkv_proj and gate_up_proj are the model's own: one slice each, not pagedserve's
    # fused parts.
    config = Phi3Config(
        **TINY_COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    torch.manual_seed(0)
    model = Phi3ForCausalLM(config).float().eval()
    terms = write_adapter(
        tmp_path / "phi", model, ((0, 1), ("qkv_proj", "gate_up_proj"), 4, 8, False), 0
    )
    loaded = LoadedModel(
        copy.deepcopy(model), default_tokenizer, config, Path("."), TINY_MAX_MODEL_LEN
    )
    engine = make_engine(loaded, enable_lora=True, lora_modules=[f"phi={tmp_path / 'phi'}"])
    prompt = list(range(5, 17))
    engine.add_request(
        "p", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, lora="phi")
    )
    run = run_to_completion(engine)
    assert_matches_reference(run.token_ids["p"], _reference(model, terms, prompt, 8), "phi-3 lora")
    with pytest.raises(LoRAError, match="already serves"):  # its wrappers follow that engine
        make_engine(loaded)
    # Phi-3 has no q_proj of its own to take a part of: refused, not a crash.
    q_proj = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}
    q_proj["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] = torch.zeros(64, 4)
    write_adapter(tmp_path / "q", model, ((), (), 4, 8, False), 0, extra=q_proj)
    fresh = LoadedModel(copy.deepcopy(model), default_tokenizer, config, Path("."), 512)
    with pytest.raises(LoRAError, match="not a linear layer"):
        make_engine(fresh, enable_lora=True, lora_modules=[f"q={tmp_path / 'q'}"])


@pytest.mark.parametrize(
    ("config_text", "weights", "message"),
    [
        ("[]", None, "not a JSON object"),
        ('{"r": 1e999}', None, "must be numbers"),
        ('{"r": 8}', b"version https://git-lfs.github.com/spec/v1\n", "holds no|at"),
        ('{"r": 8}', b"", "at"),
    ],
)
def test_unreadable_adapter_folders_are_refused_by_name(
    tmp_path, default_model_path, config_text, weights, message
):
    folder = tmp_path / "broken"
    write_adapter(folder, nn.Module(), ((), (), 8, 8, False), 0)  # a valid empty folder first
    (folder / "adapter_config.json").write_text(config_text)
    if weights is not None:
        (folder / "adapter_model.safetensors").write_bytes(weights)
    with pytest.raises(LoRAError, match=message):
        _engine(default_model_path, [f"broken={folder}"])
