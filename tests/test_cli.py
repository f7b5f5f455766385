"""The pagedserve command on the terminal."""

import subprocess
import sys

import pytest


def run_cli(*args, stdin=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_generate_prints_prompt_and_completion(default_llm):
    expected = default_llm.generate("The capital of France is", default_llm_params(), use_tqdm=False)[0].outputs[0].text
    result = run_cli("generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--kv-cache-memory", str(2**27))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("The capital of France is" + expected).strip()
    assert "finish_reason=length" in result.stderr


def default_llm_params():
    from pagedserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=8)


@pytest.mark.slow
def test_chat_answers_each_line_until_eof():
    result = run_cli("chat", "--max-tokens", "16", "--kv-cache-memory", str(2**27),
                     stdin="What is the capital of France?\nThanks!\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert result.stdout.count("> ") == 3  # two questions answered, then the prompt that met EOF


def test_bad_flag_value_is_reported_clearly():
    result = run_cli("generate", "--prompt", "x", "--block-size", "7")
    assert result.returncode == 2
    assert "block_size must be one of" in result.stderr


def test_openmp_wait_settings_are_set_before_torch_loads_and_users_win(tmp_path):
    """Threads sleep between parallel regions after a spin (see pagedserve/openmp.py): of the uncalibrated count until
    a turn of it was measured on this processor, then of SPIN_SECONDS; values the user exported are kept."""
    import os

    from pagedserve import openmp

    script = "import pagedserve.entrypoints.cli, os; print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'])"
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    clean["PAGEDSERVE_CACHE_DIR"] = str(tmp_path)

    def settings(env):
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        return result.stdout.split() or result.stderr

    assert settings(clean) == ["PASSIVE", str(openmp.UNCALIBRATED_SPIN_COUNT)]
    measured = subprocess.run([sys.executable, "-c", "from pagedserve import openmp; openmp.calibrate_spin(lambda: 1e-8)"],
                              env=clean, capture_output=True, text=True, timeout=120)
    assert measured.returncode == 0, measured.stderr
    assert settings(clean) == ["PASSIVE", str(round(openmp.SPIN_SECONDS / 1e-8))]
    assert settings({**clean, "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "7"}) == ["ACTIVE", "7"]


def test_environment_without_openmp_defaults_leaves_out_only_what_pagedserve_set():
    """Baselines (HF static batching) run with the environment as the user had it."""
    import os

    script = ("import pagedserve.openmp as host; e = host.environment_without_openmp_defaults(); "
              "print(e.get('OMP_WAIT_POLICY'), e.get('GOMP_SPINCOUNT'))")
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    result = subprocess.run([sys.executable, "-c", script], env={**clean, "GOMP_SPINCOUNT": "7"}, capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.split() == ["None", "7"], result.stderr


def test_help_gives_each_default_once_and_every_sampling_flag_its_help():
    for command in ("serve", "generate", "chat"):
        result = run_cli(command, "--help", timeout=60)
        assert result.returncode == 0
        text = " ".join(result.stdout.split())  # argparse wraps lines
        options = text.split("options:", 1)[1].split(" --")[1:]  # the flags' descriptions, after the usage line
        assert all(option.count("(default") <= 1 for option in options), [o for o in options if o.count("(default") > 1]
    generate = " ".join(run_cli("generate", "--help", timeout=60).stdout.split("sampling:", 1)[1].split())
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--repetition-penalty", "--presence-penalty",
                 "--frequency-penalty", "--stop", "--n"):
        after = generate.split(flag + " ", 1)[1].split(" --", 1)[0]
        assert "default" in after and len(after) > 30, (flag, after)


def test_parallel_flags_have_short_forms():
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.entrypoints.engine_args import engine_config_from_args

    args = build_parser().parse_args(["serve", "-tp", "2", "-pp", "3", "-dp", "2", "--distributed-executor-backend", "ray"])
    config = engine_config_from_args(args)
    assert (config.tensor_parallel_size, config.pipeline_parallel_size, config.data_parallel_size) == (2, 3, 2)
    assert config.world_size == 6 and config.executor_backend == "ray"


def test_speculative_config_is_json_on_the_command_line():
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.entrypoints.engine_args import engine_config_from_args

    parser = build_parser()
    args = parser.parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    spec = engine_config_from_args(args).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 3, 2, 4)
    assert engine_config_from_args(parser.parse_args(["serve"])).speculative is None  # off by default
    args = parser.parse_args(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'])
    with pytest.raises(ValueError, match=r"speculative_config.num_speculative_tokens must be an integer in \[1, 16\]"):
        engine_config_from_args(args)


def test_max_decode_stall_is_parsed_once_into_what_the_scheduler_reads():
    from pagedserve.config import DecodeStallLimit, EngineConfig
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.entrypoints.engine_args import engine_config_from_args

    parser = build_parser()
    config = engine_config_from_args(parser.parse_args(["serve", "--max-decode-stall", "3x"]))
    assert config.decode_stall == DecodeStallLimit(multiple=3.0) and config.decode_stall.limit(0.1) == pytest.approx(0.3)
    assert EngineConfig(max_decode_stall="0.5s").decode_stall.limit(10.0) == 0.5
    assert EngineConfig(max_decode_stall="off").decode_stall is None
    for bad in ("1x", "0s", "nans", "infx", "fast", "x"):
        with pytest.raises(ValueError, match="max_decode_stall"):
            EngineConfig(max_decode_stall=bad)


def test_reading_a_command_line_leaves_the_engine_and_web_stacks_unloaded():
    """`pagedserve serve` starts its engine process once its arguments are read: loading torch or a web stack first would
    hold back the engine's start (the server loads its own web stack while the engine starts)."""
    probe = ("import sys; from pagedserve.entrypoints.cli import build_parser; build_parser().parse_args(['serve']); "
             "print(sorted(m for m in ('torch', 'transformers', 'fastapi', 'aiohttp', 'uvicorn') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"
