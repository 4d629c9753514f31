"""The HTTP transport's route table: OpenAI-compatible completions and chat (with SSE streaming; the bodies and the
responses are server/openai_api.py's), models, info, plan, tokenize, health, metrics. Every error leaves through one
handler (``server.service.classify``) as OpenAI's error body with 400 / 401 / 429 / 503 / 504 / 500; API key, drain
and body size are checked before a body is read."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.metrics import CONTENT_TYPE
from server.openai_api import (
    ChatBody,
    CompletionBody,
    PlanBody,
    Responder,
    TokenizeBody,
)
from server.outputs import EngineClosedError, OverloadedError, RequestError
from server.sampling_params import SamplingParamsError
from server.service import AuthError, DeadlineError, Service, classify

_OPEN_PATHS = ("/health", "/metrics")


_ERROR_TYPES = {401: "authentication_error", 429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}


def error_body(status: int, message: str, param: str | None = None, headers=None) -> JSONResponse:
    """OpenAI's error body, for every refusal this server makes (ours, FastAPI's, the gate's)."""
    typ = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return JSONResponse({"error": {"message": message, "type": typ, "param": param, "code": status}},
                        status_code=status, headers=headers)


def error_response(exc: BaseException) -> JSONResponse:
    k = classify(exc)
    return error_body(k.http_status, k.message, k.param)


class _Gate:
    """API key, drain and body size, checked before the body is read. Plain ASGI (not BaseHTTPMiddleware,
    which hides the client's disconnect from the endpoint: a unary request would run on after its client left)."""

    def __init__(self, app, svc: Service):
        self.app, self.svc = app, svc

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self.svc.check_auth(headers.get("authorization"))
            if scope["method"] == "POST":
                self.svc.check_accepting()
                size = headers.get("content-length")
                if size is None:  # a chunked body could be any size; the limit needs it declared
                    return await error_body(411, "send Content-Length: chunked request bodies are not accepted")(
                        scope, receive, send)
                limit = self.svc.limits.max_request_bytes
                if size.isdigit() and int(size) > limit:
                    raise RequestError("body", f"request body is larger than {limit} bytes")
        except Exception as e:  # noqa: BLE001 - one mapping
            return await error_response(e)(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(svc: Service) -> FastAPI:
    app = FastAPI(title="quantserve", version="1", docs_url=None, redoc_url=None)
    model_name = svc.engine.info.model
    responder = Responder(svc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        e = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = loc[0] if loc else "body"
        return error_response(RequestError(param, f"{'.'.join(loc) or 'body'}: {e.get('msg')}"))

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, exc: StarletteHTTPException):
        """FastAPI's own refusals (an undecodable body, 404, 405) in the same error body as ours."""
        return error_body(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    async def _known(request: Request, exc: Exception):
        return error_response(exc)

    # Known errors by class (Starlette re-raises whatever reaches its catch-all Exception handler).
    for cls in (SamplingParamsError, RequestError, OverloadedError, EngineClosedError, AuthError, DeadlineError):
        app.add_exception_handler(cls, _known)
    app.add_exception_handler(Exception, _known)

    app.add_middleware(_Gate, svc=svc)

    @app.get("/health")
    async def health():
        if svc.draining or not svc.engine.accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(svc.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        info = svc.info()
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "quantserve", "scheme": info["scheme"],
                                            "max_model_len": info["context_length"]}]}

    @app.get("/v1/info")
    async def info():
        """What gRPC's ModelInfo says: model, scheme, dtype, device, attention, memory totals, limits."""
        return svc.info()

    @app.post("/v1/plan")
    async def plan(body: PlanBody):
        """gRPC's Plan: what the engine would do now with requests of these shapes (server/capacity.py)."""
        return await svc.plan(body.shapes())

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        ids, tokens = await svc.tokenize(body.text)
        return {"token_ids": ids, "tokens": tokens}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        return await responder.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        return await responder.chat(body, request)

    return app
