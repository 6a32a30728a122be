"""Old days of the log leave Postgres for files, and can come back.

The log is partitioned by UTC day of ``occurred_at``. ``archive`` moves whole days
older than a horizon out: detach the day's partition (a short lock on the log), copy
it to a gzipped CSV file beside its checksum, record the day in ``log_archives``,
drop the table. The projections never lose anything: the bills, lives and usage of an
archived day stay in ``usage_daily``, ``lives``, ``usage`` and ``sandboxes``; what
needs the events themselves (``audit_trail``, ``dsec events``) answers again after
``restore`` re-attaches the day.

Owner-role operations: the services may neither detach nor drop the log.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path

import psycopg
from psycopg import sql

from app.db.engine import libpq_url
from app.errors import DsecError

_COLUMNS = (
    "position, event_id, type, version, sandbox_id, node_id, tenant, job_id, occurred_at, "
    'recorded_at, payload, topic, topic_id, partition, "offset"'
)


class ArchiveError(DsecError):
    """An archive could not be written, checked or restored; nothing was lost."""


@dataclass(frozen=True)
class Archived:
    """One day moved out of the log."""

    day: date
    partition: str
    events: int
    file: Path
    sha256: str


def _day_of(partition: str) -> date:
    digits = partition.removeprefix("events_p")
    return date(int(digits[:4]), int(digits[4:6]), int(digits[6:8]))


def _attached(cur: psycopg.Cursor[tuple[str]]) -> list[str]:
    cur.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 'events'::regclass AND c.relname ~ '^events_p[0-9]{8}$'"
    )
    return [row[0] for row in cur.fetchall()]


def _detached(cur: psycopg.Cursor[tuple[str]]) -> list[str]:
    """Day tables left detached by an archive that stopped before its end."""
    cur.execute(
        "SELECT c.relname FROM pg_class c WHERE c.relkind = 'r'"
        " AND c.relname ~ '^events_p[0-9]{8}$'"
        " AND NOT EXISTS (SELECT FROM pg_inherits i WHERE i.inhrelid = c.oid)"
    )
    return [row[0] for row in cur.fetchall()]


def archive(admin_url: str, older_than_days: int, directory: Path, today: date) -> list[Archived]:
    """Move every whole day before ``today - older_than_days`` out of the log.

    Each day is detached (short lock), written to ``directory`` as
    ``events_p<day>.csv.gz`` (fsynced, checked by re-reading), recorded in
    ``log_archives`` and dropped. A run that stopped half-way is finished by the next.
    """
    if older_than_days < 1:
        raise ArchiveError("--older-than must be at least 1 day: today's log is being written")
    cutoff = today - timedelta(days=older_than_days)
    directory.mkdir(parents=True, exist_ok=True)
    done: list[Archived] = []
    with psycopg.connect(libpq_url(admin_url), autocommit=True) as conn, conn.cursor() as cur:
        for part in sorted(p for p in _attached(cur) if _day_of(p) < cutoff):
            with conn.transaction():
                cur.execute(sql.SQL("ALTER TABLE events DETACH PARTITION {}").format(
                    sql.Identifier(part)))  # fmt: skip
        for part in sorted(_detached(cur)):
            done.append(_write_and_drop(conn, part, directory))
    return done


def _write_and_drop(
    conn: psycopg.Connection[tuple[object, ...]], part: str, directory: Path
) -> Archived:
    path = directory / f"{part}.csv.gz"
    partial = path.with_suffix(".gz.partial")
    table = sql.Identifier(part)
    with conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT count(*), min(position), max(position) FROM {}").format(table))
        count, first, last = cur.fetchone() or (0, None, None)
        with open(partial, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
            query = sql.SQL(
                "COPY (SELECT {} FROM {} ORDER BY position) TO STDOUT (FORMAT csv, HEADER)"
            )
            with cur.copy(query.format(sql.SQL(_COLUMNS), table)) as copy:
                for chunk in copy:
                    out.write(chunk)
        with open(partial, "rb") as written:
            os.fsync(written.fileno())
        digest, rows = _check(partial)
        if rows != count:
            partial.unlink()
            raise ArchiveError(f"{part}: wrote {rows} events of {count}; the day stays in Postgres")
        os.replace(partial, path)
        _fsync_dir(directory)
        with conn.transaction():
            cur.execute(
                "INSERT INTO log_archives (day, partition, events, first_position,"
                " last_position, file, sha256) VALUES (%s, %s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (day) DO UPDATE SET events = excluded.events,"
                " first_position = excluded.first_position, last_position = excluded.last_position,"
                " file = excluded.file, sha256 = excluded.sha256, archived_at = now(),"
                " archived_by = current_user, restored_at = NULL",
                (_day_of(part), part, count, first, last, str(path.resolve()), digest),
            )
            cur.execute(sql.SQL("DROP TABLE {}").format(table))
    return Archived(_day_of(part), part, int(count), path, digest)


def _check(path: Path) -> tuple[str, int]:
    """The file's sha256 and the events it holds (CSV records after the header)."""
    digest = hashlib.sha256()
    with open(path, "rb") as raw:
        for block in iter(lambda: raw.read(1 << 20), b""):
            digest.update(block)
    with gzip.open(path, "rt", newline="") as text:
        rows = sum(1 for _ in csv.reader(text)) - 1
    return digest.hexdigest(), rows


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def restore(admin_url: str, path: Path) -> Archived:
    """Put an archived day back into the log, after checking the file against its record."""
    part = path.name.removesuffix(".csv.gz")
    try:
        day = _day_of(part)
    except ValueError:
        raise ArchiveError(
            f"{path.name}: not an archive of the log (events_pYYYYMMDD.csv.gz)"
        ) from None
    with psycopg.connect(libpq_url(admin_url), autocommit=True) as conn, conn.cursor() as cur:
        cur.execute("SELECT events, sha256 FROM log_archives WHERE day = %s", (day,))
        record = cur.fetchone()
        if record is None:
            raise ArchiveError(f"{day}: no archive of this day is recorded in log_archives")
        digest, rows = _check(path)
        if (digest, rows) != (record[1], record[0]):
            raise ArchiveError(
                f"{path}: {rows} events, sha256 {digest[:12]}…; log_archives recorded"
                f" {record[0]} events, sha256 {record[1][:12]}…: not restoring a changed file"
            )
        lo, hi = day.isoformat(), (day + timedelta(days=1)).isoformat()
        table = sql.Identifier(part)
        with conn.transaction():
            cur.execute(sql.SQL("CREATE TABLE {} (LIKE events INCLUDING DEFAULTS)").format(table))
            with (
                gzip.open(path, "rb") as raw,
                cur.copy(
                    sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv, HEADER)").format(
                        table, sql.SQL(_COLUMNS)
                    )
                ) as copy,
            ):
                for block in iter(lambda: raw.read(1 << 20), b""):
                    copy.write(block)
            try:
                cur.execute(
                    sql.SQL(
                        "ALTER TABLE events ATTACH PARTITION {} FOR VALUES"
                        " FROM ({}::timestamp AT TIME ZONE 'UTC')"
                        " TO ({}::timestamp AT TIME ZONE 'UTC')"
                    ).format(table, sql.Literal(lo), sql.Literal(hi))
                )
            except psycopg.errors.CheckViolation as exc:
                raise ArchiveError(
                    f"{day}: events of this day arrived after it was archived and sit in"
                    f" events_default; the day cannot be re-attached ({exc.diag.message_primary})"
                ) from exc
            cur.execute("SELECT dsec_guard_partition(%s)", (part,))
            cur.execute("UPDATE log_archives SET restored_at = now() WHERE day = %s", (day,))
    return Archived(day, part, rows, path, digest)


def archived_days(admin_url: str) -> Iterator[tuple[object, ...]]:
    """Every recorded archive: day, events, file, sha256, when, by whom, restored when."""
    with psycopg.connect(libpq_url(admin_url)) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT day, events, first_position, last_position, file, sha256, archived_at,"
            " archived_by, restored_at FROM log_archives ORDER BY day"
        )
        yield from cur.fetchall()
