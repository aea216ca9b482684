"""Imports point one way: no import circle between forge_core modules, no import of a higher layer from a lower
one, and forge_core never imports Prefect, tasks or flows.

Every module of forge_core, tasks and flows is parsed (ast, no import executed). Imports inside functions and
under `if TYPE_CHECKING:` count: a deferred import is the same dependency, only hidden. `LAYERS` is the order,
lowest first, written once here; a package missing from it fails the test until it is placed.

Why this order (what the code needs): the stage registry (forge_core.stages) is a leaf every layer may read;
config validates model flavors from data it owns (config/catalog.py); faults (test fault injection) is called by
storage, trainers and the generator; launch classifies storage errors; compute (the only unit that imports
Ray) runs launches on the cluster's nodes; the policy artifact (forge_core.artifacts)
is read by trainers and rollout alike; data/metrics/models read config and storage; the distributed engine
builds models;
the batch types are pure torch, below the losses that consume them; rewards run in workers watched through
launch; rollout scores with rewards; environments (multi-turn episodes) drive the generation protocol and run
their tools in the reward workers; trainers read the rollout table (GRPO trains on it) and never the
reverse; run (the stage workers) ties everything together; drills (fault drills) read what runs commit; tasks
wrap run for Prefect, flows call tasks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("forge_core", "tasks", "flows")

# Lowest first. Units in one tuple are siblings: neither may import the other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("forge_core.credentials", "forge_core.stages", "forge_core.timings"),
    ("forge_core.config",),
    ("forge_core.faults",),
    ("forge_core.storage",),
    ("forge_core.launch",),
    ("forge_core.compute",),
    ("forge_core.artifacts",),
    ("forge_core.data", "forge_core.metrics", "forge_core.models"),
    ("forge_core.engine",),
    ("forge_core.batch",),
    ("forge_core.losses",),
    ("forge_core.rewards",),
    ("forge_core.rollout",),
    ("forge_core.envs",),
    ("forge_core.trainers",),
    ("forge_core.run",),
    ("forge_core.drills",),
    ("tasks",),
    ("flows",),
)
# Modules that are no unit of their own: the root package's __init__ (its docstring and version only).
UNPLACED = frozenset({"forge_core"})
FORBIDDEN_IN_FORGE_CORE = ("prefect",)
# The one unit that speaks to Ray: every other module reaches the cluster through it.
RAY_UNIT = "forge_core.compute"


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str  # a module of the tree, or the top-level name of an outside package
    line: int


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """{dotted module name: file} of every .py file under the packages (a package is its __init__)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _absolute(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a module of the tree."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import statement of the module, wherever it stands, resolved to the module it loads."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, path.name == "__init__.py", node)
            # `from pkg import sub` loads the submodule; `from pkg import name` loads pkg.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            module = _known(target, modules)
            if module is None:
                found.append(Import(name, target.split(".")[0], node.lineno))
            elif module != name:
                found.append(Import(name, module, node.lineno))
    return found


def unit_of(module: str, layers=LAYERS) -> str | None:
    units = [u for layer in layers for u in layer if module == u or module.startswith(u + ".")]
    return max(units, key=len) if units else None


def layer_index(unit: str, layers=LAYERS) -> int:
    return next(i for i, layer in enumerate(layers) if unit in layer)


def import_circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
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
                    circles.append(sorted(component))
    return circles


def layer_violations(root: Path, packages=PACKAGES, layers=LAYERS, unplaced=UNPLACED) -> list[str]:
    """Every problem found, one line each (empty when the imports keep the rules)."""
    modules = module_files(root, packages)
    problems = []
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for imp in imports_of(name, path, modules):
            if imp.imported not in modules:
                if name.startswith("forge_core") and imp.imported in FORBIDDEN_IN_FORGE_CORE:
                    problems.append(f"{name} (line {imp.line}) imports {imp.imported}: forge_core never does")
                if imp.imported == "ray" and unit_of(name, layers) != RAY_UNIT:
                    problems.append(f"{name} (line {imp.line}) imports ray: only {RAY_UNIT} does")
                continue
            edges[name].add(imp.imported)
            problems += _layer_problem(imp, layers, unplaced)
    for name in modules:
        if name not in unplaced and unit_of(name, layers) is None:
            problems.append(f"{name}: in no layer; place its package in LAYERS (tests/test_import_layers.py)")
    problems += [f"import circle: {' <-> '.join(circle)}" for circle in import_circles(edges)]
    return sorted(set(problems))


def _layer_problem(imp: Import, layers, unplaced) -> list[str]:
    if imp.importer in unplaced or imp.imported in unplaced:
        return []
    lower, upper = unit_of(imp.importer, layers), unit_of(imp.imported, layers)
    if lower is None or upper is None or lower == upper:
        return []
    if layer_index(lower, layers) > layer_index(upper, layers):
        return []
    relation = "a sibling" if layer_index(lower, layers) == layer_index(upper, layers) else "a higher layer"
    return [
        f"{imp.importer} (line {imp.line}) imports {imp.imported}: {upper} is {relation} than {lower}; "
        + "move the shared code down or pass it in"
    ]


def test_forge_core_imports_point_down_and_never_in_a_circle():
    problems = layer_violations(ROOT)
    assert not problems, "\n" + "\n".join(problems)


def test_the_check_finds_a_circle_an_upward_import_an_unplaced_package_and_ray_outside_compute(tmp_path):
    """The checker itself, on a tree made to break each rule once (so the test above can fail)."""
    files = {
        "forge_core/__init__.py": "",
        "forge_core/config/__init__.py": "",
        "forge_core/config/schema.py": "def f():\n    from forge_core.models.catalog import X\n",
        "forge_core/models/__init__.py": "",
        "forge_core/models/catalog.py": "import ray\nX = 1\n",
        "forge_core/rewards/__init__.py": "",
        "forge_core/rewards/registry.py": "from forge_core.rewards import builtin\n",
        "forge_core/rewards/builtin.py": "from .registry import register\n",
        "forge_core/extra/__init__.py": "import prefect\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    layers = (("forge_core.config",), ("forge_core.models",), ("forge_core.rewards",))
    problems = layer_violations(tmp_path, ("forge_core",), layers)
    assert problems == [
        (
            "forge_core.config.schema (line 2) imports forge_core.models.catalog: forge_core.models is a "
            "higher layer than forge_core.config; move the shared code down or pass it in"
        ),
        "forge_core.extra (line 1) imports prefect: forge_core never does",
        "forge_core.extra: in no layer; place its package in LAYERS (tests/test_import_layers.py)",
        "forge_core.models.catalog (line 1) imports ray: only forge_core.compute does",
        "import circle: forge_core.rewards.builtin <-> forge_core.rewards.registry",
    ]
