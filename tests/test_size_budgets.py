"""Size budgets of the core (STYLE.md §9), enforced: `LLMEngine.step` reads top to bottom in at most
15 lines, no function in engine/, scheduler/ or cache/ exceeds 40 lines (kernels aside), and no
file there exceeds 300 lines. Lines are counted from `def` to the function's last line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE_PACKAGES = ("engine", "scheduler", "cache")
# Kernels are numeric code with their own shape: the C++ sources and the Triton kernels.
KERNEL_FILES = {"cache/attention/triton_kernels.py"}
MAX_FUNCTION_LINES = 40
MAX_FILE_LINES = 300
MAX_STEP_LINES = 15


def _core_files() -> list[Path]:
    files = [path for package in CORE_PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    return [path for path in files if path.relative_to(ROOT).as_posix() not in KERNEL_FILES]


def _functions(tree: ast.AST) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method, with its dotted name inside the module."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return found


def _num_lines(node: ast.AST) -> int:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return node.end_lineno - first + 1


def test_core_files_exist_so_the_budgets_check_something():
    assert len(_core_files()) > 15


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_core_file_stays_under_300_lines_with_functions_of_at_most_40(path: Path):
    source = path.read_text()
    num_lines = len(source.splitlines())
    assert num_lines < MAX_FILE_LINES, f"{path.name} has {num_lines} lines"
    too_long = {
        name: _num_lines(node)
        for name, node in _functions(ast.parse(source))
        if _num_lines(node) > MAX_FUNCTION_LINES
    }
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


def test_llm_engine_step_reads_in_at_most_15_lines():
    tree = ast.parse((ROOT / "engine" / "llm_engine.py").read_text())
    (step,) = [node for name, node in _functions(tree) if name == "LLMEngine.step"]
    assert _num_lines(step) <= MAX_STEP_LINES, f"LLMEngine.step has {_num_lines(step)} lines"
