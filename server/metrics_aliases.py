"""The few gauges that routers and autoscalers read by vLLM's exact names, exported again under
`vllm:` beside our `pagedserve:` series (same snapshot, same meaning, same `model_name` label).

The Gateway API Inference Extension's endpoint picker reads `vllm:num_requests_waiting`,
`vllm:num_requests_running`, `vllm:kv_cache_usage_perc` (older releases:
`vllm:gpu_cache_usage_perc`) and `vllm:cache_config_info`; an HPA on waiting requests usually
names the vLLM gauge too. Everything else stays under `pagedserve:` only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.engine.outputs import EngineStats

VLLM_PREFIX = "vllm:"

# vLLM name -> (EngineStats field, vLLM's help text)
VLLM_GAUGES: dict[str, tuple[str, str]] = {
    "num_requests_running": (
        "num_requests_running",
        "Number of requests in model execution batches.",
    ),
    "num_requests_waiting": ("num_requests_waiting", "Number of requests waiting to be processed."),
    "kv_cache_usage_perc": ("kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
    # vLLM V0's name for the same gauge; older inference-gateway releases still read it.
    "gpu_cache_usage_perc": ("kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
}


class VllmAliasCollector(Collector):
    """Yields the `VLLM_GAUGES` and `vllm:cache_config_info` from one stats snapshot per scrape."""

    def __init__(self, read_stats: Callable[[], EngineStats], model_name: str) -> None:
        self.read_stats = read_stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.read_stats()
        for name, (field, documentation) in VLLM_GAUGES.items():
            gauge = GaugeMetricFamily(VLLM_PREFIX + name, documentation, labels=["model_name"])
            gauge.add_metric([self.model_name], float(getattr(stats, field)))
            yield gauge
        info = InfoMetricFamily(
            VLLM_PREFIX + "cache_config",
            "Information of the KV-cache config.",
            labels=["model_name"],
        )
        # vLLM's label names: the picker reads block_size and num_gpu_blocks (device-agnostic here).
        info.add_metric(
            [self.model_name],
            {
                "block_size": str(stats.block_size),
                "num_gpu_blocks": str(stats.num_total_blocks),
                "cache_dtype": stats.cache_dtype,
            },
        )
        yield info
