"""The benchmark commands run end to end (on a tiny model, small sizes) and report sane figures."""

import contextlib
import io
import json
import subprocess
import sys

import pytest


def bench(tmp_path, workload, *args):
    """`pagedserve bench WORKLOAD ARGS` through the command's own entry point, in this process (torch is imported
    here already): its record and what it printed. The command's own process start is test_cli's business."""
    from pagedserve.entrypoints import cli

    out = tmp_path / "record.json"
    printed, errors = io.StringIO(), io.StringIO()
    # --json goes first: serve's --server-args takes everything after it.
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = cli.main(["bench", workload, "--json", str(out), *args])
    assert code == 0, errors.getvalue()[-3000:]
    return json.loads(out.read_text()), printed.getvalue()


@pytest.mark.slow
def test_throughput_with_baseline_and_ceiling(tmp_path, tiny_models):
    record, stdout = bench(tmp_path, "throughput", "--model", str(tiny_models["llama"]), "--num-prompts", "6", "--input-len", "20",
                           "--output-len", "7", "--baseline", "hf", "--ceiling", "--kv-cache-memory", str(2**24), "--repeats", "3")
    assert record["prompt_tokens"] == 120 and record["output_tokens"] == 42
    assert record["total_tokens_per_s"] > 0 and record["hf_total_tokens_per_s"] > 0 and record["ceiling_tokens_per_s"] > 0
    assert record["speedup_vs_hf"] > 0 and 0 < record["fraction_of_ceiling"]
    assert "speed-up vs HF" in stdout and "median of 3 runs" in stdout
    # Each figure is the median of the runs' own, each run having HF beside it.
    runs = record["runs"]
    assert record["repeats"] == 3 and len(runs) == 3 and all(run["hf_elapsed_s"] > 0 for run in runs)
    assert record["total_tokens_per_s"] == sorted(run["total_tokens_per_s"] for run in runs)[1]
    assert record["speedup_vs_hf"] == sorted(run["hf_elapsed_s"] / run["elapsed_s"] for run in runs)[1]
    # The second ceiling decodes after the workload's mean context: 20 prompt tokens + half of 7 output.
    assert record["ceiling"]["decode_context"] == 24 and record["fraction_of_ceiling_in_context"] > 0
    assert "after 24 tokens of context" in stdout
    # The replayed ceiling: the same bare passes timed in full, right after each run.
    assert all(run["ceiling"]["replay_s"] > 0 and run["ceiling"]["replay_decode_spread"] >= 1 for run in runs)
    assert record["fraction_of_replayed_ceiling"] == sorted(run["ceiling"]["replay_s"] / run["elapsed_s"] for run in runs)[1]
    assert "fraction of the replayed ceiling" in stdout
    # The runs start once the idle engine has mapped its KV cache (a thread that is then finished).
    assert record["kv_cache_mapping_s"] >= 0 and "KV cache mapping before the runs, s" in stdout
    # Each step kind beside the machine's own limit, in the dtype the GEMMs multiply in (float32 in the suite).
    assert record["gemm_dtype"] == "float32" and record["ceiling"]["machine_read_gb_s"] > 0
    assert 0 < record["prefill_fraction_of_machine_limit"] and 0 < record["decode_fraction_of_machine_limit"]
    assert record["gemm_products"] == "float32" and record["ceiling"]["machine_float32_gop_s"] > 0
    assert "bare prefill, fraction of the machine's limit" in stdout and "by what the GEMMs multiply in" in stdout


def test_gemm_work_counts_the_weights_a_decode_step_reads(default_llm):
    """Steps the GGUF blocks take read the blocks; larger ones read the dense weights (float32 here): the blocks again
    for the layers on blocks alone (dequantized for the step), the float32 embedding for the lm_head tied to it."""
    from conftest import worker_of

    from pagedserve.benchmarks import worker_probes

    worker = worker_of(default_llm)
    model = worker.model
    small, large = worker_probes.gemm_work(worker, 1, 512), worker_probes.gemm_work(worker, 1000, 512)
    linears = [m for m in model.modules() if hasattr(m, "quantized") and hasattr(m, "packed_weight")]
    assert all(m.weight is None for m in linears) and model.lm_head.weight is not None
    layer_blocks = sum(m.quantized.blocks.numel() for m in linears)
    blocks, dense = layer_blocks + model.quantized_lm_head.blocks.numel(), layer_blocks + 4 * model.lm_head.weight.numel()
    assert (small["decode_weight_bytes"], large["decode_weight_bytes"]) == (blocks, dense)
    gemm_flops, lm_head_flops = 2 * sum(m.in_features * m.out_features for m in linears), 2 * model.lm_head.weight.numel()
    # In float32 the blocks' products are float32 too.
    assert small["flops_per_token"] == {"prefill": {"float32": gemm_flops}, "decode": {"float32": gemm_flops}}
    assert small["lm_head_flops_per_row"] == {"prefill": {"float32": lm_head_flops}, "decode": {"float32": lm_head_flops}}
    assert small["gemm_dtype"] == "float32"


