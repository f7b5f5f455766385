"""An embedding model's vector for a prompt (runner "pooling"): how the prompt's final hidden states become one vector.

- pooling_type LAST: the last token's hidden state (decoder embedding models pool so: in a causal model only the last
  token has seen the whole prompt), MEAN: the average over the prompt's tokens, CLS: the first token's.
- normalize: scaled to unit length (cosine similarity is then a dot product).

A model directory saved by sentence-transformers says both (modules.json: its Pooling module's config, and whether a
Normalize module follows); pooler_config overrides them; without either, LAST and normalized, as vLLM defaults
decoder models. MEAN and CLS read every prompt token's hidden state, so an engine pooling so recomputes cached
prefixes rather than reading them from the prefix cache.

A classification model (pagedserve/classification.py) pools as transformers' `*ForSequenceClassification` does, LAST,
and its score head reads the vector as it is: never normalized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling config flags, as pooling types (the first set wins; lasttoken is LAST).
_SENTENCE_TRANSFORMERS_MODES = (("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"),
                                ("pooling_mode_cls_token", "CLS"))


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True

    @property
    def reads_every_token(self) -> bool:
        return self.pooling_type != "LAST"


def check_pooler_values(values: dict) -> None:
    """pooler_config's values (PoolerConfig's fields), checked: ValueError naming the field."""
    if "pooling_type" in values and values["pooling_type"] not in POOLING_TYPES:
        raise ValueError(f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, got {values['pooling_type']!r}")
    if "normalize" in values and not isinstance(values["normalize"], bool):
        raise ValueError(f"pooler_config.normalize must be true or false, got {values['normalize']!r}")


def resolve_pooler(values: dict | None, model_dir: str | Path, classifier: bool = False) -> PoolerConfig:
    """The pooler an engine runs: pooler_config's fields over the model directory's sentence-transformers pooling, or
    over a classification model's (classifier)."""
    if classifier and (values or {}).get("normalize"):
        raise ValueError("pooler_config.normalize scales an embedding to unit length; a classification model's score "
                         "head reads its vector unscaled (leave it unset or false)")
    base = PoolerConfig(normalize=False) if classifier else _sentence_transformers_pooler(Path(model_dir))
    return replace(base, **(values or {}))


def _sentence_transformers_pooler(model_dir: Path) -> PoolerConfig:
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return PoolerConfig()
    kinds = {str(module.get("type", "")).rsplit(".", 1)[-1]: module for module in modules if isinstance(module, dict)}
    pooling_type = PoolerConfig.pooling_type
    pooling = kinds.get("Pooling")
    if pooling is not None:
        settings = _read_json(model_dir / str(pooling.get("path", "")) / "config.json") or {}
        pooling_type = next((kind for flag, kind in _SENTENCE_TRANSFORMERS_MODES if settings.get(flag)), pooling_type)
    return PoolerConfig(pooling_type, normalize="Normalize" in kinds)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
