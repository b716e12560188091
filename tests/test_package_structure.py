"""The package's structure: no module imports another that imports it back (directly or through a
loop, imports inside functions included), nor does any of its sub-packages (hpctrain.comm,
hpctrain.models, ...: one floor each, imports running down only), and few modules at the root."""

import ast
import os

from conftest import REPO

PACKAGE = os.path.join(REPO, "hpctrain")


def _modules() -> dict:
    """Dotted module name -> its path, for every .py file of the package (a package is its __init__)."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, REPO)[:-3].split(os.sep)
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(module: str, path: str, modules: dict) -> set:
    """The package's modules that ``module`` names in an import statement, anywhere in the file."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # "from . import x": x may be a submodule; else the names come from base itself
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(n for n in names if n in modules and n != module)
    return found


def _cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_another_that_imports_it_back():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert graph["hpctrain.training.trainer"] & {"hpctrain.training.step", "hpctrain.training.loop"}  # it reads
    assert _cycles(graph) == []


def test_no_sub_package_imports_one_that_imports_it_back():
    modules = _modules()
    floor = lambda m: ".".join(m.split(".")[:2])  # noqa: E731 - hpctrain.comm.ring -> hpctrain.comm
    graph: dict = {}
    for m, p in modules.items():
        graph.setdefault(floor(m), set()).update(floor(n) for n in _imports(m, p, modules) if floor(n) != floor(m))
    assert "hpctrain.comm" in graph["hpctrain.training"]
    assert _cycles(graph) == []


def test_the_root_holds_few_modules():
    root = sorted(n for n in os.listdir(PACKAGE) if n.endswith(".py") and n not in ("__init__.py", "__main__.py"))
    assert len(root) <= 6, root
