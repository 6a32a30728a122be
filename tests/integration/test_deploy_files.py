"""The deployment files check out: the systemd units pass `systemd-analyze verify`
(with this checkout's `dsec` in place of the installed one, which the tool insists
exists), each restarts its service on failure and logs to journald; the compose file
is valid, whole, and names only pinned images or the two the repository builds;
Prometheus scrapes each dsec service where it serves; the Grafana dashboard draws
only series the platform exposes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from app import metrics
from app.config import Settings
from app.images.platform import CONTROL, NODE, default_tag

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "docker" / "systemd"


def test_the_systemd_units_verify(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    assert tool is not None, "systemd-analyze is part of Debian's systemd"
    bin_dir = REPO / ".venv" / "bin"
    checked = []
    for unit in sorted(UNITS.glob("*.service")):
        text = unit.read_text().replace("/opt/dsec/bin/", f"{bin_dir}/")
        assert "Restart=on-failure" in text and "StandardOutput=journal" in text, unit.name
        # A template is verified as an instance of it.
        name = unit.name.replace("@.", "@node0." if "node" in unit.name else "@0.")
        (tmp_path / name).write_text(text)
        checked.append(str(tmp_path / name))
    assert len(checked) == 5
    done = subprocess.run([tool, "verify", *checked], capture_output=True, text=True, cwd=tmp_path)
    # It says what it ignores on stderr and still exits 0: both must be clean.
    assert done.returncode == 0 and done.stderr.strip() == "", done.stderr


# --- the compose deployment, its Prometheus and its Grafana dashboard ----------------

DOCKER = REPO / "docker"
#: What compose needs from docker/compose/.env, given here as dummies.
COMPOSE_ENV = {
    name: "not-a-real-secret"
    for name in ("POSTGRES_PASSWORD", "DSEC_OWNER_PASSWORD", "DSEC_APP_PASSWORD",
                 "REDIS_PASSWORD", "FLOWER_PASSWORD", "GRAFANA_PASSWORD")
}  # fmt: skip


def _compose_config() -> dict[str, Any]:
    """The compose file as `docker-compose config` resolves and validates it."""
    tool = shutil.which("docker-compose")
    assert tool is not None, "the bootstrap installs Debian's docker-compose"
    done = subprocess.run(
        [tool, "-f", str(DOCKER / "compose.yaml"), "config"],
        capture_output=True, text=True, env={"PATH": os.environ["PATH"], **COMPOSE_ENV},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return dict(yaml.safe_load(done.stdout))


def _mounts(service: dict[str, Any]) -> list[str]:
    """Where a service's volumes are mounted, as docker-compose config resolves them."""
    out = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            out.append(str(volume["target"]))
        else:
            out.append(str(volume).split(":")[1])
    return out


def test_the_compose_file_is_a_whole_deployment_of_pinned_or_built_images() -> None:
    services = _compose_config()["services"]
    assert set(services) == {
        "kafka-secrets", "kafka-1", "kafka-2", "kafka-3", "postgres", "redis", "prepare",
        "projector", "scheduler", "hub", "flower", "node-1", "node-2", "prometheus",
        "grafana",
    }  # fmt: skip
    ours = {CONTROL.name(default_tag()), NODE.name(default_tag())}
    for name, service in services.items():
        image = service["image"]
        repository, _, tag = image.partition(":")
        # An image the repository builds, or one pinned to a release (never latest).
        pinned = bool(tag) and tag != "latest" and any(c.isdigit() for c in tag)
        assert image in ours or (pinned and not repository.startswith("dsec/")), (name, image)
    for broker in ("kafka-1", "kafka-2", "kafka-3"):
        assert services[broker]["image"].startswith("apache/kafka:")
        # Its properties are the generator's (docker/kafka/, scripts/render_kafka.py)
        targets = _mounts(services[broker])
        assert "/etc/dsec/kafka/server.properties" in targets, broker
        # and it sees the brokers' secrets, never the control plane's
        assert "/var/lib/dsec/secrets" not in targets, broker
    check = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "render_kafka.py"), "--check"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr
    # The platform treats it as Apache Kafka: replicated topics, idempotent producers.
    for name in ("prepare", "projector", "scheduler", "node-1", "node-2"):
        env = services[name]["environment"]
        assert env["DSEC_KAFKA_REPLICATION_FACTOR"] == "3", name
        assert "not-a-real-secret@" in env["DSEC_CELERY_BROKER_URL"], name


def test_prometheus_scrapes_every_dsec_service_where_it_serves() -> None:
    services = _compose_config()["services"]
    scrape = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = {
        target
        for job in scrape["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    settings = Settings()
    expected = {f"projector:{settings.metrics_port}"}
    expected.add(f"scheduler:{services['scheduler']['environment']['DSEC_SCHEDULER_METRICS_PORT']}")
    for name in ("node-1", "node-2"):
        node_id = services[name]["environment"]["DSEC_NODE_ID"]
        expected.add(f"{name}:{settings.node_metrics_port_of(node_id)}")
    assert targets == expected


def _series() -> set[str]:
    """Every series name the platform's metrics expose."""
    names: set[str] = set()
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            for family in value.describe():
                suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
                names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def test_the_dashboard_shows_what_an_operator_watches_from_series_that_exist() -> None:
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "dsec.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for e in exprs for name in re.findall(r"\bdsec_[a-z_]+", e)}
    assert used <= _series(), used - _series()
    for wanted in (
        "dsec_node_sandboxes",
        "dsec_node_warm_ready",
        "dsec_node_commands_in_flight",
        "dsec_node_create_seconds_bucket",
        "dsec_node_exec_seconds_bucket",
        "dsec_consumer_lag",
        "dsec_dead_letters_total",
        "dsec_refusals_total",
    ):
        assert wanted in used, wanted  # fmt: skip
    assert any("by (reason)" in e and "dsec_refusals_total" in e for e in exprs)
    datasource = yaml.safe_load(
        (DOCKER / "grafana" / "provisioning" / "datasources" / "dsec.yaml").read_text()
    )
    uids = {d["uid"] for d in datasource["datasources"]}
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} <= uids
