"""The package's shape: no import cycle, nothing outside the engine reaches into its parts, short
functions.

Both read the source with `ast` (every import, function-local and type-only ones included), so
they hold for code paths no other test runs.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mbd_jax"


def module_files() -> dict[str, pathlib.Path]:
    """{dotted module name: file} of every module of the package (a package is its __init__)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(files: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """{module: the package's modules it imports anywhere in its source}. `from a.b import c`
    names module a.b.c when that is a module, else a.b."""
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files
                         else node.module for a in node.names}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle():
    graph = import_graph(module_files())
    assert "mbd_jax.model.transformer" in graph["mbd_jax.model.sharding"]  # the parse sees imports
    assert cycles(graph) == []


def test_the_engine_does_not_import_the_service():
    """The HTTP tier sits on the engine, never under it."""
    graph = import_graph(module_files())
    below = [m for m in graph if m.split(".")[1:2] in (["engine"], ["cache"], ["model"],
                                                      ["decoding"])]
    assert below and not [(m, d) for m in below for d in graph[m] if d.startswith("mbd_jax.serving")]


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    # a function-local import counts: model.transformer importing the sharding module back
    files = module_files()
    graph = import_graph(files)
    graph["mbd_jax.model.transformer"] |= {"mbd_jax.model.sharding"}
    assert ["mbd_jax.model.sharding", "mbd_jax.model.transformer"] in cycles(graph)


# The engine's parts: what an outsider must read through Engine's own methods (stats(), sync(),
# flush(), close(), ...), never directly.
ENGINE_PARTS = {"pages", "offloader", "prefix_store", "call_log", "kv", "cache", "params",
                "programs"}
INSIDE = {"engine", "cache", "model", "decoding", "train"}  # the engine and what it is built on


def reaches_into_engine(source: str, where: str) -> list[str]:
    """Attribute reads of an engine's parts or private members in `source` (on a name or
    attribute called like an engine: `engine`, `self.engine`, `warm_engine`, ...)."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
        if "engine" in name.lower() and (node.attr.startswith("_") or node.attr in ENGINE_PARTS):
            hits.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return hits


def outsiders() -> list[pathlib.Path]:
    """The package outside the engine (the service, the CLI, benchmarks, multi-host) and the
    tools. Tests are the engine's own white-box checks and may look inside."""
    inside = [p for p in PACKAGE.rglob("*.py")
              if p.relative_to(PACKAGE).parts[0] not in INSIDE]
    return sorted(inside) + sorted((ROOT / "tools").glob("*.py"))


def test_nothing_outside_the_engine_reads_its_parts():
    files = outsiders()
    assert ROOT / "mbd_jax/serving/scheduler.py" in files and ROOT / "mbd_jax/bench.py" in files
    hits = [hit for path in files
            for hit in reaches_into_engine(path.read_text(), str(path.relative_to(ROOT)))]
    assert hits == []


def test_the_seam_check_sees_a_reach():
    source = ("def f(self, engine):\n    n = self.engine.pages.free\n"
              "    return engine._call_log, engine.stats().pages_free\n")
    assert reaches_into_engine(source, "probe.py") == [
        "probe.py:2: self.engine.pages", "probe.py:3: engine._call_log"]


# The decoding state machine, one jitted update over the whole Block Buffer (the model's math,
# like everything under mbd_jax/model/, may be as long as its formulas).
MATH = {("mbd_jax/decoding/block_buffer.py", "advance")}
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = {"mbd_jax/engine/core.py": 300, "mbd_jax/serving/scheduler.py": 300}


def long_functions(source: str, where: str, limit: int) -> list[str]:
    return [f"{where}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > limit and (where, n.name) not in MATH]


def test_functions_and_the_step_stay_short():
    """No function over 80 lines outside the model's math; the engine step and the scheduler
    each under 300 lines."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if not where.startswith("mbd_jax/model/"):
            found += long_functions(path.read_text(), where, MAX_FUNCTION_LINES)
    assert not found, found
    for where, limit in MAX_MODULE_LINES.items():
        assert len((ROOT / where).read_text().splitlines()) < limit, where


def test_the_length_check_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    assert long_functions(f"def f():\n{body}\n", "m.py", MAX_FUNCTION_LINES) == ["m.py:1 f (82 lines)"]
    assert long_functions(f"def advance():\n{body}\n", "mbd_jax/decoding/block_buffer.py",
                          MAX_FUNCTION_LINES) == []
