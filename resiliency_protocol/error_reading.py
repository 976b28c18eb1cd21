"""How the clients of our HTTP APIs read an error answer back (the body is errors.py's
`ErrorOut`): one line, whatever answered. Imports no pydantic, so that an operator command
starts without it."""

from __future__ import annotations

import json

import httpx


def error_message(response: httpx.Response) -> str:
    """The one line an error answer carries: our `message`, else `detail`, else the body
    (a proxy's page, a standby's readiness), else the status's reason."""
    try:
        data = response.json()
    except ValueError:
        return " ".join(response.text.split())[:200] or response.reason_phrase
    if isinstance(data, dict):
        for key in ("message", "detail"):
            if key in data:
                return str(data[key])[:500]
    return json.dumps(data)[:200]
