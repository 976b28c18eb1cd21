"""`python -m training.torch_workload`: run one rank (see `config.py`)."""

import signal

# Until the worker client installs its handler, an emergency-checkpoint signal must not
# kill the rank (SIGUSR1's default action): there is nothing to save yet anyway.
signal.signal(signal.SIGUSR1, signal.SIG_IGN)

from training.torch_workload.train import main  # noqa: E402

raise SystemExit(main())
