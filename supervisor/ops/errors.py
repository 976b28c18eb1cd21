"""Exit codes of the operator commands, in one place: scripts branch on them."""

from __future__ import annotations

from enum import IntEnum

from supervisor.errors import SupervisorError


class ExitCode(IntEnum):
    OK = 0
    #: The API refused the request (4xx other than 401, 403, 404); its message is printed.
    REFUSED = 1
    #: Bad arguments or CLI configuration (argparse uses 2 as well).
    USAGE = 2
    NOT_FOUND = 3
    #: The server cannot be reached, timed out, answered 5xx or something not JSON.
    UNAVAILABLE = 4
    #: 401 or 403: no token, a wrong one, or a feature the server keeps closed.
    UNAUTHORIZED = 5


class CliError(SupervisorError):
    """A failure to report in one line, with the exit code it maps to."""

    def __init__(self, message: str, code: ExitCode) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


#: For the commands' --help (docs/operator-cli.md has the full table).
EXIT_CODES_HELP = "exit codes: " + ", ".join(
    f"{code.value} {code.name.lower().replace('_', ' ')}" for code in ExitCode
)
