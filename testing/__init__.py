"""Test harness: a real Kubernetes control plane on loopback and a local kubelet.

`disagg.testing.cluster.LocalCluster` runs both (see its docstring);
`python -m disagg.testing up|down` runs them in the background by hand.
"""
