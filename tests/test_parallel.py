"""Tensor, pipeline and data parallelism give the single-process engine's outputs: token for token, or
diverging only where the reference's top two tokens are a near-tie (an all-reduce sums in another order);
logprobs within 1e-3. Each mode also runs the features that touch the step contract: prefix caching,
chunked prefill, preemption, n > 1, aborts and a structured output (its token masks travel with the
step). Ranks are processes, so these tests are slow."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import assert_matches
from server_utils import RemoteServer, metric_value

from pagedserve import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

SHARED = list(range(300, 340))  # a prefix of 40 tokens that two prompts share: cached blocks
PROMPTS = [[1, 400, 500, 600, 700], SHARED + [11, 12], SHARED + [13, 14, 15], list(range(100, 190)), [7] * 3]


def run_workload(llm: LLM) -> list:
    """Greedy requests with logprobs (one with n=2, one under a regular expression), one aborted midway; returns the
    finished outputs."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
    engine.add_request("pair", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2))
    lowercase = StructuredOutputsParams(regex="[a-z ]+")
    engine.add_request("structured", {"prompt_token_ids": PROMPTS[1]},
                       SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, structured_outputs=lowercase))
    engine.add_request("aborted", {"prompt_token_ids": PROMPTS[3]}, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    finished = {}
    for step in range(10_000):
        if not engine.has_unfinished_requests():
            break
        if step == 4:
            engine.abort_request("aborted")
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert "aborted" not in finished
    assert engine.get_stats().kv_cache_usage == 0.0  # every block back, the aborted request's too
    return [finished[str(index)] for index in range(len(PROMPTS))] + [finished["pair"], finished["structured"]]


def parallel_llm(model_dir, **settings) -> LLM:
    # A small cache (preemptions) and a small token budget (chunked prefill).
    return LLM(str(model_dir), num_gpu_blocks_override=12, max_model_len=192, max_num_batched_tokens=48, **settings)


@pytest.fixture(scope="module")
def reference(tiny_models):
    llm = parallel_llm(tiny_models["llama"])
    outputs = run_workload(llm)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # the workload does exercise both
    return outputs


@pytest.mark.parametrize("settings", [
    {"tensor_parallel_size": 2},
    {"pipeline_parallel_size": 2},
    {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    {"pipeline_parallel_size": 2, "pp_layer_partition": "1,1", "distributed_executor_backend": "mp"},
], ids=["tp2", "pp2", "tp2-pp2", "pp2-explicit"])
def test_parallel_engine_matches_the_single_process_one(tiny_models, reference, settings):
    llm = parallel_llm(tiny_models["llama"], **settings)
    try:
        outputs = run_workload(llm)
        assert llm.llm_engine.get_stats().num_preemptions > 0
    finally:
        llm.llm_engine.shutdown()
    assert_matches(outputs, reference)


@pytest.mark.parametrize("arch,settings", [
    ("qwen2_moe", {"tensor_parallel_size": 2}),
    ("qwen2_moe", {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    ("mixtral", {"pipeline_parallel_size": 2}),
    ("olmoe", {"tensor_parallel_size": 2}),
], ids=["qwen2_moe-tp2", "qwen2_moe-tp2-ep", "mixtral-pp2", "olmoe-tp2"])
def test_a_mixture_of_experts_split_over_ranks_matches_the_single_process_one(tiny_models, arch, settings):
    """Tensor parallelism splits every expert's features (and the shared expert's) over the ranks, and OLMoE's q and k
    norms over all heads are summed across them; expert parallelism gives each rank half of the experts, whole;
    pipeline parallelism gives each stage its layers' experts."""
    from pagedserve.benchmarks.worker_probes import experts_held

    reference = run_workload(parallel_llm(tiny_models[arch]))
    llm = parallel_llm(tiny_models[arch], **settings)
    try:
        outputs = run_workload(llm)
        held = llm.llm_engine.call_utility("collective_rpc", experts_held)
    finally:
        llm.llm_engine.shutdown()
    assert_matches(outputs, reference)
    layer = "model.layers.1.mlp.experts"
    if settings.get("enable_expert_parallel"):
        assert [rank[layer] for rank in held] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    elif "tensor_parallel_size" in settings:
        assert [rank[layer] for rank in held] == [list(range(8))] * 2


def test_a_checkpoint_saved_fused_splits_over_ranks_as_the_others_do(tiny_models):
    """Phi-3 saves each layer's q/k/v and gate/up fused: each rank takes its heads and columns of each part."""
    reference = run_workload(parallel_llm(tiny_models["phi3"]))
    llm = parallel_llm(tiny_models["phi3"], tensor_parallel_size=2)
    try:
        outputs = run_workload(llm)
    finally:
        llm.llm_engine.shutdown()
    assert_matches(outputs, reference)


@pytest.mark.parametrize("settings", [{"tensor_parallel_size": 2, "kv_cache_dtype": "fp8"},
                                      {"pipeline_parallel_size": 2, "kv_cache_dtype": "int8"}], ids=["tp2-fp8", "pp2-int8"])
def test_parallel_engine_over_an_8_bit_cache_matches_the_single_process_one(tiny_models, settings):
    """Each rank quantizes its own KV heads' rows (a row is one KV head's), as the single process does."""
    reference = run_workload(parallel_llm(tiny_models["llama"], kv_cache_dtype=settings["kv_cache_dtype"]))
    llm = parallel_llm(tiny_models["llama"], **settings)
    try:
        outputs = run_workload(llm)
    finally:
        llm.llm_engine.shutdown()
    assert_matches(outputs, reference)


def test_ray_backend_runs_the_same_workers(tiny_models, reference):
    pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]'")
    llm = parallel_llm(tiny_models["llama"], tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        outputs = run_workload(llm)
    finally:
        llm.llm_engine.shutdown()
    assert_matches(outputs, reference)


def test_three_way_tensor_parallel_default_model(default_model_dir, tokenizer):
    """9 heads and 3 KV heads over 3 ranks, each GEMM on its share of the GGUF blocks."""
    prompts = ["The capital of France is", "Here is a short story about a robot who learns to paint:"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    reference = LLM(max_model_len=512, kv_cache_memory=2**27).generate(prompts, params, use_tqdm=False)
    llm = LLM(max_model_len=512, kv_cache_memory=2**27, tensor_parallel_size=3)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert_matches(outputs, reference)


def _fail_steps(worker) -> None:
    def fail(scheduler_output):
        raise ValueError("a step that cannot run")
    worker.execute_model = fail


def test_a_rank_that_fails_a_step_is_reported_with_its_error(tiny_models):
    """The step's output comes back through its own ring; a rank's error comes back on the results socket, which the
    executor reads while it waits, so a failed step raises at once with the rank's traceback instead of hanging."""
    llm = LLM(str(tiny_models["llama"]), tensor_parallel_size=2, max_model_len=64, distributed_executor_backend="mp")
    engine = llm.llm_engine
    try:
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], params)[0].outputs[0].token_ids) == 3
        engine.call_utility("collective_rpc", _fail_steps)
        engine.add_request("doomed", {"prompt_token_ids": [1, 2, 3]}, params)
        start = time.monotonic()
        with pytest.raises(Exception, match="a step that cannot run"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 10
    finally:
        engine.shutdown()


def test_impossible_splits_fail_at_start_naming_the_numbers(tiny_models):
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\) is not divisible by tensor_parallel_size \(2\)"):
        LLM(tensor_parallel_size=2, kv_cache_memory=2**27)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(3\) is more than the model's 2 layers"):
        LLM(str(tiny_models["llama"]), pipeline_parallel_size=3, kv_cache_memory=2**24)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) above num_key_value_heads \(2\) must be a multiple"):
        LLM(str(tiny_models["llama"]), tensor_parallel_size=3, kv_cache_memory=2**24)
    with pytest.raises(ValueError, match="pp_layer_partition must be 2 positive layer counts"):
        LLM(str(tiny_models["llama"]), pipeline_parallel_size=2, pp_layer_partition="2")
    with pytest.raises(ValueError, match="distributed_executor_backend must be mp or ray with more than one rank"):
        LLM(str(tiny_models["llama"]), tensor_parallel_size=2, distributed_executor_backend="uni")


def _descendants(pid: int) -> list[int]:
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(child) for child in children] + [grandchild for child in children for grandchild in _descendants(int(child))]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _stream_then_kill(server: RemoteServer, victim) -> tuple[int, Exception | None]:
    """A long stream; after its 5th chunk victim() is killed. -> (chunks seen, the error that ended it)."""

    async def main():
        client = server.async_openai()
        stream = await client.completions.create(model="tiny", prompt=[5, 6], max_tokens=900, stream=True,
                                                 extra_body={"ignore_eos": True})
        seen, error = 0, None
        try:
            async for _ in stream:
                seen += 1
                if seen == 5:
                    os.kill(victim(), signal.SIGKILL)
        except Exception as exc:
            error = exc
        return seen, error

    return asyncio.run(main())


