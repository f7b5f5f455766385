"""`pagedserve bench <workload>`: the workloads of BENCHMARKS.md, one table each (and --json)."""

from __future__ import annotations

import argparse
import importlib
import sys

from pagedserve.config import EngineConfig
from pagedserve.entrypoints.engine_args import add_engine_args


def register(sub) -> None:
    bench = sub.add_parser("bench", help="run a benchmark workload")
    workloads = bench.add_subparsers(dest="workload", required=True)

    throughput = _workload(workloads, "throughput", "offline LLM.generate throughput", engine=True)
    throughput.add_argument("--dataset", choices=["random", "mixed"], default="random",
                            help="random: uniform lengths; mixed: input 16-512 and output 16-256 tokens")
    throughput.add_argument("--num-prompts", type=int, default=None, help="default 32 (random) or 64 (mixed)")
    throughput.add_argument("--input-len", type=int, default=128)
    throughput.add_argument("--output-len", type=int, default=128)
    throughput.add_argument("--baseline", choices=["none", "hf"], default="none", help="also run transformers static batching")
    throughput.add_argument("--ceiling", action="store_true",
                            help="also measure the bare forward pass at full batch: its best passes, and all the passes "
                                 "the workload needs replayed in full (adds about the run's own time)")
    throughput.add_argument("--repeats", type=_positive_int, default=1,
                            help="run the workload this many times (fresh prompts each, HF right after ours) and report medians")

    serve = _workload(workloads, "serve", "streaming HTTP client against an OpenAI-compatible server", prompt_seed=None)
    serve.add_argument("--base-url", default=None, help="server to measure (default: start our own)")
    serve.add_argument("--model", default=EngineConfig.model, help="model for our own server")
    serve.add_argument("--served-model", nargs="+", default=None,
                       help="model name(s) to send, the requests spread over them in turn (LoRA adapters, say); default: "
                            "the server's first")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--num-prompts", type=int, default=64)
    serve.add_argument("--input-len", type=int, default=128)
    serve.add_argument("--output-len", type=int, default=128)
    serve.add_argument("--vocab-size", type=int, default=49152, help="random prompt ids are drawn below this")
    serve.add_argument("--dataset", choices=["random", "mixed", "chat"], default="random",
                       help="random: --input-len/--output-len token ids; mixed: input 16-512 and output 16-256 tokens; chat: "
                            "multi-turn conversations over the shipped English passages, output 32-256 tokens")
    serve.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                       help="/v1/completions or /v1/chat/completions (TTFT: the first content token, after the role delta)")
    serve.add_argument("--temperature", type=float, nargs="+", default=[0.0],
                       help="sampling temperature of every request; several run in turn (default: 0, greedy)")
    serve.add_argument("--top-p", type=float, default=None, help="top_p of every request (default: the server's)")
    serve.add_argument("--top-k", type=int, default=None, help="top_k of every request (default: the server's)")
    serve.add_argument("--min-p", type=float, default=None, help="min_p of every request (default: the server's)")
    for penalty in ("repetition", "frequency", "presence"):
        serve.add_argument(f"--{penalty}-penalty", type=float, default=None, help=f"{penalty}_penalty of every request (default: none)")
    serve.add_argument("--seeded", action="store_true", help="give every request a seed of its own")
    serve.add_argument("--structure", nargs="+", choices=["none", "json-schema", "json-schema-distinct"], default=["none"],
                       help="the output's structure: none; json-schema (one JSON schema for every request, compiled once); "
                            "json-schema-distinct (a schema of its own for each request, each compiled cold); several run in turn")
    serve.add_argument("--request-rate", nargs="+", default=["inf"],
                       help="requests/s (Poisson, or as --burstiness shapes the gaps), or inf; several run in turn")
    serve.add_argument("--burstiness", type=_positive_float, default=1.0,
                       help="shape of the gamma distribution of the gaps between requests at a finite rate, their mean "
                            "1/rate: 1 is Poisson, below 1 the requests come in clumps, above 1 more evenly (default 1)")
    serve.add_argument("--max-concurrency", type=int, nargs="+", default=None,
                       help="cap on requests in flight; several run in turn (a sweep, for `bench plot`)")
    serve.add_argument("--health-interval", type=float, default=0.1,
                       help="seconds between GET /health probes during each run, their latency reported (0: no probe)")
    serve.add_argument("--label", default=None, help="name of the measured server in the record and plots")
    serve.add_argument("--repeats", type=_positive_int, default=1,
                       help="run each rate/concurrency this many times (fresh prompts each) and report the medians")
    serve.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="extra flags for our own server (last)")

    prefix = _workload(workloads, "prefix", "prefix caching on vs off", engine=True)
    prefix.add_argument("--num-prompts", type=int, default=32)
    prefix.add_argument("--prefix-len", type=int, default=1024)

    interference = _workload(workloads, "interference", "decode latency while a long prompt is prefilled", engine=True)
    interference.add_argument("--long-prompt-len", type=int, default=2048)
    interference.add_argument("--chunk-size", type=int, default=32, help="prompt tokens per step with chunked prefill")

    kv = _workload(workloads, "kv", "KV cache waste and concurrency (no model)")
    kv.add_argument("--block-size", type=int, default=16)
    kv.add_argument("--num-blocks", type=int, default=2048)
    kv.add_argument("--mean-len", type=int, default=320)
    kv.add_argument("--max-model-len", type=int, default=8192)
    kv.add_argument("--model", default=EngineConfig.model, help="the model whose cache capacity is reported per dtype")
    kv.add_argument("--kv-cache-memory", type=int, default=EngineConfig.kv_cache_memory, help="bytes of KV cache")

    kv_accuracy = _workload(workloads, "kv-accuracy", "KV cache dtypes against a float32 cache: perplexity over the shipped "
                                                      "English text, logprob differences, greedy agreement on chat prompts")
    kv_accuracy.add_argument("--model", default=EngineConfig.model)
    kv_accuracy.add_argument("--kv-cache-dtype", nargs="+", default=["int8", "fp8_e4m3", "fp8_e5m2", "bfloat16"],
                             help="the caches measured against float32 (each on the torch attention backend, as float32 is)")
    kv_accuracy.add_argument("--window", type=_positive_int, default=1024, help="tokens of text per prompt (perplexity)")
    kv_accuracy.add_argument("--chunk", type=_positive_int, default=128,
                             help="prompt tokens per step: later chunks attend to context read back from the cache")
    kv_accuracy.add_argument("--num-prompts", type=_positive_int, default=16, help="chat prompts (greedy agreement)")
    kv_accuracy.add_argument("--output-len", type=_positive_int, default=64, help="greedy tokens per chat prompt")

    gemm_accuracy = _workload(workloads, "gemm-accuracy", "dtype auto, bfloat16 and int8 GEMMs against float32 ones: perplexity "
                                                          "over the shipped English text, logprob differences, greedy agreement")
    gemm_accuracy.add_argument("--model", default=EngineConfig.model)
    gemm_accuracy.add_argument("--variants", nargs="+", default=["bfloat16", "int8", "int8, bfloat16"],
                               choices=["auto", "bfloat16", "int8", "int8, bfloat16"], help="what is measured against float32 GEMMs")
    gemm_accuracy.add_argument("--window", type=_positive_int, default=1024, help="tokens of text per prompt (perplexity)")
    gemm_accuracy.add_argument("--chunk", type=_positive_int, default=256, help="prompt tokens per step")
    gemm_accuracy.add_argument("--num-prompts", type=_positive_int, default=32, help="chat prompts (greedy agreement)")
    gemm_accuracy.add_argument("--output-len", type=_positive_int, default=64, help="greedy tokens per chat prompt")

    kv_speed = _workload(workloads, "kv-speed", "the bare decode step over long contexts for each KV cache dtype, the dtypes "
                                                "in turn")
    kv_speed.add_argument("--model", default=EngineConfig.model)
    kv_speed.add_argument("--kv-cache-dtype", nargs="+", default=["float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"])
    kv_speed.add_argument("--num-seqs", type=_positive_int, default=32, help="decodes in the step")
    kv_speed.add_argument("--context", type=_positive_int, default=2048, help="tokens in each sequence's cache")
    kv_speed.add_argument("--block-size", type=_positive_int, default=EngineConfig.block_size)
    kv_speed.add_argument("--passes", type=_positive_int, default=10, help="steps timed per dtype and round")
    kv_speed.add_argument("--rounds", type=_positive_int, default=2, help="times through the dtypes")

    sched = _workload(workloads, "sched", "scheduler + KV manager step time (no model)")
    sched.add_argument("--num-running", type=int, default=256)
    sched.add_argument("--num-blocks", type=int, default=20000)
    sched.add_argument("--steps", type=int, default=500)
    sched.add_argument("--model", default=EngineConfig.model, help="whose tokenizer detokenizes the step's outputs")

    machine = _workload(workloads, "machine", "the machine's limits: memory read bandwidth, float32 / bfloat16 / int8 matrix "
                                              "rates, and the vector units' byte products (no model)")
    machine.add_argument("--memory-mib", type=_positive_int, default=1024, help="size of the tensor read")
    machine.add_argument("--matmul-size", type=_positive_int, default=1024,
                         help="the smallest n of the n x n x n matrix products (quick ones are timed up to 4n too)")
    machine.add_argument("--repeats", type=_positive_int, default=5, help="each figure is the best of this many")

    executor = _workload(workloads, "executor", "the executor's messages per step with several ranks, no model", engine=True)
    executor.add_argument("--num-running", type=int, default=256)
    executor.add_argument("--steps", type=int, default=200)

    spec = _workload(workloads, "spec", "speculative decoding on vs off: copy-heavy chat at several concurrencies, random-token "
                                        "throughput")
    spec.add_argument("--model", default=EngineConfig.model)
    spec.add_argument("--concurrency", type=_positive_int, nargs="+", default=[1, 4, 16], help="concurrent users, in turn")
    spec.add_argument("--requests-per-user", type=_positive_int, default=3, help="requests per concurrent user")
    spec.add_argument("--num-speculative-tokens", type=_positive_int, default=4)
    spec.add_argument("--random-throughput", action=argparse.BooleanOptionalAction, default=True,
                      help="also the offline random-token workload with and without speculation")
    spec.add_argument("--num-prompts", type=int, default=32, help="random-token workload: prompts")
    spec.add_argument("--input-len", type=int, default=128)
    spec.add_argument("--output-len", type=int, default=128)
    spec.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="extra flags for both servers (last)")

    pd = _workload(workloads, "pd", "disaggregated prefill and decode (proxy + P2pConnector, a core share each) against one "
                                    "instance: streams decoding while long prompts arrive", prompt_seed=None)
    pd.add_argument("--model", default=EngineConfig.model)
    pd.add_argument("--num-streams", type=_positive_int, default=16)
    pd.add_argument("--stream-input-len", type=_positive_int, default=64)
    pd.add_argument("--stream-output-len", type=_positive_int, default=256)
    pd.add_argument("--num-long", type=_positive_int, default=4, help="long prompts, arriving while the streams decode")
    pd.add_argument("--long-prompt-len", type=_positive_int, default=2048)
    pd.add_argument("--long-output-len", type=_positive_int, default=16)
    pd.add_argument("--first-long-after", type=float, default=3.0, help="seconds after the streams start")
    pd.add_argument("--long-interval", type=float, default=5.0, help="seconds between long prompts")
    pd.add_argument("--vocab-size", type=int, default=49152, help="random prompt ids are drawn below this")
    pd.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="extra flags for every server (last)")

    moe = _workload(workloads, "moe-model", "write a random-weight mixture of experts (or its dense equal) for bench throughput")
    moe.add_argument("--out", required=True, help="directory to write the HF model into")
    moe.add_argument("--dense", action="store_true", help="the dense model with the same active parameters per token instead")
    moe.add_argument("--layers", type=_positive_int, default=16)
    moe.add_argument("--hidden", type=_positive_int, default=1024, help="hidden size (a multiple of 64: heads of 64)")
    moe.add_argument("--experts", type=_positive_int, default=32)
    moe.add_argument("--expert-width", type=_positive_int, default=512, help="each expert's intermediate size")
    moe.add_argument("--top-k", type=_positive_int, default=4, help="experts per token")

    loras = _workload(workloads, "lora-adapters", "write random-weight LoRA adapters (PEFT directories) of a model, for "
                      "serving them with --lora-modules and bench serve --served-model")
    loras.add_argument("--model", default=EngineConfig.model, help="the base model")
    loras.add_argument("--out", required=True, help="directory to write lora-0, lora-1, ... into")
    loras.add_argument("--count", type=_positive_int, default=4)
    loras.add_argument("--rank", type=_positive_int, default=16)

    kv_store = _workload(workloads, "kv-store", "TTFT of a long prompt loaded from a SharedStorageConnector store vs computed",
                         engine=True)
    kv_store.add_argument("--prompt-len", type=_positive_int, default=2048)

    plot = workloads.add_parser("plot", help="PNG plots from `bench serve --json` records")
    plot.add_argument("records", nargs="+", help="JSON records written by `bench serve --json` (one per server)")
    plot.add_argument("--out-dir", default="docs/img", help="where the PNG files go")
    plot.set_defaults(handler=run_plot)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _workload(workloads, name: str, help_text: str, engine: bool = False, prompt_seed: int | None = 0) -> argparse.ArgumentParser:
    parser = workloads.add_parser(name, help=help_text)
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    if engine:
        add_engine_args(parser)  # its --seed seeds the prompts too
    elif prompt_seed is None:
        parser.add_argument("--seed", type=int, default=None,
                            help="seed of the random prompts (default: a new one each invocation, named in the record, so "
                                 "a server that stays up cannot answer a repeated workload from its prefix cache)")
    else:
        parser.add_argument("--seed", type=int, default=prompt_seed, help="seed of the random prompts")
    parser.set_defaults(handler=run_bench)
    return parser


