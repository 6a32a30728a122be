"""Write docker/kafka/kafka-N.properties, the compose deployment's brokers, from the
one generator (`dsec kafka properties`); with --check, say whether they are current.

    .venv/bin/python scripts/render_kafka.py [--check]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BROKERS = ("kafka-1", "kafka-2", "kafka-3")
VOTERS = ",".join(f"{i}@{name}:9093" for i, name in enumerate(BROKERS, 1))


def rendered(node_id: int, host: str) -> str:
    """One broker's properties, as the compose deployment runs it."""
    dsec = ROOT / ".venv" / "bin" / "dsec"
    argv = [str(dsec), "kafka", "properties", "--node-id", str(node_id), "--voters", VOTERS,
            "--host", host, "--data-dir", "/var/lib/kafka/data"]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    stale = []
    for node_id, host in enumerate(BROKERS, 1):
        path = ROOT / "docker" / "kafka" / f"{host}.properties"
        text = rendered(node_id, host)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.write_text(text)
    if stale:
        sys.exit("not what the generator makes (run scripts/render_kafka.py): " + ", ".join(stale))


if __name__ == "__main__":
    main()
