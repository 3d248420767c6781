"""The package holds what a rule or a user command runs; experiments/ holds the rest.

Every module of vqpipe/ is reached, through any import (a lazy one too, or a ``"vqpipe.X"``
string such as the command line's STAGES), from the package itself, its command line, or a module
that workflow/ or the Makefile names; vqpipe never imports experiments/.

The package has no import cycles (an import inside a function counts), imports run down its floors
(FLOORS), no library module imports a stage, and no stage imports another: what two stages share
lives in a library module (e.g. vqpipe/store/quantized.py, the quantize artifact).
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMED = re.compile(r"\bvqpipe(?:\.[a-z_]+)+")


def _modules():
    out = {}
    for path in (ROOT / "vqpipe").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name, path):
    """Dotted names ``path`` imports or names in a string, relative imports resolved."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.update(NAMED.findall(node.value))
    return found


def _graph():
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = set()
        for dotted in _imports(name, path):
            while dotted:  # importing a.b.c imports a and a.b too
                if dotted in modules:
                    deps.add(dotted)
                dotted = dotted.rpartition(".")[0]
        graph[name] = deps
    return graph


def test_every_module_is_reached_from_a_rule_or_a_command():
    graph = _graph()
    named = "".join(p.read_text() for p in [*(ROOT / "workflow").rglob("*.smk"), ROOT / "workflow/Snakefile", ROOT / "Makefile"])
    named += "".join(f" {pkg}.{m.strip()}" for pkg, line in re.findall(r"from (vqpipe(?:\.\w+)*) import ([\w, ]+)", named) for m in line.split(","))
    roots = {"vqpipe", "vqpipe.__main__", *(m for m in NAMED.findall(named) if m in graph)}
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    assert sorted(set(graph) - seen) == []


def test_the_package_never_imports_experiments():
    for name, path in _modules().items():
        hits = [d for d in _imports(name, path) if d == "experiments" or d.startswith("experiments.")]
        assert not hits, (name, hits)


def _edges():
    """Module -> the vqpipe modules it imports anywhere in its body (a function's import too), not
    counting its own parent packages (Python imports those first whatever the module says)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules)
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def _cycles(graph):
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, deps = work[-1]
            dep = next(deps, None)
            if dep is not None:
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on.add(dep)
                    work.append((dep, iter(sorted(graph[dep]))))
                elif dep in on:
                    low[node] = min(low[node], index[dep])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    top = stack.pop()
                    on.discard(top)
                    scc.append(top)
                    if top == node:
                        break
                if len(scc) > 1:
                    out.append(sorted(scc))
    return out


def test_no_import_cycles():
    assert _cycles(_edges()) == []


def test_stages_import_no_stage_and_no_library_module_imports_a_stage():
    for name, deps in _edges().items():
        stages = sorted(d for d in deps if d.startswith("vqpipe.stages."))
        assert not stages, f"{name} imports {stages}: shared code belongs in a library module"


# The package's floors, bottom up: a module imports from its own floor or the ones below it. The
# root's shared modules are the ground floor; the front door (vqpipe.load, the command line, the
# Snakefile's config check) stands above everything.
FLOORS = ["", "codec", "kernels", "layers", "quant", "decode", "kivi", "bench", "store", "sources", "report", "stages",
          "apps"]
FRONT = {"vqpipe", "vqpipe.__main__", "vqpipe.config_check"}


def _floor(name):
    parts = name.split(".")
    if name in FRONT:
        return len(FLOORS)
    return FLOORS.index(parts[1] if len(parts) > 2 or (ROOT / "vqpipe" / parts[-1]).is_dir() else "")


def test_imports_run_downward():
    up = sorted(f"{name} -> {dep}" for name, deps in _edges().items() for dep in deps if _floor(dep) > _floor(name))
    assert up == []
