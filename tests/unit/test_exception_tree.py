"""Every exception errors.py draws is raised from there: no room defines a second class of the same
name (compare's ArmsDiffer was one, while errors.ArmsDiffer was never raised)."""

from __future__ import annotations

import ast
from pathlib import Path

from kvlens import errors

PACKAGE = Path(errors.__file__).parent


def test_no_room_defines_an_exception_of_the_tree_again() -> None:
    tree = {name for name, value in vars(errors).items() if isinstance(value, type)}
    again = [
        f"{path.relative_to(PACKAGE)}: {node.name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "errors.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name in tree
    ]
    assert again == []