def test_gemm_work_names_integer_products_where_the_blocks_round_their_input(default_llm, monkeypatch):
    """Blocks that round the input to 8 bits multiply integers at the steps they take (a decode's rows here), and the
    dense products the rest (a prefill's rows)."""
    from conftest import worker_of

    from pagedserve.benchmarks import worker_probes
    from pagedserve.layers.linear import QuantizedWeight

    worker = worker_of(default_llm)
    monkeypatch.setattr(QuantizedWeight, "rounds_activations", property(lambda self: True))
    work = worker_probes.gemm_work(worker, 1, 512)
    linears = [m for m in worker.model.modules() if hasattr(m, "quantized") and hasattr(m, "packed_weight")]
    gemm_flops = 2 * sum(m.in_features * m.out_features for m in linears)
    assert work["flops_per_token"] == {"prefill": {"float32": gemm_flops}, "decode": {"int8": gemm_flops}}
    assert list(work["lm_head_flops_per_row"]["decode"]) == ["int8"] and list(work["lm_head_flops_per_row"]["prefill"]) == ["float32"]


def test_machine_limits_price_each_products_flops_at_its_own_rate(monkeypatch):
    """A step's GEMMs in int8 and in float32 take their FLOPs' time at each one's measured rate; a decode step the
    longer of that and reading its weights."""
    from types import SimpleNamespace

    from pagedserve.benchmarks import ceiling, machine

    work = {"gemm_dtype": "float32", "decode_weight_bytes": 10**9,
            "flops_per_token": {"prefill": {"float32": 6 * 10**8, "int8": 2 * 10**8}, "decode": {"int8": 8 * 10**8}},
            "lm_head_flops_per_row": {"prefill": {"float32": 128 * 10**8}, "decode": {"int8": 10**8}}}
    llm = SimpleNamespace(llm_engine=SimpleNamespace(call_utility=lambda *args: [work]))
    monkeypatch.setattr(machine, "read_bandwidth_gb_s", lambda *args: 20.0)
    monkeypatch.setattr(machine, "matmul_gflop_s", lambda dtype, *args: {"float32": 300.0}[str(dtype).removeprefix("torch.")])
    monkeypatch.setattr(machine, "int8_gop_s", lambda *args: 900.0)
    limits = ceiling.machine_limits(llm, decode_rows=64)
    prefill_token_s = 6e8 / 300e9 + 2e8 / 900e9 + 128e8 / ceiling.PREFILL_LEN / 300e9
    assert limits["prefill_limit_tokens_per_s"] == pytest.approx(1 / prefill_token_s)
    assert limits["decode_limit_tokens_per_s"] == pytest.approx(64 / max(1e9 / 20e9, 64 * 9e8 / 900e9))
    assert limits["gemm_products"] == "float32, int8" and (limits["machine_float32_gop_s"], limits["machine_int8_gop_s"]) == (300, 900)


def test_repeats_must_be_positive(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "throughput", "--repeats", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--repeats" in result.stderr and "must be >= 1" in result.stderr


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_burstiness_must_be_a_positive_number(value):
    result = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "serve", "--burstiness", value],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--burstiness" in result.stderr and "must be a finite number > 0" in result.stderr


