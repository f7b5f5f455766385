"""A sequence classification model (a `*ForSequenceClassification` checkpoint: a decoder with a `score` head over its
pooled final hidden state): its labels, and how its logits become what the API answers.

- /classify (LLM.classify): each label's probability. As transformers' loss for the model's problem_type reads its
  logits: softmax over two or more labels, sigmoid for multi-label classification or a single label, the logits
  themselves for regression.
- /v1/score and /v1/rerank (LLM.score), a model of one label (a cross-encoder, which reads the two texts together):
  as sentence-transformers' CrossEncoder scores: the logit itself where its config's activation_fn is Identity, else
  its sigmoid.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# sentence-transformers' CrossEncoder activation_fn (a torch.nn module's qualified name) -> whether it keeps the logits
# (else: sigmoid for one label, softmax for several, as it does for a model that names none).
_CROSS_ENCODER_ACTIVATIONS = {"Identity": True, "Sigmoid": False, "Softmax": False}


@dataclass(frozen=True)
class Classifier:
    labels: tuple[str, ...]  # label i's name (config.json's id2label)
    classify_activation: str  # softmax, sigmoid or identity (activate's)
    score_activation: str

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def probabilities(self, logits: np.ndarray, use_activation: bool = True) -> np.ndarray:
        return activate(logits, self.classify_activation if use_activation else "identity")

    def pair_score(self, logits: np.ndarray) -> float:
        """A cross-encoder's score of a pair, from its one logit."""
        return float(activate(logits, self.score_activation)[0])


def is_classifier(hf_config) -> bool:
    return any(map(is_classifier_architecture, getattr(hf_config, "architectures", None) or []))


def is_classifier_architecture(name: str) -> bool:
    return name.endswith("ForSequenceClassification")


def classifier_of(hf_config) -> Classifier | None:
    """The model's Classifier; None for a model without a classification head. ValueError for a cross-encoder
    activation it does not know."""
    if not is_classifier(hf_config):
        return None
    num_labels = num_labels_of(hf_config)
    if num_labels < 1:
        raise ValueError(f"a classification model needs num_labels >= 1 in its config.json, got {num_labels}")
    names = getattr(hf_config, "id2label", None) or {}
    labels = tuple(str(names.get(index, names.get(str(index), f"LABEL_{index}"))) for index in range(num_labels))
    return Classifier(labels, _classify_activation(getattr(hf_config, "problem_type", None), num_labels),
                      _score_activation(hf_config, num_labels))


def num_labels_of(hf_config) -> int:
    """The rows of a classification model's score head: as transformers counts them, its id2label's entries (a resolved
    config.json carries id2label, and num_labels only as transformers' property of it)."""
    names = getattr(hf_config, "id2label", None)
    return len(names) if names else int(getattr(hf_config, "num_labels", 0) or 0)


def activate(logits: np.ndarray, activation: str) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float64)
    if activation == "softmax":
        exponents = np.exp(logits - logits.max())
        return exponents / exponents.sum()
    if activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    return logits


def _classify_activation(problem_type: str | None, num_labels: int) -> str:
    if problem_type == "regression":
        return "identity"
    if problem_type == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    return "softmax"


def _score_activation(hf_config, num_labels: int) -> str:
    sentence_transformers = getattr(hf_config, "sentence_transformers", None)
    name = sentence_transformers.get("activation_fn") if isinstance(sentence_transformers, dict) else None
    name = name or getattr(hf_config, "sbert_ce_default_activation_function", None)
    keeps_logits = _CROSS_ENCODER_ACTIVATIONS.get(str(name).rsplit(".", 1)[-1]) if name else False
    if keeps_logits is None:
        raise ValueError(f"the cross-encoder activation {name!r} is not supported; supported: torch.nn's "
                         f"{', '.join(_CROSS_ENCODER_ACTIVATIONS)}")
    if keeps_logits:
        return "identity"
    return "sigmoid" if num_labels == 1 else "softmax"
