"""What the routes of a server with runner pooling share: each prompt's pooled output (an embedding model's vector, a
classification model's logits), all prompts admitted or none."""

from __future__ import annotations

from fastapi import Request

from pagedserve.engine.frontend import FrontEnd
from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.serving_base import ServingBase
from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import EmbeddingRequestOutput


class OpenAIServingPooling(ServingBase):
    async def pool(self, request_id: str, prompts: list, truncate_prompt_tokens: int | None, priority: int,
                   lora_request: LoRARequest | None, raw_request: Request,
                   prompt_field: str | None = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's pooled output, in their order (all admitted, or none); a prompt that cannot be pooled (too
        long, tokens beyond the vocabulary) is a 400 naming prompt_field."""
        params = FrontEnd.embedding_params(truncate_prompt_tokens)
        added = await self.add_requests(request_id, prompts, params, False, priority, lora_request=lora_request,
                                        prompt_field=prompt_field)
        outputs = await self.collect_final(added, raw_request)
        if not all(isinstance(output, EmbeddingRequestOutput) for output in outputs):
            raise APIError(503, "the request ended before its pooled outputs were made")
        return outputs