def test_request_gaps_have_the_rate_and_the_burstiness_asked():
    """Gamma-distributed gaps, mean 1/rate, coefficient of variation 1/sqrt(burstiness): burstiness 1 is the Poisson
    process (the same draws as exponential gaps), 0.1 clumps, 4 spreads evenly; no gap at rate inf."""
    import random
    import statistics

    from pagedserve.benchmarks.serve import arrival_gap

    assert arrival_gap(random.Random(0), float("inf"), 0.1) == 0.0
    poisson, exponential = random.Random(3), random.Random(3)
    assert [arrival_gap(poisson, 20.0) for _ in range(100)] == pytest.approx([exponential.expovariate(20.0) for _ in range(100)],
                                                                             rel=1e-12)
    for burstiness in (0.1, 1.0, 4.0):
        rng = random.Random(1)
        gaps = [arrival_gap(rng, 20.0, burstiness) for _ in range(40000)]
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(0.05, rel=0.05)
        assert statistics.pstdev(gaps) / mean == pytest.approx(burstiness ** -0.5, rel=0.05)


def test_the_health_probe_is_up_and_has_probed_before_the_load_begins():
    """The probe's process starts (a new interpreter, a CPU's worth for a while) and probes once before the block that
    runs the load, so the start-up does not compete with the server's first steps; it probes until the block ends."""
    import http.server
    import threading

    from pagedserve.benchmarks.health_probe import health_probe

    hits = []

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with health_probe(f"http://127.0.0.1:{server.server_address[1]}", interval_s=60.0) as probe:
            hits_when_the_load_begins = list(hits)
    finally:
        server.shutdown()
    assert hits_when_the_load_begins == ["/health"]
    assert len(probe["latencies"]) == 1 and probe["failures"] == 0


def _serve_connections(answers):
    """A connection handler for asyncio.start_server that takes each connection's first request and answers it as
    answers[i] (the i-th connection) says: "close" shuts the connection unanswered, "reset" resets it before reading
    the request, "stream" streams one completion chunk and [DONE], "cut" sends the response's head and one chunk,
    then shuts the connection. Returns the handler and the list of the answers given so far."""
    import socket
    import struct

    seen = []
    chunk = b'data: {"choices": [{"text": "hi"}], "usage": {"completion_tokens": 1}}\n\n'

    async def on_connection(reader, writer):
        answer = answers[len(seen)]
        seen.append(answer)
        if answer == "reset":  # at once, before the request is read: the client's write or read fails
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.close()
            return
        await reader.readuntil(b"\r\n\r\n")
        if answer != "close":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            body = chunk + (b"data: [DONE]\n\n" if answer == "stream" else b"")
            writer.write(b"%x\r\n%s\r\n" % (len(body), body) + (b"0\r\n\r\n" if answer == "stream" else b""))
            await writer.drain()
        writer.close()

    return on_connection, seen


@pytest.mark.parametrize("answers, succeeds, connections", [
    (["close", "stream"], True, 2),  # closed before any answer (a kept-alive connection the server let go): sent again
    (["close", "close", "stream"], True, 3),
    (["reset", "stream"], True, 2),
    (["close", "close", "close"], False, 3),  # sent twice again at most
    (["cut"], False, 1),  # cut off after the answer began: an error of the run, never sent twice
])
def test_a_request_the_server_closed_unanswered_is_sent_again(answers, succeeds, connections):
    import asyncio

    import aiohttp

    from pagedserve.benchmarks.serve import send_one

    async def run():
        on_connection, seen = _serve_connections(answers)
        server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, aiohttp.ClientSession() as session:
            result = await send_one(session, f"http://127.0.0.1:{port}", "completions", {"prompt": "a"}, None)
        return result, seen

    result, seen = asyncio.run(run())
    assert len(seen) == connections
    assert result.success is succeeds
    if succeeds:
        assert result.output_tokens == 1 and result.ttft > 0
    else:
        assert "ClientPayloadError" in result.error or "ServerDisconnected" in result.error


