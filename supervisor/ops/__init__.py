"""The operator command line: `supervisor get | describe | create | delete | inject | end |
cordon | uncordon | watch | config | completion` (and the online `goodput`), a client of
the HTTP API only, with kubectl's habits.

- :mod:`.errors`: the exit codes, and the one error type commands raise.
- :mod:`.client`: HTTP requests, the live stream, and how answers map to exit codes.
- :mod:`.config`: contexts (server and token) from flags, environment and config file.
- :mod:`.args`: options shared by the commands, and durations such as 1h30m.
- :mod:`.output`: tables (wide or not), names, descriptions, JSON, YAML, jsonpath.
- :mod:`.jsonpath`: kubectl's `-o jsonpath=TEMPLATE` language.
- :mod:`.listing`: `get` and `describe`; :mod:`.follow`: `get -w`.
- :mod:`.maintenance`: maintenance windows (`get`, `describe`, `create`, `delete`);
  :mod:`.drills`: fault drills (`get`, `create`, `delete`).
- :mod:`.completion`: bash and zsh completion made from the parser.
- :mod:`.commands`: the other subcommands, and the registration of all.

Nothing here imports the server (store, runtime, API routes): it must run wherever an
operator has Python, httpx and PyYAML, and start fast.
"""
