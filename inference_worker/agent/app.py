"""The agent's HTTP API (FastAPI). Every route but ``/health`` needs ``Authorization: Bearer <token>``.

Routes (JSON unless noted)::

    GET    /health                               liveness, no auth
    GET    /v1/processes?selector=k=v,k2=v2      list (pid, port, endpoint, labels, alive, ready, exit_code, ...)
    POST   /v1/processes                         start {name, args, env, labels, drain_timeout_s} -> 201
    GET    /v1/processes/{name}                  one process
    DELETE /v1/processes/{name}?timeout_s=S      SIGTERM, wait for drain (S or its drain_timeout_s), remove
    POST   /v1/processes/{name}/restart          stop with drain, start again (restart_count + 1)
    GET    /v1/processes/{name}/logs?tail=N      text/plain, last N lines of stdout+stderr
    GET    /v1/templates?selector=...            track templates (what to run for a pool track)
    PUT    /v1/templates/{name}                  store a template {labels, ...}
    GET    /v1/templates/{name}
    DELETE /v1/templates/{name}

Errors: 400 invalid request (including a command that is not ``serve``/``router``), 401 bad or
missing token, 404 unknown name, 409 name taken or already stopping.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

from inference_worker.agent.processes import ProcessManager
from inference_worker.agent.state import AgentError, InvalidRequest


class StartRequest(BaseModel):
    name: str = Field(description="process name, e.g. decode-a-stable-0 (also passed as --replica)")
    args: list[str] = Field(description="arguments after 'python -m inference_worker': serve|router ...")
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    drain_timeout_s: float = Field(default=30.0, gt=0, le=3600)


def parse_selector(selector: str | None) -> dict[str, str]:
    """``"a=1,b=2"`` -> ``{"a": "1", "b": "2"}``. Raises InvalidRequest on a term without '='."""
    if not selector:
        return {}
    result = {}
    for term in selector.split(","):
        if "=" not in term:
            raise InvalidRequest(f"selector term {term!r} must be key=value")
        key, value = term.split("=", 1)
        result[key.strip()] = value.strip()
    return result


def create_app(manager: ProcessManager, token: str, *, stop_workers_on_exit: bool = True) -> FastAPI:
    """The agent app. On shutdown (SIGTERM/SIGINT to the agent) it drains and stops every worker,
    unless ``stop_workers_on_exit`` is False (then workers keep running and a new agent re-adopts them).
    """
    if len(token) < 16:
        raise ValueError("the agent token must be at least 16 characters")
    expected = token.encode()
    bearer = HTTPBearer(auto_error=False)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        manager.start_poller()
        try:
            yield
        finally:
            if stop_workers_on_exit:
                await asyncio.to_thread(manager.stop_all)
            manager.close()

    app = FastAPI(title="Ferry local agent", version="1", lifespan=lifespan)

    def authenticate(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if credentials is None or not hmac.compare_digest(credentials.credentials.encode(), expected):
            raise _Unauthorized()

    @app.exception_handler(_Unauthorized)
    async def unauthorized(request: Request, exc: _Unauthorized) -> JSONResponse:
        return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(AgentError)
    async def agent_error(request: Request, exc: AgentError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": exc.errors()}, status_code=400)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    auth = [Depends(authenticate)]

    @app.get("/v1/processes", dependencies=auth)
    def list_processes(selector: str | None = None) -> list[dict[str, Any]]:
        return manager.list(parse_selector(selector))

    @app.post("/v1/processes", status_code=201, dependencies=auth)
    def start_process(body: StartRequest) -> dict[str, Any]:
        return manager.start(body.name, body.args, body.env, body.labels, body.drain_timeout_s)

    @app.get("/v1/processes/{name}", dependencies=auth)
    def get_process(name: str) -> dict[str, Any]:
        return manager.get(name)

    @app.delete("/v1/processes/{name}", dependencies=auth)
    def stop_process(name: str, timeout_s: float | None = Query(default=None, gt=0, le=3600)) -> dict[str, Any]:
        return manager.stop(name, timeout_s)

    @app.post("/v1/processes/{name}/restart", dependencies=auth)
    def restart_process(name: str) -> dict[str, Any]:
        return manager.restart(name)

    @app.get("/v1/processes/{name}/logs", dependencies=auth, response_class=PlainTextResponse)
    def process_logs(name: str, tail: int = 100) -> str:
        return manager.logs(name, tail)

    @app.get("/v1/templates", dependencies=auth)
    def list_templates(selector: str | None = None) -> dict[str, dict[str, Any]]:
        return manager.list_templates(parse_selector(selector))

    @app.put("/v1/templates/{name}", dependencies=auth)
    def put_template(name: str, body: dict[str, Any]) -> dict[str, Any]:
        return manager.put_template(name, body)

    @app.get("/v1/templates/{name}", dependencies=auth)
    def get_template(name: str) -> dict[str, Any]:
        return manager.get_template(name)

    @app.delete("/v1/templates/{name}", status_code=204, dependencies=auth)
    def delete_template(name: str) -> None:
        manager.delete_template(name)

    return app


class _Unauthorized(Exception):
    pass