def test_ceiling_decodes_after_the_context_it_names():
    import torch

    from pagedserve.benchmarks.ceiling import mean_decode_context
    from pagedserve.benchmarks.datasets import BenchRequest
    from pagedserve.executor.input_batch import dummy_layout
    from pagedserve.layers import cpu_kernels
    from pagedserve.layers.attention.cpu_backend import CPUAttentionBackend

    backend = CPUAttentionBackend(cpu_kernels.load())
    meta = backend.build_metadata(dummy_layout(num_seqs=3, seq_len=1, context=40, block_size=16), torch.device("cpu"))
    assert meta.num_decode_tokens == 3 and meta.decode_seq_lens.tolist() == [41, 41, 41]
    tables = meta.decode_block_tables.tolist()
    assert [len(set(t)) for t in tables] == [3, 3, 3] and not set(tables[0]) & set(tables[1])
    # Each new token's slot is position 40 of its own sequence: block 2 of its table, offset 8.
    assert meta.slot_mapping.tolist() == [t[2] * 16 + 8 for t in tables]
    # Prefills take the engine's route: 128-token fresh chunks go to the CPU kernel, none left to torch.
    prefill = backend.build_metadata(dummy_layout(num_seqs=4, seq_len=128, context=0, block_size=16), torch.device("cpu"))
    assert prefill.paged_prefills is not None and prefill.paged_prefills.query_lens.tolist() == [128] * 4
    assert prefill.torch_chunks == []
    requests = [BenchRequest([1] * 10, 4), BenchRequest([1] * 30, 12)]
    assert mean_decode_context(requests) == 24  # (10 + 4/2 + 30 + 12/2) / 2


@pytest.mark.slow
def test_mixed_dataset_lengths_vary(tmp_path, tiny_models):
    record, _ = bench(tmp_path, "throughput", "--model", str(tiny_models["llama"]), "--dataset", "mixed", "--num-prompts", "5",
                      "--kv-cache-memory", str(2**24))
    assert record["num_prompts"] == 5
    assert 5 * 16 <= record["prompt_tokens"] <= 5 * 512 and 5 * 16 <= record["output_tokens"] <= 5 * 256


@pytest.mark.slow
def test_prefix_and_interference(tmp_path, tiny_models):
    prefix, _ = bench(tmp_path, "prefix", "--model", str(tiny_models["llama"]), "--num-prompts", "8", "--prefix-len", "256",
                      "--kv-cache-memory", str(2**24))
    # Timing is the benchmark's business, not the test's: the test checks that the cached run reused the
    # prefix (every request after the first found its full blocks) and the uncached run did not.
    assert prefix["mean_ttft_cached_s"] > 0 and prefix["mean_ttft_uncached_s"] > 0
    assert prefix["cached_prompt_tokens"] >= 7 * 256 and prefix["cached_prompt_tokens_uncached_run"] == 0
    interference, _ = bench(tmp_path, "interference", "--model", str(tiny_models["llama"]), "--long-prompt-len", "512",
                            "--chunk-size", "64", "--kv-cache-memory", str(2**24))
    assert all(interference[arm]["itl_p50_s"] > 0 and interference[arm]["prefill_s"] > 0 for arm in ("stall_free", "chunked", "whole"))
    # The arms are what they claim: the whole prompt in one step holds every stream's gap over the whole
    # prefill; fixed chunks spread it over several steps, so no gap spans it.
    assert interference["whole"]["itl_p50_s"] >= interference["whole"]["prefill_s"]
    assert interference["chunked"]["itl_p99_s"] < interference["chunked"]["prefill_s"]
    assert interference["stall_free_p99_over_decode_only"] > 0


def test_kv_and_sched(tmp_path):
    kv, _ = bench(tmp_path, "kv", "--num-blocks", "512")
    assert 0 <= kv["waste_pct"] < 10 and kv["max_concurrent_requests"] > kv["max_concurrent_with_max_len_reservation"]
    assert kv["slots_allocated"] >= kv["tokens_stored"]
    sched, _ = bench(tmp_path, "sched", "--num-running", "64", "--steps", "50")
    assert sched["num_running"] == 64 and sched["median_us_per_step"] > 0 and sched["prepare_inputs_median_us"] > 0
    assert sched["sampling_metadata_greedy_median_us"] > 0 and sched["sampling_metadata_sampled_median_us"] > 0
    assert sched["sampled_bookkeeping_median_us"] > 0
    assert all(sched[f"output_{stage}_median_us"] > 0 for stage in ("encode", "decode", "metrics", "output_processor"))


@pytest.mark.slow
def test_serve_repeats_report_medians(tmp_path, tiny_models):
    record, stdout = bench(tmp_path, "serve", "--model", str(tiny_models["llama"]), "--num-prompts", "4", "--input-len", "16",
                           "--output-len", "5", "--repeats", "3", "--server-args", "--kv-cache-memory", str(2**24))
    [run] = record["runs"]
    repeats = run["repeats"]
    assert len(repeats) == 3 and all(one["completed"] == 4 and one["failures"] == 0 for one in repeats)
    assert run["completed"] == 12 and run["failures"] == 0
    for key in ("output_tokens_per_s", "ttft_p99_s", "itl_p50_s"):
        assert run[key] == sorted(one[key] for one in repeats)[1]
    assert "median of 3 runs" in stdout