def _processes_of(server: RemoteServer, marker: str) -> list[int]:
    pids = _descendants(server.process.pid)
    return [pid for pid in pids if _alive(pid) and marker in open(f"/proc/{pid}/cmdline").read()]


@pytest.mark.parametrize("mode", ["tp-worker", "dp-core"])
def test_a_killed_worker_or_core_fails_the_server_cleanly(tiny_models, mode):
    flags = ["-tp", "2"] if mode == "tp-worker" else ["-dp", "2"]
    server = RemoteServer("--model", str(tiny_models["llama"]), "--served-model-name", "tiny", "--kv-cache-memory", str(2**24), *flags)
    everyone = _descendants(server.process.pid)
    try:
        spawned = _processes_of(server, "spawn_main")
        victim = spawned[-1]  # a worker (spawned by the engine core) or the second engine core
        seen, error = _stream_then_kill(server, lambda: victim)
        returncode = server.process.wait(60)
    finally:
        server.stop()
    assert error is not None and seen < 900
    assert returncode != 0 and "engine core is dead" in server.log_text()
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in everyone) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in everyone if _alive(pid)], "processes outlived the server"


def test_data_parallel_server_routes_by_load_and_prefix_and_labels_its_metrics(tiny_models):
    """Two engine cores behind one server: greedy outputs as one engine gives them, requests spread over both,
    a shared prompt prefix kept on one core (its cache hits), streams and aborts as usual, per-core metrics,
    and SIGTERM stops every process."""
    server = RemoteServer("--model", str(tiny_models["llama"]), "--served-model-name", "tiny", "--kv-cache-memory", str(2**24),
                          "-dp", "2")
    everyone = _descendants(server.process.pid)
    single = LLM(str(tiny_models["llama"]), kv_cache_memory=2**24)
    prompts = [[5 + index, 6, 7, 8] for index in range(8)]
    expected = [o.outputs[0].text for o in single.generate([{"prompt_token_ids": p} for p in prompts],
                                                          SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                                                          use_tqdm=False)]
    try:
        async def main():
            client = server.async_openai()
            answers = await asyncio.gather(*(client.completions.create(
                model="tiny", prompt=p, max_tokens=16, temperature=0.0, logprobs=1, extra_body={"ignore_eos": True}) for p in prompts))
            stream = await client.completions.create(model="tiny", prompt=[9, 9, 9], max_tokens=400, stream=True,
                                                     extra_body={"ignore_eos": True})
            async for _ in stream:
                break  # a client that goes away: its request is aborted on its core
            await stream.close()
            shared = list(range(300, 364))
            for suffix in range(4):
                await client.completions.create(model="tiny", prompt=shared + [suffix], max_tokens=2)
            return answers

        answers = asyncio.run(main())
        assert [a.choices[0].text for a in answers] == expected
        metrics = server.get("/metrics").text
        generated = [metric_value(metrics, f'pagedserve:generation_tokens_total{{engine="{e}",model_name="tiny"}}') for e in (0, 1)]
        assert all(count > 0 for count in generated)  # both cores served
        hits = [metric_value(metrics, f'pagedserve:prefix_cache_hits_total{{engine="{e}",model_name="tiny"}}') for e in (0, 1)]
        assert max(hits) >= 3 * 64 - 16  # the shared prefix's later requests hit the core that cached it
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            metrics = server.get("/metrics").text
            if all(metric_value(metrics, f'pagedserve:num_requests_running{{engine="{e}",model_name="tiny"}}') == 0 for e in (0, 1)):
                break
            time.sleep(0.2)
        assert all(metric_value(metrics, f'pagedserve:kv_cache_usage_perc{{engine="{e}",model_name="tiny"}}') == 0 for e in (0, 1))
    finally:
        assert server.stop(signal.SIGTERM) == 0
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in everyone) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in everyone if _alive(pid)]


