"""The cluster files check out without a cluster: cloud YAMLs against Ray's schema, KubeRay manifests
against the KubeRay v1.7.0 CRDs, pinned versions, entrypoints that exist, env vars the code reads."""

from __future__ import annotations

import copy
import gzip
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import REPO
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

CRDS = REPO.parent / "shared" / "kuberay-crds"  # KubeRay v1.7.0's CRDs, where the workspace has them
# The v1 openAPIV3Schema of each kind, extracted from those CRDs (KubeRay, Apache-2.0), so CI checks
# the manifests wherever it clones the repo.
SCHEMAS = REPO / "tests" / "data" / "kuberay-v1.7.0-schemas.json.gz"
CLOUD = ["aws.yaml", "gcp.yaml"]
KUBERAY = sorted((REPO / "cluster" / "kuberay").glob("*.yaml"))


def ray_schema() -> dict:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("name", [*CLOUD, "local-autoscale.yaml"])
def test_launcher_yamls_validate_against_rays_schema(name):
    import ray

    config = load(REPO / "cluster" / name)[0]
    jsonschema.validate(config, ray_schema())
    types = config["available_node_types"]
    head = config["head_node_type"]
    workers = {k: v for k, v in types.items() if k != head}
    assert workers and all(t.get("min_workers", 0) == 0 for t in workers.values())  # scale from zero
    assert config["idle_timeout_minutes"] > 0
    if name in CLOUD:
        from ray.autoscaler._private.util import prepare_config, validate_config

        validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` runs first
        assert config["docker"]["image"].split(":")[1].startswith(ray.__version__ + "-")
        assert any("pip install" in c and "rayjobs" in c for c in config["setup_commands"])
        assert any("GPU" in json.dumps(t["node_config"]) or "gpu" in k for k, t in workers.items())
        assert any("spot" in json.dumps(t["node_config"]).lower() for t in workers.values())
        assert all("--dashboard-host=127.0.0.1" in c for c in config["head_start_ray_commands"] if "--head" in c)
    else:
        assert types[head]["resources"]["CPU"] == 0


def test_a_wrong_type_in_a_launcher_yaml_is_caught():
    config = load(REPO / "cluster" / "aws.yaml")[0]
    config["available_node_types"]["gpu_spot"]["max_workers"] = "four"
    with pytest.raises(jsonschema.ValidationError, match="four"):
        jsonschema.validate(config, ray_schema())


def crd_schema(kind: str) -> dict:
    return json.loads(gzip.decompress(SCHEMAS.read_bytes()))[kind]


@pytest.mark.skipif(not CRDS.is_dir(), reason="no ../shared/kuberay-crds here to compare the extracted schemas with")
@pytest.mark.slow
def test_the_extracted_schemas_are_the_kuberay_crds():
    for kind in ("RayCluster", "RayJob"):
        crd = yaml.safe_load((CRDS / f"ray.io_{kind.lower()}s.yaml").read_text())
        v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
        assert v1 == crd_schema(kind), kind


def ray_documents() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in KUBERAY for d in load(p) if d.get("apiVersion") == "ray.io/v1"]


def cluster_spec(doc: dict) -> dict:
    return doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]


def ray_containers(spec: dict) -> list[dict]:
    pods = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    return [c for pod in pods for c in pod["spec"]["containers"]]


def test_kuberay_manifests_validate_against_the_crds():
    docs = ray_documents()
    assert {d["kind"] for _, d in docs} == {"RayCluster", "RayJob"} and len(docs) == 3
    for name, doc in docs:
        errors = list(jsonschema.Draft7Validator(crd_schema(doc["kind"])).iter_errors(doc))
        assert not errors, (name, [e.message for e in errors])
        spec = cluster_spec(doc)
        assert spec["enableInTreeAutoscaling"] is True and spec["authOptions"]["mode"] == "token"
        assert all(g["minReplicas"] == 0 for g in spec["workerGroupSpecs"])
    broken = copy.deepcopy(dict(docs)["raycluster.yaml"])
    broken["spec"]["workerGroupSpecs"][0]["maxReplicas"] = "eight"
    assert list(jsonschema.Draft7Validator(crd_schema("RayCluster")).iter_errors(broken))


def _series(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _pinned(package: str) -> SpecifierSet:
    """pyproject's version range for ``package``."""
    import tomllib

    for dep in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(dep)
        if req.name == package:
            return req.specifier
    raise AssertionError(f"pyproject.toml does not depend on {package}")


def test_kuberay_pins_ray_and_mlflow_versions_to_the_images():
    """The images run a Ray and an MLflow that pyproject allows, of the release series installed here (a
    patch release on the registry, installed by a clean `make test`, is no mismatch; MLflow 3.18's
    release, which `mlflow>=3.0,<4` let a clean clone install beside the 3.17.2 server image, was)."""
    import mlflow
    import ray

    dockerfile = (REPO / "cluster" / "Dockerfile").read_text()
    base_tag = re.search(r"^FROM rayproject/ray:(\S+)", dockerfile, re.M).group(1)
    image_ray = base_tag.split("-")[0]
    assert image_ray in _pinned("ray") and _series(image_ray) == _series(ray.__version__), (image_ray, ray.__version__)
    for name, doc in ray_documents():
        spec = cluster_spec(doc)
        assert spec["rayVersion"] == image_ray, name
        for container in ray_containers(spec):
            assert container["image"].split(":")[1] == base_tag, (name, container["image"])
    mlflow_images = [
        c["image"]
        for d in load(REPO / "cluster/kuberay/mlflow.yaml")
        if d["kind"] == "Deployment"
        for c in d["spec"]["template"]["spec"]["containers"]
    ]
    assert len(mlflow_images) == 1 and mlflow_images[0].startswith("ghcr.io/mlflow/mlflow:v"), mlflow_images
    image_mlflow = mlflow_images[0].rpartition(":v")[2]
    assert image_mlflow in _pinned("mlflow") and _series(image_mlflow) == _series(mlflow.__version__), (
        image_mlflow,
        mlflow.__version__,
    )
    services = [d for d in load(REPO / "cluster/kuberay/mlflow.yaml") if d["kind"] == "Service"]
    assert [s["spec"]["type"] for s in services] == ["ClusterIP"]  # reached through port-forward on 127.0.0.1


def test_kuberay_entrypoints_exist_and_their_configs_load():
    from rayjobs.config import load_config

    jobs = [(n, d) for n, d in ray_documents() if d["kind"] == "RayJob"]
    assert {d["spec"]["entrypoint"].split()[2] for _, d in jobs} == {"rayjobs.train", "rayjobs.tune"}
    for name, doc in jobs:
        argv = shlex.split(doc["spec"]["entrypoint"])
        assert argv[:2] == ["python", "-m"], name
        assert (REPO / (argv[2].replace(".", "/") + ".py")).is_file(), argv[2]
        config = argv[argv.index("--config") + 1]
        overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
        cfg = load_config(REPO / config, overrides)  # every --set names a real field with a valid value
        assert cfg.storage_path.startswith("/mnt/shared") and cfg.tracking.uri.startswith("http://mlflow")


def test_kuberay_sets_only_environment_variables_the_code_reads():
    source = "\n".join(p.read_text() for p in (REPO / "rayjobs").glob("*.py"))
    names = set()
    for _, doc in ray_documents():
        for container in ray_containers(cluster_spec(doc)):
            names |= {e["name"] for e in container.get("env", [])}
        if doc["kind"] == "RayJob":
            names |= set(yaml.safe_load(doc["spec"]["runtimeEnvYAML"])["env_vars"])
    assert names
    unread = sorted(n for n in names if n not in source)
    assert not unread, f"set in cluster/kuberay but read nowhere in rayjobs/: {unread}"


def test_cluster_files_are_secure_by_default():
    """MLflow on KubeRay: basic auth with the admin password from a Secret, and a NetworkPolicy that
    admits only the Ray pods; the cloud clusters start every node with token auth and one shared token."""
    docs = {d["kind"]: d for d in load(REPO / "cluster" / "kuberay" / "mlflow.yaml")}
    server = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert server["command"][server["command"].index("--app-name") + 1] == "basic-auth"
    env = {e["name"]: e for e in server["env"]}
    assert env["MLFLOW_AUTH_ADMIN_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "mlflow-auth", "key": "password"}
    assert "admin_password" not in docs["ConfigMap"]["data"]["basic_auth.ini"]  # no password in the manifests
    policy = docs["NetworkPolicy"]["spec"]
    assert policy["podSelector"] == {"matchLabels": {"app": "mlflow"}} and policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["from"] == [{"podSelector": {"matchExpressions": [{"key": "ray.io/node-type", "operator": "Exists"}]}}]
    for _, doc in ray_documents():  # the Ray pods log in with the same Secret, which must exist
        for container in ray_containers(cluster_spec(doc)):
            for e in container.get("env", []):
                if e["name"].startswith("MLFLOW_TRACKING_"):
                    assert e["valueFrom"]["secretKeyRef"]["name"] == "mlflow-auth"
                    assert "optional" not in e["valueFrom"]["secretKeyRef"]
    for name in CLOUD:
        config = load(REPO / "cluster" / name)[0]
        starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
        ray_starts = [c for c in starts if "ray start" in c]
        assert len(ray_starts) == 2 and all("RAY_AUTH_MODE=token" in c for c in ray_starts), (name, ray_starts)
        assert all("RAY_AUTH_TOKEN_PATH=~/rayjobs-auth-token" in c for c in ray_starts)
        assert config["file_mounts"]["~/rayjobs-auth-token"] == "~/.ray/rayjobs-auth-token"