@pytest.mark.slow
def test_serve_against_our_own_server_and_plots(tmp_path, tiny_models):
    record, stdout = bench(tmp_path, "serve", "--model", str(tiny_models["llama"]), "--num-prompts", "8", "--input-len", "16",
                           "--output-len", "6", "--request-rate", "inf", "4", "--max-concurrency", "2", "8", "--label", "ours",
                           "--server-args", "--kv-cache-memory", str(2**24))
    assert record["label"] == "ours" and record["num_prompts"] == 8
    assert [(run["request_rate"], run["max_concurrency"]) for run in record["runs"]] == [
        (float("inf"), 2), (float("inf"), 8), (4.0, 2), (4.0, 8)]
    for run in record["runs"]:
        assert run["failures"] == 0 and run["completed"] == 8
        assert run["ttft_p50_s"] > 0 and run["itl_p50_s"] > 0 and run["output_tokens_per_s"] > 0
        assert run["ttft_p50_s"] <= run["ttft_p90_s"] <= run["ttft_p99_s"] and run["itl_p50_s"] <= run["itl_p99_s"]
        assert run["e2el_p50_s"] >= run["ttft_p50_s"]
    record_path = tmp_path / "record.json"
    out_dir = tmp_path / "img"
    result = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "plot", str(record_path), "--out-dir",
                             str(out_dir)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("serve_throughput_vs_concurrency.png", "serve_latency_percentiles.png"):
        data = (out_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.slow
def test_serve_samples_and_chats(tmp_path, tiny_models):
    """Sampled runs beside greedy ones, unconstrained and under a JSON schema of each request's own, and the chat
    endpoint on the multi-turn chat dataset: TTFT counts from the first content token, not the role delta."""
    record, stdout = bench(tmp_path, "serve", "--model", str(tiny_models["llama"]), "--num-prompts", "6", "--dataset", "chat",
                           "--endpoint", "chat", "--temperature", "0", "1", "--top-p", "0.9", "--top-k", "20",
                           "--structure", "none", "json-schema-distinct",
                           "--server-args", "--kv-cache-memory", str(2**24), "--max-model-len", "1024")
    assert record["dataset"] == "chat" and record["endpoint"] == "chat"
    assert [(run["structure"], run["temperature"], run["top_p"], run["top_k"]) for run in record["runs"]] == [
        ("none", 0.0, 0.9, 20), ("none", 1.0, 0.9, 20), ("json-schema-distinct", 0.0, 0.9, 20), ("json-schema-distinct", 1.0, 0.9, 20)]
    for run in record["runs"]:
        assert run["failures"] == 0 and run["completed"] == 6 and run["ttft_p50_s"] > 0 and run["output_tokens_per_s"] > 0
    assert "temperature 1" in stdout
    assert isinstance(record["seed"], int)


def test_the_serve_client_loads_no_torch():
    """bench serve's client runs beside the server it measures: only its own workload's module is imported, and
    nothing of it loads torch (seconds of CPU taken from the server at the start)."""
    code = ("import sys; import pagedserve.benchmarks.serve as serve; serve.run = lambda args: print('torch' in sys.modules); "
            "from pagedserve.entrypoints.cli import main; main(['bench', 'serve', '--base-url', 'http://127.0.0.1:9'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "False"


def test_serve_prompts_differ_between_invocations_unless_seeded():
    from pagedserve.benchmarks.serve import prompt_seed
    from pagedserve.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "serve"])
    assert args.seed is None
    assert prompt_seed(None) != prompt_seed(None) and prompt_seed(7) == 7


