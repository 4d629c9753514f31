"""A real server (gRPC + HTTP over one engine) on free loopback ports, run on its own event loop in a
background thread, for the end-to-end tests; ``module_server`` makes a module's ``server`` fixture of it, and
``pool_back_to_zero`` checks after each test that every request gave its KV blocks back."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import threading
import time

import pytest

from server.config import EngineConfig, Limits
from server.engine import Engine
from server.serve import ServeConfig, run


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

    def assert_idle(self, timeout: float = 20.0) -> None:
        """Every request made so far (finished, cancelled or timed out) has given its KV blocks back, shared ones
        included."""
        eng = self.engine
        end = time.monotonic() + timeout
        while time.monotonic() < end and (eng.pool.used_blocks or eng.scheduler.has_work):
            time.sleep(0.01)
        assert eng.pool.used_blocks == 0 and eng.pool.stats()["requests"] == 0
        eng.pool.audit()  # the pool's books equal a recount: no leaked reference, no freed block still mapped

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


def module_server(**start_kw):
    """A module-scoped ``server`` fixture: ``start(tiny_model_dir, cache_dir, **start_kw)``, shut down after the
    module's last test, which then checks that it exited with status 0. Bind it as ``server = module_server(...)``."""

    @pytest.fixture(scope="module")
    def server(tiny_model_dir, cache_dir):
        s = start(tiny_model_dir, cache_dir, **start_kw)
        yield s
        s.shutdown()
        assert s.rc == 0

    return server


@pytest.fixture(autouse=True)
def pool_back_to_zero(request):
    """Bound in a module (``_pool_back_to_zero = live_server.pool_back_to_zero``), after each of its tests that used
    ``server``: every request made so far has given its KV blocks back (Running.assert_idle)."""
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").assert_idle()


def self_signed_cert(tmp_path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 / localhost and its key, as PEM files: (cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)
