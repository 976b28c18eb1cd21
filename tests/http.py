"""One HTTP client for the tests' requests to the servers they start.

`httpx.get(...)` makes a client per call, and each builds a TLS context: about 45 ms of
CPU, which a wait polling every 0.1 s turns into half a core taken from the processes
under test. `http.get(...)` takes the same arguments (the client's TLS settings aside:
a request that needs its own `verify` makes its own client). No connection is kept
alive: the servers behind a port come and go between requests (restarts, kills).
"""

from __future__ import annotations

import httpx

http = httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0))
