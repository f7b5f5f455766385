"""The token embedding and the lm_head, split by vocabulary among the tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.parallel_state import tp_all_gather, tp_all_reduce
from pagedserve.layers.linear import split_evenly


class VocabParallelEmbedding(nn.Module):
    """Each rank holds the rows of a contiguous range of the vocabulary; a token's vector comes from the
    rank that holds it (the others contribute zeros to an all-reduce)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_start, self.num_local = split_evenly(vocab_size, "vocab_size")
        self.split = self.num_local != vocab_size
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return tp_all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))

    def rank_slice(self, tensor: torch.Tensor, shard: int | None, is_bias: bool) -> torch.Tensor:
        return tensor.narrow(0, self.vocab_start, self.num_local)


def gather_logits(local_logits: torch.Tensor) -> torch.Tensor:
    """The full vocabulary's logits from each rank's share (every rank gets them, and samples alike)."""
    return tp_all_gather(local_logits, dim=-1)
