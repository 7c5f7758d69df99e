"""The package's shape: every import of nanovllm names something that exists (the CUDA-only paths
import lazily, inside functions the CPU tests never run, so a moved name would first fail on a
GPU), and the floors import only downwards."""
import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanovllm"
# each floor may import its own and those listed after it, never those before
FLOORS = ["llm", "executor", "engine", "sampling", "config", "engine_args", "loader", "models", "layers", "distributed",
          "kernels"]
# plain data (lora: its LoRARequest), importable from every floor above kernels
DATA = {"sampling_params", "outputs", "sequence", "lora"}


def _imports(path: Path):
    """(line, module, names) of every `from nanovllm... import names` and `import nanovllm...` in path."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nanovllm"):
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name, []) for a in node.names if a.name.startswith("nanovllm"))


def _floor(module: str) -> str:
    part = module.split(".")[1] if "." in module else "__init__"
    return part


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_import_resolves(path):
    pytest.importorskip("triton")  # the kernels' modules import it (conftest runs them in its interpreter)
    for line, module, names in _imports(path):
        loaded = importlib.import_module(module)
        for name in names:
            assert hasattr(loaded, name) or importlib.util.find_spec(f"{module}.{name}") is not None, \
                f"{path.relative_to(ROOT)}:{line}: {module} has no {name}"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_floors_import_only_downwards(path):
    here = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    if here not in FLOORS:
        return  # the package's face and the data modules
    for line, module, _ in _imports(path):
        there = _floor(module)
        if there in DATA or there == here:
            continue
        assert there in FLOORS[FLOORS.index(here) + 1:], f"{path.relative_to(ROOT)}:{line} imports {module} from above"
