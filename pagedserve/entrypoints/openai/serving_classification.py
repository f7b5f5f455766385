"""POST /classify (vLLM's): each input's classes from a classification model (a server with runner pooling over a
*ForSequenceClassification checkpoint; pagedserve/classification.py says how its logits become probabilities)."""

from __future__ import annotations

from fastapi import Request

from pagedserve.entrypoints.openai.protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    UsageInfo,
    random_id,
)
from pagedserve.entrypoints.openai.serving_base import prompt_list
from pagedserve.entrypoints.openai.serving_pooling import OpenAIServingPooling


class OpenAIServingClassification(OpenAIServingPooling):
    async def create_classify(self, request: ClassificationRequest, raw_request: Request) -> ClassificationResponse:
        lora_request = self.check_model(request.model)
        request_id = random_id("classify")
        outputs = await self.pool(request_id, prompt_list(request.input, "input"), request.truncate_prompt_tokens,
                                  request.priority, lora_request, raw_request, prompt_field="input")
        front_end = self.engine.front_end
        labels = front_end.model_info.classifier.labels
        data = []
        for index, output in enumerate(outputs):
            probs = front_end.classified(output, request.use_activation).outputs.probs
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=index, label=labels[best], probs=probs, num_classes=len(probs)))
        num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        return ClassificationResponse(id=request_id, model=self.models.response_name(request.model), data=data,
                                      usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens))
