"""Session fixtures shared by the test folders: one real control plane (and
local kubelets) per session, used by tests/e2e and tests/helm alike, and
`tiny_model_dir`, a tiny random Llama folder for the worker tests (tests/engine
overrides it with one folder per model family).

The fixtures start nothing until a test asks for them, so offline test runs
pay only for these imports.

If the binaries cannot be found or built the fixture fails (never skips):
a missing control plane must not look like a green run.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from disagg.testing.binaries import BinariesError, find_binaries
from disagg.testing.cluster import LocalCluster, create_namespace
from disagg.testing.anyip import local_network
from disagg.testing.kubelet import LocalKubelet
from disagg.testing.rest import Kube
from disagg.testing.tiny_model import build_tiny_model

ROUTABLE_NODE = "disagg-routable-node"
_START_NOTE = pytest.StashKey[str]()
_FAILED = pytest.StashKey[bool]()
POD_LOG_CHARS = 4000  # of each pod's log, printed when a test that made pods fails


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    try:
        binaries = find_binaries()
    except BinariesError as e:
        problem = str(e)
    else:
        problem = ""
    if problem:
        pytest.fail(f"the Kubernetes binaries are not available: {problem}", pytrace=False)
    local = LocalCluster(binaries=binaries)
    local.start()
    request.config.stash[_START_NOTE] = f"control plane started in {local.start_seconds:.1f} s ({binaries.folder})"
    yield local
    local.stop()


@pytest.fixture(scope="session")
def kube(cluster: LocalCluster) -> Iterator[Kube]:
    """The admin (system:masters) identity's connection."""
    connection = cluster.kube(admin=True)
    yield connection
    connection.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Mark a test whose call failed, for the fixtures' teardown."""
    report = yield
    if report.when == "call" and report.failed:
        item.stash[_FAILED] = True
    return report


@pytest.fixture
def namespace(request: pytest.FixtureRequest, cluster: LocalCluster, kube: Kube) -> Iterator[str]:
    """A fresh namespace, deleted (with its pods) after the test; when the test failed, the end of
    each of its pods' logs goes to stderr first (pytest shows it with the failure)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    create_namespace(kube, name)
    yield name
    if request.node.stash.get(_FAILED, False):
        for log in sorted(cluster.workdir.glob(f"*/pods/{name}_*.log")):
            sys.stderr.write(f"--- the end of {log.name} ---\n{log.read_text(errors='replace')[-POD_LOG_CHARS:]}\n")
    kube.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def routable_kubelet(cluster: LocalCluster) -> Iterator[LocalKubelet]:
    """A second kubelet whose pods get addresses outside 127.0.0.0/8.

    EndpointSlices refuse loopback addresses, so tests of a Service's
    endpoints put their pods on this node: `spec.nodeName`, or a nodeSelector
    `kubernetes.io/hostname: disagg-routable-node` (it binds only the pods that
    select it; the default kubelet takes those that select no node). It needs
    CAP_NET_ADMIN to route a range to the loopback device; without it the
    tests that use it are skipped, with that reason.
    """
    with local_network() as network:
        if network is None:
            pytest.skip("needs CAP_NET_ADMIN to route a non-loopback range to lo (EndpointSlices refuse 127/8)")
        kubelet = LocalKubelet(cluster.admin_kubeconfig, cluster.workdir / "routable-kubelet",
                               node_name=ROUTABLE_NODE, address_pool=network, bind_unselected=False)
        kubelet.start()
        yield kubelet
        kubelet.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Say how long the control plane took to start, when one ran."""
    note = config.stash.get(_START_NOTE, None)
    if note is not None:
        terminalreporter.write_line(note)
