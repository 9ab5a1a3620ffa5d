"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): LoRA adapters loaded and
unloaded while serving. The routes exist only with --allow-runtime-lora-updating, as vLLM's only
with VLLM_ALLOW_RUNTIME_LORA_UPDATING, since a load reads any folder the server can read.

A load reads and checks the PEFT folder on the engine thread between two steps
(engine/runtime_lora.py); what cannot be served is a 400 naming why (a folder that is not there a
404), and nothing changes. An unloaded adapter is gone from /v1/models and refused to new
requests at once, while its running requests finish with it. Answers are vLLM's: plain text on
success, OpenAI-style JSON errors otherwise.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from pagedserve.engine.lora_adapter import LoRAError
from pagedserve.server.errors import APIError, invalid_request
from pagedserve.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

router = APIRouter()


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> str:
    engine, name = request.app.state.engine, body.lora_name
    path = str(Path(body.lora_path).expanduser()) if body.lora_path else body.lora_path
    if not name or not path:
        raise invalid_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    if name in engine.served_model_names:
        raise invalid_request(f"The lora adapter '{name}' conflicts with the served model.")
    if name in engine.lora_adapters and not body.load_inplace:
        raise invalid_request(
            f"The lora adapter '{name}' has already been loaded; set 'load_inplace' to replace "
            "it (requests running it finish with it).",
            "lora_name",
        )
    if not Path(path).is_dir():
        raise APIError(404, f"No LoRA adapter folder at {path!r}.", "not_found_error", "lora_path")
    try:
        await engine.load_lora_adapter(name, path, replace=body.load_inplace)
    except LoRAError as error:
        raise invalid_request(str(error), "lora_path") from None
    return f"Success: LoRA adapter '{name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> str:
    name = body.lora_name
    if not name:
        raise invalid_request("'lora_name' needs to be provided to unload a LoRA adapter.")
    try:
        await request.app.state.engine.unload_lora_adapter(name)
    except KeyError:
        raise APIError(
            404, f"The lora adapter '{name}' cannot be found.", "not_found_error", "lora_name"
        ) from None
    return f"Success: LoRA adapter '{name}' removed successfully."
