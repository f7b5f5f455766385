"""A model's config.json as transformers resolves it, every default of its model type filled in.

transformers is the authority on what a config means, but importing its config classes takes seconds (they pull in
its model-loading stack). So the resolution runs once per config.json and transformers version, and its result, a
plain dict, is kept in the cache; every later start reads that back. Whether resolved now or read back, callers get
the same ResolvedConfig: attribute access as on transformers' config, and the real object only where transformers'
own code needs it (to_transformers).
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

from pagedserve import cached_json
from pagedserve.models.language_model import text_config_values

# Bumped when what is stored changes shape.
_FORMAT = "1"


class ResolvedConfig:
    """The resolved fields of a config as attributes (a missing one raises AttributeError, so getattr defaults work)."""

    def __init__(self, values: dict) -> None:
        self._values = values

    def __getattr__(self, name: str):
        try:
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(f"the model's config has no field {name!r}") from None

    def to_dict(self) -> dict:
        return dict(self._values)

    def to_transformers(self):
        """transformers' own config object with these values, for transformers functions that take one."""
        from transformers import AutoConfig

        values = self.to_dict()
        return AutoConfig.for_model(values.pop("model_type"), **values)


def load_hf_config(model_dir: Path, overrides: dict | None = None) -> ResolvedConfig:
    """model_dir/config.json resolved by transformers (from the cache when it was resolved before), as the engine serves
    the model (a multimodal checkpoint's language model: models/language_model.py), overrides set over it
    (hf_overrides)."""
    try:
        raw = (model_dir / "config.json").read_bytes()
    except OSError as exc:
        raise ValueError(f"bad config.json in {model_dir}: {exc}") from exc
    path = cached_json.cache_file("configs", raw, metadata.version("transformers"), _FORMAT)
    values = cached_json.read(path)
    if values is None:
        values = _resolve(model_dir)
        cached_json.write(path, values)
    return ResolvedConfig({**text_config_values(values), **(overrides or {})})


def _resolve(model_dir: Path) -> dict:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError, json.JSONDecodeError, OSError) as exc:
        raise ValueError(f"bad config.json in {model_dir}: {exc}") from exc
    # Through JSON now, so that a first start sees exactly what later starts read back.
    values = json.loads(config.to_json_string(use_diff=False))
    values.pop("_name_or_path", None)  # where it was read first; directories with the same config.json share an entry
    return values
