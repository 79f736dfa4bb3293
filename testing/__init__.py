"""Test harness: a real Kubernetes control plane on loopback and a local kubelet,
and tiny random models (`tiny_model`) for tests and benchmarks.

`disagg.testing.cluster.LocalCluster` runs both (see its docstring);
`python -m disagg.testing up|down` runs them in the background by hand.
"""
