"""A fake Kubernetes API server for tests, driven through the official ``kubernetes`` client.

See ``tests/kube/README.md`` for what is modelled and what is not.
"""

from .server import FakeKube, Fault, RequestRecord

__all__ = ["FakeKube", "Fault", "RequestRecord"]
