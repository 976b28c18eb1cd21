"""Benchmarks of the supervisor's hot paths: `python -m bench` prints one table.

Rows: heartbeat ingest over real HTTP against a bare-ASGI ceiling, node-loss detection
lateness against a polling baseline, and memory per tracked node against the heartbeat's
JSON size. See bench/README.md.
"""
