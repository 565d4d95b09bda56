"""The import graph, read from the code: one-way layers and no import circles.

`tui` -> `sim` <- (the executor protocol) `gpu`: `sim` names nothing of `tui` or `gpu`, `gpu`
nothing of `sim` or `tui`. Within each, no module imports one that imports it back, however
indirectly. A project import inside a function says why on its line (a comment), since it hides
how the modules connect."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sim", "tui", "gpu")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = p
    return mods


MODULES = _modules()


def imports(path: Path):
    """(line, imported module, at module top, the source line) for each project import."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    top = {id(n) for n in tree.body}
    # (an import under `if TYPE_CHECKING:` or try/except at the top still runs at import time)
    for node in tree.body:
        if isinstance(node, (ast.If, ast.Try)):
            top |= {id(n) for n in ast.walk(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = []
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                names.append(sub if sub in MODULES else node.module)
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES and name in MODULES:
                yield node.lineno, name, id(node) in top, lines[node.lineno - 1]


def graph(top_only: bool) -> dict[str, set[str]]:
    g = {m: set() for m in MODULES}
    for m, p in MODULES.items():
        for _, name, at_top, _ in imports(p):
            if name != m and (at_top or not top_only):
                g[m].add(name)
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
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
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_planted_circle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(g) == [["a", "b", "c"]]


def test_no_import_circles_counting_imports_inside_functions():
    assert _cycles(graph(top_only=False)) == []


def test_layers_point_one_way():
    allowed = {"sim": {"sim"}, "gpu": {"gpu"}, "tui": {"tui", "sim", "gpu"}}
    wrong = [f"{m} imports {n}" for m, deps in graph(top_only=False).items()
             for n in deps if n.split(".")[0] not in allowed[m.split(".")[0]]]
    assert wrong == []


def test_imports_inside_functions_say_why():
    silent = [f"{p.relative_to(ROOT)}:{line}: {src.strip()}"
              for m, p in MODULES.items() for line, _, at_top, src in imports(p)
              if not at_top and "#" not in src]
    assert silent == []
