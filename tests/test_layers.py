"""The package's architecture, checked: each folder is one layer, imports point down only, no module
imports another's private names, and the module graph has no circles (issue 25).

Every `import` and `from ... import` counts, those inside functions too: a lazy import is still a
dependency, it only moves the cost. TYPE_CHECKING imports count as well (none cross a layer).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "pulsediff"

# Bottom first. A module may import its own unit and any unit listed before it, never one after.
LAYERS = [
    ("errors", "version", "example"),  # leaves: import nothing of pulsediff
    ("runtime",),
    ("kernels",),
    ("io",),
    ("codecs",),
    ("format",),
    ("ops",),
    ("series",),
    ("engines",),
    ("cli",),
    ("__main__", ""),  # the package's own __init__: the public API, on top of everything
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def unit_of(module: str) -> str:
    """'pulsediff.io.checkpoint' -> 'io'; 'pulsediff.errors' -> 'errors'; 'pulsediff' -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports_of(module: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every pulsediff import in `module`."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.split(".")[0] == "pulsediff"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "pulsediff":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                # `from pulsediff.codecs import entropy` imports the module entropy, not a name of codecs
                out.append((sub, "", node.lineno) if sub in MODULES else (target, alias.name, node.lineno))
    return out


def dynamic_imports_of(module: str) -> list[int]:
    """Lines of `importlib.import_module(...)` and `__import__(...)` calls naming a pulsediff module:
    imports the checks above cannot see. Only the package's own __init__ (the top, lazy public API)
    may use them."""
    lines = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            dynamic = (isinstance(f, ast.Attribute) and f.attr == "import_module") or \
                (isinstance(f, ast.Name) and f.id in ("__import__", "import_module"))
            # third-party modules (numba's warning classes, say) may be looked up this way
            names_pulsediff = any(isinstance(c, ast.Constant) and isinstance(c.value, str) and "pulsediff" in c.value
                                  for arg in node.args for c in ast.walk(arg))
            if dynamic and names_pulsediff:
                lines.append(node.lineno)
    return lines


def edges() -> dict[str, set[str]]:
    return {m: {target for target, _, _ in imports_of(m) if target != m} for m in MODULES}


def test_every_module_belongs_to_a_layer():
    unplaced = sorted(m for m in MODULES if unit_of(m) not in RANK)
    assert not unplaced, f"place these in LAYERS (a new folder or top-level module is a decision): {unplaced}"


def test_imports_point_down_only():
    upward = []
    for module in MODULES:
        for target, name, line in imports_of(module):
            assert target in MODULES, f"{module}:{line} imports {target}, which does not exist"
            if RANK[unit_of(target)] > RANK[unit_of(module)]:
                upward.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_leaves_import_nothing_of_pulsediff():
    leaves = [m for m in MODULES if unit_of(m) in LAYERS[0]]
    assert not {m: imports_of(m) for m in leaves if imports_of(m)}


def test_no_dynamic_imports_below_the_public_api():
    found = {m: dynamic_imports_of(m) for m in MODULES if m != "pulsediff" and dynamic_imports_of(m)}
    assert not found, f"importlib/__import__ calls hide dependencies from this check: {found}"


def test_no_module_imports_private_names_of_another():
    private = []
    for module in MODULES:
        for target, name, line in imports_of(module):
            leaf = name or target.rpartition(".")[2]
            if leaf.startswith("_") and not leaf.startswith("__"):
                private.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} imports {target} {name}")
    assert not private, "private names imported across modules:\n" + "\n".join(private)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of nodes (first == last), or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_module_graph_has_no_circles():
    # A package's __init__ runs before any of its modules, so a module importing its own package's
    # __init__ and that __init__ importing it back is a circle too.
    cycle = find_cycle(edges())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("graph, cyclic", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"a": {"a"}}, True),
    ({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}, False),
])
def test_the_cycle_finder_finds_cycles(graph, cyclic):
    assert (find_cycle(graph) is not None) == cyclic


@pytest.mark.parametrize("code, check, words", [
    ("def f():\n    from pulsediff.ops.make import helper\n", "up", "io/checkpoint.py:2 imports pulsediff.ops.make"),
    ("import pulsediff.ops.make as m\n", "up", "io/checkpoint.py:1 imports pulsediff.ops.make"),
    ("from ..ops import make\n", "up", "io/checkpoint.py:1 imports pulsediff.ops.make"),
    ("from pulsediff import ops\n", "up", "io/checkpoint.py:1 imports pulsediff.ops"),
    ("from pulsediff.ops.make import *\n", "up", "imports pulsediff.ops.make"),
    ("from pulsediff.ops.make import _helper\n", "private", "_helper"),
    ("import importlib\nm = importlib.import_module('pulsediff.ops.make')\n", "dynamic", "pulsediff.io.checkpoint"),
    ("m = __import__('pulsediff.ops.make')\n", "dynamic", "pulsediff.io.checkpoint"),
])
def test_the_checker_sees_planted_violations(tmp_path, monkeypatch, code, check, words):
    """The checks can fail: each planted import in io/checkpoint.py is reported."""
    fake = tmp_path / "pulsediff"
    (fake / "io").mkdir(parents=True)
    (fake / "ops").mkdir()
    for f in ("__init__.py", "io/__init__.py", "ops/__init__.py", "ops/make.py"):
        (fake / f).write_text("")
    (fake / "io" / "checkpoint.py").write_text(code)
    monkeypatch.setitem(globals(), "PACKAGE", fake)
    monkeypatch.setitem(globals(), "MODULES", {module_name(p): p for p in sorted(fake.rglob("*.py"))})
    test = {"up": test_imports_point_down_only, "private": test_no_module_imports_private_names_of_another,
            "dynamic": test_no_dynamic_imports_below_the_public_api}[check]
    with pytest.raises(AssertionError, match=words.replace(".", r"\.").replace("(", r"\(")):
        test()


def test_the_public_api_is_where_it_was():
    """Every public name is defined where the lazy table says (not a re-import that could go stale)."""
    import importlib

    import pulsediff

    assert set(pulsediff._HOMES) | {"__version__"} == set(pulsediff.__all__)
    for name, home in pulsediff._HOMES.items():
        obj = getattr(pulsediff, name)
        assert callable(obj) and obj.__module__ == home and getattr(importlib.import_module(home), name) is obj, name
    assert pulsediff.__version__ and "catch_up_state_dict" in dir(pulsediff)
