"""The operator command line: `supervisor get | describe | inject | end | cordon | uncordon
| watch | config` (and the online `goodput`), a client of the HTTP API only.

- :mod:`.errors`: the exit codes, and the one error type commands raise.
- :mod:`.client`: HTTP requests, the live stream, and how answers map to exit codes.
- :mod:`.config`: contexts (server and token) from flags, environment and config file.
- :mod:`.output`: tables, descriptions, JSON and YAML.
- :mod:`.commands`: the subcommands and their arguments.

Nothing here imports the server (store, runtime, API routes): it must run wherever an
operator has Python, httpx and PyYAML, and start fast.
"""
