"""PNG plots of `bench serve` records: throughput against concurrency, and latency percentiles.

Each record is one server (its label); its runs are the points. Regenerate with
`pagedserve bench plot RECORD.json [...] --out-dir docs/img`.
"""

from __future__ import annotations

import json
from pathlib import Path

PERCENTILE_KEYS = (("p50", "ttft_p50_s", "itl_p50_s"), ("p90", "ttft_p90_s", "itl_p90_s"), ("p99", "ttft_p99_s", "itl_p99_s"))


def load_records(paths: list[str]) -> list[dict]:
    records = []
    for path in paths:
        try:
            record = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a JSON record ({exc})") from exc
        if record.get("benchmark") != "serve":
            raise ValueError(f"{path}: not a `bench serve` record (benchmark={record.get('benchmark')!r})")
        records.append(record)
    return records


def plot_serve_records(paths: list[str], out_dir: str) -> list[Path]:
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("bench plot needs matplotlib: pip install 'pagedserve[bench]'") from exc
    matplotlib.use("Agg")  # files only, no display
    records = load_records(paths)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [_throughput_vs_concurrency(records, out / "serve_throughput_vs_concurrency.png"),
            _latency_percentiles(records, out / "serve_latency_percentiles.png")]


def _concurrency(run: dict, record: dict) -> int:
    # No cap means every request at once: the number of requests is the concurrency.
    return run["max_concurrency"] or record["num_prompts"]


def _throughput_vs_concurrency(records: list[dict], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for record in records:
        runs = sorted(record["runs"], key=lambda run: _concurrency(run, record))
        ax.plot([_concurrency(r, record) for r in runs], [r["output_tokens_per_s"] for r in runs], marker="o", label=record["label"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests in flight (max concurrency)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Serving throughput ({_workload(records[0])})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _latency_percentiles(records: list[dict], path: Path) -> Path:
    import matplotlib.pyplot as plt

    bars = [(f"{record['label']}, {_run_name(run, record)}", run) for record in records for run in record["runs"]]
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 1.1 * len(bars) + 5), 6))
    width = 0.8 / len(PERCENTILE_KEYS)
    for metric, ax in zip(("TTFT", "ITL"), axes):
        for i, (name, ttft_key, itl_key) in enumerate(PERCENTILE_KEYS):
            key = ttft_key if metric == "TTFT" else itl_key
            ax.bar([x + i * width for x in range(len(bars))], [run.get(key, float("nan")) for _, run in bars], width, label=name)
        ax.set_xticks([x + width for x in range(len(bars))], [label for label, _ in bars], fontsize=7, rotation=35, ha="right")
        ax.set_ylabel("seconds")
        ax.set_title(f"{metric} percentiles")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle(f"Serving latency ({_workload(records[0])})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _run_name(run: dict, record: dict) -> str:
    rate = "inf" if run["request_rate"] == float("inf") else f"{run['request_rate']:g}/s"
    return f"rate {rate}, {_concurrency(run, record)} in flight"


def _workload(record: dict) -> str:
    if record.get("dataset", "random") != "random":
        return f"{record['num_prompts']} requests, {record['dataset']} dataset, {record.get('endpoint', 'completions')}"
    return f"{record['num_prompts']} requests, {record['input_len']} in / {record['output_len']} out"
