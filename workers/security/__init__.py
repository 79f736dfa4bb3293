"""Who may talk to a worker: the cluster key, the credentials derived from it,
and the gRPC interceptors that send and check them (docs/security.md)."""
