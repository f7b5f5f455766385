"""The package layering of docs/architecture.md, enforced: which packages may import which, and no
import cycle between packages. Every import counts, those inside functions too."""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "pagedserve"
SUBPACKAGES = ("core", "engine", "executor", "models", "layers", "entrypoints", "benchmarks", "distributed", "spec_decode",
               "structured_output", "kv_transfer")

# package -> the packages it must not import (and whether torch is forbidden too)
FORBIDDEN = {
    "core": {"models", "layers", "executor", "engine", "entrypoints", "benchmarks", "distributed", "spec_decode", "structured_output",
             "kv_transfer", "torch"},
    "distributed": {"core", "models", "layers", "executor", "engine", "entrypoints", "benchmarks", "spec_decode", "structured_output"},
    "layers": {"core", "engine", "executor", "entrypoints", "models", "benchmarks", "spec_decode", "structured_output", "kv_transfer"},
    "models": {"core", "engine", "executor", "entrypoints", "benchmarks", "spec_decode", "structured_output", "kv_transfer"},
    # Connectors see the step's contracts, requests and the KV cache's tensors, never the model or the engine.
    "kv_transfer": {"models", "layers", "executor", "engine", "entrypoints", "benchmarks", "spec_decode", "structured_output",
                    "distributed"},
    # Proposers and the rejection sampler see token lists and tensors, never requests or steps.
    "spec_decode": {"core", "engine", "executor", "entrypoints", "benchmarks", "distributed"},
    "executor": {"engine", "entrypoints", "benchmarks", "structured_output"},
    # Grammars and their states know requests and the step's contract, never the model or the devices.
    "structured_output": {"models", "layers", "executor", "engine", "entrypoints", "benchmarks", "distributed", "spec_decode"},
    "engine": {"models", "layers", "entrypoints", "benchmarks", "spec_decode"},
    "benchmarks": {"layers", "models", "entrypoints", "distributed", "spec_decode"},
    # The modules at the top of the package (config, envs, request, outputs, sampling_params) are shared by all.
    "common": {*SUBPACKAGES, "torch"},
    # The package's own __init__, every process's entry: the shared modules, and LLM from engine (lazily).
    "entry": {*(set(SUBPACKAGES) - {"engine"}), "torch"},
}


def package_of(path: Path) -> str | None:
    parts = path.relative_to(PACKAGE_ROOT).parts
    if len(parts) == 1:
        return "entry" if parts[0] == "__init__.py" else "common"
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


def test_nothing_inside_the_package_imports_the_package_itself():
    """A module that needs a side effect of `import pagedserve` (the OpenMP defaults) calls it by name instead."""
    importers = set()
    for path in PACKAGE_ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import) and any(alias.name == "pagedserve" for alias in node.names):
                importers.add(str(path.relative_to(PACKAGE_ROOT)))
            elif isinstance(node, ast.ImportFrom) and node.module == "pagedserve" and path.name != "__init__.py":
                if not all(_is_module(f"pagedserve.{alias.name}") for alias in node.names):  # `from pagedserve import envs` is a module
                    importers.add(str(path.relative_to(PACKAGE_ROOT)))
    assert not importers, f"modules that import the package itself: {sorted(importers)}"


def test_no_import_cycle_between_modules_of_a_package():
    """Inside a package too: the executor interface does not import the executors that implement it."""
    graph = defaultdict(set)
    for path in PACKAGE_ROOT.rglob("*.py"):
        module = ".".join(("pagedserve", *path.relative_to(PACKAGE_ROOT).with_suffix("").parts)).removesuffix(".__init__")
        for name in imported_modules(path):
            while name and not _is_module(name):
                name = name.rpartition(".")[0]
            if name and name != module and name.split(".")[:2] == module.split(".")[:2] and name.count(".") > 1:
                graph[module].add(name)

    def on_cycle(start):
        stack, seen = list(graph[start]), set()
        while stack:
            node = stack.pop()
            if node == start:
                return True
            if node not in seen:
                seen.add(node)
                stack.extend(graph[node])
        return False

    cycles = sorted(module for module in list(graph) if on_cycle(module))
    assert not cycles, f"modules on an import cycle: {cycles}"


def _is_module(name: str) -> bool:
    path = PACKAGE_ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


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
