"""The package's layering, read from the source (AST), so that it stays as the README's code map shows it.

Three layers, imports pointing one way: the library (``config``, ``model``, ``errors``, ``io``,
``parallel``, ``optim``, ``data``, ``checkpoint``, ``eval``, ``generation``, ``plan``, ``options``,
``interop``) <- the runtime (``runtime``, ``training``) <- the commands (``cli``, ``commands``).
Every ``import`` counts, also one inside a function.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "tnlg"
LAYERS = {"commands": 2, "cli": 2, "__main__": 2, "runtime": 1, "training": 1}  # everything else: library (0)


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("tnlg",) + path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _target(name: str) -> str | None:
    """The tnlg module an imported name lives in (``tnlg.a.b.func`` -> ``tnlg.a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # ``from pkg import mod`` imports the module; ``from mod import name`` the module holding it
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            target = _target(name) if name.startswith("tnlg.") or name == "tnlg" else None
            if target and target not in (module, "tnlg"):
                found.add(target)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], 0) if len(parts) > 1 else 0


def test_imports_point_from_the_commands_to_the_runtime_to_the_library():
    wrong = sorted(f"{m} ({_layer(m)}) imports {t} ({_layer(t)})" for m, ts in GRAPH.items() for t in ts
                   if _layer(t) > _layer(m))
    assert not wrong, "layer 0 = library, 1 = runtime, 2 = commands:\n" + "\n".join(wrong)


def test_no_import_cycles():
    """Tarjan's strongly connected components over every import edge: each must be one module."""
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, cycles


# the library's own order, lowest first: a package imports only from those before it (and from itself). The
# parallel layout's sizes, rank order and checks (tnlg.layout: torch-free, for the commands' flags)
# sit below parallel, whose process groups follow that rank order; they import only what comes before them.
LIBRARY_ORDER = ["tnlg.errors", "tnlg.io", "tnlg.data", "tnlg.config", "tnlg.layout", "tnlg.parallel", "tnlg.model"]


def _package(module: str) -> str:
    """The entry of LIBRARY_ORDER a module belongs to (a module named there, else its top-level package)."""
    return module if module in LIBRARY_ORDER else ".".join(module.split(".")[:2])


def test_the_library_imports_downwards():
    """``parallel`` (the collectives, layers, loss, pipeline schedule) never imports ``model`` (the decoder and its
    pipeline stages, built from ``parallel``'s pieces), and neither imports the packages above them."""
    rank = {p: i for i, p in enumerate(LIBRARY_ORDER)}
    wrong = sorted(f"{m} imports {t}" for m, ts in GRAPH.items() if _package(m) in rank for t in ts
                   if rank.get(_package(t), len(rank)) > rank[_package(m)])
    assert not wrong, "\n".join(wrong)


def test_few_modules_at_the_top_of_the_package():
    top = sorted(p.name for p in ROOT.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= 5, top


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")))
def test_no_function_longer_than_60_lines(path):
    tree = ast.parse((ROOT / path).read_text())
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
    assert not long, long


def test_the_graph_sees_relative_and_function_level_imports():
    """The checks above are only as good as the graph: it must hold edges written every way."""
    assert "tnlg.runtime.launch" in GRAPH["tnlg.commands.inference"]  # from ..runtime.launch import ...
    assert "tnlg.training.checkpointing" in GRAPH["tnlg.commands.pretrain"]  # inside a function
    assert "tnlg.parallel.state" in GRAPH["tnlg.model.decoder"]  # from ..parallel.state import ... (a package's module)
    assert "tnlg.model.decoder" in GRAPH["tnlg.model"]  # from .decoder import ... (a package's __init__)
    assert os.path.basename(MODULES["tnlg.cli"]) == "cli.py"


def test_checkpoints_take_the_run_options_as_data():
    """The checkpoint package records and compares a run's options without importing them: the options
    (what a command resolves) sit above what they configure, and are handed to the checkpoint as values."""
    wrong = sorted(f"{m} imports {t}" for m, ts in GRAPH.items() if m.startswith("tnlg.checkpoint")
                   for t in ts if t == "tnlg.options" or t.startswith("tnlg.options."))
    assert not wrong, wrong


def test_checkpoints_take_the_parameter_layout_as_data():
    """The checkpoint package builds no model: the parameters' TP layout (what ``GPT.describe`` returns) is
    handed to it by its callers, so no module of ``tnlg.checkpoint`` imports ``tnlg.model``."""
    wrong = sorted(f"{m} imports {t}" for m, ts in GRAPH.items() if m == "tnlg.checkpoint" or
                   m.startswith("tnlg.checkpoint.") for t in ts if t == "tnlg.model" or t.startswith("tnlg.model."))
    assert not wrong, wrong
    assert any(t.startswith("tnlg.checkpoint") for t in GRAPH["tnlg.generation.loading"])  # (the graph sees them)


def _part(module: str) -> str:
    """The part of tnlg a module belongs to (``tnlg.options.recorded`` -> ``tnlg.options``; a loose module,
    ``tnlg.config``, is its own)."""
    return ".".join(module.split(".")[:2])


def _private_imports(module: str, path: Path) -> list[str]:
    """``from M import _name`` statements of ``module`` whose ``M`` is in another part of tnlg."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            up = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(up + ([base] if base else []))
        if not base.startswith("tnlg"):
            continue
        for a in node.names:
            target = f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
            if a.name.startswith("_") and not a.name.startswith("__") and _part(target) != _part(module):
                found.append(f"{module}:{node.lineno} imports {a.name} from {base}")
    return found


def test_no_part_of_the_package_imports_another_parts_private_names():
    """A name with a leading underscore is its package's own: one that another package needs is made public
    where it lives (or moved to where it belongs)."""
    wrong = [line for m, p in MODULES.items() for line in _private_imports(m, p)]
    assert not wrong, "\n".join(wrong)


def test_the_private_import_check_sees_relative_imports(tmp_path):
    """The check above is only as good as its reading: a relative import of another package's private name."""
    sample = tmp_path / "finetune.py"
    sample.write_text("def f():\n    from ..options.recorded import _from_manifest, checkpoint_args\n")
    assert _private_imports("tnlg.commands.finetune", sample) == [
        "tnlg.commands.finetune:2 imports _from_manifest from tnlg.options.recorded"]
    sample.write_text("from .block import Block, _dropout\n")
    assert _private_imports("tnlg.model.decoder", sample) == []  # (its own package's)
