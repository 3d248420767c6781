"""The package holds what a rule or a user command runs; experiments/ holds the rest.

Every module of vqpipe/ is reached, through any import (a lazy one too, or a ``"vqpipe.X"``
string such as the command line's STAGES), from the package itself, its command line, or a module
that workflow/ or the Makefile names; vqpipe never imports experiments/.
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
