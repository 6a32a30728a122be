"""Where a keyed record lands: Kafka's default partitioner, without a Kafka client.

The Java client, kafka-python (and so the SDK) and librdkafka's ``murmur2_random``
put a keyed record on ``murmur2(key) & 0x7fffffff`` modulo the topic's partitions.
The gate checks every request against it (a request read on another partition than
its key's is a copy, see app/domain/gate.py), and the domain may not import a Kafka
client: this is the same hash, written out (a unit test holds it to kafka-python's).
"""

from __future__ import annotations

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """MurmurHash2 of ``data`` as Kafka computes it (32-bit, unsigned)."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    end = length - length % 4
    for i in range(0, end, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = length % 4
    if tail >= 3:
        h ^= data[end + 2] << 16
    if tail >= 2:
        h ^= data[end + 1] << 8
    if tail >= 1:
        h ^= data[end]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


def key_partition(key: str, partitions: int) -> int:
    """The partition a record keyed ``key`` lands on with Kafka's default partitioner."""
    return (murmur2(key.encode()) & 0x7FFF_FFFF) % partitions