def run_plot(args) -> int:
    from pagedserve.benchmarks import plots

    try:
        paths = plots.plot_serve_records(args.records, args.out_dir)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


# Each workload's module in pagedserve.benchmarks and its entry point: only the chosen one is imported (a client-side
# workload such as serve does not load torch).
_RUNNERS = {"throughput": ("throughput", "run"), "serve": ("serve", "run"), "prefix": ("prefix", "run"),
            "interference": ("interference", "run"), "kv": ("kv_sched", "run_kv"), "sched": ("kv_sched", "run_sched"),
            "executor": ("executor", "run"), "spec": ("spec", "run"), "machine": ("machine", "run"),
            "kv-accuracy": ("kv_accuracy", "run"), "gemm-accuracy": ("gemm_accuracy", "run"), "kv-speed": ("kv_speed", "run"),
            "moe-model": ("moe_model", "run"), "lora-adapters": ("lora_adapters", "run"), "kv-store": ("kv_store", "run"),
            "pd": ("pd", "run")}


def run_bench(args) -> int:
    if args.workload in ("throughput", "prefix", "interference", "executor", "kv-store"):
        defaults = {f.name: f.default for f in EngineConfig.settings()}
        # Engine settings the user changed, passed on to LLM(...); the model travels separately.
        args.engine_overrides = {name: getattr(args, name) for name in defaults if name != "model" and hasattr(args, name)
                                 and getattr(args, name) != defaults[name]}
    if args.workload == "throughput" and args.num_prompts is None:
        args.num_prompts = 64 if args.dataset == "mixed" else 32
    module, function = _RUNNERS[args.workload]
    getattr(importlib.import_module(f"pagedserve.benchmarks.{module}"), function)(args)
    return 0