PLAIN_SCRIPT = """from pagedserve import LLM, SamplingParams, StructuredOutputsParams
llm = LLM({model!r}, tensor_parallel_size=2, kv_cache_memory=2**24)
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
print("TOKENS", llm.generate([{{"prompt_token_ids": [1, 400, 500]}}], params, use_tqdm=False)[0].outputs[0].token_ids)
"""


def test_a_plain_script_without_a_main_guard_runs_tensor_parallel(tiny_models, tmp_path):
    """As with vLLM: `LLM(tensor_parallel_size=2)` at the top of a script works without `if __name__ == "__main__":` (the
    workers start by fork where that is safe); where they must start by spawn, the user gets one error that says
    what to add, not Python's bootstrapping traceback."""
    from conftest import hf_greedy

    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT.format(model=str(tiny_models["llama"])))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"TOKENS {hf_greedy(tiny_models['llama'], [[1, 400, 500]], 6)[0]}" in run.stdout
    spawned = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                             env={**os.environ, "PAGEDSERVE_WORKER_MULTIPROC_METHOD": "spawn"})
    assert spawned.returncode != 0
    assert 'if __name__ == "__main__":' in spawned.stderr and "bootstrapping" not in spawned.stderr, spawned.stderr[-3000:]


def test_workers_start_by_fork_only_where_it_is_safe():
    """Once OpenMP has run a parallel region, a forked child would inherit its pool without the threads and hang."""
    script = ("import torch; from pagedserve.processes import child_start_method; print(child_start_method()[0]); "
              "torch.set_num_threads(2); a = torch.randn(600, 600); a @ a; print(child_start_method()[0])")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["fork", "spawn"], run.stderr[-2000:]
