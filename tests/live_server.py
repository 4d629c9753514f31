"""A real server (gRPC + HTTP over one engine) on free loopback ports, run on its own event loop in a
background thread, for the end-to-end tests."""

from __future__ import annotations

import asyncio
import threading

from server.engine import Engine, EngineConfig
from server.serve import ServeConfig, run
from server.service import Limits


class Running:
    def __init__(self, engine: Engine, cfg: ServeConfig):
        self.engine, self.cfg = engine, cfg
        self.ports: dict = {}
        self._ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.stop = None
        self.rc = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        assert self._ready.wait(60), "server did not start"

    def _main(self):
        asyncio.set_event_loop(self.loop)
        self.stop = asyncio.Event()

        def ready(ports):
            self.ports.update(ports)
            self._ready.set()

        self.rc = self.loop.run_until_complete(run(self.cfg, self.engine, ready=ready, stop=self.stop))

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    def shutdown(self):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(60)


def start(tiny_model_dir, cache_dir, api_key=None, limits=Limits(), grace_s=2.0, tls: tuple[str, str] | None = None,
          **engine_kw) -> Running:
    """``tls``: (certificate file, key file) in PEM."""
    ecfg = EngineConfig(**{"memory_budget": "4MiB", "dtype": "float32", "max_prefill_tokens": 64, **engine_kw})
    engine = Engine.from_path(str(tiny_model_dir), ecfg, cache_dir)
    cfg = ServeConfig(artifact=str(tiny_model_dir), grpc_port=0, http_port=0, grace_s=grace_s, api_key=api_key,
                      engine=ecfg, limits=limits, tls_cert=tls and tls[0], tls_key=tls and tls[1])
    return Running(engine, cfg)
