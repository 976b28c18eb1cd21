"""`python -m training.numpy_workload`: run one training worker (see `config.py`)."""

import os
import signal

# Until the worker client installs its handler, an emergency-checkpoint signal must not
# kill the worker (SIGUSR1's default action): there is nothing to save yet anyway.
signal.signal(signal.SIGUSR1, signal.SIG_IGN)

# One BLAS thread per worker: several workers share a machine, and single-threaded
# reductions keep every run bit-identical. Must be set before numpy is imported.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

from training.numpy_workload.train import main  # noqa: E402

raise SystemExit(main())
