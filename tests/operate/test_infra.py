"""infra/: the compose file validates with `docker compose config` (no engine needed), the
Kubernetes base job template declares what it uses and requests GPUs, the Ray recipe parses,
and no secret lives in a file of the repository."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

INFRA = Path(__file__).resolve().parents[2] / "infra"
COMPOSE = INFRA / "docker-compose.yml"
ENV_EXAMPLE = INFRA / ".env.example"


def _compose() -> list[str]:
    """`docker compose` (v2 plugin) if it answers, else Debian's `docker-compose`, else skip."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("neither `docker compose` nor `docker-compose` is installed (apt: docker-compose)")


def _config(env_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*_compose(), "-f", str(COMPOSE), "--env-file", str(env_file), "config"],
        capture_output=True,
        text=True,
        cwd=INFRA.parent,
    )


def test_compose_file_is_valid_and_auth_is_on():
    done = _config(ENV_EXAMPLE)
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    services = config["services"]
    assert {"postgres", "redis", "prefect-server", "worker"} <= set(services)
    server, worker = services["prefect-server"]["environment"], services["worker"]["environment"]
    assert server["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://")
    assert server["PREFECT_SERVER_API_AUTH_STRING"] == worker["PREFECT_API_AUTH_STRING"] != ""
    assert worker["PREFECT_API_URL"].endswith(":4200/api")
    from flows.cli.broker import server_env

    broker = server_env("redis", 6379)
    assert {k: str(server[k]) for k in broker} == broker  # the settings the tests run with
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["count"] == "all"
    assert any(v.endswith(":/data:rw") or v.endswith(":/data") for v in _volumes(services))
    assert worker["SDPIPE_DATA"] == "/data"


def _volumes(services: dict) -> list[str]:
    out = []
    for v in services["worker"]["volumes"]:
        out.append(v if isinstance(v, str) else f"{v['source']}:{v['target']}")
    return out


def test_compose_refuses_to_start_without_an_auth_string(tmp_path):
    env = tmp_path / "noauth.env"
    env.write_text(
        "".join(
            line + "\n"
            for line in ENV_EXAMPLE.read_text().splitlines()
            if not line.startswith("PREFECT_AUTH_STRING=")
        )
    )
    done = _config(env)
    assert done.returncode != 0
    assert "PREFECT_AUTH_STRING" in done.stdout + done.stderr


def test_no_secrets_in_the_repository():
    values = dict(
        line.split("=", 1)
        for line in ENV_EXAMPLE.read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    assert values["HF_TOKEN"] == "" and values["WANDB_API_KEY"] == ""
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "infra/.env"], cwd=INFRA.parent, capture_output=True
    )
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0, "infra/.env must be ignored by git"


def test_kubernetes_base_job_template_requests_gpus():
    template = json.loads((INFRA / "k8s" / "base-job-template.json").read_text())
    declared = set(template["variables"]["properties"])
    used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", json.dumps(template["job_configuration"])))
    assert used <= declared, used - declared
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    env = {e["name"]: e for e in container["env"]}
    assert "secretKeyRef" in env["PREFECT_API_AUTH_STRING"]["valueFrom"]
    assert "secretKeyRef" in env["HF_TOKEN"]["valueFrom"]


def test_ray_recipe_has_a_gpu_worker_group():
    cluster = yaml.safe_load((INFRA / "ray" / "raycluster.yaml").read_text())
    assert cluster["kind"] == "RayCluster"
    group = cluster["spec"]["workerGroupSpecs"][0]
    resources = group["template"]["spec"]["containers"][0]["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) >= 1


def _reads_the_ray_token_from_a_secret_file(pod: dict, container: dict) -> str:
    """The Secret whose file the container's RAY_AUTH_TOKEN_PATH names (token mode on), never a
    token in the environment."""
    env = {e["name"]: e for e in container.get("env", [])}
    assert env["RAY_AUTH_MODE"]["value"] == "token", container["name"]
    assert "RAY_AUTH_TOKEN" not in env, container["name"]
    path = env["RAY_AUTH_TOKEN_PATH"]["value"]
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert path == f"{mount['mountPath']}/auth_token", path
    # Required: a pod without it fails at its start naming the Secret, not Ray at its first use.
    assert not volume["secret"].get("optional"), volume
    return volume["secret"]["secretName"]


def test_the_ray_cluster_and_the_flow_runs_use_one_token_file():
    """docs/scale-out.md: token authentication on every Ray node and in the flow runs that
    connect, the token read from one Secret mounted as a file."""
    cluster = yaml.safe_load((INFRA / "ray" / "raycluster.yaml").read_text())
    pods = [cluster["spec"]["headGroupSpec"]["template"]["spec"]]
    pods += [g["template"]["spec"] for g in cluster["spec"]["workerGroupSpecs"]]
    template = json.loads((INFRA / "k8s" / "base-job-template.json").read_text())
    pods.append(template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"])
    autoscaler = cluster["spec"]["autoscalerOptions"]  # KubeRay's sidecar in the head pod
    sidecar = {"name": "autoscaler", **autoscaler}
    pods.append({"containers": [sidecar], "volumes": pods[0]["volumes"]})
    secrets = {
        _reads_the_ray_token_from_a_secret_file(pod, c) for pod in pods for c in pod["containers"]
    }
    assert secrets == {"sdpipe-ray-auth"}
    assert (
        "sdpipe-ray-auth" in (INFRA / "ray" / "raycluster.yaml").read_text().split("apiVersion")[0]
    )


def test_dockerfile_copies_what_exists():
    dockerfile = (INFRA / "Dockerfile.worker").read_text()
    for src in re.findall(r"^COPY (.+) \S+$", dockerfile, flags=re.M):
        for path in src.split():
            assert (INFRA.parent / path).exists(), path
