/*
 * dsec-agent: the persistent exec agent that runs as PID 1 of every dsec sandbox.
 *
 * Build:  gcc -static -O2 -Wall -Wextra -o dsec-agent dsec_agent.c
 * Usage:  dsec-agent [SOCKET_PATH]          (default /.dsec/run/agent.sock)
 *
 * Direction. The HOST listens on a unix socket in a host-owned directory that is
 * mounted read-only into the sandbox; the agent CONNECTS OUT to it, retrying every
 * 50-200 ms while that fails and reconnecting whenever the connection drops (the
 * node worker may restart). So the host never opens a path the sandbox can write
 * and never follows a sandbox-made symlink.
 *
 * Connections (version 3). The agent keeps several connections to the host and one
 * of them idle at all times (it connects another as soon as a request arrives on the
 * last idle one, up to MAX_CONNS). Each request is served by a handler process forked
 * for it, so requests on different connections run at once; a connection carries one
 * request at a time. A handler that exits with anything but success closes its
 * connection. Versions 1-2 had one connection and served it in PID 1.
 *
 * Wire protocol (version 3 = version 2 with several connections; version 2: version
 * 1 + EXEC_STREAM); all integers big-endian.
 *   frame  = u32 length, then `length` bytes of payload
 *   bytes  = u32 length, then the bytes          (strings: UTF-8, no NUL bytes)
 *   list   = u32 count, then the items
 * On connect the agent sends   HELLO  = u8 0x10, u32 version, u32 pid
 * Requests (host -> agent), one at a time per connection, payload = u8 op + fields:
 *   0x01 PING
 *   0x02 EXEC        list<bytes> argv, list<bytes> env ("K=V"), bytes cwd ("" =
 *                    /workspace), u32 timeout_ms (0 = none), u32 max_output_bytes
 *                    (per stream, clamped to 64 MiB), bytes stdin
 *   0x03 WRITE_FILE  bytes path, u32 mode, bytes data
 *   0x04 READ_FILE   bytes path, u32 max_bytes (clamped to 64 MiB)
 *   0x05 EXEC_STREAM as EXEC; while the command runs the agent also sends OUTPUT
 *                    frames, then the same final response as EXEC
 *   0x06 SIGNAL_ALL  u32 signo (SIGSTOP, SIGCONT or SIGKILL): kill(-1, signo) from the
 *                    request's handler, so every process of the sandbox but PID 1 and
 *                    that handler gets it (other requests' handlers too: a frozen
 *                    sandbox's commands and their handlers stop together)
 * Responses (agent -> host), payload = u8 status + body:
 *   status 1 (error, any op): u32 errno (0 if not an OS error), bytes message
 *   status 0 PING, SIGNAL_ALL: (empty)
 *   status 0 EXEC:       i32 exit_code (-N if killed by signal N), u8 flags (bit0
 *                        timed_out, bit1 stdout_truncated, bit2 stderr_truncated),
 *                        u64 duration_ns, bytes stdout, bytes stderr
 *   status 0 WRITE_FILE: u64 bytes_written
 *   status 0 READ_FILE:  u8 truncated, bytes data
 *   status 2 OUTPUT (EXEC_STREAM only, before the final response): u8 stream (1
 *                        stdout, 2 stderr), bytes data: output kept since the last
 *                        OUTPUT frame of that stream, sent STREAM_LINGER_MS after its
 *                        first byte or once STREAM_CHUNK bytes wait, whichever first
 * Request frames above 64 MiB are answered with an error and the connection is
 * closed. Closing the connection while an EXEC runs cancels it (the command's process
 * group is killed).
 *
 * EXEC semantics. The command runs in its own session/process group with stdin from a
 * pipe fed with the given bytes (closed at once if empty), stdout and stderr on two
 * pipes read with poll(). Output beyond the cap is read and discarded so the command
 * never blocks on a full pipe. On timeout the whole process group gets SIGKILL and the
 * agent carries on. When the command's first process exits, the agent waits at most
 * LINGER_MS for the pipes to close: background children that keep them open (`sleep
 * 100 &`) are left running, not waited for. Environment: the agent's own (the
 * container's: image ENV + sandbox env), overridden by the request's entries; PATH
 * and HOME are defaulted when absent and /.dsec/bin is appended to the inherited PATH
 * (a request that sets PATH gets exactly its PATH). A command that cannot be started exits 127
 * (not found) or 126 (other errors, e.g. a bad cwd) with a message on stderr, like a
 * shell.
 *
 * File ops refuse relative paths and ".." components, never follow a symlink (neither
 * in parent directories nor the final component), and only touch regular files.
 * WRITE_FILE creates missing parent directories (0755) and truncates in place.
 *
 * PID 1 duties: reap every zombie (as a child subreaper when not PID 1), exit on
 * SIGTERM/SIGINT from outside the sandbox. Hostile neighbours: commands are the
 * sandbox's own code; the agent is not dumpable (no ptrace, no /proc/1/mem) and
 * ignores signals sent from inside, and the host accepts only PID 1's connection. Memory stays small: buffers live only for one request.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PROTO_VERSION 3u
#define MAX_FRAME (64u << 20)
#define MAX_OUTPUT (64u << 20)
#define DEFAULT_SOCKET "/.dsec/run/agent.sock"
#define DEFAULT_PATH "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/.dsec/bin"
#define DEFAULT_HOME "HOME=/root"
#define DEFAULT_CWD "/workspace"
#define LINGER_NS (100ull * 1000000ull)
#define KILL_WAIT_NS (2000ull * 1000000ull)
#define STREAM_LINGER_NS (50ull * 1000000ull)
#define STREAM_CHUNK (32u << 10)
#define RETRY_MIN_MS 50
#define RETRY_MAX_MS 200
#define MAX_CONNS 256

enum {
    OP_PING = 0x01,
    OP_EXEC = 0x02,
    OP_WRITE_FILE = 0x03,
    OP_READ_FILE = 0x04,
    OP_EXEC_STREAM = 0x05,
    OP_SIGNAL_ALL = 0x06,
    OP_HELLO = 0x10
};
enum { STATUS_OK = 0, STATUS_ERROR = 1, STATUS_OUTPUT = 2 };

extern char **environ;

static int g_sigfd = -1;
/* The first process of the running EXEC, so the reaper can record its status. */
static pid_t g_leader;
static int g_leader_done;
static int g_leader_status;
/* PID 1's connections to the host: handler is the pid serving a request on it. */
struct conn {
    int fd;
    pid_t handler;
};
static struct conn g_conns[MAX_CONNS];
static int g_nconns;
/* Set in a handler process (it serves one request, then exits). */
static int g_handler;

