"""The package's shape (DESIGN.md): no import cycles, and nothing imports a layer above its own.

Every ``import`` statement of every module counts, at the top or inside a function (a lazy
import still runs), and under ``if TYPE_CHECKING:`` too: a type checker follows those, and a
cycle that only type annotations close is still two modules that cannot be read apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

import splitrl

PACKAGE = Path(splitrl.__file__).resolve().parent

LAYERS: list[tuple[str, ...]] = [
    ("__main__", "cli"),
    ("bench", "plan", "cutplan", "lab", "report", "export"),
    ("runner",),
    ("schedule",),
    ("stages",),
    ("settings", "models", "envs", "pick_by_cue", "carracing", "grayscale"),
    ("codecs",),
    ("ppo",),
    ("transport",),
    ("netem",),
    ("runs", "summary", "checkpoints", "launch", "errors", "units", "devices", "lazy", "allocator", "stops"),
]
"""Top to bottom; a module may import its own layer and the layers below it."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / Path(*name.split("."))).is_dir()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Module -> the splitrl modules it imports."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module}: in no layer of LAYERS (add it where DESIGN.md puts it)")


def test_every_module_has_a_layer():
    for module in import_graph():
        if module != "splitrl":
            layer(module)


def test_no_module_imports_a_layer_above_its_own():
    upward = [f"{m} imports {t}" for m, targets in import_graph().items() if m != "splitrl"
              for t in sorted(targets) if t != "splitrl" and layer(t) < layer(m)]
    assert upward == []


def test_there_are_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_walk_sees_lazy_and_type_checking_imports():
    graph = import_graph()
    # splitrl.settings.specs imports the codecs inside a function (to validate codec specs).
    assert "splitrl.codecs" in graph["splitrl.settings.specs"]
    # splitrl.models.build names EnvSpec and TrainSettings for type checkers only: counted all the same.
    assert {"splitrl.envs", "splitrl.settings"} <= graph["splitrl.models.build"]
