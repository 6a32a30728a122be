"""How long trainers go unanswered when the broker dies.

    .venv/bin/python bench/failover.py [--trainers 4] [--before 10] [--after 120]

``--trainers`` threads each run ``true`` in a sandbox of their own, one command after
another (a command unanswered for 31 s counts as timed out, and the next is a new request).
After ``--before`` seconds the embedded broker is killed with SIGKILL and left to the
supervisor, which starts it again; nobody types `dsec up`. It prints, from the
trainers' side: the time from the kill to the first command answered again, the
longest silence of any trainer, commands that timed out, and p50/p99 of the commands
before the kill and in the 30 s after service came back. The last line is
``RESULT failover ...``. Needs `dsec up`.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import threading
import time

from app.config import get_settings
from app.control import tenants
from app.errors import DsecError
from app.sdk import Client, Sandbox
from app.stack import services as stack_mod
from app.stats import percentile


class Trainer(threading.Thread):
    """One sandbox, commands one after another; records (sent at, seconds) of each."""

    def __init__(self, box: Sandbox, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.box, self.stop = box, stop
        self.answered: list[tuple[float, float]] = []
        self.timeouts = 0

    def run(self) -> None:
        while not self.stop.is_set():
            sent = time.monotonic()
            try:
                self.box.exec("true", timeout_s=1)
            except DsecError:
                self.timeouts += 1
                continue
            self.answered.append((sent, time.monotonic() - sent))

    def longest_silence(self) -> float:
        """Longest time between two answers (the end of one to the end of the next)."""
        ends = [sent + took for sent, took in self.answered]
        return max((b - a for a, b in itertools.pairwise(ends)), default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", type=int, default=4)
    parser.add_argument("--before", type=float, default=10.0)
    parser.add_argument("--after", type=float, default=120.0)
    args = parser.parse_args()
    settings = get_settings()
    broker = stack_mod.services(settings)[0]
    stop = threading.Event()
    credential = tenants.local(settings, "bench")
    with Client(settings, credential=credential, job_id="failover") as client:
        boxes = client.create_many(args.trainers, memory_mb=32)
        trainers = [Trainer(box, stop) for box in boxes]
        for t in trainers:
            t.start()
        time.sleep(args.before)
        pid = broker.pid(settings)
        if pid is None:
            raise SystemExit("the broker is not running")
        killed = time.monotonic()
        os.killpg(pid, signal.SIGKILL)
        time.sleep(args.after)
        stop.set()
        for t in trainers:
            t.join(timeout=30)
        for box in boxes:
            box.close()
    answered = sorted(a for t in trainers for a in t.answered)
    after = [(s, d) for s, d in answered if s + d > killed]
    back = min((s + d for s, d in after), default=float("nan")) - killed
    before = [d for s, d in answered if s + d <= killed]
    settled = [d for s, d in after if s >= killed + back and s < killed + back + 30]
    silence = max(t.longest_silence() for t in trainers)
    timeouts = sum(t.timeouts for t in trainers)

    def ms(samples: list[float], p: int) -> float:
        return percentile(samples, p) * 1000 if samples else float("nan")

    print(f"answered again {back:.1f} s after the kill; longest silence {silence:.1f} s")
    print(f"before: p50 {ms(before, 50):.1f} ms, p99 {ms(before, 99):.1f} ms ({len(before)})")
    print(f"30 s after: p50 {ms(settled, 50):.1f} ms, p99 {ms(settled, 99):.1f} ms")
    print(f"commands timed out: {timeouts}")
    print(
        f"RESULT failover back_s={back:.1f} longest_silence_s={silence:.1f}"
        f" timeouts={timeouts} p50_before_ms={ms(before, 50):.1f}"
        f" p99_after_ms={ms(settled, 99):.1f}"
    )


if __name__ == "__main__":
    main()
