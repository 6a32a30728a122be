"""dsec control plane: schemas, Kafka plumbing, scheduler, projector, SDK and CLI."""
