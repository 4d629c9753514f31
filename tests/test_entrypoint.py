"""The container entrypoint (server.envconfig: environment -> `quant serve`) and the gRPC health probe
(quantserve.client.health) the images' health checks call."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from server.envconfig import VARS, EnvError, main, serve_argv


@pytest.mark.unit
def test_every_variable_maps_to_its_flag():
    env = {"QUANTSERVE_ARTIFACT": "/artifacts/m", "QUANTSERVE_GRPC_PORT": "-1", "QUANTSERVE_HTTP_PORT": "8080",
           "QUANTSERVE_MEMORY_BUDGET": "0.3", "QUANTSERVE_MAX_QUEUE": "7", "QUANTSERVE_MAX_BATCH": "8",
           "QUANTSERVE_MAX_PREFILL_TOKENS": "128", "QUANTSERVE_MAX_NEW_TOKENS": "512",
           "QUANTSERVE_MAX_PROMPT_TOKENS": "1024", "QUANTSERVE_MAX_REQUEST_BYTES": "65536",
           "QUANTSERVE_DTYPE": "float16", "QUANTSERVE_DEVICE": "cuda", "QUANTSERVE_THREADS": "4",
           "QUANTSERVE_EMBEDDINGS": "float", "QUANTSERVE_INT4_ACTIVATIONS": "int8", "QUANTSERVE_KERNELS": "static",
           "QUANTSERVE_GRACE_SECONDS": "25", "QUANTSERVE_TLS_CERT": "/tls/c.pem", "QUANTSERVE_TLS_KEY": "/tls/k.pem",
           "QUANTSERVE_API_KEY_FILE": "/secrets/key", "QUANTSERVE_LOG_LEVEL": "WARNING", "QUANTSERVE_CACHE": "/c",
           "QUANTSERVE_PREFIX_CACHE": "false", "QUANTSERVE_KV_ADMISSION": "reserve", "QUANTSERVE_KV_WATERMARK": "0.05",
           "QUANTSERVE_KV_DTYPE": "int8", "QUANTSERVE_SPECULATE": "draft", "QUANTSERVE_SPECULATE_TOKENS": "4",
           "QUANTSERVE_DRAFT": "/artifacts/draft", "QUANTSERVE_DRAFT_DTYPE": "bfloat16",
           "PATH": "/usr/bin"}
    argv = serve_argv(env)
    assert argv[0] == "/artifacts/m"
    switches = {v.flag for v in VARS if v.switch}
    assert switches == {"--prefix-cache"}
    rest = [a for a in argv[1:] if a not in ("--prefix-cache", "--no-prefix-cache")]
    assert [a for a in argv[1:] if a not in rest] == ["--no-prefix-cache"]  # a switch is its flag alone
    pairs = dict(zip(rest[0::2], rest[1::2]))
    assert pairs == {v.flag: env.get(v.name, v.default) for v in VARS if v.flag and not v.switch}  # nothing else
    assert pairs["--host"] == "0.0.0.0"  # the container default
    # The flags are quant serve's own: its parser takes them all.
    from server.cli import build_parser

    parsed = build_parser().parse_args(argv)
    assert (parsed.grpc_port, parsed.max_batch, parsed.grace, parsed.api_key_file) == (-1, 8, 25.0, "/secrets/key")
    assert parsed.prefix_cache is False
    assert (parsed.kv_admission, parsed.kv_watermark, parsed.kv_dtype) == ("reserve", 0.05, "int8")


@pytest.mark.unit
@pytest.mark.parametrize("env,msg", [
    ({}, "QUANTSERVE_ARTIFACT must be set"),
    ({"QUANTSERVE_ARTIFACT": "a", "QUANTSERVE_GRPC_PORT": "http"}, "QUANTSERVE_GRPC_PORT must be an integer"),
    ({"QUANTSERVE_ARTIFACT": "a", "QUANTSERVE_HTTP_PORT": "70000"}, "QUANTSERVE_HTTP_PORT must be a port"),
    ({"QUANTSERVE_ARTIFACT": "a", "QUANTSERVE_MAX_BATCH": "0"}, "QUANTSERVE_MAX_BATCH must be an integer >= 1"),
    ({"QUANTSERVE_ARTIFACT": "a", "QUANTSERVE_GRACE_SECONDS": "nan"}, "QUANTSERVE_GRACE_SECONDS must be"),
    ({"QUANTSERVE_ARTIFACT": "a", "QUANTSERVE_DTYPE": "fp8"}, "QUANTSERVE_DTYPE must be one of"),
    ({"QUANTSERVE_ARTIFACT": "a", "QUANTSERVE_GRPC_PRT": "1"}, "QUANTSERVE_GRPC_PRT is not a quantserve setting"),
    ({"QUANTSERVE_ARTIFACT": "a", "QUANTSERVE_API_KEY": "k"}, "QUANTSERVE_API_KEY_FILE"),
    ({"QUANTSERVE_ARTIFACT": "a", "QUANTSERVE_TLS_CERT": "c"}, "go together"),
    ({"QUANTSERVE_ARTIFACT": " "}, "QUANTSERVE_ARTIFACT must be a non-empty value"),
])
def test_bad_environment_is_one_line_naming_the_variable(env, msg, capsys):
    with pytest.raises(EnvError, match=re.escape(msg)):
        serve_argv(env)
    assert main([], env) == 2
    err = capsys.readouterr().err
    assert err.startswith("quantserve: error: ") and msg in err and len(err.splitlines()) == 1


@pytest.mark.unit
def test_unknown_arguments_are_refused(capsys):
    assert main(["--dry-run"], {"QUANTSERVE_ARTIFACT": "/a"}) == 2
    assert capsys.readouterr().err.startswith("usage: python -m server.envconfig")


@pytest.mark.unit
def test_print_shows_the_command(capsys):
    assert main(["--print"], {"QUANTSERVE_ARTIFACT": "/a", "QUANTSERVE_THREADS": "2"}) == 0
    cmd = json.loads(capsys.readouterr().out)
    assert cmd == ["-m", "server.cli", "/a", "--host", "0.0.0.0", "--threads", "2"]  # quant serve itself


@pytest.mark.e2e
def test_the_entrypoint_serves_with_the_key_file_and_the_health_probe_answers(tiny_model_dir, tmp_path):
    """The real entrypoint process (exec'd into quant serve), probed as a container health check would."""
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUANTSERVE_") or k == "QUANTSERVE_CACHE"}
    env.update(QUANTSERVE_ARTIFACT=str(tiny_model_dir), QUANTSERVE_HOST="127.0.0.1", QUANTSERVE_GRPC_PORT="0",
               QUANTSERVE_HTTP_PORT="0", QUANTSERVE_DTYPE="float32", QUANTSERVE_MEMORY_BUDGET="4MiB",
               QUANTSERVE_THREADS="1", QUANTSERVE_GRACE_SECONDS="5", QUANTSERVE_API_KEY_FILE=str(key),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "server.envconfig"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in proc.stderr:
            m = re.search(r"grpc on [\d.]+:(\d+), http on [\d.]+:(\d+)", line)
            if m:
                port, http = int(m.group(1)), int(m.group(2))
                break
        assert port, "the entrypoint did not start quant serve"
        probe = [sys.executable, "-m", "quantserve.client.health", "--target", f"127.0.0.1:{port}"]
        r = subprocess.run(probe, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "SERVING" in r.stdout  # health is open without the key
        import httpx

        assert httpx.get(f"http://127.0.0.1:{http}/v1/models", timeout=10).status_code == 401  # the key file
        assert httpx.get(f"http://127.0.0.1:{http}/v1/models", timeout=10,
                         headers={"authorization": "Bearer s3cret"}).status_code == 200
        proc.send_signal(signal.SIGTERM)  # exec'd: the signal reaches quant serve itself
        assert proc.wait(60) == 0
        r = subprocess.run(probe + ["--timeout", "1"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and "UNAVAILABLE" in r.stdout  # nothing there any more
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.e2e
def test_health_probe_without_a_server_fails_fast():
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "quantserve.client.health", "--target", "127.0.0.1:9", "--timeout", "1"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "127.0.0.1:9:" in r.stdout and time.monotonic() - t0 < 20
