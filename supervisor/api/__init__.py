"""The REST API: FastAPI app factory, routes, request/response schemas, auth."""

from supervisor.api.app import create_app

__all__ = ["create_app"]
