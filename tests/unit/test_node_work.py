"""A request kind a node carries out is declared once (app.domain.node_tasks.NODE_WORK):
the scheduler's routing, the node's Celery tasks, its inbox and its handlers follow."""

from __future__ import annotations

from app.domain.node_tasks import NODE_WORK, TASK_FOR_REQUEST, VIA_INBOX, NodeTask
from app.domain.requests import RequestBase


def test_every_task_is_declared_once_with_a_request_of_its_own() -> None:
    tasks = [work.task for work in NODE_WORK]
    requests = [work.request for work in NODE_WORK]
    # Every task but the revocations, which carry no request (app/domain/direct.py)
    assert sorted(tasks) == sorted(set(NodeTask) - {NodeTask.REVOKE_KEYS})
    assert len(set(requests)) == len(requests)
    assert all(issubclass(r, RequestBase) for r in requests)
    assert {w.request.model_fields["type"].default: w.task for w in NODE_WORK} == TASK_FOR_REQUEST
    assert {NodeTask.EXEC, NodeTask.KILL_COMMAND} == VIA_INBOX


def test_the_node_registers_a_celery_task_and_a_handler_for_each_declared_kind() -> None:
    # Given the node's task module (importing it registers its Celery tasks)
    from workers import tasks
    from workers.celery_app import celery

    celery.loader.import_default_modules()
    # Then each declared kind has a handler and a Celery task under its wire name
    assert set(tasks.HANDLERS) == {work.task for work in NODE_WORK}
    for work in NODE_WORK:
        task = celery.tasks[work.task.value]
        assert task.__doc__ == work.summary
