"""ModelInfo: what the engine core and its front end learn of the loaded model when the engine is ready. Defined
here, beside the other shared types, so that the front end reads it without reaching into the executor."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.classification import Classifier
from pagedserve.pooling import PoolerConfig


@dataclass
class ModelInfo:
    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int
    # Default sampling parameters (SamplingParams field names) from the generation config; empty when none.
    generation_defaults: dict[str, float | int]
    num_experts: int = 0  # experts of each mixture-of-experts layer; 0 for a dense model
    experts_per_token: int = 0  # the experts each token is routed to (top-k); 0 for a dense model
    # Runner pooling: the pooler the runner runs (pooling.resolve_pooler's, resolved once by the worker); None: generate.
    pooler: PoolerConfig | None = None
    # Runner pooling of a classification model: its labels and activations; its pooled outputs are its logits.
    classifier: Classifier | None = None
    # The sizes an embedding may be shortened to (a matryoshka model's; matryoshka.matryoshka_dimensions); None: none.
    matryoshka_dimensions: list[int] | None = None
