"""The plan of the house (DESIGN section 2), held by the import graph: a room imports only rooms
on its own floor or lower, and no import closes a cycle, imports inside functions and under
TYPE_CHECKING included (a cycle closed inside a function is still a cycle).

Imports that still run up a floor are listed in ``UP_A_FLOOR_STILL`` with why: the test fails on
any other, and on a listed one that is gone (so the list shrinks as the house is mended, and
never hides a new one)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "service" / "kvlens"

# The floors of DESIGN section 2, by the module or package right under kvlens.
FLOORS = {
    1: {"definitions", "stats", "errors", "limits", "logs", "terminal", "nnls", "outputs"},
    2: {"http", "records", "jsonscan", "reduce", "reduce_sql", "sqltext", "bandwidth", "shapes"}
    | {"accounting"},
    3: {"sources", "fleet", "tenancy"},
    4: {"exporter", "analysis", "simulate", "experiment", "audit"},
    5: {"config"},
    6: {"cli", "console", "healthcheck"},
}
ROOM_FLOOR = {room: floor for floor, rooms in FLOORS.items() for room in rooms}

# Up a floor, still: none (the rooms read their own settings models since issue 28 item 2).
UP_A_FLOOR_STILL: set[tuple[str, str]] = set()


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The kvlens modules ``name`` imports, anywhere in it."""

    def module_of(dotted: str) -> str:
        while dotted not in known and "." in dotted:
            dotted = dotted.rsplit(".", 1)[0]
        return dotted

    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (module_of(alias.name) for alias in node.names if alias.name.startswith("kvlens."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source == "kvlens" or source.startswith("kvlens."):
                for alias in node.names:  # `from kvlens.x import y`: y may be a module of x
                    yield module_of(f"{source}.{alias.name}")


def graph() -> dict[str, set[str]]:
    known = modules()
    return {
        name: {m for m in imports(name, path, known) if m not in (name, "kvlens")}
        for name, path in known.items()
    }


def room(name: str) -> str:
    return name.split(".")[1] if name.count(".") else ""


def test_every_room_has_a_floor() -> None:
    rooms = {room(name) for name in modules()} - {""}
    assert rooms <= set(ROOM_FLOOR), (
        f"place these in DESIGN section 2's floors: {sorted(rooms - set(ROOM_FLOOR))}"
    )


def test_no_import_runs_up_a_floor_but_the_listed_ones() -> None:
    up = {
        (name, target)
        for name, targets in graph().items()
        for target in targets
        if room(name) and room(target) and ROOM_FLOOR[room(target)] > ROOM_FLOOR[room(name)]
    }
    assert up - UP_A_FLOOR_STILL == set(), "imports up a floor (DESIGN section 2)"
    assert UP_A_FLOOR_STILL - up == set(), "mended: take these off UP_A_FLOOR_STILL"


def test_no_import_closes_a_cycle() -> None:
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert cycles == []


def test_the_graph_is_read_whole() -> None:
    # the reader of the graph itself: a function-level import and a TYPE_CHECKING one are edges
    edges = graph()
    assert "kvlens.definitions" in edges["kvlens.reduce"]
    assert len(edges) > 100


def private_names_borrowed(path: Path, known: dict[str, Path]) -> Iterator[str]:
    """``_name``s of another kvlens module that ``path`` imports or reads through a module:
    a name used across modules is part of its owner's interface and says so."""
    tree = ast.parse(path.read_text(), str(path))
    modules_bound: set[str] = set()  # local names of kvlens modules
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("kvlens.") and alias.asname:
                    modules_bound.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvlens"):
            for alias in node.names:
                if f"{node.module}.{alias.name}" in known:
                    modules_bound.add(alias.asname or alias.name)
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules_bound
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            yield f"{node.value.id}.{node.attr}"


def test_no_module_borrows_another_modules_private_names() -> None:
    known = modules()
    root = PACKAGE.parents[1]
    paths = [*known.values(), *(root / "bench").rglob("*.py"), *(root / "scripts").rglob("*.py")]
    borrowed = {
        f"{path.relative_to(root)}: {name}" for path in paths for name in private_names_borrowed(path, known)
    }
    assert sorted(borrowed) == []


def test_the_design_notes_plan_places_every_room_on_its_floor() -> None:
    """docs/design.md's "Layout" names every room under service/kvlens/ once, under the floor
    FLOORS gives it (a plan that lags the house misleads the next reader more than none)."""
    design = (PACKAGE.parents[1] / "docs" / "design.md").read_text()
    layout = design[design.index("## Layout") : design.index("## Measured figures")]
    placed: dict[str, int] = {}
    floor = 0
    for line in layout.splitlines():
        if line.startswith("floor "):
            floor = int(line.split()[1].rstrip(":"))
        elif line.startswith("service/kvlens/"):
            name = line.split()[0].removeprefix("service/kvlens/").rstrip("/").removesuffix(".py")
            assert name not in placed, f"{name} placed twice in docs/design.md"
            placed[name] = floor
    assert placed == ROOM_FLOOR
