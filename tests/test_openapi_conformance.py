"""Schemathesis against the server's own /openapi.json: requests generated from the schema (valid ones and
not) never get a server error, and every response matches the schema (the real 200 bodies, the real 400s)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import schemathesis
from conftest import make_tiny_classifier
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from server_utils import RemoteServer

from pagedserve.entrypoints.openai.openapi_schema import decimal_pattern_up_to

API_KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Bounded and reproducible: the same examples on every run.
EXAMPLES_PER_ROUTE = 25


@pytest.fixture(scope="module")
def fuzz_server(tiny_models):
    server = RemoteServer("--model", str(tiny_models["llama"]), "--served-model-name", "tiny", "--kv-cache-memory", str(16 * 1024**2),
                          "--max-model-len", "256", "--max-num-seqs", "8", "--max-request-bytes", str(256 * 1024),
                          "--enable-auto-tool-choice", "--tool-call-parser", "hermes", api_key=API_KEY)
    yield server
    assert server.stop() == 0, server.log_text()[-3000:]


@pytest.fixture
def api_schema(fuzz_server):
    loaded = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", headers=AUTH)
    # Requests that fit the schema and requests that break it, the same ones on every run.
    loaded.config.generation.update(modes=list(schemathesis.GenerationMode), deterministic=True)
    return loaded


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
def test_server_answers_every_generated_request_as_its_schema_says(case, fuzz_server):
    case.call_and_validate(base_url=fuzz_server.url, headers=AUTH, timeout=120,
                           checks=[not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance])


def run_coverage_phase(server) -> None:
    cli = Path(sys.executable).with_name("st")
    hooks = {"SCHEMATHESIS_HOOKS": "schemathesis_hooks", "PYTHONPATH": str(Path(__file__).parent)}
    command = [str(cli), "run", server.url + "/openapi.json", "--phases", "coverage", "--request-timeout", "120", "--no-color",
               "-H", f"Authorization: {AUTH['Authorization']}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env={**os.environ, **hooks})
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


@pytest.mark.slow
def test_schemathesis_coverage_phase_finds_the_schema_and_the_server_agree(fuzz_server):
    """schemathesis's coverage phase (every field at its boundaries, each kind of invalid value) with all its checks:
    a request the schema allows is served ("schema-valid request rejected" fails it), one it forbids is refused, and
    every response is as documented. (schemathesis_hooks.py keeps min_tokens within max_tokens' default: a rule between
    two numbers that JSON Schema cannot state.)"""
    run_coverage_phase(fuzz_server)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["embedding", "cross-encoder"])
def test_schemathesis_coverage_phase_on_a_pooling_models_server(model, tiny_models, default_model_dir, tmp_path):
    """The same of a server with runner pooling: an embedding model's embeddings, scores and reranks; a cross-encoder's
    classes, scores and reranks."""
    if model == "embedding":
        model_dir = tiny_models["llama"]
    else:
        model_dir = make_tiny_classifier(tmp_path, default_model_dir, "Qwen2ForSequenceClassification", {0: "relevant"})
    server = RemoteServer("--model", str(model_dir), "--served-model-name", "tiny", "--runner", "pooling",
                          "--kv-cache-memory", str(16 * 1024**2), "--max-model-len", "256", "--max-num-seqs", "8",
                          "--max-request-bytes", str(256 * 1024), api_key=API_KEY)
    try:
        run_coverage_phase(server)
    finally:
        assert server.stop() == 0, server.log_text()[-3000:]


@pytest.mark.parametrize("largest", [0, 7, 10, 99, 100, 509, 1000, 49151])
def test_the_token_id_key_pattern_takes_the_numbers_up_to_the_largest_id(largest):
    """logit_bias's keys in the schema: the decimal numbers 0 to the largest token id, without leading zeros."""
    pattern = re.compile(decimal_pattern_up_to(largest))
    for number in [*range(0, 1200), *range(largest - 50, largest + 50)]:
        assert bool(pattern.match(str(number))) == (0 <= number <= largest), number
    assert not any(pattern.match(text) for text in ("", "-1", "01", "00", "1.0", " 1", f"{largest}0"))
