"""`python -m disagg.testing demo`: the operator's own demo on the local cluster.

What a user does with kubectl and helm, each command printed before it runs:
the local control plane and kubelet (`up`), `helm install` of the chart (the
operator runs as the chart Deployment's pod under the local kubelet, with its
ServiceAccount's token), `kubectl apply -f` of the CPU example, `kubectl get
dc -w` until it is Available, one chat answer from the pod behind the prefill
Service, `kubectl get dc,dr,pods`, and the tear-down (`down`), unless asked to
keep the cluster up for more (`--keep`, `make demo-k8s KEEP=1`). Every step has
a deadline.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from disagg.testing.binaries import REPO_ROOT
from disagg.testing.daemon import down, read_state, up

CHART = REPO_ROOT / "deploy" / "helm" / "disagg"
EXAMPLE = REPO_ROOT / "deploy" / "examples" / "cpu-disaggcluster.yaml"
CLUSTER = "smollm2"  # the example's name, its Service's and its served model's
RELEASE_NAMESPACE = "disagg-system"


class DemoError(RuntimeError):
    """A step failed; the message says which and why."""


def _free_port() -> int:
    # The operator pod binds 0.0.0.0, so its ports must be free on the whole machine.
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


class Shell:
    """Runs kubectl and helm as a user would, with the cluster's kubeconfig and binaries on PATH."""

    def __init__(self, state: dict[str, str | int], runtime_dir: Path) -> None:
        home = runtime_dir / "helm"
        self.env = {
            **os.environ,
            "KUBECONFIG": str(state["admin_kubeconfig"]),
            "PATH": os.pathsep.join([str(state["binaries"]), str(Path(sys.executable).parent), os.environ["PATH"]]),
            "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }

    def run(self, *argv: str, timeout_s: float = 120.0, show: bool = True) -> str:
        """Run one command (printed first); its output is printed and returned; DemoError on failure."""
        if show:
            print(f"$ {shlex.join(argv)}", flush=True)
        try:
            done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout_s,
                                  cwd=REPO_ROOT, check=False)
        except subprocess.TimeoutExpired as e:
            raise DemoError(f"{argv[0]} {argv[1]} ran past {timeout_s:.0f} s") from e
        if show and done.stdout:
            print(done.stdout.rstrip(), flush=True)
        if done.returncode != 0:
            raise DemoError(f"{shlex.join(argv)} exited with {done.returncode}:\n{done.stderr}")
        return done.stdout

    def watch_until_available(self, timeout_s: float) -> None:
        """`kubectl get dc -w`, shown live, until `kubectl wait` sees the cluster Available."""
        print(f"$ kubectl get dc -n {RELEASE_NAMESPACE} -w   (until {CLUSTER} is Available, at most {timeout_s:.0f} s)", flush=True)
        watch = subprocess.Popen(["kubectl", "get", "dc", "-n", RELEASE_NAMESPACE, "-w"], env=self.env, stdout=sys.stdout,
                                 stderr=subprocess.STDOUT)
        try:
            self.run("kubectl", "wait", "-n", RELEASE_NAMESPACE, f"dc/{CLUSTER}", "--for=jsonpath={.status.available}=True",
                     f"--timeout={int(timeout_s)}s", timeout_s=timeout_s + 30, show=False)
        finally:
            watch.terminate()
            watch.wait(timeout=10)


def _chat(shell: Shell, timeout_s: float) -> str:
    """One chat answer from the pod behind the prefill Service.

    NOTE: the local cluster has no kube-proxy, so a ClusterIP routes nowhere;
    the demo resolves the Service to what it selects, as kube-proxy would.
    """
    selector = shell.run("kubectl", "get", "svc", CLUSTER, "-n", RELEASE_NAMESPACE, "-o",
                         "go-template={{range $k, $v := .spec.selector}}{{$k}}={{$v}},{{end}}").strip(",")
    ip = shell.run("kubectl", "get", "pods", "-n", RELEASE_NAMESPACE, "-l", selector, "-o",
                   "jsonpath={.items[0].status.podIP}")
    port = shell.run("kubectl", "get", "svc", CLUSTER, "-n", RELEASE_NAMESPACE, "-o", "jsonpath={.spec.ports[0].targetPort}")
    if not port.isdigit():  # a named port: the prefill container's
        port = shell.run("kubectl", "get", "pods", "-n", RELEASE_NAMESPACE, "-l", selector, "-o",
                         f"jsonpath={{.items[0].spec.containers[0].ports[?(@.name==\"{port}\")].containerPort}}")
    url = f"http://{ip.strip()}:{port.strip()}/v1/chat/completions"
    body = {"model": CLUSTER, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32, "temperature": 0}
    print(f"$ curl {url} -d '{{\"model\": \"{CLUSTER}\", \"messages\": [...]}}'", flush=True)
    r = httpx.post(url, json=body, timeout=timeout_s)
    if r.status_code != 200:
        raise DemoError(f"the chat request answered {r.status_code}: {r.text}")
    answer: str = r.json()["choices"][0]["message"]["content"]
    return answer


def demo(runtime_dir: Path, keep: bool = False, ready_timeout_s: float = 900.0) -> int:
    """The demo; its exit code. Without `keep` the cluster is torn down at the end, whatever happened."""
    began = time.monotonic()
    try:
        code = _demo(runtime_dir, keep, ready_timeout_s)
    finally:
        if not keep:
            print(f"$ {sys.executable} -m disagg.testing down   (make demo-k8s KEEP=1 keeps the cluster up)", flush=True)
            down(runtime_dir)
    print(f"\n{'done' if code == 0 else 'failed'} in {time.monotonic() - began:.0f} s")
    return code


def _demo(runtime_dir: Path, keep: bool, ready_timeout_s: float) -> int:
    if up(runtime_dir) != 0:
        return 1
    state = read_state(runtime_dir)
    if state is None:
        print("the cluster stopped right after starting; see its serve.log", file=sys.stderr)
        return 1
    shell = Shell(state, runtime_dir)
    try:
        shell.run("helm", "upgrade", "--install", "disagg", str(CHART), "--namespace", RELEASE_NAMESPACE,
                  "--create-namespace", "--wait", "--timeout", "5m",
                  "--set", f"metrics.port={_free_port()}", "--set", f"operator.healthPort={_free_port()}",
                  timeout_s=330)
        shell.run("kubectl", "get", "pods", "-n", RELEASE_NAMESPACE)
        # The chart's operator watches its release namespace: the example goes there.
        shell.run("kubectl", "apply", "-n", RELEASE_NAMESPACE, "-f", str(EXAMPLE.relative_to(REPO_ROOT)))
        shell.watch_until_available(ready_timeout_s)
        answer = _chat(shell, timeout_s=120)
        print(f"answer: {answer!r}")
        shell.run("kubectl", "get", "dc,dr,pods", "-n", RELEASE_NAMESPACE, "-o", "wide")
    except DemoError as e:
        print(f"demo-k8s failed: {e}\npod logs: {state['pod_logs']}", file=sys.stderr)
        return 1
    if not keep:
        return 0
    print("Try it yourself:")
    print(f"  export KUBECONFIG={state['admin_kubeconfig']} PATH={state['binaries']}:$PATH")
    print(f"  kubectl get dc,dr,pods -n {RELEASE_NAMESPACE}   (pod logs: {state['pod_logs']})")
    print(f"then tear it all down: make cluster-down   ({sys.executable} -m disagg.testing down "
          f"--runtime-dir {runtime_dir})")
    return 0
