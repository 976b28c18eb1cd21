"""The directory that `training.auto_progress.startup_env` puts first on a worker's
PYTHONPATH: the interpreter imports its `sitecustomize` at start. Nothing else here is
meant to be imported from it."""
