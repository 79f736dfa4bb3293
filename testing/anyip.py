"""Extra local addresses outside 127.0.0.0/8, for objects that refuse loopback.

The API server rejects loopback addresses in EndpointSlices and Endpoints
("may not be in the loopback range"), so pods on 127.0.0.N never appear in a
Service's endpoints. A `local` route makes a whole range behave as 127/8 does
(every address bindable, traffic looped back) without configuring addresses;
adding one needs CAP_NET_ADMIN. The range is drawn from 198.18.0.0/15 (set
aside for benchmarking, RFC 2544), one /24 per caller so that concurrent test
sessions never remove each other's route.
"""

from __future__ import annotations

import ipaddress
import random
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

_POOL = ipaddress.IPv4Network("198.18.0.0/15")


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)


@contextmanager
def local_network() -> Iterator[ipaddress.IPv4Network | None]:
    """A fresh /24 routed to the loopback device for the duration, or None when
    this machine does not allow it (no `ip` command or no CAP_NET_ADMIN)."""
    if shutil.which("ip") is None:
        yield None
        return
    subnets = list(_POOL.subnets(new_prefix=24))
    network = random.choice(subnets)
    route = ["local", str(network), "dev", "lo", "table", "local"]
    if _ip("route", "add", *route).returncode != 0:
        yield None  # not permitted, or (rarely) that /24 is taken: the caller goes without
        return
    try:
        yield network
    finally:
        _ip("route", "del", *route)
