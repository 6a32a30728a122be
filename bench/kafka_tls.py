"""The broker alone, over the stack's two listeners: what a record costs in time and
CPU over SASL on loopback, and over SASL with TLS (what traffic that leaves the
machine pays), in the same run.

    .venv/bin/python bench/kafka_tls.py [--n 2000] [--in-flight 40] [--hops 300]

For each listener: one hop (a record handed to the platform's Publisher, acknowledged
with acks=all, until a consumer with the platform's settings that polls all the time
has it: p50 and p99), and the CPU of this process (producer and consumer) and of the
broker per record produced and consumed, ``--in-flight`` at once. Needs `dsec up`.
"""

from __future__ import annotations

import argparse

from substrate import kafka_hop, kafka_records

from app.config import Settings, get_settings
from app.stack import broker
from app.stats import percentile


def tls(settings: Settings) -> Settings:
    """The same stack, reached on its TLS listener (checked against the stack's CA)."""
    host, _client, tls_port, _internal, _controller = broker.ports(settings)
    return settings.model_copy(
        update={
            "kafka_bootstrap": f"{host}:{tls_port}",
            "kafka_security_protocol": "SASL_SSL",
            "kafka_ssl_cafile": settings.ca_dir / "ca.pem",
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=40)
    parser.add_argument("--hops", type=int, default=300)
    args = parser.parse_args()
    plain = get_settings()
    figures: dict[str, tuple[float, float, float, float]] = {}
    for name, settings in (("sasl", plain), ("sasl_tls", tls(plain))):
        hops = kafka_hop(settings, args.hops)
        client_ms, broker_ms = kafka_records(settings, args.n, args.in_flight)
        p50, p99 = percentile(hops, 50) * 1000, percentile(hops, 99) * 1000
        figures[name] = (p50, p99, client_ms, broker_ms)
        print(
            f"{name:<9} one hop p50 {p50:6.2f} ms  p99 {p99:6.2f} ms;"
            f" per record: client {client_ms:.3f} ms CPU, broker {broker_ms:.3f} ms CPU"
        )
    parts = " ".join(
        f"{name}_hop_p50_ms={p50:.2f} {name}_hop_p99_ms={p99:.2f}"
        f" {name}_client_cpu_ms={c:.3f} {name}_broker_cpu_ms={b:.3f}"
        for name, (p50, p99, c, b) in figures.items()
    )
    print(f"RESULT kafka {parts}")


if __name__ == "__main__":
    main()
