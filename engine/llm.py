"""`LLM`: the offline API in vLLM's shape: `LLM(model).generate(prompts, SamplingParams)`."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from pagedserve.configs import SamplingParams, load_engine_config
from pagedserve.configs.engine import DEFAULT_MODEL, OFFLINE_MAX_NUM_BATCHED_TOKENS
from pagedserve.engine.classifier import probabilities
from pagedserve.engine.embeddings import normalized
from pagedserve.engine.errors import RequestFailedError
from pagedserve.engine.heap import freeze_startup_objects
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.outputs import (
    ClassificationOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)

PromptInput = str | list[int]
EMBEDDING = SamplingParams(max_tokens=1, temperature=0.0, embed=True)  # the token is dropped


class LLM:
    """Batch generation without a server. Engine keyword arguments mirror the CLI flags
    (`block_size`, `num_kv_blocks`, `kv_cache_memory`, `max_model_len`, `max_num_seqs`,
    `max_num_batched_tokens`, `enable_prefix_caching`, `dtype`, `device`, `attention_backend`,
    ...). `max_num_batched_tokens` defaults to OFFLINE_MAX_NUM_BATCHED_TOKENS here (with chunked
    prefill on), not to the server's 512: a batch job wants throughput, not a short step for the
    next arrival. Once built, everything alive is frozen out of the garbage collector's full
    passes, as the server does (engine/heap.py)."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        if engine_args.get("enable_chunked_prefill", True):  # else max_model_len (SchedulerConfig)
            engine_args.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)
        config = load_engine_config(cli={"model": model, **engine_args}, environ={})
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        freeze_startup_objects()  # out of the collector's full passes (engine/heap.py)

    def default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults (its generation config's; vLLM's method of this name)."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, all submitted together; outputs in prompt order.
        Without `sampling_params`, the model's sampling defaults (as vLLM's `LLM`)."""
        prompts = _prompt_list(prompts)
        params_list = _broadcast(sampling_params or self.default_sampling_params(), len(prompts))
        outputs: dict[str, RequestOutput] = {}
        added = self._add_all(prompts, params_list)
        for prompt, params, (request_id, token_ids) in zip(
            prompts, params_list, added, strict=True
        ):
            outputs[request_id] = RequestOutput(
                request_id,
                prompt if isinstance(prompt, str) else None,
                token_ids,
                [
                    CompletionOutput(i, "", [], None, [] if params.logprobs is not None else None)
                    for i in range(params.n)
                ],
                finished=False,
            )
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                output = outputs[delta.request_id]
                if delta.prompt_logprobs is not None and output.prompt_logprobs is None:
                    output.prompt_logprobs = list(delta.prompt_logprobs)
                choice = output.outputs[delta.index]
                choice.text += delta.new_text
                choice.token_ids.extend(delta.new_token_ids)
                if choice.logprobs is not None and delta.new_logprobs:
                    choice.logprobs.extend(delta.new_logprobs)
                if delta.finished:
                    choice.finish_reason = delta.finish_reason
                    choice.stop_reason = delta.stop_reason
        for output in outputs.values():
            output.finished = True
        return list(outputs.values())

    def embed(
        self, prompts: PromptInput | Sequence[PromptInput], normalize: bool = True
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, in prompt order: the final hidden state of its last token
        (engine/embeddings.py), L2-normalised unless `normalize` is false."""
        prompts = _prompt_list(prompts)
        token_ids = dict(self._add_all(prompts, [EMBEDDING] * len(prompts)))
        states: dict[str, tuple[float, ...]] = {}
        try:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    if delta.finished and delta.embedding is None:
                        raise RequestFailedError(f"request {delta.request_id}: {delta.error}")
                    if delta.embedding is not None:
                        states[delta.request_id] = delta.embedding
        except BaseException:  # leave nothing of this call in the engine
            for request_id in token_ids:
                self.engine.abort_request(request_id)
            raise
        shape = normalized if normalize else list
        return [
            EmbeddingRequestOutput(request_id, ids, EmbeddingOutput(shape(states[request_id])))
            for request_id, ids in token_ids.items()
        ]

    def classify(self, prompts: PromptInput | Sequence[PromptInput]) -> list[ClassificationOutput]:
        """A sequence classifier's class probabilities for each prompt, in prompt order
        (engine/classifier.py): softmax over its labels (a sigmoid for one label)."""
        head = self.engine.classifier
        if head is None:
            raise ValueError("classify needs a sequence classifier (*ForSequenceClassification)")
        token_ids = [
            head.pooled(self.tokenizer.encode(p) if isinstance(p, str) else list(p))
            for p in _prompt_list(prompts)
        ]
        states = [output.outputs.embedding for output in self.embed(token_ids, normalize=False)]
        return [
            ClassificationOutput(probabilities(logits), head.best_label(logits), logits)
            for logits in head.logits(states)
        ]

    def score(
        self, text_1: str | Sequence[str], text_2: str | Sequence[str]
    ) -> list[ScoringRequestOutput]:
        """vLLM's: each pair's score, `text_1` (one text) against each of `text_2`, or the two
        lists pairwise. A cross-encoder (a one-label classifier) scores the pair encoded as the
        tokenizer encodes a pair, by the sigmoid of its head; another model by the cosine of the
        two texts' embeddings (the server's /score, server/routes/scores.py)."""
        left = [text_1] if isinstance(text_1, str) else list(text_1)
        right = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(left) == 1:
            left = left * len(right)
        if len(left) != len(right) or not right:
            raise ValueError(f"{len(left)} first texts for {len(right)} second texts")
        pairs = list(zip(left, right, strict=True))
        head = self.engine.classifier
        if head is None:
            return self._cosines(pairs)
        if head.num_labels != 1:
            raise ValueError(f"scores need a one-label classifier; this one has {head.num_labels}")
        token_ids = [head.pooled(self.tokenizer(*pair)["input_ids"]) for pair in pairs]
        states = [output.outputs.embedding for output in self.embed(token_ids, normalize=False)]
        logits = head.logits(states)
        return [
            ScoringRequestOutput(ids, ScoringOutput(probabilities(row)[0]))
            for ids, row in zip(token_ids, logits, strict=True)
        ]

    def _cosines(self, pairs: list[tuple[str, str]]) -> list[ScoringRequestOutput]:
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))  # each embedded once
        vectors = dict(zip(texts, self.embed(texts), strict=True))
        outputs = []
        for first, second in pairs:
            a, b = vectors[first], vectors[second]
            cosine = math.fsum(map(float.__mul__, a.outputs.embedding, b.outputs.embedding))
            ids = a.prompt_token_ids + b.prompt_token_ids
            outputs.append(ScoringRequestOutput(ids, ScoringOutput(cosine)))
        return outputs

    def _add_all(
        self, prompts: list[PromptInput], params_list: list[SamplingParams]
    ) -> list[tuple[str, list[int]]]:
        """Queue every prompt: (request id, token ids) each. If one is refused, those queued
        before it are aborted (their blocks freed) before the error is raised."""
        added: list[tuple[str, list[int]]] = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                request_id = str(next(self._ids))
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                self.engine.add_request(request_id, ids, params)
                added.append((request_id, ids))
        except BaseException:
            for request_id, _ in added:
                self.engine.abort_request(request_id)
            raise
        return added

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (with the generation prompt), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            list(
                self.tokenizer.apply_chat_template(
                    conversation, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params)


def _prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _broadcast(
    params: SamplingParams | Sequence[SamplingParams], count: int
) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"{len(params)} SamplingParams for {count} prompts")
    return list(params)
