"""What a model must be for the model runner to serve it through the paged cache, checked once
at load: attention routed through transformers' AttentionInterface (so it reaches
engine/model_runner.py's `paged_attention_forward`), latent attention in transformers' latent-
cache layout, and no RoPE scaling that depends on the batch."""

from __future__ import annotations

import torch

ATTN_IMPLEMENTATION = "pagedserve"  # the name the paged attention function is registered under

# Rotary variants that pick their scaling from the largest position in the whole flattened batch:
# one long request would change the encoding of every short one batched with it.
_BATCH_DEPENDENT_ROPE = ("longrope", "dynamic")


def check_paged_attention_support(model: torch.nn.Module) -> None:
    """Refuse, at load, a model whose attention would bypass or mis-serve the paged cache.

    Raises:
        ValueError: naming the model class and why.
    """
    name = type(model).__name__
    config = model.config
    if getattr(config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        # transformers keeps eager/sdpa, with only a warning, for classes that do not route
        # attention through AttentionInterface: each step would then attend over its own tokens
        # only, across requests, with no history.
        raise ValueError(
            f"{name} does not route attention through transformers' "
            "AttentionInterface, so it cannot read the paged KV cache"
        )
    if getattr(config, "kv_lora_rank", None) is not None and not all(
        hasattr(module, "expand_kv") for module in _attention_modules(model)
    ):
        # The latent is only reachable where the attention writes it through `cache.update`
        # and expands it afterwards (transformers' DeepSeek-V2/V3 layout): see latent_attention.
        raise ValueError(
            f"{name} uses multi-head latent attention without transformers' latent-cache "
            "layout (cache.update of the latent, then expand_kv), so its paged latent cache "
            "cannot be filled; not supported"
        )
    for rope in (getattr(config, "rope_scaling", None), getattr(config, "rope_parameters", None)):
        rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
        if rope_type in _BATCH_DEPENDENT_ROPE:
            raise ValueError(
                f"{name} uses {rope_type!r} RoPE scaling, which depends on the longest "
                "sequence in a batch and would mix requests; it is not supported"
            )


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [
        module
        for name, module in model.named_modules()
        if name.endswith("self_attn") and getattr(module, "layer_idx", None) is not None
    ]
