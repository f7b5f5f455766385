"""The model runner's pooling (runner pooling): each request's vector from its prompt's final hidden states, gathered
over the steps its prompt's chunks run in (pagedserve/pooling.py says what each pooling type takes); a classification
model's logits of that vector (its score head)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.executor.input_batch import ModelInputs
from pagedserve.pooling import PoolerConfig


class StepPooler:
    def __init__(self, config: PoolerConfig, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """head: a classification model's, from pooled vectors [rows, hidden] to their logits."""
        self.config = config
        self.head = head
        # Requests whose prompt is part way: MEAN's sum of their rows so far, CLS's first row.
        self._partial: dict[str, torch.Tensor] = {}

    def pool(self, inputs: ModelInputs, hidden_states: torch.Tensor, num_prompt_tokens: Callable[[str], int]) -> dict[str, bytes]:
        """The vectors (or a classification model's logits) of the requests whose prompt ends in this step
        (inputs.sampling_req_ids), each as float32 values in native byte order."""
        if self.config.reads_every_token:
            self._gather(inputs, hidden_states)
        request_ids = inputs.sampling_req_ids
        if not request_ids:
            return {}
        if self.config.pooling_type == "LAST":
            vectors = hidden_states[inputs.logits_indices].float()  # one row each: the prompt's last token's
        else:
            vectors = torch.stack([self._finish(request_id, num_prompt_tokens(request_id)) for request_id in request_ids])
        if self.config.normalize:
            vectors = F.normalize(vectors, p=2, dim=-1)
        if self.head is not None:
            vectors = self.head(vectors)
        rows = vectors.cpu().numpy()
        return {request_id: rows[index].tobytes() for index, request_id in enumerate(request_ids)}

    def forget(self, request_id: str) -> None:
        """A request finished or preempted (its prompt is recomputed from its start)."""
        self._partial.pop(request_id, None)

    def _gather(self, inputs: ModelInputs, hidden_states: torch.Tensor) -> None:
        decodes = [(request_id, row, 1, int(inputs.positions[row])) for row, request_id in enumerate(inputs.decode_request_ids)]
        for request_id, row, num_rows, start in decodes + inputs.chunk_spans:
            rows = hidden_states[row:row + num_rows].float()
            if self.config.pooling_type == "MEAN":
                total = self._partial.get(request_id)
                self._partial[request_id] = rows.sum(dim=0) if total is None else total + rows.sum(dim=0)
            elif start == 0:  # CLS: the prompt's first token
                self._partial[request_id] = rows[0]

    def _finish(self, request_id: str, num_tokens: int) -> torch.Tensor:
        gathered = self._partial.pop(request_id)
        return gathered / num_tokens if self.config.pooling_type == "MEAN" else gathered
