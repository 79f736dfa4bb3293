"""Fixtures for the end-to-end tests: one real control plane and local kubelet per session.

If the binaries cannot be found or built the fixture fails (never skips):
a missing control plane must not look like a green run.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from disagg.testing.binaries import BinariesError, find_binaries
from disagg.testing.cluster import LocalCluster, create_namespace
from disagg.testing.rest import Kube


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    try:
        binaries = find_binaries()
    except BinariesError as e:
        pytest.fail(f"the Kubernetes binaries are not available: {e}", pytrace=False)
    local = LocalCluster(binaries=binaries)
    local.start()
    reporter = request.config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"control plane started in {local.start_seconds:.1f} s ({binaries.folder})")
    yield local
    local.stop()


@pytest.fixture(scope="session")
def kube(cluster: LocalCluster) -> Iterator[Kube]:
    """The admin (system:masters) identity's connection."""
    connection = cluster.kube(admin=True)
    yield connection
    connection.close()


@pytest.fixture
def namespace(kube: Kube) -> Iterator[str]:
    """A fresh namespace, deleted (with its pods) after the test."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    create_namespace(kube, name)
    yield name
    kube.delete(f"/api/v1/namespaces/{name}")
