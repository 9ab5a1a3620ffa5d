"""Import direction: the block bookkeeping, scheduler and configs stay torch-free, and `cache/`
never reaches up into `scheduler`, `engine` or `server`."""

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TORCH_FREE_MODULES = [
    "pagedserve.cache.block_pool",
    "pagedserve.cache.block_table",
    "pagedserve.cache.block_manager",
    "pagedserve.scheduler",
    "pagedserve.configs",
]
FORBIDDEN_HEAVY_MODULES = ["torch", "transformers"]
PACKAGES_ABOVE_CACHE = {"scheduler", "engine", "server"}


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_bookkeeping_module_imports_without_torch_or_transformers(module):
    check = (
        "import importlib, sys\n"
        f"importlib.import_module({module!r})\n"
        f"loaded = [m for m in {FORBIDDEN_HEAVY_MODULES!r} if m in sys.modules]\n"
        "assert not loaded, f'importing the module pulled in {loaded}'\n"
    )
    # A fresh interpreter: this test process may already have torch loaded by other tests.
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def _package_of(module: str) -> str:
    """`pagedserve.engine.x` -> `engine` (the project's own layer); `os.path` -> `os`."""
    parts = module.split(".")
    return parts[1] if parts[0] == "pagedserve" and len(parts) > 1 else parts[0]


def imported_top_level_packages(path: Path) -> set[str]:
    """Layer names of every `import x` / `from x import y` in a file, at any nesting."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(_package_of(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(_package_of(node.module))
    return names


def cache_source_files() -> list[Path]:
    return sorted((REPO_ROOT / "cache").rglob("*.py"))


def test_cache_package_has_source_files():
    assert any(path.name == "block_manager.py" for path in cache_source_files())


@pytest.mark.parametrize(
    "path", cache_source_files(), ids=lambda path: str(path.relative_to(REPO_ROOT))
)
def test_cache_never_imports_scheduler_engine_or_server(path):
    upward = imported_top_level_packages(path) & PACKAGES_ABOVE_CACHE
    assert not upward, f"{path.relative_to(REPO_ROOT)} imports {sorted(upward)}"


@pytest.mark.parametrize(
    "path", cache_source_files(), ids=lambda path: str(path.relative_to(REPO_ROOT))
)
def test_cache_uses_no_relative_imports(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    relative = [
        node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert not relative, f"{path.relative_to(REPO_ROOT)}: relative imports at lines {relative}"


def test_import_scan_sees_nested_and_from_imports(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text(
        "import os.path\nfrom pagedserve.engine.x import y\ndef f():\n    import pagedserve.server\n"
    )
    assert imported_top_level_packages(source) == {"os", "engine", "server"}


def lint_imports_command() -> list[str] | None:
    """The import-linter CLI of this interpreter's environment, if installed."""
    if importlib.util.find_spec("importlinter") is None:
        return None
    script = Path(sys.executable).with_name("lint-imports")
    if script.exists():
        return [str(script)]
    found = shutil.which("lint-imports")
    return [found] if found else None


def run_import_linter() -> str:
    command = lint_imports_command()
    if command is None:
        pytest.skip("import-linter is not installed")
    result = subprocess.run(
        [*command, "--no-cache", "--no-logo"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def import_linter_report() -> str:
    return run_import_linter()


def import_linter_contract_names() -> list[str]:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:
        return ["layers", "bookkeeping is torch-free"]
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    contracts = config.get("tool", {}).get("importlinter", {}).get("contracts", [])
    return [contract["name"] for contract in contracts]


def test_import_linter_is_configured_for_the_bookkeeping():
    names = import_linter_contract_names()
    assert "layers" in names
    assert "bookkeeping is torch-free" in names


@pytest.mark.parametrize("contract", import_linter_contract_names())
def test_import_linter_contract_is_kept(contract, import_linter_report):
    assert f"{contract} KEPT" in import_linter_report, import_linter_report
