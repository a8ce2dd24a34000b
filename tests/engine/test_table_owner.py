"""The page table is the one writer of its columns: no other module of ``kvtier`` assigns to
one (``t.state[rows] = ...``, ``table.pins[rows] += 1``, ``pins = t.pins; pins[rows] -= 1``),
and none names its state codes. Every change of a page goes through a ``PageTable`` verb."""

from __future__ import annotations

import ast
from pathlib import Path

import kvtier
from kvtier import pagetable

PACKAGE = Path(kvtier.__file__).parent
COLUMNS = frozenset(pagetable._COLUMNS)
TABLE_NAMES = frozenset({"t", "table", "pt"})


def _is_table(node: ast.expr) -> bool:
    """``t`` / ``table`` / ``<anything>.table``: the page table, as the engine names it."""
    if isinstance(node, ast.Name):
        return node.id in TABLE_NAMES
    return isinstance(node, ast.Attribute) and node.attr == "table"


def _is_column(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in COLUMNS and _is_table(node.value)


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out: list[ast.expr] = []
        for target in node.targets:
            out += target.elts if isinstance(target, ast.Tuple) else [target]
        return out
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


MUTATORS = frozenset({"fill", "put", "sort", "itemset", "resize", "setfield"})


def _mutating_call(node: ast.AST, aliases: set[str]) -> bool:
    """``t.pins.fill(0)``, ``np.add.at(t.hits, rows, 1)``, ``np.copyto(t.slot, ...)``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    func = node.func

    def column(expr: ast.expr) -> bool:
        return _is_column(expr) or (isinstance(expr, ast.Name) and expr.id in aliases)

    if func.attr in MUTATORS and column(func.value):
        return True
    first = node.args[0] if node.args else None
    ufunc_at = func.attr == "at" and isinstance(func.value, ast.Attribute)  # np.add.at(...)
    into = func.attr in ("copyto", "put", "place", "putmask")  # np.copyto(column, ...)
    return first is not None and (ufunc_at or into) and column(first)


def column_writes(source: str) -> list[int]:
    """Lines that write a page-table column (directly, or through a local name bound to one)."""
    tree = ast.parse(source)
    aliases = set()
    for node in ast.walk(tree):  # ``pins = t.pins``: the name is the column
        if isinstance(node, ast.Assign) and _is_column(node.value):
            aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
    lines = [node.lineno for node in ast.walk(tree) if _mutating_call(node, aliases)]
    for node in ast.walk(tree):
        for target in _targets(node):
            base = target.value if isinstance(target, ast.Subscript) else target
            if _is_column(base) or (
                isinstance(target, ast.Subscript)
                and isinstance(base, ast.Name)
                and base.id in aliases
            ):
                lines.append(node.lineno)
    return sorted(set(lines))


def state_code_uses(source: str) -> list[int]:
    """Lines that import or name a state code of the table (``S_GPU``, ``STATE_OF_TIER``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "kvtier.pagetable":
            named = any("S_" in alias.name or "STATE" in alias.name for alias in node.names)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            named = node.value.id == "pagetable" and "S_" in node.attr  # ``pagetable.S_GPU``
        else:
            named = False
        if named:
            lines.append(node.lineno)
    return lines


def _modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p != Path(pagetable.__file__)]


def test_the_checker_sees_every_kind_of_write() -> None:
    src = (
        "t.state[rows], t.slot[rows] = 1, 2\n"
        "core.table.pins[rows] += 1\n"
        "pins = self.table.pins\n"
        "pins[rows] -= 1\n"
        "self._core.table.doomed[x] = True\n"
        "t.waiting = None\n"
        "opt.state[p] = {}\n"  # not the table
        "x = t.state[rows]\n"  # a read
        "t.pins.fill(0)\n"
        "np.add.at(core.table.hits, rows, 1)\n"
        "np.copyto(t.slot, other)\n"
        "np.add(t.hits, 1)\n"  # a read: the result is a new array
    )
    assert column_writes(src) == [1, 2, 4, 5, 6, 9, 10, 11]
    named = "from kvtier.pagetable import S_GPU, EMPTY\nx = pagetable.S_UP\n"
    assert state_code_uses(named) == [1, 2]
    assert state_code_uses("stat.S_IMODE(mode)\n") == []


def test_no_module_but_the_page_table_writes_a_column() -> None:
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in _modules()
        if (lines := column_writes(path.read_text()))
    }
    assert found == {}


def test_no_module_but_the_page_table_names_a_state_code() -> None:
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in _modules()
        if (lines := state_code_uses(path.read_text()))
    }
    assert found == {}
