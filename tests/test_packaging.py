"""A normal install works: the wheel holds every subpackage, the CLI (as partc.cli, no top-level
`cli` package) and the device and cluster configs, and partc runs from it in another directory."""
from __future__ import annotations

import configparser
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _setup_packages() -> set[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return {p.strip() for p in config["options"]["packages"].split() if p.strip()}


def test_setup_cfg_lists_every_subpackage() -> None:
    subpackages = {".".join(p.parent.relative_to(ROOT).parts)
                   for p in (ROOT / "partc").rglob("__init__.py")}
    assert _setup_packages() == subpackages | {"partc.cli", "partc.configs"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # No build isolation: the build backend (setuptools) comes from this environment, offline.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(out), str(ROOT)],
                   check=True, capture_output=True, text=True, timeout=600)
    (found,) = out.glob("partc-*.whl")
    return found


def test_wheel_has_one_top_level_package_with_configs_and_schema(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"partc"}
    assert "partc/cli/main.py" in names and "partc/plans/schema/plan-v1.schema.json" in names
    configs = {Path(n).stem for n in names if n.startswith("partc/configs/clusters/")}
    assert {"cpu", "8xa100-80gb"} <= configs
    assert any(n.startswith("partc/configs/devices/h100") for n in names)


def test_installed_wheel_compiles_from_another_directory(wheel: Path, tmp_path: Path) -> None:
    """pip install of the wheel (not editable) into a fresh venv, then partc from elsewhere."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                    "--no-deps", str(wheel)], check=True, capture_output=True, text=True,
                   timeout=600)
    # The dependencies (torch, onnx, ortools, ...) come from this environment's site-packages,
    # added as a plain path: its .pth files (the editable install of this checkout) stay inactive.
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "partc-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    assert not (site / "cli").exists()
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PARTC_CONFIG_DIR")}

    def partc(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(venv / "bin" / "partc"), *args], capture_output=True,
                              text=True, cwd=work, env=env, timeout=600)

    where = subprocess.run([str(python), "-c", "import partc, partc.cli.main; "
                            "print(partc.__file__)"], capture_output=True, text=True, cwd=work,
                           env=env, check=True).stdout.strip()
    assert Path(where).is_relative_to(site), where
    model = str(ROOT / "examples" / "mlp.py")
    local = partc("compile", model, "-b", "8", "-o", "plans/mlp")
    assert local.returncode == 0, local.stderr[-2000:]
    assert (work / "plans" / "mlp" / "plan.yaml").is_file()
    a100 = partc("compile", model, "-b", "8", "--cluster", "8xa100-80gb", "-o", "plans/a100")
    assert a100.returncode == 0, a100.stderr[-2000:]
    shown = partc("show", "plans/a100")
    assert shown.returncode == 0 and "a100-80gb" in shown.stdout, shown.stderr[-2000:]
    version = subprocess.run([str(python), "-m", "partc", "--version"], capture_output=True,
                             text=True, cwd=work, env=env)
    assert version.returncode == 0 and "partc, version" in version.stdout
