"""The host a node runs on: its system user and files, its rootless Podman service and
the watch that revives it, the shared read-only layer store and the user's idmapped
view of it, and the root-side helpers setting them up needs."""
