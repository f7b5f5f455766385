"""POST /v1/embeddings: each input's vector from an embedding model (a server with runner pooling)."""

from __future__ import annotations

import base64
import sys
from array import array

from fastapi import Request

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, random_id
from pagedserve.entrypoints.openai.serving_base import prompt_list
from pagedserve.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagedserve.outputs import EmbeddingOutput


class OpenAIServingEmbedding(OpenAIServingPooling):
    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> EmbeddingResponse:
        lora_request = self.check_model(request.model)
        front_end = self.engine.front_end
        try:
            front_end.check_dimensions(request.dimensions)
        except ValueError as exc:
            raise APIError.bad_request(exc, param="dimensions") from exc
        request_id = random_id("embd")
        outputs = await self.pool(request_id, prompt_list(request.input, "input"), request.truncate_prompt_tokens,
                                  request.priority, lora_request, raw_request, prompt_field="input")
        data = [EmbeddingData(index=index, embedding=_encoded(front_end.shortened(output, request.dimensions).outputs,
                                                              request.encoding_format))
                for index, output in enumerate(outputs)]
        num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        return EmbeddingResponse(id=request_id, model=self.models.response_name(request.model), data=data,
                                 usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))


def _encoded(output: EmbeddingOutput, encoding_format: str) -> list[float] | str:
    """A vector as the API gives it: its values, or base64 of them as little-endian float32 (OpenAI's encoding)."""
    if encoding_format == "float":
        return output.embedding
    data = output.data
    if sys.byteorder != "little":
        values = array("f", data)
        values.byteswap()
        data = values.tobytes()
    return base64.b64encode(data).decode("ascii")
