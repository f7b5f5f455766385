"""What an engine's model gives (vLLM's tasks), from its runner and its model: text (generate); prompts' vectors
(embed) and the scores of text pairs by their cosine similarity, from an embedding model; classes (classify) from a
classification model, and the scores of text pairs from one of a single label (a cross-encoder). The front end
refuses a request for any other, and the server serves the routes of these only. And the runner a model gets when
none is named (runner auto)."""

from __future__ import annotations

from pagedserve.classification import Classifier, is_classifier_architecture

# What each task gives, and where it comes from: the two halves of a refusal.
_GIVES = {"generate": "text", "embed": "embeddings", "classify": "classes",
          "score": "scores of text pairs"}
_COMES_FROM = {
    "generate": "an engine with runner generate",
    "embed": "an engine with runner pooling over an embedding model",
    "classify": "an engine with runner pooling over a classification model (a *ForSequenceClassification checkpoint)",
    "score": "an engine with runner pooling over an embedding model or a cross-encoder (a classification model of one label)",
}
TASKS = tuple(_GIVES)


def runner_for(architectures: list[str]) -> str:
    """runner auto's choice, as vLLM's: pooling for a model that only pools (a base model, `*Model`, which has no
    lm_head; a classification model, `*ForSequenceClassification`), else generate."""
    pools = any(name.endswith("Model") or is_classifier_architecture(name) for name in architectures)
    return "pooling" if pools else "generate"


def supported_tasks(runner: str, classifier: Classifier | None) -> tuple[str, ...]:
    if runner != "pooling":
        return ("generate",)
    if classifier is None:
        return ("embed", "score")
    return ("classify", "score") if classifier.num_labels == 1 else ("classify",)


def check_task(task: str, supported: tuple[str, ...]) -> None:
    """Refuse (ValueError, saying what the engine gives instead) a task the engine does not run."""
    if task not in supported:
        gives = " and ".join(_GIVES[name] for name in supported)
        raise ValueError(f"this engine does not give {_GIVES[task]}: that takes {_COMES_FROM[task]}; its model gives {gives}")
