"""The benchmark commands run end to end (on a tiny model, small sizes) and report sane figures."""

import json
import subprocess
import sys


def bench(tmp_path, workload, *args, timeout=600):
    out = tmp_path / "record.json"
    # --json goes first: serve's --server-args takes everything after it.
    result = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", workload, "--json", str(out), *args],
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


def test_throughput_with_baseline_and_ceiling(tmp_path, tiny_models):
    record, stdout = bench(tmp_path, "throughput", "--model", str(tiny_models["llama"]), "--num-prompts", "6", "--input-len", "20",
                           "--output-len", "7", "--baseline", "hf", "--ceiling", "--kv-cache-memory", str(2**24))
    assert record["prompt_tokens"] == 120 and record["output_tokens"] == 42
    assert record["total_tokens_per_s"] > 0 and record["hf_total_tokens_per_s"] > 0 and record["ceiling_tokens_per_s"] > 0
    assert record["speedup_vs_hf"] > 0 and 0 < record["fraction_of_ceiling"]
    assert "speed-up vs HF" in stdout


def test_mixed_dataset_lengths_vary(tmp_path, tiny_models):
    record, _ = bench(tmp_path, "throughput", "--model", str(tiny_models["llama"]), "--dataset", "mixed", "--num-prompts", "5",
                      "--kv-cache-memory", str(2**24))
    assert record["num_prompts"] == 5
    assert 5 * 16 <= record["prompt_tokens"] <= 5 * 512 and 5 * 16 <= record["output_tokens"] <= 5 * 256


def test_prefix_and_interference(tmp_path, tiny_models):
    prefix, _ = bench(tmp_path, "prefix", "--model", str(tiny_models["llama"]), "--num-prompts", "8", "--prefix-len", "256",
                      "--kv-cache-memory", str(2**24))
    assert prefix["mean_ttft_cached_s"] > 0 and prefix["ttft_ratio"] < 1.5
    interference, _ = bench(tmp_path, "interference", "--model", str(tiny_models["llama"]), "--long-prompt-len", "512",
                            "--chunk-size", "64", "--kv-cache-memory", str(2**24))
    assert interference["chunked"]["itl_p50_s"] > 0 and interference["unchunked"]["itl_p99_s"] > 0


def test_kv_and_sched(tmp_path):
    kv, _ = bench(tmp_path, "kv", "--num-blocks", "512")
    assert 0 <= kv["waste_pct"] < 10 and kv["max_concurrent_requests"] > kv["max_concurrent_with_max_len_reservation"]
    assert kv["slots_allocated"] >= kv["tokens_stored"]
    sched, _ = bench(tmp_path, "sched", "--num-running", "64", "--steps", "50")
    assert sched["num_running"] == 64 and sched["median_us_per_step"] > 0


def test_serve_against_our_own_server(tmp_path, tiny_models):
    record, stdout = bench(tmp_path, "serve", "--model", str(tiny_models["llama"]), "--num-prompts", "8", "--input-len", "16",
                           "--output-len", "6", "--request-rate", "inf", "4", "--server-args", "--kv-cache-memory", str(2**24))
    assert [run["request_rate"] for run in record["runs"]] == [float("inf"), 4.0]
    for run in record["runs"]:
        assert run["failures"] == 0 and run["completed"] == 8
        assert run["ttft_p50_s"] > 0 and run["itl_p50_s"] > 0 and run["output_tokens_per_s"] > 0
