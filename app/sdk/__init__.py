"""The trainer's SDK: create sandboxes, run commands, move files, over Kafka alone.

`Client` is the synchronous client, `AsyncClient` the same client awaited. This
package imports the domain's messages and the Kafka plumbing and nothing of the
server (`make lint` checks it), so a trainer can install and read it alone.
"""

from app.sdk.aio import AsyncClient, AsyncCommand, AsyncExecStream, AsyncGroup, AsyncSandbox
from app.sdk.client import Chunk, Client, Command, ExecResult, ExecStream, Group, Sandbox

__all__ = [
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
    "Sandbox",
]
