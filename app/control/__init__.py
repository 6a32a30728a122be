"""The control plane: the scheduler (around the pure dispatcher), the projector and
the consumers that feed them, the keyring that proves identities, and the tenants."""