def test_datasets_mix_lengths_and_turns():
    from pagedserve.benchmarks.datasets import chat_requests, mixed_requests, passages

    assert len(passages()) >= 30
    conversations = chat_requests(40, seed=3)
    turns = {sum(m["role"] == "user" for m in r.messages) for r in conversations}
    assert turns == {1, 2, 3, 4}
    assert all(r.messages[-1]["role"] == "user" and 32 <= r.output_len <= 256 for r in conversations)
    assert any(p in conversations[0].messages[1]["content"] for p in passages())
    assert "assistant:" in conversations[0].as_prompt()
    mixed = mixed_requests(50, vocab_size=1000, seed=1)
    lengths = [len(r.prompt_token_ids) for r in mixed]
    assert min(lengths) >= 16 and max(lengths) <= 512 and len(set(lengths)) > 30
    import random

    text = mixed[0].as_messages(random.Random(0))[0]["content"]
    assert abs(len(text.split()) - round(lengths[0] * 0.75)) <= 1


def test_plot_rejects_records_of_other_benchmarks(tmp_path):
    path = tmp_path / "kv.json"
    bench(tmp_path, "kv", "--num-blocks", "64")
    path.write_text((tmp_path / "record.json").read_text())
    result = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "plot", str(path), "--out-dir",
                             str(tmp_path / "img")], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "not a `bench serve` record" in result.stderr


def test_replayed_ceiling_runs_the_passes_the_ceiling_counts(monkeypatch):
    """Prompt tokens in 4 x 128-token prefill passes, output tokens in decode passes of the whole batch,
    each kind's time scaled to the exact token count."""
    from types import SimpleNamespace

    from pagedserve.benchmarks import ceiling
    from pagedserve.benchmarks.datasets import BenchRequest

    calls = []

    def fake_passes(llm, num_seqs, seq_len, passes, context=0):
        calls.append((num_seqs, seq_len, passes, context))
        return [2.0] * (passes - 1) + [1.0] if seq_len == 1 else [4.0] * passes

    monkeypatch.setattr(ceiling, "time_bare_passes", fake_passes)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(config=SimpleNamespace(max_num_seqs=8)))
    requests = [BenchRequest([1] * 300, 5) for _ in range(10)]  # 3000 prompt tokens, 50 output tokens
    result = ceiling.replay_seconds(llm, requests)
    # 3000 / 512 -> 6 prefill passes; a batch of 8 (max_num_seqs) -> 50 / 8 -> 7 decode passes.
    assert calls == [(4, 128, 6, 0), (8, 1, 7, 0)]
    assert result["replay_s"] == pytest.approx(24.0 * 3000 / 3072 + 13.0 * 50 / 56)
    assert result["replay_decode_spread"] == 2.0


