"""dsec, all but the node: the trainer's SDK (sdk/), the control plane (control/), the
hosts (stack/), the commands (cli/), Postgres (db/) and the domain below them all
(domain/), with the plumbing they share at this level (config, errors, the bus, the
task queue, the ports). The map: docs/architecture.md."""

#: The one version of both distributions (``dsec`` and ``dsec-sdk``): their builds
#: read it from here, and the server pins the SDK it ships with to it.
__version__ = "0.2.0"
