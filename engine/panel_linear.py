"""CPU linears at decode-sized batches through the C++ panel kernel
(cache/attention/csrc/panel_linear.cpp), larger batches through the layer as the loader packed it.

A decode step multiplies one row per running request by each weight. oneDNN's packed linear,
which the loader uses for float32 and native-bfloat16 layers, runs such batches well below its
prefill rate; the panel kernel keeps 12 rows x 32 columns of sums in AVX-512 registers over a
weight packed once into column panels, prefetching the next panel while it computes. The default
model's 120 decoder linears, cold weights, two threads, a 2-core AMD EPYC Zen 4 (AVX-512 with
AVX512_BF16), oneDNN against the kernel (`python -m pagedserve.benchmarks.decode_linears`;
benchmarks/RESULTS.md, "Seventeenth session"):

| rows | bfloat16 ms | float32 ms |
| ---: | ---: | ---: |
| 1 | 17.1 -> 10.5 | 28.3 -> 16.3 (the skinny kernel: 14.4) |
| 16 | 21.0 -> 15.5 | 33.0 -> 28.8 (skinny: 33.7) |
| 64 | 50.7 -> 45.3 | 100.4 -> 79.2 |
| 128 | 89.1 -> 85.6 | 174.1 -> 152.9 |

So every decoder linear sends 1-MAX_ROWS rows to the kernel, where the host's build is AVX-512:
the AVX2 build was level with oneDNN at 64 rows (0.98x), so AVX2 hosts keep oneDNN and the
skinny kernel. float32 models under `--cpu-float32-linear mkl`, which asks for Hugging Face's exact
sums, keep their linears. At one float32 row the skinny kernel is a little faster still (14.4
against 16.3 ms), but keeping it for every layer beside the panels would keep a third copy of each
weight: panel hosts give it the head only.

The LM head (the default model's 49,152 x 576, tied to the embeddings) takes the kernel in
bfloat16 too: cold weights, two threads, Zen 4, oneDNN against the kernel 2.03 -> 1.15 ms at one
row, 1.69 -> 1.14 at 4, 3.08 -> 2.50 at 16, 9.34 -> 8.81 at 64, 17.6 -> 17.2 at 128; whole decode
steps at batch 1 11.66 -> 10.49 ms, at batch 64 0.4 ms less (benchmarks/RESULTS.md,
"Twenty-seventh session"). Its panels are one more copy of the head's weight (57 MB there). A
float32 head keeps the skinny kernel and oneDNN: the panels were 1.14x at one row and 1.05x at 64
there, for another 113 MB copy.

On a CPU with AMX (Sapphire Rapids and later) oneDNN's packed bfloat16 linear multiplies decode
batches on AMX tiles, faster than the kernel's AVX512_BF16 dot products from two rows on (120
decoder linears, cold weights, two threads: 12.5 -> 13.4 ms at 2 rows, 18.6 -> 75.0 at 64;
benchmarks/RESULTS.md, "Twenty-ninth session"). So there the kernel multiplies the same panels on
AMX tiles too (a panel's pairs of k are the tiles' layout; panel_linear.cpp), where Linux grants
the tile state (`panel_amx`): 13.3 -> 10.0 ms at 1 row, 13.0 -> 9.9 at 2, 13.7 -> 10.3 at 16,
15.9 -> 11.3 at 32, 18.5 -> 16.7 at 64 (17.5-18.2 in other runs), 25.3 -> 26.6 at 128; the head
1.18-1.29x oneDNN's at 1-32 rows and 0.94-1.07x at 64 ("Thirtieth session"). Past 32 rows each
panel is multiplied a second time, from L2, for the next 32, and the gain shrinks: so AMX hosts
send 1-AMX_MAX_ROWS rows to the kernel, and where the tiles are refused, one row only
(`panel_max_rows`).

Each swapped layer keeps its packed copy for prefill batches: the panels are a second copy of the
weight, logged at load. bfloat16 layers with a bias are left alone (the kernel rounds its sums to
bfloat16 before the module adds the bias, where oneDNN adds it first and rounds once: a bias that
nearly cancels a sum would show the second rounding), and so are bfloat16 ones with an odd
in_features (the kernel multiplies pairs of k). Sums run in another order than oneDNN's: float32
results agree to float32 rounding, bfloat16 ones to one bfloat16 rounding of the output (each swap
is checked on a probe).
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import Tensor, nn

from pagedserve.cache.attention.cpu_features import host_cpu_flags
from pagedserve.cache.huge_pages import copy_to_huge_pages
from pagedserve.engine.module_swap import cpu_kernel_or_none, swap_verified, within_float32_rounding
from pagedserve.engine.packed_linear import can_pack, can_pack_float32
from pagedserve.engine.widened_linear import WidenedLinear, computes_linears_in_float32

logger = logging.getLogger(__name__)

# The batches the kernel takes: at 128 rows it was still 1.01x (bfloat16) and 1.12x (float32)
# oneDNN's, past that prefill sizes, where oneDNN is as fast or faster (0.92-1.02x bfloat16 at 512).
MAX_ROWS = 128
# bfloat16 on a CPU with AMX (module docstring): up to AMX_MAX_ROWS rows on the kernel's tiles, or
# one row where the kernel may not use them and oneDNN's AMX linear takes every larger batch.
AMX_MAX_ROWS = 64
AMX_BF16_MAX_ROWS = 1
PANEL_LANES = 16  # the kernel is used on AVX-512 builds only (module docstring)


class PanelLinear(nn.Module):
    """A linear layer whose 1-`max_rows`-row batches go through the panel kernel and whose larger
    ones go to `fallback` (the layer itself, which the loader may pack for oneDNN afterwards)."""

    def __init__(self, linear: nn.Linear, kernel: ModuleType, max_rows: int = MAX_ROWS) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias  # the same Parameter as the fallback's, added after the kernel
        self.max_rows = max_rows
        # Not part of the state dict: a layout of the fallback's weight, made again at load. On
        # huge pages (cache/huge_pages.py): every decode step streams all panels from memory.
        panels = copy_to_huge_pages(kernel.pack_panels(linear.weight.detach()))
        self.register_buffer("panels", panels, persistent=False)
        self.fallback = linear
        self._kernel = kernel

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        if not 1 <= rows <= self.max_rows or x.dtype != self.panels.dtype:
            return self.fallback(x)
        output = self._kernel.panel_linear(x, self.panels, self.out_features)
        return output if self.bias is None else output + self.bias

    def extra_repr(self) -> str:
        return f"panels=C++ at 1-{self.max_rows} rows"


def panel_dtype(model: nn.Module, float32_linear: str = "auto") -> torch.dtype | None:
    """The dtype of the linears `use_panel_linears` would swap in this model, or None: float32 ones
    where the loader packs them for oneDNN (the config's `cpu_float32_linear`), bfloat16 ones on a
    CPU with native bf16; either only where the host's kernel build is AVX-512 (one with
    AVX512_BF16 for bfloat16)."""
    if computes_linears_in_float32(model):
        dtype = torch.float32 if can_pack_float32(model, float32_linear) else None
    else:
        dtype = torch.bfloat16 if can_pack(model) else None
    if dtype is None:
        return None
    kernel = cpu_kernel_or_none("the panel linears")
    if kernel is None or kernel.vector_lanes != PANEL_LANES:
        return None
    return dtype if dtype == torch.float32 or kernel.panel_bf16 else None


def panel_max_rows(
    dtype: torch.dtype, flags: frozenset[str] | None = None, amx_panels: bool | None = None
) -> int:
    """The largest batch a panel linear of `dtype` sends to the kernel on a CPU with `flags` (None:
    the host's) whose kernel does (`amx_panels`; None: the host's kernel) or does not multiply
    bfloat16 panels on AMX tiles: for bfloat16 on a CPU with AMX, AMX_MAX_ROWS on the kernel's
    tiles or one row without them; else MAX_ROWS (module docstring)."""
    flags = host_cpu_flags() if flags is None else flags
    if dtype != torch.bfloat16 or "amx_bf16" not in flags:
        return MAX_ROWS
    if amx_panels is None:
        kernel = cpu_kernel_or_none("the panel linears")
        amx_panels = kernel is not None and kernel.panel_amx
    return AMX_MAX_ROWS if amx_panels else AMX_BF16_MAX_ROWS


def use_panel_linears(
    model: nn.Module,
    dtype: torch.dtype,
    kernel: ModuleType | None = None,
    max_rows: int | None = None,
) -> int:
    """Swap every `nn.Linear` of `dtype` for a `PanelLinear` whose fallback is that layer (the LM
    head only in bfloat16: module docstring); returns how many. Each sends 1-`max_rows` rows to
    the kernel (None: `panel_max_rows` for the host). Call it before the layers are packed
    (packing then packs each fallback). A layer whose kernel output is not within rounding of its
    own on a probe is left as it is (and logged)."""
    kernel = kernel or cpu_kernel_or_none("the panel linears")
    if kernel is None:
        return 0
    if max_rows is None:
        max_rows = panel_max_rows(dtype, amx_panels=kernel.panel_amx)
    head = _head_linear(model) if dtype == torch.float32 else None

    def panel(child: nn.Module) -> PanelLinear | None:
        if type(child) is not nn.Linear or child is head or child.weight.dtype != dtype:
            return None
        if dtype == torch.bfloat16 and (child.bias is not None or child.in_features % 2):
            return None  # module docstring
        return PanelLinear(child, kernel, max_rows)

    def agrees(linear: nn.Linear, panel: PanelLinear) -> bool:  # float32 sums, bf16 outputs
        return within_float32_rounding(linear, panel, rows=min(8, max_rows))  # rows it computes

    return swap_verified(model, panel, agrees, "the panel kernel")


def swap_in_panel_linears(model: nn.Module, float32_linear: str = "auto") -> torch.dtype | None:
    """The loader's step: `use_panel_linears` where `panel_dtype` says it applies, logged; returns
    the dtype of the swapped layers, or None."""
    dtype = panel_dtype(model, float32_linear)
    if dtype is None or not (swapped := use_panel_linears(model, dtype)):
        return None
    logger.info(
        "%d %s linear layers run 1-%d rows through the panel kernel (%.0f MiB of panels)",
        swapped,
        str(dtype).removeprefix("torch."),
        panel_max_rows(dtype),
        panel_weight_mib(model),
    )
    return dtype


def panel_weight_mib(model: nn.Module) -> float:
    """The panel copies' memory."""
    panels = [m.panels for m in model.modules() if isinstance(m, PanelLinear)]
    return sum(p.numel() * p.element_size() for p in panels) / 2**20


def _head_linear(model: nn.Module) -> nn.Module | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head.inner if isinstance(head, WidenedLinear) else head
