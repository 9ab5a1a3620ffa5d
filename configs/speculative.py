"""`SpeculativeConfig`: n-gram (prompt-lookup) speculative decoding, vLLM's flag shape.

`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
"prompt_lookup_max": 4}'` (a JSON object on the command line or in `PAGEDSERVE_SPECULATIVE_CONFIG`,
a mapping in the YAML file). Absent (the default) means no speculation at all.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["ngram"] = Field(description="how drafts are proposed (prompt lookup)")
    num_speculative_tokens: int = Field(ge=1, le=16, description="drafts proposed per step (K)")
    prompt_lookup_min: int = Field(1, ge=1, description="shortest suffix n-gram looked up")
    prompt_lookup_max: int = Field(4, ge=1, le=16, description="longest suffix n-gram looked up")
    # The gate, from benchmarks/spec_decode.py on the 2-core CPU: verifying K drafts costs K more
    # rows of the forward pass. At batch 1 a step is bound by reading the weights and the drafts
    # are nearly free (2.2x faster); at batch 4 the extra rows already cost what accepted drafts
    # save (0.99x), and a larger batch is compute-bound: every rejected draft is lost work.
    disable_by_batch_size: int = Field(
        4, ge=1, description="no drafts in a step with more running sequences than this"
    )
    # A request whose recent drafts are mostly rejected stops drafting for a while (the rows it
    # adds cost compute and it has no copying pattern to exploit).
    min_acceptance_rate: float = Field(
        0.1, ge=0.0, le=1.0, description="recent acceptance below which a request pauses drafting"
    )

    @model_validator(mode="after")
    def _ordered(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self