static void handler_ended(pid_t pid, int status);

/* ---------------------------------------------------------------- utilities */

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void put_u32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static void put_u64(uint8_t *p, uint64_t v)
{
    put_u32(p, (uint32_t)(v >> 32));
    put_u32(p + 4, (uint32_t)v);
}

static uint32_t get_u32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static void set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static void close_fd(int *fd)
{
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

/* ------------------------------------------------------ signals and reaping */

static void reap_children(void)
{
    int st;
    pid_t pid;
    /* Orphans re-parented to us (PID 1 / subreaper) are reaped here too. */
    while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
        if (g_leader > 0 && pid == g_leader) {
            g_leader_done = 1;
            g_leader_status = st;
        } else if (!g_handler) {
            handler_ended(pid, st);
        }
    }
}

static void handle_signals(void)
{
    struct signalfd_siginfo si[8];
    ssize_t n;
    int term = 0;
    while ((n = read(g_sigfd, si, sizeof si)) > 0) {
        for (size_t i = 0; i < (size_t)n / sizeof si[0]; i++)
            /* As PID 1, only a sender outside the sandbox's pid namespace (Podman
             * stopping the container: ssi_pid 0 here) may end us; the sandbox's own
             * processes must not be able to take its agent down. */
            if ((si[i].ssi_signo == SIGTERM || si[i].ssi_signo == SIGINT) &&
                (getpid() != 1 || si[i].ssi_pid == 0))
                term = 1;
    }
    reap_children();
    if (term) {
        if (g_leader > 0 && !g_leader_done)
            kill(-g_leader, SIGKILL);
        _exit(g_handler ? 1 : 0);
    }
}

