"""What `quant serve` runs (its command line: server/cli.py): one engine behind gRPC and HTTP in one process,
with a graceful drain on SIGTERM.

The main thread runs the asyncio loop (both transports) and never does torch work; the engine loads and runs
on its own thread (server/engine.py). SIGTERM or SIGINT: health flips to NOT_SERVING / HTTP 503, new requests
are refused with UNAVAILABLE / 503, in-flight ones get ``grace_s`` seconds to finish, the rest end with
UNAVAILABLE / an error event, then both servers stop and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

from server.config import EngineConfig, Limits
from server.engine import Engine
from server.service import Service
from server.settings import setting

log = logging.getLogger("quantserve.serve")


@dataclass(frozen=True)
class ServeConfig:
    """What `quant serve` runs. Defaults and meanings: the settings table (server/settings.py)."""

    artifact: str | None  # None: the embedded default model (required here; the command line's default is None)
    host: str = setting("host")
    grpc_port: int | None = setting("grpc_port")  # None: no gRPC
    http_port: int | None = setting("http_port")  # None: no HTTP
    grace_s: float = setting("grace")
    tls_cert: str | None = setting("tls_cert")
    tls_key: str | None = setting("tls_key")
    api_key: str | None = setting("api_key")
    engine: EngineConfig = field(default_factory=EngineConfig)
    limits: Limits = field(default_factory=Limits)

    def validate(self) -> "ServeConfig":
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        for name in ("tls_cert", "tls_key"):
            p = getattr(self, name)
            if p is not None and not Path(p).is_file():
                raise ValueError(f"--{name.replace('_', '-')}: no such file {p}")
        if self.grpc_port is None and self.http_port is None:
            raise ValueError("nothing to serve: give --grpc-port or --http-port")
        for name in ("grpc_port", "http_port"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and 0 <= v < 65536):
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 65535], got {v!r}")
        if not (self.grace_s >= 0):
            raise ValueError(f"--grace must be >= 0, got {self.grace_s!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        self.engine.validate()
        self.limits.validate()
        return self


class _Uvicorn:
    """uvicorn.Server without its own signal handlers (the drain below owns SIGTERM)."""

    def __init__(self, app, cfg: ServeConfig, port: int):
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        self.server = Server(uvicorn.Config(
            app, host=cfg.host, port=port, log_config=None, access_log=False, lifespan="off",
            ssl_certfile=cfg.tls_cert, ssl_keyfile=cfg.tls_key, timeout_graceful_shutdown=5,
        ))

    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]


async def run(cfg: ServeConfig, engine: Engine, ready=None, stop: asyncio.Event | None = None) -> int:
    """Serve until SIGTERM/SIGINT (or ``stop`` is set), then drain. ``ready(ports)`` is called once both
    transports listen, with {"grpc": port, "http": port}."""
    from server import grpc_server
    from server.http_server import create_app

    svc = Service(engine, cfg.limits, cfg.api_key)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    ports: dict[str, int] = {}
    gsrv = hs = None
    if cfg.grpc_port is not None:
        tls = None
        if cfg.tls_cert:
            tls = (Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())
        gsrv, hs, ports["grpc"] = await grpc_server.start(svc, cfg.host, cfg.grpc_port, tls)
    web = task = None
    if cfg.http_port is not None:
        web = _Uvicorn(create_app(svc), cfg, cfg.http_port)
        task = asyncio.create_task(web.server.serve())
        while not web.server.started:
            if task.done():  # failed to bind: surface the error
                await task
                raise RuntimeError("the HTTP server stopped before it started")
            await asyncio.sleep(0.01)
        ports["http"] = web.port()
    log.info("serving %s: %s", engine.info.model, ", ".join(f"{k} on {cfg.host}:{v}" for k, v in ports.items()))
    if ready is not None:
        ready(ports)
    await stop.wait()

    log.info("draining: no new requests; %.1f s for the %d running and %d queued", cfg.grace_s,
             engine.totals().running, engine.totals().queued)
    svc.draining = True
    if hs is not None:
        await grpc_server.set_not_serving(hs)
    await asyncio.to_thread(engine.close, cfg.grace_s)  # finishes or cancels every request; their streams end
    if gsrv is not None:
        await gsrv.stop(grace=5)
    if web is not None:
        web.server.should_exit = True
        await task
    log.info("stopped")
    return 0


def serve(cfg: ServeConfig, cache_dir: Path) -> int:
    cfg.validate()
    engine = Engine.from_path(cfg.artifact, cfg.engine, cache_dir)
    return asyncio.run(run(cfg, engine))