def test_ceiling_leaves_no_stale_prefix_cache(tiny_models):
    """The bare forward writes K/V into cache blocks behind the block pool's back; a prompt served
    before it must not be answered from those overwritten blocks afterwards."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.benchmarks.ceiling import measure_ceiling

    llm = LLM(str(tiny_models["llama"]), kv_cache_memory=2**24, enable_prefix_caching=True)
    prompt = {"prompt_token_ids": list(range(10, 74))}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    measure_ceiling(llm, num_seqs=4, seq_len=64)
    after = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before


@pytest.mark.slow
def test_executor_messages_are_timed_without_the_model(tmp_path, tiny_models):
    record, stdout = bench(tmp_path, "executor", "--model", str(tiny_models["llama"]), "-tp", "2", "--num-running", "64", "--steps", "20",
                           "--kv-cache-memory", str(2**24))
    assert record["tensor_parallel_size"] == 2 and record["num_running"] == 64 and record["steps"] == 20
    assert 0 < record["median_us_per_step"] <= record["p99_us_per_step"]
    assert "2 ranks" in stdout


@pytest.mark.slow
def test_spec_compares_speculation_on_and_off(tmp_path, tiny_models):
    """Both servers answer the copy workload; the random-token run reports both sides."""
    record, stdout = bench(tmp_path, "spec", "--model", str(tiny_models["llama"]), "--concurrency", "1", "2", "--requests-per-user", "1",
                           "--num-prompts", "3", "--input-len", "12", "--output-len", "6", "--server-args", "--kv-cache-memory",
                           str(2**24))
    rows = record["copy"]
    assert sorted((r["speculation"], r["concurrency"]) for r in rows) == [(False, 1), (False, 2), (True, 1), (True, 2)]
    assert all(r["failures"] == 0 and r["output_tokens_per_s"] > 0 for r in rows)
    assert all(r["mean_accepted_length"] is None for r in rows if not r["speculation"])
    assert record["speculative_config"]["method"] == "ngram"
    off, on = record["random_throughput"]
    assert (off["speculation"], on["speculation"]) == (False, True) and off["drafts"] == 0
    assert "speed-up" in stdout and "mean accepted length" in stdout and "ratio on/off" in stdout


def test_machine_limits_are_measured_and_name_the_processor(tmp_path):
    from pagedserve.cpu_features import cpu_features

    record, stdout = bench(tmp_path, "machine", "--memory-mib", "64", "--matmul-size", "128", "--repeats", "2")
    features = cpu_features()
    assert record["cpu"] == features.model_name and record["isa"] == features.isa
    assert record["read_bandwidth_gb_s"] > 0 and record["float32_gflop_s"] > 0
    assert record["bfloat16_gflop_s"] is None or record["bfloat16_gflop_s"] > 0
    assert record["float32_matmul_size"] in (128, 256, 512)  # quick products are timed at up to 4x the size asked
    assert "memory read, GB/s" in stdout and f"float32 matmul, GFLOP/s (best at n = {record['float32_matmul_size']})" in stdout
    # The vector units' byte products: every processor these kernels build for has AVX2's at least.
    assert record["int8_vector_gop_s"] > 0 and "int8 products on the vector units" in stdout


def test_a_quick_product_is_timed_at_larger_sizes_and_the_best_rate_kept(monkeypatch):
    """A library may not split a small product among every thread: where a product takes under the budget, twice the
    size is timed too (two doublings at most), and the best rate is the machine's; a slow product stops the growth."""
    import torch

    from pagedserve.executor import matmul_rate

    rates = {1024: 1400.0, 2048: 2400.0, 4096: 2300.0, 8192: 9999.0}  # GFLOP/s; 4096^3 at 2300 takes ~60 ms
    timed = []
    monkeypatch.setattr(matmul_rate, "matmul_rate_at", lambda dtype, size, repeats: timed.append(size) or rates[size])
    assert matmul_rate.max_rate_and_size(torch.bfloat16, 1024, 3) == (2400.0, 2048)
    assert timed == [1024, 2048, 4096]
    timed.clear()
    rates[1024] = 20.0  # 1024^3 takes ~0.1 s: no larger product
    assert matmul_rate.max_rate_and_size(torch.bfloat16, 1024, 3) == (20.0, 1024) and timed == [1024]


def test_kv_capacity_per_dtype_and_kv_accuracy_against_float32(tmp_path, tiny_models):
    """bench kv: the default model's 8-bit caches (head size 64: 68 bytes a row against float32's 256) hold 3.5x
    float32's blocks or more in the same memory. bench kv-accuracy: float32 measured against itself is exact, and each
    other cache has its figures."""
    kv, stdout = bench(tmp_path, "kv", "--num-blocks", "256", "--kv-cache-memory", str(2**26))
    capacity = kv["capacity_by_dtype"]
    for dtype in ("int8", "fp8_e4m3", "fp8_e5m2"):
        assert capacity[dtype]["blocks"] >= 3.5 * capacity["float32"]["blocks"]
    assert capacity["bfloat16"]["blocks"] == 2 * capacity["float32"]["blocks"]
    record, _ = bench(tmp_path, "kv-accuracy", "--model", str(tiny_models["llama"]), "--kv-cache-dtype", "int8", "--window", "64",
                      "--chunk", "16", "--num-prompts", "2", "--output-len", "8")
    exact, int8 = record["results"]["float32"], record["results"]["int8"]
    assert exact["max_logprob_diff"] == 0 and exact["identical_answers"] == 2 and exact["perplexity_change_pct"] == 0
    assert int8["perplexity"] > 1 and int8["max_logprob_diff"] >= 0 and len(int8["tokens_before_divergence"]) == 2


def test_gemm_accuracy_measures_int8_gemms_against_float32(tmp_path, tiny_models):
    """bench gemm-accuracy: float32 GEMMs measured against themselves are exact; int8 GEMMs round, and have their figures."""
    record, stdout = bench(tmp_path, "gemm-accuracy", "--model", str(tiny_models["llama"]), "--variants", "int8", "--window", "64",
                           "--chunk", "32", "--num-prompts", "2", "--output-len", "8")
    exact, int8 = record["results"]["float32"], record["results"]["int8"]
    assert exact["max_logprob_diff"] == 0 and exact["identical_answers"] == 2 and exact["perplexity_change_pct"] == 0
    assert int8["max_logprob_diff"] > 0 and len(int8["tokens_before_divergence"]) == 2
    assert "int8: perplexity vs float32 %" in stdout


