"""Imports point down the layers drawn in docs/architecture.md: transport → engine → common → bindings → runner
(and the Lightning strategy, over the torch binding) → launch engines (spark, ray).

Walks the AST of every module under ``horovod/`` (top-level and function-level imports alike) and fails on any
import of a higher layer, naming the file and line.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "horovod"
LAYERS = {"transport": 0, "engine": 1, "common": 2,
          "numpy": 3, "torch": 3, "tensorflow": 3, "keras": 3, "_keras": 3, "mxnet": 3, "jax": 3,
          "runner": 4, "doctor": 4, "lightning": 4, "spark": 5, "ray": 5}


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def test_every_import_points_down_the_layers():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if len(parts) < 2 or parts[0] not in LAYERS:
            continue   # horovod/__init__.py re-exports the public API from every layer
        mine = LAYERS[parts[0]]
        for lineno, module in _imports(path):
            pieces = module.split(".")
            if pieces[0] == "horovod" and len(pieces) > 1 and LAYERS.get(pieces[1], -1) > mine:
                upward.append(f"{path.relative_to(ROOT.parent)}:{lineno} imports {module}")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists() or
                (p.is_dir() and any(p.glob("*.py")))}
    assert packages <= set(LAYERS), f"packages without a layer: {sorted(packages - set(LAYERS))}"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(type_checking: bool = False):
    """Module → the horovod modules it imports (relative imports resolved; ``if TYPE_CHECKING:`` blocks skipped
    unless ``type_checking``)."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}

    def known(name: str):
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = set() if type_checking else {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                   for n in ast.walk(node)}
        edges = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            edges |= {known(t) for t in targets if t.startswith("horovod")}
        graph[name] = edges - {None, name}
    return graph


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_no_import_cycles_between_modules():
    # Function-level imports count too: a lazy import hides a cycle from Python, not from the reader. So do imports
    # made only for the type checker: two modules that need each other's types are one job split in two, or want a
    # protocol between them.
    cycles = _cycles(_import_graph(type_checking=True))
    assert not cycles, "modules that import each other (directly or in a ring):\n" + "\n".join(
        " -> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_ring():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_engine_parts_keep_to_their_interfaces():
    # The engine's parts share one typed state and call each other through public methods: an access to another
    # object's private attribute (``other._x``) couples two parts behind their interfaces. Allowed: ``self`` and
    # ``cls``, a class's own table, and the interpreter's stack snapshot the hang doctor needs.
    allowed = {"sys._current_frames", "HandleTable._tables"}
    reaches = []
    for path in sorted((ROOT / "engine").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.endswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if ast.unparse(node) not in allowed:
                reaches.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not reaches, "engine code reaching into another object's private attributes:\n" + "\n".join(reaches)
