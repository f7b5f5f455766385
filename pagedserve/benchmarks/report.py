"""One readable table per benchmark, and a JSON record with --json."""

from __future__ import annotations

import json
import statistics


def print_table(title: str, rows: list[tuple[str, object]]) -> None:
    width = max(len(name) for name, _ in rows)
    print(f"\n== {title} ==")
    for name, value in rows:
        print(f"  {name:<{width}}  {_fmt(value)}")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


def write_json(path: str | None, record: dict) -> None:
    if path:
        with open(path, "w") as handle:
            json.dump(record, handle, indent=2)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")
