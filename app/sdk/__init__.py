"""The trainer's SDK: create sandboxes, run commands, move files, over Kafka alone.

`Client` is the synchronous client, `AsyncClient` the same client awaited. This
package imports the domain's messages and the Kafka plumbing and nothing of the
server (`make lint` checks it): it is the ``dsec-sdk`` distribution, which a trainer
installs alone (sdk/README.md). ``PROTOCOL_VERSIONS`` are the wire protocol's versions
it speaks; a platform that serves none of them refuses its requests with
``unsupported_version``.
"""

from app.domain.base import PROTOCOL_VERSIONS
from app.domain.egress import NetworkPolicy
from app.sdk.aio import AsyncClient, AsyncCommand, AsyncExecStream, AsyncGroup, AsyncSandbox
from app.sdk.client import Chunk, Client, ExecResult
from app.sdk.handles import Command, ExecStream, Group, Sandbox

__all__ = [
    "PROTOCOL_VERSIONS",
    "AsyncClient",
    "AsyncCommand",
    "AsyncExecStream",
    "AsyncGroup",
    "AsyncSandbox",
    "Chunk",
    "Client",
    "Command",
    "ExecResult",
    "ExecStream",
    "Group",
    "NetworkPolicy",
    "Sandbox",
]
