"""The package layering of docs/architecture.md, enforced: which packages may import which, and no
import cycle between packages. Every import counts, those inside functions too."""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "pagedserve"
SUBPACKAGES = ("core", "engine", "executor", "models", "layers", "entrypoints", "benchmarks", "distributed", "spec_decode")

# package -> the packages it must not import (and whether torch is forbidden too)
FORBIDDEN = {
    "core": {"models", "layers", "executor", "engine", "entrypoints", "benchmarks", "distributed", "spec_decode", "torch"},
    "distributed": {"core", "models", "layers", "executor", "engine", "entrypoints", "benchmarks", "spec_decode"},
    "layers": {"core", "engine", "executor", "entrypoints", "models", "benchmarks", "spec_decode"},
    "models": {"core", "engine", "executor", "entrypoints", "benchmarks", "spec_decode"},
    # Proposers and the rejection sampler see token lists and tensors, never requests or steps.
    "spec_decode": {"core", "engine", "executor", "entrypoints", "benchmarks", "distributed"},
    "executor": {"engine", "entrypoints", "benchmarks"},
    "engine": {"models", "layers", "entrypoints", "benchmarks", "spec_decode"},
    "benchmarks": {"layers", "models", "entrypoints", "distributed", "spec_decode"},
    # The modules at the top of the package (config, envs, request, outputs, sampling_params) are shared by all.
    "common": {*SUBPACKAGES, "torch"},
}


def package_of(path: Path) -> str | None:
    parts = path.relative_to(PACKAGE_ROOT).parts
    if len(parts) == 1:
        return None if parts[0] == "__init__.py" else "common"  # the package's __init__ is its entry point
    return parts[0]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def target_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "torch":
        return "torch"
    if parts[0] != "pagedserve" or len(parts) < 2:
        return None
    if parts[1] in SUBPACKAGES:
        return parts[1]
    return "common" if (PACKAGE_ROOT / f"{parts[1]}.py").is_file() else None


def package_imports() -> dict[str, dict[str, set[str]]]:
    """package -> imported package -> the files that import it."""
    edges: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in PACKAGE_ROOT.rglob("*.py"):
        source = package_of(path)
        if source is None:
            continue
        for module in imported_modules(path):
            target = target_of(module)
            if target is not None and target != source:
                edges[source][target].add(str(path.relative_to(PACKAGE_ROOT)))
    return edges


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_its_layer_allows(package):
    edges = package_imports()[package]
    violations = {target: sorted(files) for target, files in edges.items() if target in FORBIDDEN[package]}
    assert not violations, f"{package} imports what its layer forbids: {violations}"


def test_no_import_cycle_between_packages():
    edges = {source: set(targets) - {"torch"} for source, targets in package_imports().items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in edges.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(package for package in edges if reaches(package, package, {package}))
    assert not cycles, f"packages on an import cycle: {cycles} (edges: { {k: sorted(v) for k, v in edges.items()} })"


def test_the_checker_sees_lazy_imports(tmp_path):
    """An import inside a function counts as much as one at the top."""
    source = tmp_path / "module.py"
    source.write_text("def f():\n    from pagedserve.models.loader import load_model\n")
    assert "pagedserve.models.loader" in imported_modules(source)


def test_core_functions_stay_short():
    """The scheduler's step reads as "running requests, then waiting ones": schedule() fits in 40 lines and no
    function in core/ passes 50; what else shapes a step lives in its own unit (step plan, stall bound, drafts)."""
    lengths = {}
    for path in (PACKAGE_ROOT / "core").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[f"{path.name}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert lengths["scheduler.py:schedule"] <= 40
    assert not {name: n for name, n in lengths.items() if n > 50}
