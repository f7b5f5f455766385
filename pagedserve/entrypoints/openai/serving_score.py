"""POST /v1/score and /v1/rerank (vLLM's): text pairs scored by a cross-encoder, which reads each pair together
(pagedserve/classification.py), or by an embedding model, the cosine similarity of their embeddings
(pagedserve/scoring.py)."""

from __future__ import annotations

import asyncio

from fastapi import Request

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.protocol import (
    EmbeddingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    random_id,
)
from pagedserve.entrypoints.openai.serving_base import prompt_list
from pagedserve.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagedserve.outputs import EmbeddingRequestOutput
from pagedserve.scoring import cosine_similarity, score_pairs


class OpenAIServingScores:
    def __init__(self, pooling: OpenAIServingPooling) -> None:
        self.pooling = pooling

    async def score(self, request: ScoreRequest, raw_request: Request) -> ScoreResponse:
        first, second = prompt_list(request.text_1, "text_1"), prompt_list(request.text_2, "text_2")
        try:
            pairs = score_pairs(len(first), len(second))
        except ValueError as exc:
            raise APIError.bad_request(exc, param="text_1") from exc
        request_id = random_id("score")
        scores, outputs = await self._scores(request_id, first, second, pairs, request, raw_request, "text_2")
        num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        return ScoreResponse(id=request_id, model=self.pooling.models.response_name(request.model),
                             data=[ScoreData(index=index, score=score) for index, score in enumerate(scores)],
                             usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))

    async def rerank(self, request: RerankRequest, raw_request: Request) -> RerankResponse:
        request_id = random_id("rerank")
        pairs = score_pairs(1, len(request.documents))
        scores, outputs = await self._scores(request_id, [request.query], request.documents, pairs, request, raw_request,
                                             "documents")
        ranked = sorted(range(len(scores)), key=lambda index: scores[index], reverse=True)[:request.top_n or None]
        results = [RerankResult(index=index, relevance_score=scores[index],
                                document=RerankDocument(text=request.documents[index]) if request.return_documents else None)
                   for index in ranked]
        return RerankResponse(id=request_id, model=self.pooling.models.response_name(request.model), results=results,
                              usage=RerankUsage(total_tokens=sum(len(output.prompt_token_ids) for output in outputs)))

    async def _scores(self, request_id: str, first: list[str], second: list[str], pairs: list[tuple[int, int]],
                      request: ScoreRequest | RerankRequest, raw_request: Request,
                      second_field: str) -> tuple[list[float], list[EmbeddingRequestOutput]]:
        """Each pair's score, and the pooled outputs it took: a cross-encoder's of each pair, or an embedding model's
        of every text (each embedded once)."""
        pooling, front_end = self.pooling, self.pooling.engine.front_end
        lora_request = pooling.check_model(request.model)
        if front_end.model_info.classifier is None:
            outputs = await pooling.pool(request_id, first + second, request.truncate_prompt_tokens, request.priority,
                                         lora_request, raw_request)
            return [cosine_similarity(outputs[i].outputs, outputs[len(first) + j].outputs) for i, j in pairs], outputs
        truncating = request.truncate_prompt_tokens is not None
        try:
            prompts = await asyncio.to_thread(lambda: [front_end.pair_prompt(first[i], second[j], truncating) for i, j in pairs])
        except ValueError as exc:
            raise APIError.bad_request(exc, param=second_field) from exc
        outputs = await pooling.pool(request_id, prompts, request.truncate_prompt_tokens, request.priority, lora_request,
                                     raw_request, prompt_field=second_field)
        return [front_end.pair_score(output) for output in outputs], outputs
