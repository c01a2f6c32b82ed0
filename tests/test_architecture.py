"""The layout carries the architecture: passes in subpackages whose dependencies point one way,
a torch-free solver core and plan tools, a cheap `import partc`.

Every `import` statement in partc/ and cli/ is read (module level, inside functions and under
TYPE_CHECKING alike): a module may import only from its own layer or from a layer below it.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A module's layer is its subpackage's (partc/<layer>/...); the top-level modules
# are the core vocabulary, except the package facade and the entry points, which sit on top.
LAYERS = ("core", "graph", "frontend", "hardware", "cost", "solve", "plans", "emit", "run",
          "entry")
ENTRY_MODULES = {"partc", "partc.__main__", "partc.launch"}


def _module_name(path: Path) -> str:
    if path.is_relative_to(ROOT / "cli"):
        parts = ("partc", "cli", *path.relative_to(ROOT / "cli").with_suffix("").parts)
    else:
        parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if module in ENTRY_MODULES or parts[:2] == ["partc", "cli"]:
        return "entry"
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS):
        return parts[1]
    return "core"


def _sources() -> list[Path]:
    return sorted([*(ROOT / "partc").rglob("*.py"), *(ROOT / "cli").rglob("*.py")])


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every partc module the file imports, at any depth of the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("partc")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("partc"):
            found.append((node.lineno, node.module))
    return found


def test_every_module_belongs_to_a_layer() -> None:
    names = {_layer(_module_name(p)) for p in _sources()}
    assert names <= set(LAYERS), names - set(LAYERS)
    assert set(LAYERS) - {"core", "entry"} <= names


def test_dependencies_point_one_way() -> None:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = []
    for path in _sources():
        source = _module_name(path)
        for line, target in _imports(path):
            if rank[_layer(target)] > rank[_layer(source)]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({_layer(source)}) imports "
                              f"{target} ({_layer(target)})")
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def _run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


TORCH_FREE = ("partc", "partc.options", "partc.errors", "partc.files", "partc.interrupts",
              "partc.graph.opgraph",
              "partc.graph.module_summary", "partc.hardware.configs", "partc.cost.table",
              "partc.cost.roofline", "partc.solve.search", "partc.solve.simulator",
              "partc.solve.partition", "partc.plans.plan", "partc.plans.diff",
              "partc.plans.report", "partc.cli.main", "partc.frontend.model_source",
              # `partc launch` refuses a bad plan before importing torch (its workers import it,
              # once, in their forkserver)
              "partc.run.launch", "partc.launch")


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_modules_import_without_torch(module: str) -> None:
    heavy = _run_python(f"import sys, importlib; importlib.import_module({module!r}); "
                        "print(sorted(m for m in ('torch', 'onnx', 'onnxruntime') "
                        "if m in sys.modules))")
    assert heavy == "[]", f"importing {module} imports {heavy}"


@pytest.mark.parametrize("module", ["partc.emit.compile", "partc.plans.check",
                                    "partc.cost.measured", "partc.run.runtime"])
def test_onnx_is_imported_only_where_a_model_is_exported_or_fed(module: str) -> None:
    """onnx (with ml_dtypes) takes about 1.1 s to import: compile, check, verify and launch,
    which export nothing by default, import it only when they export or profile in ORT."""
    heavy = _run_python(f"import sys, importlib; importlib.import_module({module!r}); "
                        "print(sorted(m for m in ('onnx', 'onnxruntime', 'ml_dtypes') "
                        "if m in sys.modules))")
    assert heavy == "[]", f"importing {module} imports {heavy}"


def test_every_lazy_export_is_defined_where_partc_says() -> None:
    code = ("import partc, importlib\n"
            "for name, module in partc._EXPORTS.items():\n"
            "    value = getattr(partc, name)\n"
            "    assert getattr(value, '__module__', module) == module, (name, module)\n"
            "    assert getattr(partc, name) is getattr(importlib.import_module(module), name)\n"
            "print(len(partc._EXPORTS))")
    assert int(_run_python(code)) > 30


def test_show_and_diff_of_a_plan_never_import_torch(tmp_path: Path) -> None:
    plans = ROOT / "examples" / "plans"
    code = f"""
import sys
from partc.cli.main import cli
for args in (["show", {str(plans / "mlp")!r}, "--png", {str(tmp_path / "mlp.png")!r}],
             ["diff", {str(plans / "mlp")!r}, {str(plans / "resnet")!r}]):
    cli.main(args=args, prog_name="partc", standalone_mode=False)
print("torch imported:", "torch" in sys.modules)
"""
    out = _run_python(code)
    assert out.endswith("torch imported: False"), out
    assert (tmp_path / "mlp.png").stat().st_size > 0


def test_plan_schema_speaks_the_shared_vocabulary() -> None:
    """The schema's enums are the words of partc.options: a new schedule, strategy, optimizer,
    precision, placement or sharding is added in both or neither."""
    import json

    from partc.options import (
        OPTIMIZERS,
        PLACEMENTS,
        PRECISIONS,
        SCHEDULES,
        SHARDINGS,
        STRATEGIES,
    )

    schema = json.loads((ROOT / "partc" / "plans" / "schema" / "plan-v1.schema.json").read_text())
    props = schema["properties"]
    training = props["training"]["properties"]
    pinned = props["costs"]["properties"]["pinned"]["properties"]
    assert tuple(training["schedule"]["enum"]) == SCHEDULES
    assert tuple(pinned["schedule"]["enum"]) == SCHEDULES
    assert tuple(training["optimizer"]["enum"]) == OPTIMIZERS
    assert tuple(training["precision"]["enum"]) == PRECISIONS
    assert tuple(training["placement"]["enum"]) == PLACEMENTS
    assert tuple(props["costs"]["properties"]["strategy"]["enum"]) == STRATEGIES
    assert tuple(props["solver"]["properties"]["strategy"]["enum"]) == STRATEGIES
    assert tuple(training["sharding"]["enum"]) == SHARDINGS
    assert tuple(pinned["sharding"]["enum"]) == SHARDINGS
    assert tuple(schema["$defs"]["stage"]["properties"]["sharding"]["enum"]) == SHARDINGS


def test_a_bad_model_path_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    """A missing, directory or syntactically broken model file ends in its one line before any
    command that takes a model imports torch (seconds of imports that would end the same way)."""
    broken = tmp_path / "broken.py"
    broken.write_text("def build_model(:\n    pass\n")
    code = f"""
import contextlib, io, sys
from partc.cli.main import cli
cases = [({str(tmp_path / "missing.py")!r}, "not found"), ({str(tmp_path)!r}, "is a directory"),
         ({str(broken)!r}, "syntax error at line 1")]
for command in (["compile", "-b", "4"], ["solve", "-b", "4"], ["profile", "-b", "4"],
                ["inspect"]):
    for path, fragment in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli.main(args=[command[0], path, *command[1:]], prog_name="partc",
                            standalone_mode=False)
        lines = err.getvalue().splitlines()
        assert code == 2 and len(lines) == 1 and fragment in lines[0], (command, code, lines)
print("torch imported:", "torch" in sys.modules)
"""
    out = _run_python(code)
    assert out.endswith("torch imported: False"), out
