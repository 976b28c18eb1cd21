"""`python -m training.torch_workload`: run one rank (see `config.py`)."""

import signal

# Until the worker client installs its handler, an emergency-checkpoint signal must not
# kill the rank (SIGUSR1's default action): there is nothing to save yet anyway.
signal.signal(signal.SIGUSR1, signal.SIG_IGN)

import os  # noqa: E402
import sys  # noqa: E402

from training.torch_workload.train import main  # noqa: E402

code = main()
# torch 2.13's DDP on gloo aborts (SIGABRT) in its C++ destructors at exit in about one
# run in ten here, which the host monitor would count as a crash: everything is saved and
# reported by now, so leave without running them.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
