"""The dsec node: one worker per host that runs sandboxes in rootless Podman and
commands through each sandbox's agent, and reports every fact to the log over Kafka."""
