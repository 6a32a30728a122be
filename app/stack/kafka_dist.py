"""Apache Kafka's broker, fetched from Maven Central and checked: the jars the
embedded stack and the test clusters run.

`kafka/pom.xml` names the broker (``org.apache.kafka:kafka_2.13``) at a pinned
version; Maven resolves its run-time dependencies with strict checksums (Central's
SHA-1), and every jar is then checked against ``kafka/libs.sha256`` (SHA-256, kept
in the repository). Jars already in place that pass the check are used as they are:
Maven never runs again. `kafka.Kafka` starts a broker and `kafka.tools.StorageTool`
formats its log directory, as Apache Kafka's ``bin/kafka-server-start.sh`` and
``bin/kafka-storage.sh`` do.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path

from app.config import Settings
from app.errors import ConfigError, ServiceUnavailable

#: The broker's version (the pom's; libs.sha256 holds its jars).
KAFKA_VERSION = "4.1.1"
#: What starts a broker, and what formats its storage.
BROKER_CLASS = "kafka.Kafka"
STORAGE_CLASS = "kafka.tools.StorageTool"


def packaged(name: str) -> Path:
    """A file shipped beside this module in ``kafka/`` (the pom, the checksums, the
    logging configuration)."""
    return Path(str(resources.files("app.stack").joinpath("kafka", name)))


def pinned() -> dict[str, str]:
    """Jar name -> SHA-256, as libs.sha256 pins them."""
    out: dict[str, str] = {}
    for line in packaged("libs.sha256").read_text().splitlines():
        if line.strip():
            digest, name = line.split()
            out[name] = digest
    return out


def libs_dir(settings: Settings) -> Path:
    """Where the broker's jars live on this host."""
    return _home(settings) / f"kafka-{KAFKA_VERSION}" / "libs"


def _home(settings: Settings) -> Path:
    return settings.kafka_dist_dir or settings.state_dir / "kafka"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check(libs: Path) -> list[str]:
    """How ``libs`` differs from the pinned jars (empty: it is exactly them)."""
    wanted = pinned()
    found: list[str] = []
    present = {p.name for p in libs.glob("*.jar")} if libs.is_dir() else set()
    for name, digest in sorted(wanted.items()):
        if name not in present:
            found.append(f"{name}: missing")
        elif _sha256(libs / name) != digest:
            found.append(f"{name}: SHA-256 differs from the pinned one")
    found += [f"{name}: not pinned" for name in sorted(present - wanted.keys())]
    return found


def java() -> str:
    """The Java runtime (JAVA_HOME's, else the PATH's)."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise ServiceUnavailable("no Java runtime: Apache Kafka needs one (run `make bootstrap`)")
    return found


def ensure(settings: Settings) -> Path:
    """The checked jars of the pinned broker, fetched through Maven if not in place."""
    libs = libs_dir(settings)
    if not check(libs):
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise ServiceUnavailable(
            "Maven is not installed: it fetches Apache Kafka (`make bootstrap`)"
        )
    staging = libs.with_name("libs.fetching")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    command = [
        mvn, "--batch-mode", "--quiet", "--strict-checksums",
        "-f", str(packaged("pom.xml")),
        f"-Dmaven.repo.local={_home(settings) / 'm2'}",
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={staging}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise ServiceUnavailable(f"Maven could not fetch Apache Kafka {KAFKA_VERSION}:\n{tail}")
    wrong = check(staging)
    if wrong:
        shutil.rmtree(staging, ignore_errors=True)
        raise ConfigError(
            "Apache Kafka's jars do not match the pinned checksums (app/stack/kafka/"
            "libs.sha256): " + "; ".join(wrong)
        )
    shutil.rmtree(libs, ignore_errors=True)
    staging.rename(libs)
    return libs


def classpath(libs: Path) -> str:
    """The JVM's class path: every jar of ``libs``."""
    return f"{libs}/*"