def test_kv_speed_times_a_decode_step_for_each_dtype(tmp_path, tiny_models):
    """bench kv-speed: each dtype's bare decode step over its contexts, and its ratio to bfloat16's in the same run."""
    record, stdout = bench(tmp_path, "kv-speed", "--model", str(tiny_models["llama"]), "--kv-cache-dtype", "bfloat16", "fp8",
                           "--num-seqs", "3", "--context", "100", "--passes", "2", "--rounds", "2")
    results = record["results"]
    assert set(results) == {"bfloat16", "fp8"} and record["context"] == 100
    assert all(r["step_ms_best"] <= r["step_ms_median"] for r in results.values()) and results["fp8"]["step_ms_best"] > 0
    assert results["fp8"]["vs_bfloat16"] == pytest.approx(results["fp8"]["step_ms_median"] / results["bfloat16"]["step_ms_median"])
    assert "fp8: vs bfloat16" in stdout


@pytest.mark.slow
def test_moe_model_writes_a_mixture_and_its_dense_equal(tmp_path):
    """The mixture of the shape asked for, and the dense model whose MLP is as wide as top_k experts: the same
    parameters active per token; both load and generate."""
    from pagedserve import LLM, SamplingParams

    shape = ["--layers", "2", "--hidden", "128", "--experts", "4", "--expert-width", "32", "--top-k", "2"]
    moe, stdout = bench(tmp_path, "moe-model", "--out", str(tmp_path / "moe"), *shape)
    dense, _ = bench(tmp_path, "moe-model", "--out", str(tmp_path / "dense"), "--dense", *shape)
    assert moe["experts"] == 4 and dense["experts"] == 0 and "active parameters per token" in stdout
    assert moe["parameters"] - dense["parameters"] == 2 * (3 * 128 * 32 * 2 + 4 * 128)  # two more experts, and the router
    assert moe["active_parameters_per_token"] == dense["parameters"] + 2 * 4 * 128
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["moe_intermediate_size"] == 32
    for name in ("moe", "dense"):
        output = LLM(str(tmp_path / name), kv_cache_memory=2**22).generate({"prompt_token_ids": [5, 6, 7]},
                                                                          SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(output[0].outputs[0].token_ids) == 4


def test_lora_adapters_are_peft_directories_the_engine_and_peft_agree_on(tmp_path, tiny_models):
    """The written adapters are what peft itself reads: served, each gives peft's own greedy tokens."""
    from conftest import greedy, hf_greedy

    from pagedserve import LLM, LoRARequest

    record, stdout = bench(tmp_path, "lora-adapters", "--model", str(tiny_models["llama"]), "--out", str(tmp_path / "adapters"),
                           "--count", "2", "--rank", "8")
    assert record["rank"] == 8 and len(record["adapters"]) == 2 and "lora-0=" in stdout
    # Two layers of q, k, v, o (64 -> 64, 64 -> 32 twice, 64 -> 64) and gate, up, down (64 <-> 128), float32.
    assert record["bytes_per_adapter"] == 2 * 8 * (128 + 96 + 96 + 128 + 3 * 192) * 4
    llm = LLM(str(tiny_models["llama"]), enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_memory=2**22, dtype="float32")
    prompt = list(range(40, 60))
    for index, path in enumerate(record["adapters"]):
        output = llm.generate({"prompt_token_ids": prompt}, greedy(8), lora_request=LoRARequest(f"lora-{index}", index + 1, path),
                              use_tqdm=False)[0]
        assert list(output.outputs[0].token_ids) == hf_greedy(tiny_models["llama"], [prompt], 8, adapter_dir=path)[0]


def test_kv_store_loads_a_prompt_a_fresh_engine_would_compute(tmp_path, tiny_models):
    record, stdout = bench(tmp_path, "kv-store", "--model", str(tiny_models["llama"]), "--prompt-len", "200",
                           "--kv-cache-memory", str(2**22), "--dtype", "float32")
    assert record["loaded_tokens"] == 192 and "loaded / computed" in stdout
    assert record["ttft_loaded_s"] > 0 and record["ttft_computed_s"] > 0
