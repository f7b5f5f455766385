"""The pagedserve command on the terminal."""

import subprocess
import sys


def run_cli(*args, stdin=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def test_generate_prints_prompt_and_completion(default_llm):
    expected = default_llm.generate("The capital of France is", default_llm_params(), use_tqdm=False)[0].outputs[0].text
    result = run_cli("generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--kv-cache-memory", str(2**27))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("The capital of France is" + expected).strip()
    assert "finish_reason=length" in result.stderr


def default_llm_params():
    from pagedserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=8)


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
