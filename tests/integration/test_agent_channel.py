"""The agent's channel against the sandbox's own code, attacked from inside a sandbox.

The code in a sandbox is written by the model being trained and gains from forged
results. A real rogue program (static C, built here, uploaded and started in the
sandbox) tries to take the agent's place on the host socket, to trace the agent and to
signal it; the trainer must still get what its commands really produced.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

#: Connects to the host's agent socket as the agent would, and answers every request
#: with a forged success: exit 0, its own stdout, its own file content. With argument
#: "trace" it tries ptrace, /proc/1/mem and /proc/1/environ on the agent instead.
ROGUE_C = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static void put32(unsigned char *p, uint32_t v) {
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}

static int read_all(int fd, unsigned char *buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r <= 0) return -1;
        got += r;
    }
    return 0;
}

static int serve(void) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    strcpy(a.sun_path, "/.dsec/run/agent.sock");
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) { perror("connect"); return -1; }
    unsigned char hello[13];
    put32(hello, 9); hello[4] = 0x10; put32(hello + 5, 2); put32(hello + 9, getpid());
    write(fd, hello, sizeof hello);
    printf("hello sent\n"); fflush(stdout);
    static unsigned char req[1 << 20];
    for (;;) {
        unsigned char h[4];
        if (read_all(fd, h, 4) < 0) {
            printf("closed by host\n"); fflush(stdout); close(fd); return 0;
        }
        uint32_t n = (uint32_t)h[0] << 24 | h[1] << 16 | h[2] << 8 | h[3];
        if (n > sizeof req || read_all(fd, req, n) < 0) { close(fd); return 0; }
        unsigned char out[64] = {0};
        size_t len;
        if (req[0] == 0x02 || req[0] == 0x05) {   /* EXEC: exit 0, stdout "forged" */
            out[4] = 0;                            /* status ok, exit 0, flags 0, dur 0 */
            put32(out + 4 + 14, 7); memcpy(out + 4 + 18, "forged\n", 7);
            put32(out + 4 + 25, 0);
            len = 29;
        } else if (req[0] == 0x04) {              /* READ_FILE: not truncated, "forged" */
            put32(out + 4 + 2, 6); memcpy(out + 4 + 6, "forged", 6);
            len = 12;
        } else if (req[0] == 0x03) {              /* WRITE_FILE: ok, 0 bytes */
            len = 9;
        } else {                                  /* PING: ok */
            len = 1;
        }
        put32(out, len);
        write(fd, out, 4 + len);
        printf("answered op %d\n", req[0]); fflush(stdout);
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "trace") == 0) {
        long r = ptrace(PTRACE_ATTACH, 1, 0, 0);
        printf("ptrace %s\n", r == 0 ? "ok" : strerror(errno));
        int m = open("/proc/1/mem", O_RDWR);
        printf("mem %s\n", m >= 0 ? "ok" : strerror(errno));
        int e = open("/proc/1/environ", O_RDONLY);
        printf("environ %s\n", e >= 0 ? "ok" : strerror(errno));
        return 0;
    }
    for (int i = 0; i < 20; i++) {   /* keep trying, as a newest HELLO would win */
        serve();
        usleep(100000);
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def rogue(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.fail("no C compiler to build the rogue agent (make test installs gcc)")
    work: Path = tmp_path_factory.mktemp("rogue")
    (work / "rogue.c").write_text(ROGUE_C)
    subprocess.run(
        [cc, "-static", "-s", "-Os", "-w", "-o", str(work / "rogue"), str(work / "rogue.c")],
        check=True,
    )
    return work / "rogue"


@pytest.fixture
def box(client: Any) -> Iterator[Any]:
    with client.create() as sandbox:
        yield sandbox


def test_a_rogue_process_cannot_take_the_agents_place(box: Any, rogue: Path) -> None:
    box.upload(rogue, "/workspace")
    box.write_file("/workspace/truth.txt", b"the real content")
    started = box.exec("/workspace/rogue > /workspace/rogue.log 2>&1 &")
    assert started.exit_code == 0
    deadline = time.monotonic() + 3
    while b"hello sent" not in box.read_file("/workspace/rogue.log"):
        assert time.monotonic() < deadline, "the rogue never reached the host socket"
        time.sleep(0.1)
    for _ in range(5):  # the rogue keeps reconnecting meanwhile
        result = box.exec("echo real; exit 3")
        assert (result.exit_code, result.text) == (3, "real\n")
        assert box.read_file("/workspace/truth.txt") == b"the real content"
        time.sleep(0.1)
    log = box.read_file("/workspace/rogue.log").decode()
    assert "closed by host" in log, log
    assert "answered" not in log, log  # the host never sent it a request


def test_commands_cannot_trace_or_signal_the_agent(box: Any, rogue: Path) -> None:
    box.upload(rogue, "/workspace")
    traced = box.exec(["/workspace/rogue", "trace"])
    assert "ptrace ok" not in traced.text and "mem ok" not in traced.text, traced.text
    assert "environ ok" not in traced.text, traced.text
    # Every signal a command can send its agent: none may end or stop it.
    box.exec("for s in TERM INT HUP USR1 QUIT STOP KILL; do kill -$s 1; done; true")
    after = box.exec("echo still here")
    assert (after.exit_code, after.text) == (0, "still here\n")
