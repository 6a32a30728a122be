"""dsec node agent: Celery worker, Podman driver, in-sandbox exec agent and image store."""