static void setup_signals(void)
{
    sigset_t set;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    /* Dispositions we inherited (e.g. SIGINT ignored by a shell) would leak into
     * every command: reset them; only SIGPIPE is ignored here (and reset in the child). */
    for (int s = 1; s < NSIG; s++)
        if (s != SIGKILL && s != SIGSTOP)
            sigaction(s, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    /* Blocked signals are queued even for a namespace's PID 1 (which otherwise drops
     * default-disposition signals), and signalfd lets poll() service them. */
    sigemptyset(&set);
    sigaddset(&set, SIGCHLD);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigprocmask(SIG_BLOCK, &set, NULL);
    g_sigfd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
    if (g_sigfd < 0) {
        perror("dsec-agent: signalfd");
        exit(1);
    }
}

/* ------------------------------------------------------------ blocking I/O */

/* Waits until `fd` is ready for `events`, servicing signals meanwhile. */
static int wait_fd(int fd, short events, int timeout_ms)
{
    for (;;) {
        struct pollfd p[2] = {{fd, events, 0}, {g_sigfd, POLLIN, 0}};
        int r = poll(p, 2, timeout_ms);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (p[1].revents)
            handle_signals();
        if (p[0].revents || r == 0)
            return r == 0 ? 1 : 0;
    }
}

/* Reads exactly n bytes; -1 on EOF or error. */
static int read_full(int fd, void *buf, size_t n)
{
    size_t off = 0;
    while (off < n) {
        ssize_t r = read(fd, (char *)buf + off, n - off);
        if (r > 0) {
            off += (size_t)r;
        } else if (r == 0) {
            return -1;
        } else if (errno == EAGAIN) {
            if (wait_fd(fd, POLLIN, -1) < 0)
                return -1;
        } else if (errno != EINTR) {
            return -1;
        }
    }
    return 0;
}

static int write_iov(int fd, struct iovec *iov, int cnt)
{
    while (cnt > 0) {
        ssize_t w = writev(fd, iov, cnt);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN) {
                if (wait_fd(fd, POLLOUT, -1) < 0)
                    return -1;
                continue;
            }
            return -1;
        }
        size_t left = (size_t)w;
        while (cnt > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- responses */

/* Sends a frame: status byte + the given body pieces (at most 6). */
static int send_response(int sock, uint8_t status, const struct iovec *body, int nbody)
{
    uint8_t hdr[5];
    struct iovec iov[7];
    size_t total = 1;
    for (int i = 0; i < nbody; i++) {
        iov[i + 1] = body[i];
        total += body[i].iov_len;
    }
    put_u32(hdr, (uint32_t)total);
    hdr[4] = status;
    iov[0].iov_base = hdr;
    iov[0].iov_len = sizeof hdr;
    return write_iov(sock, iov, nbody + 1);
}

static int send_error(int sock, int err, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int send_error(int sock, int err, const char *fmt, ...)
{
    char msg[600];
    uint8_t head[8];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if ((size_t)n >= sizeof msg)
        n = sizeof msg - 1;
    put_u32(head, (uint32_t)err);
    put_u32(head + 4, (uint32_t)n);
    struct iovec body[2] = {{head, sizeof head}, {msg, (size_t)n}};
    return send_response(sock, 1, body, 2);
}

/* ------------------------------------------------------------ request parsing */

struct reader {
    uint8_t *p;
    size_t n;
    int bad;
};

static uint32_t rd_u32(struct reader *r)
{
    if (r->bad || r->n < 4) {
        r->bad = 1;
        return 0;
    }
    uint32_t v = get_u32(r->p);
    r->p += 4;
    r->n -= 4;
    return v;
}

static uint8_t *rd_bytes(struct reader *r, size_t *len)
{
    uint32_t l = rd_u32(r);
    if (r->bad || r->n < l) {
        r->bad = 1;
        return NULL;
    }
    uint8_t *p = r->p;
    r->p += l;
    r->n -= l;
    *len = l;
    return p;
}

/* A NUL-terminated string built in place: the bytes move 4 back over their (already
 * consumed) length prefix, which saves an allocation per argument. */
static char *rd_str(struct reader *r)
{
    size_t l = 0;
    uint8_t *p = rd_bytes(r, &l);
    if (!p)
        return NULL;
    if (memchr(p, 0, l)) {
        r->bad = 1;
        return NULL;
    }
    char *s = (char *)p - 4;
    memmove(s, p, l);
    s[l] = '\0';
    return s;
}

/* A list of strings as a NULL-terminated, malloc'd array. */
static char **rd_strlist(struct reader *r, uint32_t *count)
{
    uint32_t c = rd_u32(r);
    if (r->bad || c > r->n / 4) {
        r->bad = 1;
        return NULL;
    }
    char **v = calloc((size_t)c + 1, sizeof *v);
    if (!v) {
        r->bad = 1;
        return NULL;
    }
    for (uint32_t i = 0; i < c; i++) {
        v[i] = rd_str(r);
        if (!v[i]) {
            free(v);
            return NULL;
        }
    }
    *count = c;
    return v;
}

/* --------------------------------------------------------------------- EXEC */

static size_t key_len(const char *kv)
{
    const char *eq = strchr(kv, '=');
    return eq ? (size_t)(eq - kv) : strlen(kv);
}

static int has_key(char **env, size_t n, const char *key, size_t klen)
{
    for (size_t i = 0; i < n; i++)
        if (key_len(env[i]) == klen && strncmp(env[i], key, klen) == 0)
            return 1;
    return 0;
}

/* Once at startup: commands inherit the agent's environment (the container's), with
 * PATH and HOME defaulted and /.dsec/bin (static busybox) last on PATH. */
static void init_env(void)
{
    const char *path = getenv("PATH");
    if (!path || !*path) {
        setenv("PATH", DEFAULT_PATH + 5, 1);
    } else if (!strstr(path, "/.dsec/bin")) {
        size_t n = strlen(path) + sizeof ":/.dsec/bin";
        char *p = malloc(n);
        if (p) {
            snprintf(p, n, "%s:/.dsec/bin", path);
            setenv("PATH", p, 1);
            free(p);
        }
    }
    if (!getenv("HOME"))
        setenv("HOME", DEFAULT_HOME + 5, 1);
}

/* environ, minus the keys the request sets, plus the request's entries and defaults. */
static char **build_env(char **req, uint32_t nreq)
{
    size_t nbase = 0;
    while (environ && environ[nbase])
        nbase++;
    char **out = malloc((nbase + nreq + 3) * sizeof *out);
    if (!out)
        return NULL;
    size_t n = 0;
    for (size_t i = 0; i < nbase; i++)
        if (!has_key(req, nreq, environ[i], key_len(environ[i])))
            out[n++] = environ[i];
    for (uint32_t i = 0; i < nreq; i++)
        out[n++] = req[i];
    if (!has_key(out, n, "PATH", 4))
        out[n++] = DEFAULT_PATH;
    if (!has_key(out, n, "HOME", 4))
        out[n++] = DEFAULT_HOME;
    out[n] = NULL;
    return out;
}

struct obuf {
    int fd;
    int truncated;
    char *data;
    size_t len, cap, limit;
    size_t sent; /* EXEC_STREAM: bytes already sent in OUTPUT frames */
};

/* EXEC_STREAM: send what each stream kept since its last OUTPUT frame. */
static int send_output(int sock, struct obuf *ob)
{
    for (uint8_t i = 0; i < 2; i++) {
        size_t n = ob[i].len - ob[i].sent;
        if (!n)
            continue;
        uint8_t head[5];
        head[0] = (uint8_t)(i + 1);
        put_u32(head + 1, (uint32_t)n);
        struct iovec body[2] = {{head, sizeof head}, {ob[i].data + ob[i].sent, n}};
        if (send_response(sock, STATUS_OUTPUT, body, 2) < 0)
            return -1;
        ob[i].sent = ob[i].len;
    }
    return 0;
}

/* Drains what the pipe has (a few reads per wake-up); returns 0 once it is closed. */
static int obuf_read(struct obuf *b)
{
    char discard[16384];
    for (int i = 0; i < 4; i++) {
        ssize_t r;
        if (b->len < b->limit) {
            if (b->cap == b->len) {
                size_t nc = b->cap ? b->cap * 2 : 4096;
                if (nc > b->limit)
                    nc = b->limit;
                char *d = realloc(b->data, nc);
                if (!d) {
                    b->limit = b->len; /* out of memory: keep what we have */
                    continue;
                }
                b->data = d;
                b->cap = nc;
            }
            r = read(b->fd, b->data + b->len, b->cap - b->len);
            if (r > 0)
                b->len += (size_t)r;
        } else {
            /* Past the cap: keep reading so the writer never blocks, but drop it. */
            r = read(b->fd, discard, sizeof discard);
            if (r > 0)
                b->truncated = 1;
        }
        if (r == 0) {
            close_fd(&b->fd);
            return 0;
        }
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN)
                return 1;
            close_fd(&b->fd);
            return 0;
        }
    }
    return 1;
}

static void run_child(char **argv, char **envp, const char *cwd, int in, int out, int err)
    __attribute__((noreturn));

static void run_child(char **argv, char **envp, const char *cwd, int in, int out, int err)
{
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    setsid();
    /* The pipe fds are >= 3 (main() keeps 0-2 open) and close-on-exec. */
    if (dup2(in, 0) < 0 || dup2(out, 1) < 0 || dup2(err, 2) < 0)
        _exit(126);
    if (chdir(cwd) < 0) {
        dprintf(2, "dsec-agent: cannot change directory to %s: %s\n", cwd, strerror(errno));
        _exit(126);
    }
    /* execvp searches the PATH of `environ`, so switch it before exec. */
    environ = envp;
    execvp(argv[0], argv);
    int e = errno;
    dprintf(2, "dsec-agent: %s: %s\n", argv[0], strerror(e));
    _exit(e == ENOENT ? 127 : 126);
}

/* Returns 0 if the connection is still usable, -1 if it must be closed. */
static int do_exec(int sock, struct reader *r, int stream)
{
    uint32_t argc = 0, envc = 0;
    char **argv = rd_strlist(r, &argc);
    char **reqenv = argv ? rd_strlist(r, &envc) : NULL;
    char *cwd = rd_str(r);
    uint32_t timeout_ms = rd_u32(r);
    uint32_t max_out = rd_u32(r);
    size_t in_len = 0;
    uint8_t *in_data = rd_bytes(r, &in_len);
    char **envp = NULL;
    int rc = 0;
    int in_p[2] = {-1, -1}, out_p[2] = {-1, -1}, err_p[2] = {-1, -1};

    if (r->bad || r->n != 0 || !argv || !reqenv || !cwd || !in_data) {
        rc = send_error(sock, EINVAL, "malformed EXEC request");
        goto out;
    }
    if (argc == 0) {
        rc = send_error(sock, EINVAL, "empty argv");
        goto out;
    }
    for (uint32_t i = 0; i < envc; i++) {
        if (!strchr(reqenv[i], '=') || reqenv[i][0] == '=') {
            rc = send_error(sock, EINVAL, "env entry is not K=V: %s", reqenv[i]);
            goto out;
        }
    }
    if (!*cwd)
        cwd = DEFAULT_CWD;
    if (max_out > MAX_OUTPUT)
        max_out = MAX_OUTPUT;
    envp = build_env(reqenv, envc);
    if (!envp || pipe2(in_p, O_CLOEXEC) < 0 || pipe2(out_p, O_CLOEXEC) < 0 ||
        pipe2(err_p, O_CLOEXEC) < 0) {
        rc = send_error(sock, errno, "cannot prepare command: %s", strerror(errno));
        goto out;
    }

    uint64_t t0 = now_ns();
    g_leader_done = 0;
    pid_t pid = fork();
    if (pid < 0) {
        rc = send_error(sock, errno, "fork: %s", strerror(errno));
        goto out;
    }
    if (pid == 0)
        run_child(argv, envp, cwd, in_p[0], out_p[1], err_p[1]);
    g_leader = pid;
    close_fd(&in_p[0]);
    close_fd(&out_p[1]);
    close_fd(&err_p[1]);

    struct obuf ob[2] = {{out_p[0], 0, NULL, 0, 0, max_out, 0},
                         {err_p[0], 0, NULL, 0, 0, max_out, 0}};
    out_p[0] = err_p[0] = -1;
    set_nonblock(ob[0].fd);
    set_nonblock(ob[1].fd);
    int in_fd = in_p[1];
    in_p[1] = -1;
    size_t in_off = 0;
    if (in_len == 0)
        close_fd(&in_fd);
    else
        set_nonblock(in_fd);

    uint64_t deadline = timeout_ms ? t0 + (uint64_t)timeout_ms * 1000000ull : 0;
    uint64_t linger_until = 0, kill_until = 0, flush_at = 0;
    int timed_out = 0, cancelled = 0;

    for (;;) {
        uint64_t now = now_ns(), next = 0;
        if (g_leader_done) {
            close_fd(&in_fd);
            if (ob[0].fd < 0 && ob[1].fd < 0)
                break;
            if (!linger_until)
                linger_until = now + LINGER_NS;
            if (now >= linger_until)
                break; /* background children hold the pipes: leave them be */
            next = linger_until;
        } else if (timed_out) {
            if (now >= kill_until)
                break; /* unkillable for now (D state): reaped later, anonymously */
            next = kill_until;
        } else if (deadline) {
            if (now >= deadline) {
                /* Before setsid() has run the group does not exist yet: kill both. */
                kill(-pid, SIGKILL);
                kill(pid, SIGKILL);
                timed_out = 1;
                kill_until = now + KILL_WAIT_NS;
                continue;
            }
            next = deadline;
        }

        struct pollfd p[5];
        int np = 0, i_sig, i_sock, i_out = -1, i_err = -1, i_in = -1;
        i_sig = np;
        p[np++] = (struct pollfd){g_sigfd, POLLIN, 0};
        i_sock = np;
        p[np++] = (struct pollfd){sock, POLLRDHUP, 0};
        if (ob[0].fd >= 0) {
            i_out = np;
            p[np++] = (struct pollfd){ob[0].fd, POLLIN, 0};
        }
        if (ob[1].fd >= 0) {
            i_err = np;
            p[np++] = (struct pollfd){ob[1].fd, POLLIN, 0};
        }
        if (in_fd >= 0) {
            i_in = np;
            p[np++] = (struct pollfd){in_fd, POLLOUT, 0};
        }
        if (flush_at && (!next || flush_at < next))
            next = flush_at;
        int tmo = -1;
        if (next)
            tmo = next > now ? (int)((next - now + 999999ull) / 1000000ull) : 0;
        if (poll(p, (nfds_t)np, tmo) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (p[i_sig].revents)
            handle_signals();
        if (p[i_sock].revents & (POLLHUP | POLLRDHUP | POLLERR)) {
            /* The host gave up on this request: nobody will read the result. */
            kill(-pid, SIGKILL);
            kill(pid, SIGKILL);
            cancelled = 1;
            break;
        }
        if (i_out >= 0 && p[i_out].revents)
            obuf_read(&ob[0]);
        if (i_err >= 0 && p[i_err].revents)
            obuf_read(&ob[1]);
        if (stream) {
            size_t waiting = (ob[0].len - ob[0].sent) + (ob[1].len - ob[1].sent);
            uint64_t t = now_ns();
            if (waiting && !flush_at)
                flush_at = t + STREAM_LINGER_NS;
            if (flush_at && (waiting >= STREAM_CHUNK || t >= flush_at)) {
                flush_at = 0;
                if (send_output(sock, ob) < 0) {
                    kill(-pid, SIGKILL); /* nobody reads the output any more */
                    kill(pid, SIGKILL);
                    cancelled = 1;
                    break;
                }
            }
        }
        if (i_in >= 0 && p[i_in].revents) {
            ssize_t w = write(in_fd, in_data + in_off, in_len - in_off);
            if (w > 0)
                in_off += (size_t)w;
            if ((w < 0 && errno != EAGAIN && errno != EINTR) || in_off == in_len)
                close_fd(&in_fd); /* EPIPE: the command stopped reading stdin */
        }
    }
    uint64_t duration = now_ns() - t0;
    int done = g_leader_done, status = g_leader_status;
    g_leader = 0;
    g_leader_done = 0;
    close_fd(&in_fd);
    close_fd(&ob[0].fd);
    close_fd(&ob[1].fd);

    if (!cancelled && stream && send_output(sock, ob) < 0)
        cancelled = 1;
    if (cancelled) {
        rc = -1;
    } else {
        int32_t code = -SIGKILL;
        if (done && WIFEXITED(status))
            code = WEXITSTATUS(status);
        else if (done && WIFSIGNALED(status))
            code = -WTERMSIG(status);
        uint8_t head[4 + 1 + 8 + 4], mid[4];
        put_u32(head, (uint32_t)code);
        head[4] = (uint8_t)((timed_out ? 1 : 0) | (ob[0].truncated ? 2 : 0) |
                            (ob[1].truncated ? 4 : 0));
        put_u64(head + 5, duration);
        put_u32(head + 13, (uint32_t)ob[0].len);
        put_u32(mid, (uint32_t)ob[1].len);
        struct iovec body[4] = {
            {head, sizeof head}, {ob[0].data, ob[0].len}, {mid, sizeof mid}, {ob[1].data, ob[1].len}};
        rc = send_response(sock, 0, body, 4);
    }
    free(ob[0].data);
    free(ob[1].data);
out:
    close_fd(&in_p[0]);
    close_fd(&in_p[1]);
    close_fd(&out_p[0]);
    close_fd(&out_p[1]);
    close_fd(&err_p[0]);
    close_fd(&err_p[1]);
    free(envp);
    free(argv);
    free(reqenv);
    return rc;
}

/* ---------------------------------------------------------------- file ops */

struct ferr {
    int code;
    char msg[512];
};

static int fail(struct ferr *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int fail(struct ferr *e, int code, const char *fmt, ...)
{
    va_list ap;
    e->code = code;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    return -1;
}

/* Rejects relative paths, ".." components and paths without a final file name. */
static int check_path(const char *path, struct ferr *e)
{
    if (path[0] != '/')
        return fail(e, EINVAL, "refused: path must be absolute: %s", path);
    size_t n = strlen(path);
    if (path[n - 1] == '/')
        return fail(e, EINVAL, "refused: path names a directory: %s", path);
    for (const char *c = path; *c;) {
        while (*c == '/')
            c++;
        const char *end = strchrnul(c, '/');
        if (end - c == 2 && c[0] == '.' && c[1] == '.')
            return fail(e, EINVAL, "refused: path contains '..': %s", path);
        if (!*end && end - c == 1 && c[0] == '.')
            return fail(e, EINVAL, "refused: path names a directory: %s", path);
        c = end;
    }
    return 0;
}

/* Opens the directory holding the final component of `path` (which is split in place)
 * without following symlinks; with `create`, missing directories are made (0755). */
static int open_parent(char *path, int create, char **leaf, struct ferr *e)
{
    if (check_path(path, e) < 0)
        return -1;
    char *full = strdup(path); /* for messages; `path` is cut up below */
    int dfd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || !full) {
        free(full);
        return fail(e, errno, "cannot open /: %s", strerror(errno));
    }
    char *s = path;
    for (;;) {
        while (*s == '/')
            s++;
        char *slash = strchr(s, '/');
        if (!slash)
            break;
        *slash = '\0';
        char *comp = s;
        s = slash + 1;
        if (strcmp(comp, ".") == 0)
            continue;
        if (create && mkdirat(dfd, comp, 0755) < 0 && errno != EEXIST) {
            fail(e, errno, "cannot create parent of %s: %s", full, strerror(errno));
            goto bad;
        }
        int nfd = openat(dfd, comp, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (nfd < 0) {
            struct stat st;
            if (fstatat(dfd, comp, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode))
                fail(e, ELOOP, "refused: symlink in path: %s", full);
            else
                fail(e, errno, "cannot open parent of %s: %s", full, strerror(errno));
            goto bad;
        }
        close(dfd);
        dfd = nfd;
    }
    *leaf = s;
    free(full);
    return dfd;
bad:
    close(dfd);
    free(full);
    return -1;
}

/* Opens the final component (never a symlink) and insists on a regular file. */
static int open_leaf(int dfd, const char *leaf, const char *path, int flags, mode_t mode,
                     struct ferr *e)
{
    /* O_NONBLOCK: a FIFO planted at the path must not wedge the agent in open(). */
    int fd = openat(dfd, leaf, flags | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, mode);
    if (fd < 0) {
        if (errno == ELOOP)
            return fail(e, ELOOP, "refused: %s is a symlink", path);
        return fail(e, errno, "cannot open %s: %s", path, strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return fail(e, EINVAL, "refused: %s is not a regular file", path);
    }
    return fd;
}

static int do_write_file(int sock, struct reader *r)
{
    char *path = rd_str(r);
    uint32_t mode = rd_u32(r) & 07777;
    size_t len = 0;
    uint8_t *data = rd_bytes(r, &len);
    if (r->bad || r->n != 0 || !path || !data)
        return send_error(sock, EINVAL, "malformed WRITE_FILE request");

    struct ferr e = {0, ""};
    char *shown = strdup(path);
    char *leaf = NULL;
    int fd = -1, dfd = open_parent(path, 1, &leaf, &e);
    if (dfd >= 0) {
        fd = open_leaf(dfd, leaf, shown ? shown : leaf, O_WRONLY | O_CREAT, mode, &e);
        close(dfd);
    }
    size_t off = 0;
    if (fd >= 0) {
        if (ftruncate(fd, 0) < 0 || fchmod(fd, mode) < 0) {
            fail(&e, errno, "cannot prepare %s: %s", shown ? shown : leaf, strerror(errno));
        } else {
            while (off < len) {
                ssize_t w = write(fd, data + off, len - off);
                if (w < 0 && errno == EINTR)
                    continue;
                if (w <= 0) {
                    fail(&e, w < 0 ? errno : EIO, "cannot write %s: %s", shown ? shown : leaf,
                         strerror(w < 0 ? errno : EIO));
                    break;
                }
                off += (size_t)w;
            }
        }
        if (close(fd) < 0 && !e.code)
            fail(&e, errno, "cannot write %s: %s", shown ? shown : leaf, strerror(errno));
    }
    free(shown);
    if (e.code || fd < 0)
        return send_error(sock, e.code, "%s", e.msg);
    uint8_t body8[8];
    put_u64(body8, off);
    struct iovec body[1] = {{body8, sizeof body8}};
    return send_response(sock, 0, body, 1);
}

static int do_read_file(int sock, struct reader *r)
{
    char *path = rd_str(r);
    uint32_t max_bytes = rd_u32(r);
    if (r->bad || r->n != 0 || !path)
        return send_error(sock, EINVAL, "malformed READ_FILE request");
    if (max_bytes > MAX_OUTPUT)
        max_bytes = MAX_OUTPUT;

    struct ferr e = {0, ""};
    char *shown = strdup(path);
    char *leaf = NULL;
    int fd = -1, dfd = open_parent(path, 0, &leaf, &e);
    if (dfd >= 0) {
        fd = open_leaf(dfd, leaf, shown ? shown : leaf, O_RDONLY, 0, &e);
        close(dfd);
    }
    char *data = NULL;
    size_t len = 0, cap = 0;
    int truncated = 0;
    if (fd >= 0) {
        for (;;) {
            if (len == max_bytes) {
                char probe;
                ssize_t p = read(fd, &probe, 1);
                truncated = p > 0;
                break;
            }
            if (len == cap) {
                size_t nc = cap ? cap * 2 : 65536;
                if (nc > max_bytes)
                    nc = max_bytes;
                char *d = realloc(data, nc);
                if (!d) {
                    fail(&e, ENOMEM, "cannot read %s: %s", shown ? shown : leaf, strerror(ENOMEM));
                    break;
                }
                data = d;
                cap = nc;
            }
            ssize_t n = read(fd, data + len, cap - len);
            if (n < 0 && errno == EINTR)
                continue;
            if (n < 0) {
                fail(&e, errno, "cannot read %s: %s", shown ? shown : leaf, strerror(errno));
                break;
            }
            if (n == 0)
                break;
            len += (size_t)n;
        }
        close(fd);
    }
    free(shown);
    int rc;
    if (e.code || fd < 0) {
        rc = send_error(sock, e.code, "%s", e.msg);
    } else {
        uint8_t head[5];
        head[0] = (uint8_t)truncated;
        put_u32(head + 1, (uint32_t)len);
        struct iovec body[2] = {{head, sizeof head}, {data, len}};
        rc = send_response(sock, 0, body, 2);
    }
    free(data);
    return rc;
}

/* ------------------------------------------------------------- connection */

/* One attempt to connect; -1 if the host is not listening (or its backlog is full). */
static int try_connect(const char *path)
{
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
    /* Non-blocking so a full backlog is EAGAIN (retry later), not a hang. */
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0)
        return fd;
    if (fd >= 0)
        close(fd);
    return -1;
}

static int connect_host(const char *path)
{
    int delay = RETRY_MIN_MS;
    for (;;) {
        int fd = try_connect(path);
        if (fd >= 0)
            return fd;
        wait_fd(-1, 0, delay); /* sleeps, still reaping and honouring SIGTERM */
        delay = delay * 3 / 2 > RETRY_MAX_MS ? RETRY_MAX_MS : delay * 3 / 2;
    }
}

static int send_hello(int sock)
{
    uint8_t hello[4 + 1 + 4 + 4];
    put_u32(hello, 9);
    hello[4] = OP_HELLO;
    put_u32(hello + 5, PROTO_VERSION);
    put_u32(hello + 9, (uint32_t)getpid());
    struct iovec iov[1] = {{hello, sizeof hello}};
    return write_iov(sock, iov, 1);
}

/* Reads and answers one request; -1 when the connection is no longer usable. */
static int serve_one(int sock)
{
    uint8_t hdr[4];
    if (read_full(sock, hdr, sizeof hdr) < 0)
        return -1;
    uint32_t len = get_u32(hdr);
    if (len == 0 || len > MAX_FRAME) {
        send_error(sock, EMSGSIZE, "request frame of %u bytes refused (limit %u)", len, MAX_FRAME);
        return -1;
    }
    uint8_t *buf = malloc(len);
    if (!buf) {
        send_error(sock, ENOMEM, "no memory for a %u-byte request", len);
        return -1;
    }
    if (read_full(sock, buf, len) < 0) {
        free(buf);
        return -1;
    }
    struct reader r = {buf + 1, len - 1, 0};
    int rc;
    switch (buf[0]) {
    case OP_PING:
        rc = r.n ? send_error(sock, EINVAL, "malformed PING request")
                 : send_response(sock, 0, NULL, 0);
        break;
    case OP_EXEC:
    case OP_EXEC_STREAM:
        rc = do_exec(sock, &r, buf[0] == OP_EXEC_STREAM);
        break;
    case OP_WRITE_FILE:
        rc = do_write_file(sock, &r);
        break;
    case OP_READ_FILE:
        rc = do_read_file(sock, &r);
        break;
    case OP_SIGNAL_ALL: {
        uint32_t signo = rd_u32(&r);
        if (r.bad || r.n != 0 || (signo != SIGSTOP && signo != SIGCONT && signo != SIGKILL))
            rc = send_error(sock, EINVAL, "SIGNAL_ALL takes SIGSTOP, SIGCONT or SIGKILL");
        else if (getppid() != 1) /* outside a pid namespace -1 is every process of the uid */
            rc = send_error(sock, EPERM, "SIGNAL_ALL only inside a sandbox (agent as PID 1)");
        else if (kill(-1, (int)signo) < 0 && errno != ESRCH)
            rc = send_error(sock, errno, "kill: %s", strerror(errno));
        else
            rc = send_response(sock, 0, NULL, 0);
        break;
    }
    default:
        rc = send_error(sock, EINVAL, "unknown op 0x%02x", buf[0]);
    }
    free(buf);
    return rc;
}

/* ------------------------------------------------------------ connections */

/* PID 1 keeps the connections; each request is served by a handler process forked
 * for it, so requests on different connections run at once (a server in the
 * background and its client). A handler inherits the agent's non-dumpable state and
 * holds only its own connection. */
static void drop_conn(int i)
{
    close_fd(&g_conns[i].fd);
    g_conns[i].handler = 0;
}

static void compact_conns(void)
{
    int j = 0;
    for (int i = 0; i < g_nconns; i++)
        if (g_conns[i].fd >= 0)
            g_conns[j++] = g_conns[i];
    g_nconns = j;
}

static void handler_ended(pid_t pid, int status)
{
    for (int i = 0; i < g_nconns; i++) {
        if (g_conns[i].fd < 0 || g_conns[i].handler != pid)
            continue;
        g_conns[i].handler = 0;
        /* Exit 0: the request was answered and the connection takes the next one.
         * Anything else (a broken connection, a handler killed from inside the
         * sandbox) leaves the stream in an unknown place: close it. */
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
            drop_conn(i);
        return;
    }
}

static void dispatch(int i)
{
    pid_t pid = fork();
    if (pid < 0) {
        drop_conn(i); /* the host sees the connection close and fails the request */
        return;
    }
    if (pid == 0) {
        g_handler = 1;
        int sock = g_conns[i].fd;
        for (int k = 0; k < g_nconns; k++)
            if (k != i && g_conns[k].fd >= 0)
                close(g_conns[k].fd);
        _exit(serve_one(sock) < 0 ? 1 : 0);
    }
    g_conns[i].handler = pid;
}

static void supervise(const char *path)
{
    for (;;) {
        compact_conns();
        int idle = 0;
        for (int i = 0; i < g_nconns; i++)
            idle += g_conns[i].handler == 0;
        /* One idle connection always waits for the host's next request. While
         * others are open, a failed attempt must not hold up their handlers' ends:
         * try again after the next poll. */
        int tmo = -1;
        if (idle == 0 && g_nconns < MAX_CONNS) {
            int sock = g_nconns == 0 ? connect_host(path) : try_connect(path);
            if (sock >= 0) {
                if (send_hello(sock) < 0)
                    close(sock);
                else
                    g_conns[g_nconns++] = (struct conn){sock, 0};
                continue;
            }
            tmo = RETRY_MAX_MS;
        }
        struct pollfd p[MAX_CONNS + 1];
        int at[MAX_CONNS + 1];
        int np = 0;
        p[np++] = (struct pollfd){g_sigfd, POLLIN, 0};
        for (int i = 0; i < g_nconns; i++) {
            if (g_conns[i].handler == 0) {
                at[np] = i;
                p[np++] = (struct pollfd){g_conns[i].fd, POLLIN | POLLRDHUP, 0};
            }
        }
        if (poll(p, (nfds_t)np, tmo) < 0)
            continue;
        if (p[0].revents)
            handle_signals();
        for (int k = 1; k < np; k++) {
            int i = at[k];
            if (!p[k].revents || g_conns[i].fd < 0 || g_conns[i].handler != 0)
                continue;
            if (p[k].revents & POLLIN)
                dispatch(i);
            else
                drop_conn(i); /* the host closed it (a restarted worker) */
        }
    }
}

int main(int argc, char **argv)
{
    const char *path = argc > 1 ? argv[1] : DEFAULT_SOCKET;
    if (strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
        fprintf(stderr, "dsec-agent: socket path too long: %s\n", path);
        return 2;
    }
    /* Commands get the pipes as 0-2 via dup2, which needs our pipe fds to be >= 3. */
    int fd;
    while ((fd = open("/dev/null", O_RDWR)) >= 0 && fd <= 2) {
    }
    if (fd > 2)
        close(fd);
    /* Fixed thresholds: big request/output buffers are mmap'd and go back to the
     * kernel when freed, so an idle agent stays at its startup footprint. */
    mallopt(M_MMAP_THRESHOLD, 128 * 1024);
    mallopt(M_TRIM_THRESHOLD, 256 * 1024);
    /* Not dumpable: a command runs as our uid without capabilities, so this is what
     * keeps it from ptrace, /proc/1/mem and pidfd_getfd on us (the agent's socket). */
    prctl(PR_SET_DUMPABLE, 0);
    setup_signals();
    init_env();
    if (getpid() != 1)
        prctl(PR_SET_CHILD_SUBREAPER, 1); /* reap orphans when run outside a container */

    supervise(path);
}
