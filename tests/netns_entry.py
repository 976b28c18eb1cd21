"""`python -m tests.netns_entry NAMESPACE MODULE [ARGS...]`: `python -m MODULE ARGS...` in
the network namespace NAMESPACE (made by `ip netns add`: /run/netns/NAMESPACE), as
`ip netns exec NAMESPACE python -m MODULE ARGS...` runs it there, for a service a warm
standby forks (tests/forked_services.py): the forked process joins the namespace itself,
then runs the module the standby imported. Its sockets, and the processes it starts, are
the namespace's; what else `ip netns exec` sets up (a mount namespace, /etc/netns) none of
the services needs.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import sys

CLONE_NEWNET = 0x40000000  # linux/sched.h


def join(namespace: str) -> None:
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into network namespace {namespace}: {os.strerror(error)}")
    finally:
        os.close(fd)


def main() -> None:
    namespace, module, *args = sys.argv[1:]
    join(namespace)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
