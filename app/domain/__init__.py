"""The domain: messages, states and rules. Imports no driver and does no I/O."""
