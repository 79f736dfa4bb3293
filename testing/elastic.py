"""What the e2e tests of elastic roles share: a DisaggCluster on the tiny model whose decode count
someone else owns, the checks that its pods serve (Ready and gated in) at given counts, and a
bounded chat load on a prefill that keeps every failure."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from disagg.operator import crd
from disagg.operator import manifests as m
from disagg.testing.cluster import wait_until
from disagg.testing.kubectl import Kubectl

CLUSTER = "llm"


def external_decode_cluster(model: Path) -> dict[str, Any]:
    """One prefill (static) and one decode (external), on the tiny model."""
    return {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {"name": CLUSTER},
            "spec": {"model": {"source": str(model)}, "image": "local",
                     "prefill": {"replicas": 1}, "decode": {"replicas": 1, "scaling": "external"},
                     "engine": {"device": "cpu", "dtype": "float32", "blockSize": 4, "numKvBlocks": 128,
                                "maxNumSeqs": 4},
                     "drain": {"timeoutSeconds": 20}}}


def serving(kubectl: Kubectl, namespace: str, role: str) -> list[str]:
    """The role's pods that are not going away, if every one of them is Ready and gated in; else []."""
    found = kubectl.json("get", "pods", "-n", namespace, "-l", f"{m.CLUSTER_LABEL}={CLUSTER},{m.ROLE_LABEL}={role}")
    live = [p for p in found["items"] if not p["metadata"].get("deletionTimestamp")]
    conditions = [{c["type"]: c["status"] for c in p["status"].get("conditions") or []} for p in live]
    if not all(c.get("Ready") == "True" and c.get(m.LINKED_GATE) == "True" for c in conditions):
        return []
    return [p["metadata"]["name"] for p in live]


def settled(kubectl: Kubectl, namespace: str, prefill: int, decode: int) -> bool:
    """Exactly `prefill` and `decode` pods serve, every pair linked, and the status says so."""
    status = kubectl.json("get", "dc", CLUSTER, "-n", namespace).get("status") or {}
    counts = {role: len(serving(kubectl, namespace, role)) for role in ("prefill", "decode")}
    return (counts == {"prefill": prefill, "decode": decode}
            and status.get("links", {}).get("established") == prefill * decode
            and status.get("decodeReady") == f"{decode}/{decode}")


def event_reasons(kubectl: Kubectl, namespace: str) -> list[str]:
    return [e["reason"] for e in kubectl.json("get", "events", "-n", namespace)["items"]]


class ChatLoad:
    """Streams of chat requests to one prefill from a few threads until `finish`; every failure kept."""

    def __init__(self, ip: str, streams: int = 3) -> None:
        self.url = f"http://{ip}:{m.HTTP_PORT}/v1"
        self.model = httpx.get(f"{self.url}/models", timeout=10).json()["data"][0]["id"]
        self.stop = threading.Event()
        self.done = 0
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(streams)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                try:
                    r = http.post(f"{self.url}/chat/completions", json={
                        "model": self.model, "messages": [{"role": "user", "content": "count"}],
                        "max_tokens": 24, "temperature": 0, "ignore_eos": True})
                    r.raise_for_status()
                    assert r.json()["usage"]["completion_tokens"] == 24, r.text
                    self.done += 1
                except (httpx.HTTPError, AssertionError) as e:
                    self.failures.append(repr(e))

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=70)


def load_until_second_decode(kubectl: Kubectl, namespace: str, prefill_ip: str, check: Callable[[], None],
                             wait_s: float) -> None:
    """Load the prefill until a second decode serves (linked and gated), run `check` then, and keep
    the load on until the two decodes have served a few more requests; no request may fail. The
    time from the load step to the second decode serving goes to stderr."""
    load = ChatLoad(prefill_ip)
    try:
        started = time.monotonic()
        wait_until(lambda: settled(kubectl, namespace, 1, 2), wait_s, "a second decode, made for the load")
        sys.stderr.write(f"load step to a second decode linked and serving: {time.monotonic() - started:.1f} s\n")
        check()
        served = load.done
        wait_until(lambda: load.done >= served + 6 or None, wait_s, "requests served by the two decodes")
    finally:
        load.finish()
    assert load.failures == [], load.failures[:3]
