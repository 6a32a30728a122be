"""Sandboxes as containers: the container driver port (port.py) with its Podman and
in-memory adapters, the labels a container carries, the spec of one, and the
cgroup limits that hold on the node."""
