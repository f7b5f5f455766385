"""What a start keeps for the next one (the resolved model config, the warm-up's step timings) and what the engine
process tells its front end early (where the model is), so that a warm start is quick and behaves as a cold one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagedserve.config import EngineConfig
from pagedserve.core.step_time import uniform_step_shape


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A cache of its own (the C++ kernels, which would build anew in it, are left off where an engine starts)."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_config_reads_as_transformers_resolves_it_and_later_without_transformers(arch, tiny_models, empty_cache):
    from transformers import AutoConfig

    from pagedserve.models.hf_config import load_hf_config

    model_dir = tiny_models[arch]
    expected = json.loads(AutoConfig.from_pretrained(str(model_dir)).to_json_string(use_diff=False))
    expected.pop("_name_or_path")
    assert load_hf_config(model_dir).to_dict() == expected
    as_transformers = load_hf_config(model_dir).to_transformers()
    assert type(as_transformers) is type(AutoConfig.from_pretrained(str(model_dir)))
    assert {k: v for k, v in json.loads(as_transformers.to_json_string(use_diff=False)).items() if k != "_name_or_path"} == expected
    probe = ("import sys, json; from pathlib import Path; from pagedserve.models.hf_config import load_hf_config; "
             f"values = load_hf_config(Path({str(model_dir)!r})).to_dict(); "
             "print(json.dumps({'transformers': 'transformers' in sys.modules, 'values': values}))")
    result = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)
    assert result == {"transformers": False, "values": expected}


def test_a_missing_field_reads_as_absent_so_that_defaults_apply(tiny_models, empty_cache):
    from pagedserve.models.hf_config import load_hf_config

    config = load_hf_config(tiny_models["llama"])
    assert getattr(config, "no_such_field", "default") == "default"
    with pytest.raises(AttributeError, match="no_such_field"):
        config.no_such_field  # noqa: B018


_TOKENIZER_PROBE = """
import json, sys
from pagedserve.engine.tokenizer import load_tokenizer
tokenizer = load_tokenizer(sys.argv[1])
texts = ["Hello, world!", "<|im_start|>user\\n  two  spaces\\tand a tab<|im_end|>", "naïve café 東京 🚀", " leading space", ""]
print(json.dumps({
    "class": f"{type(tokenizer).__module__}.{type(tokenizer).__name__}",
    "ids": [tokenizer.encode(text) for text in texts],
    "tokens": [tokenizer.convert_ids_to_tokens(tokenizer.encode(text)) for text in texts],
    "decoded": [tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) for text in texts],
    "special": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, sorted(tokenizer.all_special_tokens)],
    "chat": tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
            if tokenizer.chat_template else None,
    "vocab": len(tokenizer),
    "imported": sorted(name for name in ("torch", "transformers.models.auto.tokenization_auto") if name in sys.modules),
}))
"""


def _tokenizer_as_loaded(model_dir) -> dict:
    """What load_tokenizer gives in a fresh process: the tokenizer's class, what it makes of some texts, and the heavy
    modules it imported."""
    run = subprocess.run([sys.executable, "-c", _TOKENIZER_PROBE, str(model_dir)], capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


def _auto_tokenizer_class(model_dir) -> str:
    from transformers import AutoTokenizer

    chosen = type(AutoTokenizer.from_pretrained(str(model_dir)))
    return f"{chosen.__module__}.{chosen.__name__}"


@pytest.mark.parametrize("model", ["default model", "llama", "qwen2"])  # qwen2: a model's own tokenizer class
def test_a_tokenizer_loads_as_auto_tokenizer_loads_it_and_later_without_the_configs_imports(model, tiny_models,
                                                                                            default_model_dir, empty_cache):
    """The first load asks AutoTokenizer (which imports transformers' config classes, torch with them); later loads call
    the class it chose, with the same result and neither import."""
    model_dir = default_model_dir if model == "default model" else tiny_models[model]
    first = _tokenizer_as_loaded(model_dir)
    later = _tokenizer_as_loaded(model_dir)
    assert "torch" in first.pop("imported")
    assert later.pop("imported") == []
    assert later == first
    assert first["class"] == _auto_tokenizer_class(model_dir)


def test_a_changed_tokenizer_config_is_loaded_as_auto_tokenizer_loads_it_anew(tiny_models, empty_cache, tmp_path):
    import shutil

    model_dir = shutil.copytree(tiny_models["llama"], tmp_path / "model")
    before = _tokenizer_as_loaded(model_dir)["class"]
    assert before == _auto_tokenizer_class(model_dir)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"tokenizer_class": "Qwen2Tokenizer"}))
    changed = _tokenizer_as_loaded(model_dir)
    assert changed["class"] == _auto_tokenizer_class(model_dir) != before
    assert "torch" in changed["imported"]  # AutoTokenizer asked again


def test_a_second_start_seeds_the_step_time_model_from_the_first_and_skips_the_timed_passes(tiny_models, empty_cache,
                                                                                              monkeypatch):
    """The first start times each warm-up shape over several passes and keeps the fastest after the first (a pass slowed
    by whatever else ran then would seed every later start); the second reads those timings back."""
    from pagedserve.engine.core import EngineCore
    from pagedserve.executor import step_timings_cache
    from pagedserve.executor.model_runner import WARM_UP_TIMED_PASSES, ModelRunner

    passes = []
    time_forward_passes = ModelRunner.time_forward_passes

    def counting(self, num_seqs, seq_len, count, context=0):
        passes.append(count)
        seconds = time_forward_passes(self, num_seqs, seq_len, count, context)
        # The first pass and the last slower than any other: neither is kept
        return [1.0, *seconds[1:-1], 0.5] if count > 2 else seconds

    monkeypatch.setattr(ModelRunner, "time_forward_passes", counting)
    config = EngineConfig(model=str(tiny_models["llama"]), kv_cache_memory=64 * 1024**2, cpu_kernels=False)
    predictions = []
    for _ in range(2):
        passes.clear()
        core = EngineCore(config)
        try:
            model = core.scheduler.stall_bound.step_time
            predictions.append([model.predict(uniform_step_shape(n, 1, 64)) for n in (1, 8, 32)])
            counts = list(passes)
        finally:
            core.shutdown()
        if len(predictions) == 1:
            assert counts and set(counts) == {1 + WARM_UP_TIMED_PASSES}
            stored = step_timings_cache.load(step_timings_cache.timings_file(config, core.model_info))
            assert stored and max(seconds for *_, seconds in stored) < 0.5
    assert counts and set(counts) == {1}  # the second start: each first shape once, nothing timed
    assert predictions[0] == predictions[1]
    assert list((empty_cache / "step_timings").glob("*.json"))


def test_the_front_end_learns_where_the_model_is_before_the_engine_is_ready(tiny_models, empty_cache):
    from pagedserve.engine.core_client import AsyncMPClient

    located = []
    client = AsyncMPClient(EngineConfig(model=str(tiny_models["llama"]), kv_cache_memory=64 * 1024**2, cpu_kernels=False),
                           on_model_located=located.append)
    try:
        assert located == [client.model_info.model_dir]
    finally:
        client.shutdown()


@pytest.mark.parametrize(("ending", "leaks"), [("os._exit(0)", True), ("exit_process(0)", False)])
def test_a_process_of_the_engine_ends_at_once_and_leaks_no_semaphore(ending, leaks, tmp_path):
    """The engine's processes end without the interpreter's teardown; a semaphore made in one (tqdm's lock, once a
    progress bar ran there) is released all the same, so the parent's resource tracker reports no leak at exit."""
    script = f"""
import multiprocessing, os
from pagedserve.processes import exit_process

def child():
    from tqdm import tqdm
    for _ in tqdm(range(2), disable=False):
        pass
    {ending}

if __name__ == "__main__":
    process = multiprocessing.get_context("spawn").Process(target=child)
    process.start()
    process.join()
    assert process.exitcode == 0
"""
    (tmp_path / "program.py").write_text(script)  # spawn finds `child` in a main module that is a file
    result = subprocess.run([sys.executable, str(tmp_path / "program.py")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert ("leaked semaphore" in result.stderr) == leaks, result.stderr
