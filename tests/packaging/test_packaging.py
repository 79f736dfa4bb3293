"""The distribution: namespace mapping, the wheel's contents, the stdlib's `operator`."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]


def setup_py_constant(name: str) -> Any:
    """A literal assigned at the top of setup.py (which cannot be imported: it runs setup())."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == [name]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py assigns no {name}")


def build_wheel(source: Path, out: Path) -> Path:
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)],
        capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = out.glob("disagg-*.whl")
    return wheel


def source_modules() -> set[str]:
    """Every module the source tree defines, as its `disagg.*` name."""
    names = set()
    for package, folder in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            names.add(".".join([package, *parts]))
    return names


@pytest.mark.parametrize("flags", [[], ["-S"]], ids=["site", "no-site"])
def test_stdlib_operator_wins_with_the_repo_root_first_on_sys_path(flags: list[str]) -> None:
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import operator; print(operator.__file__); operator.itemgetter(0)"
    out = subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert not out.stdout.strip().startswith(str(ROOT / "operator")), out.stdout


def test_source_roots_have_no_init_that_could_shadow_the_stdlib() -> None:
    assert not (ROOT / "operator" / "__init__.py").exists()


def test_every_source_package_is_listed_for_the_wheel() -> None:
    listed = {*setup_py_constant("RUNTIME_PACKAGES"), setup_py_constant("TEST_HARNESS")}
    packages = set()
    for package, folder in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.parent.relative_to(ROOT / folder)
            if "__pycache__" not in rel.parts:
                packages.add(".".join([package, *rel.parts]))
    assert packages <= listed, f"not listed in pyproject.toml: {sorted(packages - listed)}"


@pytest.mark.slow
def test_wheel_holds_and_imports_every_module(tmp_path: Path) -> None:
    wheel = build_wheel(ROOT, tmp_path)
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
        in_wheel = {n[:-3].replace("/", ".").removesuffix(".__init__") for n in zf.namelist() if n.endswith(".py")}
    missing = source_modules() - in_wheel
    assert not missing, f"absent from the wheel: {sorted(missing)}"
    assert (site / "disagg" / "proto" / "disagg_pd.proto").exists()
    assert (site / "disagg" / "workers" / "engine" / "csrc" / "paged_decode.c").exists()
    assert (site / "disagg" / "workers" / "engine" / "csrc" / "vector.h").exists()
    # Import each module from the unpacked wheel alone (isolated mode: neither
    # the repository nor the editable install is on the path).
    modules = sorted(m for m in source_modules() if not m.endswith("__main__"))
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    m = importlib.import_module(name)\n"
        f"    assert (getattr(m, '__file__', None) or '').startswith({str(site)!r}), (name, m.__file__)\n"
        "print('ok', len(sys.modules))"
    )
    venv_site = [p for p in sys.path if p.endswith("site-packages")]
    env = {"PYTHONPATH": ":".join([str(site), *venv_site]), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path[:0] = {[str(site), *venv_site]!r}\n" + code],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]


def test_console_command_has_help_and_version() -> None:
    disagg = Path(sys.executable).with_name("disagg")
    out = subprocess.run([str(disagg), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("disagg "), out
    out = subprocess.run([str(disagg), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage: disagg" in out.stdout, out


@pytest.mark.slow
def test_a_wheel_built_as_the_images_build_it_has_no_test_harness(tmp_path: Path) -> None:
    """The Dockerfiles copy the build files and the runtime folders, not testing/."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in set(PACKAGE_DIRS.values()) - {"testing"}:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    with zipfile.ZipFile(build_wheel(src, tmp_path)) as zf:
        names = zf.namelist()
    assert not [n for n in names if n.startswith("disagg/testing/")], "disagg.testing reached the image's wheel"
    assert "disagg/proto/vocabulary.py" in names and "disagg/operator/spec.py" in names
