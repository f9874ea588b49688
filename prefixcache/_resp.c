/* The Redis tier's RESP exchanges (tiers/resp.py), compiled into prefixcache._core (issue 17).
 *
 * - resp_set(sock, keys, values, ttls_ms, timeout_s): `PSETEX key ttl value` for each entry in one
 *   pipeline: the command bytes built here, every value sent from the caller's buffers (a value is
 *   one buffer or a tuple of its parts, e.g. a frame's header and the payload in a host slot; a
 *   small part is joined into the command bytes), then every reply read.
 * - resp_getex(sock, keys, ttl_ms, timeout_s, max_value, deadline_s, reset): each key read and its
 *   TTL refreshed in one pipeline: `GET key` + `PEXPIRE key ttl GT` (the TTL only ever lengthened,
 *   so a key another instance gave a longer one, a pin or a retention hint, keeps it; Redis >= 7),
 *   `GETEX key PX ttl` with `reset` (sets it, for a Redis without GT), plain `GET` when ttl_ms is
 *   None. Each bulk reply is read straight into a bytearray of its exact size, once its length line
 *   says it is at most max_value (a longer one is a fault before anything is allocated: Redis, or
 *   whatever answers in its place, must never size our allocations).
 * - deadline_s (resp_set, resp_getex, RespWriter.run's each batch): the whole exchange ends by
 *   then, beyond timeout_s for each wait, so a peer dripping bytes cannot hold it.
 *
 * Why compiled: the tier's writer is one thread beside callers that encode frames and serve
 * RPCs. In Python it holds the GIL between the syscalls of a pipeline (building commands, parsing
 * replies) and has to win it back after each one; here a whole exchange is one call.
 *
 * The socket is the caller's, a redis-py connection's. A plain TCP or Unix socket comes as its
 * descriptor, and the exchange runs with the GIL released but for the allocation of each value
 * read; it may be blocking or not (a Python socket with a timeout is non-blocking underneath):
 * every wait on it is a poll() of at most timeout_s, as Python's socket methods wait. A TLS socket
 * comes as the object, whose sendall/recv_into do the I/O (with the GIL, under its own timeout):
 * the commands and the replies are still built and parsed here, and values still read in place.
 * Every reply of a pipeline is read before returning unless the socket fails, so a connection
 * whose call returned is in step. Faults raise TimeoutError, ConnectionError (closed by the
 * server), OSError (errno) or ValueError (a reply of a kind the command cannot return, or bytes
 * after the last reply; args (text, position of the reply at fault or -1)); a deadline raises
 * TimeoutError("deadline: ..."); the caller must then drop the connection. Error replies are data:
 * resp_set returns the first one's text, resp_getex each one's with the key's position (a
 * refresh's with the key's position + the number of keys).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "_resp.h"

#define JOIN_MAX (1 << 14)      /* values up to this size are copied into the command bytes */
#define IOV_PER_CALL 512        /* buffers per sendmsg (Linux allows 1024) */
#define READ_BUFFER (1 << 16)   /* reply lines; a bulk value beyond what is buffered is read in place */
#define ERROR_TEXT 512          /* kept of an error reply's text */
#define HEADER_ROOM 128         /* a SET's or GETEX's fixed bytes and its numbers, at most */

/* ---- socket I/O, without the GIL ---------------------------------------------------------- */

static struct timespec deadline_after(double seconds); /* (with the writer's clock helpers) */

enum { IO_OK = 0, IO_ERRNO, IO_TIMEOUT, IO_CLOSED, IO_PROTOCOL, IO_PYTHON /* exception set */, IO_DEADLINE };

typedef struct {
    int fd;
    PyObject *sock; /* a TLS socket, driven through its own methods with the GIL held; NULL for fd */
    PyThreadState *released; /* set while the GIL is released (fd only) */
    int timeout_ms; /* per wait; -1 waits for ever */
    int has_deadline; /* the whole exchange ends by `deadline` (a peer dripping bytes within
                       * timeout_ms of each other cannot hold it longer) */
    struct timespec deadline;
    Py_ssize_t at;  /* for IO_PROTOCOL: the reply's position in the pipeline, -1 if none */
    int blocking;   /* the descriptor blocks, under SO_SNDTIMEO/SO_RCVTIMEO: EAGAIN is a timeout */
    int status;     /* IO_* of the first fault */
    int error;      /* errno, for IO_ERRNO */
    const char *what; /* for IO_PROTOCOL */
    char seen[32];    /* for IO_PROTOCOL: the start of the reply line at fault, if any */
    size_t seen_length;
} Link;

static int
link_fail(Link *link, int status, const char *what)
{
    link->status = status;
    link->error = status == IO_ERRNO ? errno : 0;
    link->what = what;
    return -1;
}

/* The GIL is released for a plain socket's exchange, kept for a TLS socket's (its methods need it). */
static void
link_release(Link *link)
{
    if (link->sock == NULL) {
        link->released = PyEval_SaveThread();
    }
}

static void
link_acquire(Link *link)
{
    if (link->released != NULL) {
        PyEval_RestoreThread(link->released);
        link->released = NULL;
    }
}

/* One call of a TLS socket's method on buf[0..length): its int result, or -1 (the exception set). */
static Py_ssize_t
link_call(Link *link, const char *method, char *buf, size_t length, int flags)
{
    PyObject *view = PyMemoryView_FromMemory(buf, (Py_ssize_t)length, flags);
    PyObject *result = view ? PyObject_CallMethod(link->sock, method, "O", view) : NULL;
    Py_XDECREF(view);
    Py_ssize_t count = result == NULL ? -1 : result == Py_None ? 0 : PyLong_AsSsize_t(result);
    Py_XDECREF(result);
    if (count < 0) {
        link->status = IO_PYTHON;
        return -1;
    }
    return count;
}

/* A protocol fault at the reply line `line`. */
static int
link_bad_line(Link *link, const char *what, const char *line, size_t length)
{
    link->seen_length = length < sizeof link->seen ? length : sizeof link->seen;
    memcpy(link->seen, line, link->seen_length);
    return link_fail(link, IO_PROTOCOL, what);
}

/* Milliseconds left until the link's deadline (rounded up), <= 0 once it has passed. */
static long long
link_ms_left(const Link *link)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long long ns = (long long)(link->deadline.tv_sec - now.tv_sec) * 1000000000LL + (link->deadline.tv_nsec - now.tv_nsec);
    return ns <= 0 ? 0 : (ns + 999999) / 1000000;
}

/* After each transfer: a fault once the exchange is past its deadline, however fast bytes came. */
static int
link_on_time(Link *link)
{
    return link->has_deadline && link_ms_left(link) <= 0 ? link_fail(link, IO_DEADLINE, NULL) : 0;
}

/* Waits until the socket is ready for `events`; -1 (the fault recorded) on a timeout or an error. */
static int
link_wait(Link *link, short events)
{
    struct pollfd ready = {.fd = link->fd, .events = events};
    for (;;) {
        int wait_ms = link->timeout_ms, deadline_first = 0;
        if (link->has_deadline) {
            long long left = link_ms_left(link);
            if (left <= 0) {
                return link_fail(link, IO_DEADLINE, NULL);
            }
            if (wait_ms < 0 || left < wait_ms) {
                wait_ms = (int)left;
                deadline_first = 1;
            }
        }
        int count = poll(&ready, 1, wait_ms);
        if (count > 0) {
            return 0;
        }
        if (count == 0) {
            return link_fail(link, deadline_first ? IO_DEADLINE : IO_TIMEOUT, NULL);
        }
        if (errno != EINTR) {
            return link_fail(link, IO_ERRNO, NULL);
        }
    }
}

/* Sends every byte of iov[0..count), in order, in as few sendmsg calls as the kernel takes.
 * Consumes `iov` (entries are advanced past what was sent). */
static int
link_send(Link *link, struct iovec *iov, size_t count)
{
    if (link->sock != NULL) {
        for (size_t i = 0; i < count; i++) {
            if (iov[i].iov_len && link_call(link, "sendall", iov[i].iov_base, iov[i].iov_len, PyBUF_READ) < 0) {
                return -1;
            }
            if (link_on_time(link) < 0) {
                return -1;
            }
        }
        return 0;
    }
    size_t first = 0;
    while (first < count) {
        struct msghdr message = {.msg_iov = iov + first,
                                 .msg_iovlen = count - first < IOV_PER_CALL ? count - first : IOV_PER_CALL};
        /* never blocks in the kernel but under SO_SNDTIMEO (link_block): waits are poll()s, bounded */
        ssize_t sent = sendmsg(link->fd, &message, MSG_NOSIGNAL | (link->blocking ? 0 : MSG_DONTWAIT));
        if (sent < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (link->blocking) {
                    return link_fail(link, IO_TIMEOUT, NULL);
                }
                if (link_wait(link, POLLOUT) < 0) {
                    return -1;
                }
                continue;
            }
            if (errno == EPIPE || errno == ECONNRESET) {
                return link_fail(link, IO_CLOSED, NULL);
            }
            return link_fail(link, IO_ERRNO, NULL);
        }
        if (link_on_time(link) < 0) {
            return -1;
        }
        size_t left = (size_t)sent;
        while (first < count && left >= iov[first].iov_len) {
            left -= iov[first].iov_len;
            first++;
        }
        if (left) {
            iov[first].iov_base = (char *)iov[first].iov_base + left;
            iov[first].iov_len -= left;
        }
    }
    return 0;
}

/* Receives at least one byte into buf[0..room); its count, or -1 (the fault recorded). */
static ssize_t
link_recv(Link *link, char *buf, size_t room)
{
    if (link->sock != NULL) {
        Py_ssize_t got = link_call(link, "recv_into", buf, room, PyBUF_WRITE);
        return got == 0 ? link_fail(link, IO_CLOSED, NULL) : got < 0 || link_on_time(link) < 0 ? -1 : got;
    }
    for (;;) {
        ssize_t got = recv(link->fd, buf, room, link->blocking ? 0 : MSG_DONTWAIT);
        if (got > 0) {
            return link_on_time(link) < 0 ? -1 : got;
        }
        if (got == 0) {
            return link_fail(link, IO_CLOSED, NULL);
        }
        if (errno == EINTR) {
            continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            if (link->blocking) {
                return link_fail(link, IO_TIMEOUT, NULL);
            }
            if (link_wait(link, POLLIN) < 0) {
                return -1;
            }
            continue;
        }
        if (errno == ECONNRESET) {
            return link_fail(link, IO_CLOSED, NULL);
        }
        return link_fail(link, IO_ERRNO, NULL);
    }
}

typedef struct {
    Link *link;
    char buf[READ_BUFFER];
    size_t start, end;
} Reader;

/* The next reply line (without its CRLF), valid until the next read. */
static int
reader_line(Reader *reader, const char **line, size_t *length)
{
    size_t scanned = reader->start;
    for (;;) {
        for (; scanned + 1 < reader->end; scanned++) {
            if (reader->buf[scanned] == '\r' && reader->buf[scanned + 1] == '\n') {
                *line = reader->buf + reader->start;
                *length = scanned - reader->start;
                reader->start = scanned + 2;
                return 0;
            }
        }
        if (reader->start == reader->end) {
            reader->start = reader->end = scanned = 0;
        } else if (reader->end == READ_BUFFER) {
            if (reader->start == 0) {
                return link_fail(reader->link, IO_PROTOCOL, "a reply line longer than the read buffer");
            }
            size_t kept = reader->end - reader->start;
            memmove(reader->buf, reader->buf + reader->start, kept);
            scanned -= reader->start;
            reader->start = 0;
            reader->end = kept;
        }
        ssize_t got = link_recv(reader->link, reader->buf + reader->end, READ_BUFFER - reader->end);
        if (got < 0) {
            return -1;
        }
        reader->end += (size_t)got;
    }
}

/* The next `size` bytes and their CRLF into out[0..size). */
static int
reader_bulk(Reader *reader, char *out, size_t size)
{
    size_t have = reader->end - reader->start < size ? reader->end - reader->start : size;
    memcpy(out, reader->buf + reader->start, have);
    reader->start += have;
    while (have < size) {
        ssize_t got = link_recv(reader->link, out + have, size - have);
        if (got < 0) {
            return -1;
        }
        have += (size_t)got;
    }
    const char *line;
    size_t length;
    if (reader_line(reader, &line, &length) < 0) {
        return -1;
    }
    if (length) {
        return link_fail(reader->link, IO_PROTOCOL, "a bulk reply longer than its announced length");
    }
    return 0;
}

/* Sets the Python exception of a failed exchange (with the GIL held). */
static void
raise_fault(const Link *link)
{
    switch (link->status) {
    case IO_TIMEOUT:
        PyErr_SetString(PyExc_TimeoutError, "timed out");
        break;
    case IO_DEADLINE: /* the message is how tiers/resp.py tells it from a quiet socket */
        PyErr_SetString(PyExc_TimeoutError, "deadline: the exchange ran past its deadline");
        break;
    case IO_CLOSED:
        PyErr_SetString(PyExc_ConnectionError, "Connection closed by server.");
        break;
    case IO_PROTOCOL: {
        PyObject *seen = PyBytes_FromStringAndSize(link->seen, (Py_ssize_t)link->seen_length);
        PyObject *text = seen ? PyUnicode_FromFormat("unexpected reply: %s (%R)", link->what, seen) : NULL;
        /* args (text, position): tiers/resp.py names the key of an oversized value */
        PyObject *exc = text ? Py_BuildValue("(On)", text, link->at) : NULL;
        if (exc != NULL) {
            PyErr_SetObject(PyExc_ValueError, exc);
        }
        Py_XDECREF(exc);
        Py_XDECREF(text);
        Py_XDECREF(seen);
        break;
    }
    case IO_PYTHON:
        break; /* the socket's method raised: its exception stands */
    default:
        errno = link->error;
        PyErr_SetFromErrno(PyExc_OSError);
    }
}

/* ---- arguments --------------------------------------------------------------------------- */

/* deadline_arg: None, or the seconds the whole exchange may take from now (every wait, and the
 * check after every transfer, stop at it). */
static int
link_deadline(PyObject *deadline_arg, Link *link)
{
    if (deadline_arg == NULL || deadline_arg == Py_None) {
        return 0;
    }
    double seconds = PyFloat_AsDouble(deadline_arg);
    if (seconds == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    if (!(seconds > 0)) {
        PyErr_SetString(PyExc_ValueError, "deadline_s: expected None or seconds > 0");
        return -1;
    }
    link->has_deadline = 1;
    link->deadline = deadline_after(seconds);
    return 0;
}

static int
link_args(PyObject *sock_arg, PyObject *timeout_arg, Link *link)
{
    *link = (Link){.fd = -1, .timeout_ms = -1, .at = -1};
    if (!PyLong_Check(sock_arg)) { /* a TLS socket: its methods do the I/O, under its own timeout */
        if (timeout_arg != Py_None) {
            PyErr_SetString(PyExc_ValueError, "timeout_s: a socket object waits by its own timeout; pass None");
            return -1;
        }
        link->sock = sock_arg;
        return 0;
    }
    long fd = PyLong_AsLong(sock_arg);
    if (fd == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (fd < 0 || fd > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "sock: expected an open socket's descriptor, or a TLS socket");
        return -1;
    }
    link->fd = (int)fd;
    if (timeout_arg != Py_None) {
        double seconds = PyFloat_AsDouble(timeout_arg);
        if (seconds == -1.0 && PyErr_Occurred()) {
            return -1;
        }
        if (!(seconds >= 0)) {
            PyErr_SetString(PyExc_ValueError, "timeout_s: expected None or seconds >= 0");
            return -1;
        }
        link->timeout_ms = seconds * 1000 >= INT_MAX ? INT_MAX : (int)(seconds * 1000 + 0.999);
    }
    return 0;
}

/* Appends `$<len>\r\n<bytes>\r\n`. */
static char *
put_bulk(char *at, const char *bytes, size_t length)
{
    at += sprintf(at, "$%zu\r\n", length);
    memcpy(at, bytes, length);
    at += length;
    *at++ = '\r';
    *at++ = '\n';
    return at;
}

static int
key_of(PyObject *keys, Py_ssize_t i, const char **bytes, Py_ssize_t *length)
{
    PyObject *key = PySequence_Fast_GET_ITEM(keys, i);
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "keys[%zd]: expected bytes, got %.100s", i, Py_TYPE(key)->tp_name);
        return -1;
    }
    *bytes = PyBytes_AS_STRING(key);
    *length = PyBytes_GET_SIZE(key);
    return 0;
}

/* ---- SET pipelines (resp_set's and the writer's) ----------------------------------------- */

typedef struct {
    const char *key;
    size_t key_length;
    const Py_buffer *parts; /* the value: these buffers, in order */
    Py_ssize_t part_count;
    long long ttl_ms;
} SetCommand;

/* The room a pipeline of these commands needs: its command bytes (small parts joined in) and iovecs. */
static void
set_room(const SetCommand *sets, size_t count, size_t *command_bytes, size_t *pieces)
{
    *command_bytes = 1;
    *pieces = 1;
    for (size_t i = 0; i < count; i++) {
        *command_bytes += HEADER_ROOM + sets[i].key_length;
        for (Py_ssize_t j = 0; j < sets[i].part_count; j++) {
            size_t part_length = (size_t)sets[i].parts[j].len;
            *command_bytes += part_length <= JOIN_MAX ? part_length : 0;
            *pieces += part_length <= JOIN_MAX ? 0 : 2;
        }
    }
}

/* Writes the pipeline into `command`; `iov` gets its pieces and, between them, every large part
 * straight from its buffer. Returns the number of iovecs. Needs no GIL.
 *
 * Each write is `PSETEX key ttl value`, which is `SET key value PX ttl` with the value last (Redis
 * lists PSETEX as deprecated in favour of SET PX, and keeps it): Redis adopts a large argument's
 * read buffer as the stored value only when that argument ends the buffer, so a command read
 * whole with `PX ttl` behind its value has the value copied out. Redis's CPU per 128 MiB of
 * single-SET writes measured 8% lower this way at 64 KiB and 2 MiB (docs/benchmarks.md). */
static size_t
set_build(const SetCommand *sets, size_t count, char *command, struct iovec *iov)
{
    char *at = command, *piece = command;
    size_t used = 0;
    for (size_t i = 0; i < count; i++) {
        const SetCommand *set = &sets[i];
        size_t value_length = 0;
        for (Py_ssize_t j = 0; j < set->part_count; j++) {
            value_length += (size_t)set->parts[j].len;
        }
        char number[24];
        int digits = sprintf(number, "%lld", set->ttl_ms);
        at += sprintf(at, "*4\r\n$6\r\nPSETEX\r\n");
        at = put_bulk(at, set->key, set->key_length);
        at = put_bulk(at, number, (size_t)digits);
        at += sprintf(at, "$%zu\r\n", value_length);
        for (Py_ssize_t j = 0; j < set->part_count; j++) {
            size_t part_length = (size_t)set->parts[j].len;
            if (part_length <= JOIN_MAX) {
                memcpy(at, set->parts[j].buf, part_length);
                at += part_length;
            } else { /* the command so far, then the part from the caller's buffer */
                iov[used++] = (struct iovec){.iov_base = piece, .iov_len = (size_t)(at - piece)};
                iov[used++] = (struct iovec){.iov_base = set->parts[j].buf, .iov_len = part_length};
                piece = at;
            }
        }
        at += sprintf(at, "\r\n");
    }
    iov[used++] = (struct iovec){.iov_base = piece, .iov_len = (size_t)(at - piece)};
    return used;
}

/* Builds, sends and reads SETs, `depth` commands in flight at a time (one pipeline when it is
 * `count`), without the GIL for a plain socket's link (the caller released it). Returns 0 (every
 * reply +OK), 1 (an error reply: the first one's text in error[0..*error_length), ERROR_TEXT bytes
 * at most), -1 (a link fault, recorded in `link`; the connection is out of step) or -2 (out of
 * memory, nothing sent). `*answered` (when not NULL): the replies read, whatever the outcome. */
static int
set_exchange(Link *link, const SetCommand *sets, size_t count, size_t depth, char *error, size_t *error_length,
             size_t *answered)
{
    size_t command_bytes, pieces;
    set_room(sets, count, &command_bytes, &pieces); /* room for all: any group fits */
    char *command = PyMem_RawMalloc(command_bytes);
    struct iovec *iov = PyMem_RawMalloc(pieces * sizeof(struct iovec));
    Reader *reader = PyMem_RawMalloc(sizeof(Reader));
    int failed = 0, errors = 0;
    size_t replies = 0;
    if (command == NULL || iov == NULL || reader == NULL) {
        failed = -2;
    } else {
        reader->link = link; /* field by field: the 64 KiB buffer needs no clearing */
        reader->start = reader->end = 0;
    }
    for (size_t sent = 0; sent < count && !failed;) {
        size_t group = count - sent < depth ? count - sent : depth;
        if (link_send(link, iov, set_build(sets + sent, group, command, iov)) < 0) {
            failed = -1;
            break;
        }
        for (size_t i = 0; i < group && !failed; i++) {
            const char *line;
            size_t length;
            if (reader_line(reader, &line, &length) < 0) {
                failed = -1;
                break;
            }
            replies++;
            if (length == 3 && memcmp(line, "+OK", 3) == 0) {
                continue;
            } else if (length && line[0] == '-') {
                if (!errors++) {
                    *error_length = length - 1 < ERROR_TEXT ? length - 1 : ERROR_TEXT;
                    memcpy(error, line + 1, *error_length);
                }
            } else {
                failed = link_bad_line(link, "a SET answered neither +OK nor an error", line, length);
            }
        }
        sent += group;
    }
    if (!failed && reader->start != reader->end) {
        failed = link_fail(link, IO_PROTOCOL, "more reply bytes than commands");
    }
    PyMem_RawFree(reader);
    PyMem_RawFree(iov);
    PyMem_RawFree(command);
    if (answered != NULL) {
        *answered = replies;
    }
    return failed ? failed : errors ? 1 : 0;
}

PyObject *
core_resp_set(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "resp_set(sock, keys, values, ttls_ms, timeout_s, deadline_s=None) takes 5 or 6 arguments");
        return NULL;
    }
    Link link;
    if (link_args(args[0], args[4], &link) < 0 || link_deadline(nargs > 5 ? args[5] : NULL, &link) < 0) {
        return NULL;
    }
    PyObject *keys = PySequence_Fast(args[1], "keys: expected a sequence of bytes");
    PyObject *values = keys ? PySequence_Fast(args[2], "values: expected a sequence of buffers") : NULL;
    PyObject *ttls = values ? PySequence_Fast(args[3], "ttls_ms: expected a sequence of ints") : NULL;
    Py_buffer *views = NULL; /* every part of every value, in order */
    SetCommand *sets = NULL;
    Py_ssize_t count = 0, parts = 0, viewed = 0;
    PyObject *result = NULL;
    if (ttls == NULL) {
        goto done;
    }
    count = PySequence_Fast_GET_SIZE(keys);
    if (PySequence_Fast_GET_SIZE(values) != count || PySequence_Fast_GET_SIZE(ttls) != count) {
        PyErr_Format(PyExc_ValueError, "values, ttls_ms: expected %zd of each (one per key), got %zd and %zd", count,
                     PySequence_Fast_GET_SIZE(values), PySequence_Fast_GET_SIZE(ttls));
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) { /* a value is one buffer or a tuple of its parts */
        PyObject *value = PySequence_Fast_GET_ITEM(values, i);
        parts += PyTuple_Check(value) ? PyTuple_GET_SIZE(value) : 1;
    }
    views = PyMem_Calloc((size_t)parts + 1, sizeof(Py_buffer));
    sets = PyMem_Calloc((size_t)count + 1, sizeof(SetCommand));
    if (views == NULL || sets == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t key_length = 0;
        if (key_of(keys, i, &sets[i].key, &key_length) < 0) {
            goto done;
        }
        sets[i].key_length = (size_t)key_length;
        sets[i].ttl_ms = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(ttls, i));
        if (sets[i].ttl_ms == -1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "ttls_ms[%zd]: expected an int", i);
            goto done;
        }
        PyObject *value = PySequence_Fast_GET_ITEM(values, i);
        Py_ssize_t own = PyTuple_Check(value) ? PyTuple_GET_SIZE(value) : 1;
        sets[i].parts = &views[viewed];
        sets[i].part_count = own;
        for (Py_ssize_t j = 0; j < own; j++, viewed++) {
            PyObject *part = PyTuple_Check(value) ? PyTuple_GET_ITEM(value, j) : value;
            if (PyObject_GetBuffer(part, &views[viewed], PyBUF_SIMPLE) < 0) {
                if (PyTuple_Check(value)) {
                    PyErr_Format(PyExc_TypeError, "values[%zd][%zd]: expected a contiguous buffer", i, j);
                } else {
                    PyErr_Format(PyExc_TypeError, "values[%zd]: expected a contiguous buffer or a tuple of them", i);
                }
                goto done;
            }
        }
    }
    char error[ERROR_TEXT];
    size_t error_length = 0;
    link_release(&link);
    int outcome = set_exchange(&link, sets, (size_t)count, (size_t)count, error, &error_length, NULL);
    link_acquire(&link);
    if (outcome == -2) {
        PyErr_NoMemory();
    } else if (outcome == -1) {
        raise_fault(&link);
    } else if (outcome == 0) {
        result = Py_NewRef(Py_None);
    } else {
        result = PyBytes_FromStringAndSize(error, (Py_ssize_t)error_length);
    }
done:
    for (Py_ssize_t i = 0; i < viewed; i++) {
        PyBuffer_Release(&views[i]);
    }
    PyMem_Free(views);
    PyMem_Free(sets);
    Py_XDECREF(ttls);
    Py_XDECREF(values);
    Py_XDECREF(keys);
    return result;
}

/* ---- GETEX ------------------------------------------------------------------------------- */

/* Append (position, the error reply's text, cut to ERROR_TEXT) to `errors`; 0, or -3 with the
 * exception set. Called without the GIL. */
static int
append_error(Link *link, PyObject *errors, Py_ssize_t position, const char *line, size_t length)
{
    int failed = 0;
    link_acquire(link);
    size_t kept = length - 1 < ERROR_TEXT ? length - 1 : ERROR_TEXT;
    PyObject *error = Py_BuildValue("(ny#)", position, line + 1, (Py_ssize_t)kept);
    if (error == NULL || PyList_Append(errors, error) < 0) {
        failed = -3;
    }
    Py_XDECREF(error);
    link_release(link);
    return failed;
}

PyObject *
core_resp_getex(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 4 || nargs > 7) {
        PyErr_SetString(PyExc_TypeError,
                        "resp_getex(sock, keys, ttl_ms, timeout_s, max_value=None, deadline_s=None, reset=False) "
                        "takes 4 to 7 arguments");
        return NULL;
    }
    int reset = 0;
    if (nargs > 6 && (reset = PyObject_IsTrue(args[6])) < 0) {
        return NULL;
    }
    Link link;
    if (link_args(args[0], args[3], &link) < 0 || link_deadline(nargs > 5 ? args[5] : NULL, &link) < 0) {
        return NULL;
    }
    /* The largest value the caller can use (its frame size): a longer bulk reply is a fault found
     * from its length line, before a byte of it is allocated or read. */
    long long max_value = LLONG_MAX;
    if (nargs > 4 && args[4] != Py_None) {
        max_value = PyLong_AsLongLong(args[4]);
        if (max_value == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (max_value < 0) {
            PyErr_SetString(PyExc_ValueError, "max_value: expected None or bytes >= 0");
            return NULL;
        }
    }
    long long ttl = 0;
    if (args[2] != Py_None) {
        ttl = PyLong_AsLongLong(args[2]);
        if (ttl == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    PyObject *keys = PySequence_Fast(args[1], "keys: expected a sequence of bytes");
    if (keys == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(keys);
    PyObject *values = PyList_New(count);
    PyObject *errors = values ? PyList_New(0) : NULL;
    char *command = NULL;
    PyObject *result = NULL;
    if (errors == NULL) {
        goto done;
    }
    size_t command_bytes = 1;
    for (Py_ssize_t i = 0; i < count; i++) {
        const char *key = NULL;
        Py_ssize_t key_length = 0;
        if (key_of(keys, i, &key, &key_length) < 0) {
            goto done;
        }
        command_bytes += 2 * (HEADER_ROOM + (size_t)key_length); /* GET and PEXPIRE both name it */
        PyList_SET_ITEM(values, i, Py_NewRef(Py_None));
    }
    command = PyMem_RawMalloc(command_bytes);
    if (command == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* The refresh: GETEX's `PX ttl` (reset), or PEXPIRE's `ttl GT` after a plain GET (extend). */
    int refresh = args[2] != Py_None;
    int extend = refresh && !reset;
    char tail[64];
    size_t tail_length = 0;
    if (refresh) {
        int digits = snprintf(NULL, 0, "%lld", ttl);
        tail_length = (size_t)(extend ? sprintf(tail, "$%d\r\n%lld\r\n$2\r\nGT\r\n", digits, ttl)
                                      : sprintf(tail, "$2\r\nPX\r\n$%d\r\n%lld\r\n", digits, ttl));
    }
    char *at = command;
    for (Py_ssize_t i = 0; i < count; i++) {
        const char *key = NULL;
        Py_ssize_t key_length = 0;
        (void)key_of(keys, i, &key, &key_length); /* checked above */
        at += sprintf(at, refresh && !extend ? "*4\r\n$5\r\nGETEX\r\n" : "*2\r\n$3\r\nGET\r\n");
        at = put_bulk(at, key, (size_t)key_length);
        if (extend) {
            at += sprintf(at, "*4\r\n$7\r\nPEXPIRE\r\n");
            at = put_bulk(at, key, (size_t)key_length);
        }
        memcpy(at, tail, tail_length);
        at += tail_length;
    }
    struct iovec iov = {.iov_base = command, .iov_len = (size_t)(at - command)};

    int failed = 0;
    link_release(&link);
    Reader *reader = PyMem_RawMalloc(sizeof(Reader));
    if (reader == NULL) {
        failed = -2;
    } else if (link_send(&link, &iov, 1) < 0) {
        failed = -1;
    } else {
        reader->link = &link; /* field by field: the 64 KiB buffer needs no clearing */
        reader->start = reader->end = 0;
        for (Py_ssize_t i = 0; i < count && !failed; i++) {
            const char *line;
            size_t length;
            if (reader_line(reader, &line, &length) < 0) {
                failed = -1;
                break;
            }
            if (length >= 2 && line[0] == '$') {
                char digits[24];
                size_t n = length - 1 < sizeof digits - 1 ? length - 1 : sizeof digits - 1;
                memcpy(digits, line + 1, n);
                digits[n] = 0;
                char *end;
                errno = 0;
                long long size = strtoll(digits, &end, 10);
                if (*end || errno || n != length - 1 || size < -1) {
                    failed = link_bad_line(&link, "a bad bulk length", line, length);
                } else if (size > max_value) {
                    link.at = i;
                    failed = link_bad_line(&link, "a bulk reply longer than the largest value expected", line, length);
                } else if (size >= 0) {
                    link_acquire(&link);
                    PyObject *value = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)size);
                    if (value == NULL) {
                        failed = -3;
                    } else {
                        Py_SETREF(PyList_GET_ITEM(values, i), value); /* (was None) */
                    }
                    link_release(&link);
                    if (!failed && reader_bulk(reader, PyByteArray_AS_STRING(value), (size_t)size) < 0) {
                        failed = -1;
                    }
                }
            } else if (length == 1 && line[0] == '_') {
                /* RESP3's null, for a connection that said HELLO 3 */
            } else if (length && line[0] == '-') {
                failed = append_error(&link, errors, i, line, length);
            } else {
                failed = link_bad_line(&link, "a GET answered neither a bulk string nor an error", line, length);
            }
            if (failed || !extend) {
                continue;
            }
            /* PEXPIRE's answer: 1 (lengthened), 0 (missing, or already longer), or an error */
            if (reader_line(reader, &line, &length) < 0) {
                failed = -1;
            } else if (length && line[0] == '-') {
                failed = append_error(&link, errors, count + i, line, length);
            } else if (!(length >= 2 && line[0] == ':')) {
                failed = link_bad_line(&link, "a PEXPIRE answered neither an integer nor an error", line, length);
            }
        }
        if (!failed && reader->start != reader->end) {
            failed = link_fail(&link, IO_PROTOCOL, "more reply bytes than commands");
        }
        PyMem_RawFree(reader);
    }
    link_acquire(&link);
    if (failed == -2) {
        PyErr_NoMemory();
    } else if (failed == -1) {
        raise_fault(&link);
    } else if (!failed) {
        result = PyTuple_Pack(2, values, errors);
    } /* -3: the exception is set */
done:
    PyMem_RawFree(command);
    Py_XDECREF(errors);
    Py_XDECREF(values);
    Py_DECREF(keys);
    return result;
}

/* A long exchange on a plain socket: blocking sends and receives wait in the kernel, under
 * SO_SNDTIMEO/SO_RCVTIMEO, instead of a poll() after every EAGAIN (fewer syscalls and wake-ups:
 * ~7% more SET throughput at 64 KiB here). Returns the descriptor's flags for link_unblock, or -1
 * (then the link stays as it was: non-blocking waits by poll()). */
static int
link_block(Link *link)
{
    int flags = fcntl(link->fd, F_GETFL);
    struct timeval wait = {0, 0}; /* zero: no limit */
    if (link->timeout_ms >= 0) {
        wait.tv_sec = link->timeout_ms / 1000;
        wait.tv_usec = (link->timeout_ms % 1000) * 1000 + (link->timeout_ms == 0);
    }
    if (flags < 0 || setsockopt(link->fd, SOL_SOCKET, SO_SNDTIMEO, &wait, sizeof wait) < 0 ||
        setsockopt(link->fd, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait) < 0 ||
        fcntl(link->fd, F_SETFL, flags & ~O_NONBLOCK) < 0) {
        return -1;
    }
    link->blocking = 1;
    return flags;
}

/* Gives the socket back as its owner set it (Python's socket object keeps its own timeout). */
static void
link_unblock(Link *link, int flags)
{
    if (flags < 0) {
        return;
    }
    struct timeval none = {0, 0};
    fcntl(link->fd, F_SETFL, flags);
    setsockopt(link->fd, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof none);
    setsockopt(link->fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof none);
    link->blocking = 0;
}

/* ---- the writer: a queue of SETs that threads stream to Redis without the GIL --------------
 *
 * RespWriter is the Redis tier's write queue. Callers push operations with the GIL held; the
 * tier's writer threads call run(), one per lane (each on a connection of its own), which
 * releases the GIL and then, while the queue's head is a SET, takes SETs from the head (at most
 * max_batch, and at most LANE_BATCH_BYTES of values beyond the first), sends them one at a time,
 * each once the last one's reply is read, and hands the batch over as done, waiting on the queue
 * (never on the GIL) when it is empty.
 *
 * Why: callers hold the GIL while they frame blocks, and a Python writer woken by their first
 * submit could not take it back until they blocked, so Redis sat idle while a burst was framed;
 * here the first SET is on the wire while the next is framed. Why one SET in flight on each of
 * several lanes: after a large value Redis reads as much as its new query buffer holds (the
 * value's size class), so when the next command is already in the socket the read runs past that
 * command's value, which Redis then copies out instead of adopting its read buffer (see
 * set_build); one command at a time per connection never lets that happen, and a few connections
 * keep Redis fed (docs/benchmarks.md). A lane still takes a batch per wake-up, so waking and
 * handing back cost once per batch. A push wakes one lane, and only when no lane is about to look
 * at the queue anyway, or when a batch's worth waits behind the lanes sending (a slow link); a
 * lane that leaves SETs queued behind the batch it took wakes one more. A commit's few blocks
 * then go on one lane in one or two batches, where waking every lane on every push cost the
 * service half its CPU per commit (docs/benchmarks.md). SETs of one key on two lanes may land in
 * either order; they carry the same block's frame.
 *
 * A batch's worth: LANE_BATCH_BYTES, and with a batch deadline no more SETs than half of it lets
 * a lane send at the link's measured pace (`set_s`). Sent one at a time, a batch of 64 over a
 * link of 100 ms round trips would otherwise outrun its deadline and fail whole, again and again,
 * writing nothing and counting against the link's breaker (reads included). The pace is learned
 * from batches written (seconds per SET, decaying towards faster) and from a batch that ran past
 * its deadline (at least its time over the SETs answered, plus the one in flight); until the
 * first SET is answered, a batch is that one SET. Batches Python runs (TLS, Redis Cluster: pop)
 * are sized and timed the same way (paced), though pipelined: over a slow link their bytes set
 * the pace.
 *
 * Everything else stays Python's: an operation pushed without a key is run by Python on lane 0
 * (lane 0's run() returns when it heads the queue, the other lanes wait; pop() hands it over once
 * every SET before it is over, and no lane takes anything until finish()), as is a batch whose
 * exchange failed (it stays in its lane's flight for flight()/finish()). Done batches reach Python
 * through wait_done()/completed(), which release their buffers. A value's buffers are read until
 * its batch is done, finished or dropped; own_queued() copies queued values so the caller's may
 * be reused. Lock order: the GIL, then `lock`; nothing waits for the GIL while holding `lock`.
 */

#define MAX_LANES 16
#define LANE_BATCH_BYTES (1 << 20) /* a batch's values add up to at most this, beyond its first */
#define LANE_DEPTH 1               /* SETs a lane has in flight: see above */

typedef struct WriterEntry {
    struct WriterEntry *next;
    PyObject *op;      /* the caller's, handed back as is */
    char *key;         /* NULL: an operation Python runs */
    size_t key_length;
    Py_buffer *parts;  /* the value, in order */
    Py_ssize_t part_count;
    size_t value_length;
    long long ttl_ms;
    int borrowed;      /* the value lies in buffers the caller will reuse (not one bytes object) */
} WriterEntry;

typedef struct WriterBatch {
    struct WriterBatch *next;
    WriterEntry *entries;
    size_t bytes;
    double seconds;
    size_t trips; /* round trips it took: the link meter's unit (seconds = trips x latency + ...) */
} WriterBatch;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    pthread_cond_t changed; /* batch over, interrupt, stop, shutdown: pop(), wait_done() */
    pthread_cond_t work;    /* what lanes wait for: a SET pushed (one lane woken), or any change (all) */
    size_t queued_bytes;    /* of the values queued */
    int awake;              /* lanes in run() and not waiting on `work` ... */
    int sending;            /* ... of which this many are sending a batch */
    int waiting;            /* lanes waiting on `work` */
    int wake_sent;          /* a lane was signalled and has not woken yet */
    int lanes;
    WriterEntry *head, *tail;
    Py_ssize_t queued;
    WriterEntry *flight[MAX_LANES]; /* each lane's batch being written (run) or run by Python */
    int running[MAX_LANES];
    int barrier; /* lane 0 runs a Python operation: no lane takes anything */
    WriterBatch *done_head, *done_tail;
    unsigned long long interrupts;
    int stopping, shut;
    struct timespec stop_at;
    double set_s; /* seconds per SET on this writer's link, as measured (0: not yet) */
    size_t batch_most;       /* run()'s max_batch and deadline_s (every lane passes the same) */
    double batch_deadline_s;
} RespWriter;

/* The SETs a lane may take for a batch that must end within `deadline_s` (0: no deadline). */
static size_t
lane_batch(const RespWriter *self, size_t most, double deadline_s)
{
    if (deadline_s <= 0) {
        return most;
    }
    if (self->set_s <= 0) {
        return 1; /* the link's first SET measures its pace */
    }
    double fit = deadline_s / (2 * self->set_s);
    return fit < 1 ? 1 : fit < (double)most ? (size_t)fit : most;
}

/* Whether a lane's batch's worth is queued (the lock is held). */
static int
batch_waits(const RespWriter *self)
{
    return self->queued_bytes >= LANE_BATCH_BYTES ||
           (self->batch_most && (size_t)self->queued >= lane_batch(self, self->batch_most, self->batch_deadline_s));
}

/* A batch's pace: `seconds` over `sets` SETs; `at_least` when it ran past its deadline. Slower
 * is followed at once, faster a quarter of the way per batch (the lock is held). */
static void
observe_pace(RespWriter *self, double seconds, size_t sets, int at_least)
{
    double pace = seconds / (double)(sets ? sets : 1);
    if (self->set_s <= 0 || pace > self->set_s) {
        self->set_s = pace;
    } else if (!at_least) {
        self->set_s += (pace - self->set_s) / 4;
    }
}

/* One waiting lane, unless one was woken already and is yet to run (the lock is held): a SET
 * pushed wakes no more lanes than there are batches to take, each wake-up costing the machine's
 * cores a context switch (the engines' cores, beside an inference engine). */
static void
wake_lane(RespWriter *self)
{
    if (self->waiting > 0 && !self->wake_sent) {
        self->wake_sent = 1;
        pthread_cond_signal(&self->work);
    }
}

/* Every waiter, lanes included: for changes other than a SET pushed (the lock is held). */
static void
wake_all(RespWriter *self)
{
    pthread_cond_broadcast(&self->changed);
    pthread_cond_broadcast(&self->work);
}

static double
seconds_since(const struct timespec *start)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - start->tv_sec) + (double)(now.tv_nsec - start->tv_nsec) / 1e9;
}

static struct timespec
deadline_after(double seconds)
{
    struct timespec at;
    clock_gettime(CLOCK_MONOTONIC, &at);
    double whole = seconds > 1e9 ? 1e9 : seconds > 0 ? seconds : 0;
    at.tv_sec += (time_t)whole;
    at.tv_nsec += (long)((whole - (double)(time_t)whole) * 1e9);
    if (at.tv_nsec >= 1000000000L) {
        at.tv_sec += 1;
        at.tv_nsec -= 1000000000L;
    }
    return at;
}

static int
past(const struct timespec *at)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec > at->tv_sec || (now.tv_sec == at->tv_sec && now.tv_nsec >= at->tv_nsec);
}

static int
seconds_arg(PyObject *arg, double *seconds)
{
    *seconds = PyFloat_AsDouble(arg);
    return *seconds == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* Frees a list of entries (the GIL held: their buffers are released) and returns their ops as a
 * new list, or NULL with an exception set (the entries freed all the same). */
static PyObject *
entries_release(WriterEntry *entry)
{
    PyObject *ops = PyList_New(0);
    while (entry != NULL) {
        WriterEntry *next = entry->next;
        for (Py_ssize_t j = 0; j < entry->part_count; j++) {
            PyBuffer_Release(&entry->parts[j]);
        }
        if (ops != NULL && PyList_Append(ops, entry->op) < 0) {
            Py_CLEAR(ops);
        }
        Py_DECREF(entry->op);
        PyMem_Free(entry->parts);
        PyMem_Free(entry->key);
        PyMem_Free(entry);
        entry = next;
    }
    return ops;
}

/* The ops of a list of entries, left where they are (the lock held). */
static int
entries_ops(WriterEntry *entry, PyObject *ops)
{
    for (; entry != NULL; entry = entry->next) {
        if (PyList_Append(ops, entry->op) < 0) {
            return -1;
        }
    }
    return 0;
}

static int
writer_init(RespWriter *self, PyObject *args, PyObject *kwargs)
{
    int lanes = 1;
    if (!PyArg_ParseTuple(args, "|i:RespWriter", &lanes)) {
        return -1;
    }
    if (lanes < 1 || lanes > MAX_LANES) {
        PyErr_Format(PyExc_ValueError, "lanes: expected 1 to %d, got %d", MAX_LANES, lanes);
        return -1;
    }
    self->lanes = lanes;
    pthread_condattr_t attr;
    if (pthread_condattr_init(&attr) || pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) ||
        pthread_mutex_init(&self->lock, NULL) || pthread_cond_init(&self->changed, &attr) ||
        pthread_cond_init(&self->work, &attr)) {
        PyErr_SetString(PyExc_OSError, "RespWriter: could not set up its lock");
        return -1;
    }
    pthread_condattr_destroy(&attr);
    return 0;
}

static void
writer_dealloc(RespWriter *self)
{
    Py_XDECREF(entries_release(self->head));
    for (int lane = 0; lane < MAX_LANES; lane++) {
        Py_XDECREF(entries_release(self->flight[lane]));
    }
    for (WriterBatch *batch = self->done_head; batch != NULL;) {
        WriterBatch *next = batch->next;
        Py_XDECREF(entries_release(batch->entries));
        PyMem_RawFree(batch); /* (allocated by run(), without the GIL) */
        batch = next;
    }
    if (self->lanes) { /* initialised */
        pthread_cond_destroy(&self->changed);
        pthread_cond_destroy(&self->work);
        pthread_mutex_destroy(&self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
lane_arg(RespWriter *self, PyObject *arg, int *lane)
{
    long value = PyLong_AsLong(arg);
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (value < 0 || value >= self->lanes) {
        PyErr_Format(PyExc_ValueError, "lane: expected 0 to %d, got %ld", self->lanes - 1, value);
        return -1;
    }
    *lane = (int)value;
    return 0;
}

static int
batch_arg(PyObject *arg, size_t *most)
{
    Py_ssize_t value = PyLong_AsSsize_t(arg);
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (value < 1) {
        PyErr_SetString(PyExc_ValueError, "max_batch: expected an int >= 1");
        return -1;
    }
    *most = (size_t)value;
    return 0;
}

/* push(op, key, value, ttl_ms): queue `PSETEX key ttl_ms value` (value one buffer or a tuple of its
 * parts, read in place until the write is over); with key None, an operation Python runs. */
static PyObject *
writer_push(RespWriter *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "push(op, key, value, ttl_ms) takes 4 arguments");
        return NULL;
    }
    WriterEntry *entry = PyMem_Calloc(1, sizeof(WriterEntry));
    if (entry == NULL) {
        return PyErr_NoMemory();
    }
    entry->op = Py_NewRef(args[0]);
    if (args[1] != Py_None) {
        PyObject *value = args[2];
        if (!PyBytes_Check(args[1])) {
            PyErr_Format(PyExc_TypeError, "key: expected bytes or None, got %.100s", Py_TYPE(args[1])->tp_name);
            goto fail;
        }
        entry->ttl_ms = PyLong_AsLongLong(args[3]);
        if (entry->ttl_ms == -1 && PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "ttl_ms: expected an int");
            goto fail;
        }
        Py_ssize_t own = PyTuple_Check(value) ? PyTuple_GET_SIZE(value) : 1;
        entry->key_length = (size_t)PyBytes_GET_SIZE(args[1]);
        entry->key = PyMem_Malloc(entry->key_length + 1);
        entry->parts = PyMem_Calloc((size_t)own + 1, sizeof(Py_buffer));
        if (entry->key == NULL || entry->parts == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        memcpy(entry->key, PyBytes_AS_STRING(args[1]), entry->key_length);
        for (Py_ssize_t j = 0; j < own; j++) {
            PyObject *part = PyTuple_Check(value) ? PyTuple_GET_ITEM(value, j) : value;
            if (PyObject_GetBuffer(part, &entry->parts[j], PyBUF_SIMPLE) < 0) {
                PyErr_Format(PyExc_TypeError, "value: expected a contiguous buffer or a tuple of them (part %zd)", j);
                goto fail;
            }
            entry->part_count = j + 1;
            entry->value_length += (size_t)entry->parts[j].len;
        }
        entry->borrowed = !PyBytes_CheckExact(value);
    }
    pthread_mutex_lock(&self->lock);
    if (self->tail != NULL) {
        self->tail->next = entry;
    } else {
        self->head = entry;
    }
    self->tail = entry;
    self->queued++;
    self->queued_bytes += entry->value_length;
    if (entry->key == NULL) {
        pthread_cond_broadcast(&self->work); /* lane 0 runs it, whichever lane a signal would reach */
    } else if (self->awake == self->sending && (self->sending == 0 || batch_waits(self))) {
        /* No lane about to look at the queue: one more sends, if none does, or if a batch's worth
         * waits behind those that do (a slow link). Else the next lane to look takes it. */
        wake_lane(self);
    }
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(entries_release(entry));
    return NULL;
}

/* head() -> 0 (nothing queued), 1 (a SET first) or 2 (an operation Python runs first). */
static PyObject *
writer_head(RespWriter *self, PyObject *unused)
{
    pthread_mutex_lock(&self->lock);
    int head = self->head == NULL ? 0 : self->head->key != NULL ? 1 : 2;
    pthread_mutex_unlock(&self->lock);
    return PyLong_FromLong(head);
}

static Py_ssize_t
writer_length(RespWriter *self)
{
    pthread_mutex_lock(&self->lock);
    Py_ssize_t queued = self->queued;
    pthread_mutex_unlock(&self->lock);
    return queued;
}

/* Moves up to `most` consecutive SETs whose values add up to at most `bytes` (the first always),
 * or the one Python-run operation, from the head into `lane`'s flight; the lock is held and the
 * queue is not empty. */
static size_t
writer_take(RespWriter *self, int lane, size_t most, size_t bytes)
{
    WriterEntry *first = self->head, *last = first;
    size_t taken = 1, held = first->value_length;
    if (first->key != NULL) {
        while (taken < most && last->next != NULL && last->next->key != NULL &&
               held + last->next->value_length <= bytes) {
            last = last->next;
            held += last->value_length;
            taken++;
        }
    }
    self->head = last->next;
    if (self->head == NULL) {
        self->tail = NULL;
    }
    last->next = NULL;
    self->flight[lane] = first;
    self->queued -= (Py_ssize_t)taken;
    self->queued_bytes -= held;
    return taken;
}

static int
others_in_flight(RespWriter *self)
{
    for (int lane = 1; lane < self->lanes; lane++) {
        if (self->flight[lane] != NULL) {
            return 1;
        }
    }
    return 0;
}

/* pop(max_batch, deadline_s=None) -> the ops of the next batch, taken into lane 0's flight for
 * Python to run (finish(0) ends it): up to max_batch consecutive SETs (with a deadline, no more
 * than half of it fits at the link's pace, as run() takes: Python pipelines a batch, which takes
 * as long as its bytes over a slow link), or one operation Python runs, once every other lane's
 * batch is over; [] when nothing is queued. */
static PyObject *
writer_pop(RespWriter *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 && nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pop(max_batch, deadline_s=None) takes 1 or 2 arguments");
        return NULL;
    }
    size_t most;
    Link deadline = {0};
    if (batch_arg(args[0], &most) < 0 || link_deadline(nargs > 1 ? args[1] : NULL, &deadline) < 0) {
        return NULL;
    }
    double deadline_s = deadline.has_deadline ? PyFloat_AsDouble(args[1]) : 0; /* (checked) */
    int busy;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    busy = self->flight[0] != NULL || self->running[0];
    while (!busy && self->head != NULL && self->head->key == NULL && others_in_flight(self)) {
        pthread_cond_wait(&self->changed, &self->lock); /* the SETs queued before it first */
    }
    if (!busy && self->head != NULL) {
        writer_take(self, 0, lane_batch(self, most, deadline_s), SIZE_MAX);
        self->barrier = self->flight[0]->key == NULL;
    }
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    if (busy) {
        PyErr_SetString(PyExc_RuntimeError, "RespWriter.pop: lane 0 has a batch in flight");
        return NULL;
    }
    PyObject *ops = PyList_New(0);
    pthread_mutex_lock(&self->lock);
    if (ops != NULL && entries_ops(self->flight[0], ops) < 0) {
        Py_CLEAR(ops);
    }
    pthread_mutex_unlock(&self->lock);
    return ops;
}

/* paced(seconds, sets, past_deadline): a batch of `sets` SETs that Python ran (pop) took `seconds`,
 * or ran past its deadline after `seconds`: the pace that sizes the next batches. */
static PyObject *
writer_paced(RespWriter *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "paced(seconds, sets, past_deadline) takes 3 arguments");
        return NULL;
    }
    double seconds = PyFloat_AsDouble(args[0]);
    if (seconds == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t sets = PyLong_AsSsize_t(args[1]);
    if (sets == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int past = PyObject_IsTrue(args[2]);
    if (past < 0) {
        return NULL;
    }
    if (!(seconds >= 0) || sets < 1) {
        PyErr_SetString(PyExc_ValueError, "paced: expected seconds >= 0 and sets >= 1");
        return NULL;
    }
    pthread_mutex_lock(&self->lock);
    observe_pace(self, seconds, (size_t)sets, past);
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

/* flight(lane) -> the ops of a lane's batch in flight (every lane's for -1), left there. */
static PyObject *
writer_flight(RespWriter *self, PyObject *arg)
{
    int lane = -1;
    long value = PyLong_AsLong(arg);
    if ((value == -1 && PyErr_Occurred()) || (value != -1 && lane_arg(self, arg, &lane) < 0)) {
        return NULL;
    }
    PyObject *ops = PyList_New(0);
    pthread_mutex_lock(&self->lock);
    for (int i = lane < 0 ? 0 : lane; ops != NULL && i < (lane < 0 ? self->lanes : lane + 1); i++) {
        if (entries_ops(self->flight[i], ops) < 0) {
            Py_CLEAR(ops);
        }
    }
    pthread_mutex_unlock(&self->lock);
    return ops;
}

/* finish(lane) -> the ops of the lane's batch in flight (Python's, or run()'s that failed), now
 * over: its buffers are released. */
static PyObject *
writer_finish(RespWriter *self, PyObject *arg)
{
    int lane;
    if (lane_arg(self, arg, &lane) < 0) {
        return NULL;
    }
    pthread_mutex_lock(&self->lock);
    if (self->running[lane]) {
        pthread_mutex_unlock(&self->lock);
        PyErr_SetString(PyExc_RuntimeError, "RespWriter.finish: run() owns the lane's batch in flight");
        return NULL;
    }
    WriterEntry *flight = self->flight[lane];
    self->flight[lane] = NULL;
    if (lane == 0) {
        self->barrier = 0;
    }
    wake_all(self);
    pthread_mutex_unlock(&self->lock);
    return entries_release(flight);
}

/* run(fd, timeout_s, max_batch, lane, deadline_s=None) -> None, or the first error reply's text of the batch left
 * in the lane's flight. Writes SETs from the head of the queue, batch after batch, without the
 * GIL, waiting for more while there are none. Returns (None) after interrupt(), once stop()'s deadline has
 * passed or nothing is queued while stopping, and on lane 0 when an operation Python runs heads
 * the queue. A socket fault raises as resp_set's do, its batch left in flight; the connection is
 * then out of step. */
static PyObject *
writer_run(RespWriter *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "run(fd, timeout_s, max_batch, lane, deadline_s=None) takes 4 or 5 arguments");
        return NULL;
    }
    Link link;
    size_t most;
    int lane;
    if (link_args(args[0], args[1], &link) < 0 || batch_arg(args[2], &most) < 0 || lane_arg(self, args[3], &lane) < 0 ||
        link_deadline(nargs > 4 ? args[4] : NULL, &link) < 0) {
        return NULL;
    }
    double batch_deadline_s = link.has_deadline && nargs > 4 ? PyFloat_AsDouble(args[4]) : 0; /* (checked) */
    if (link.sock != NULL) {
        PyErr_SetString(PyExc_TypeError, "fd: expected a plain socket's descriptor (a TLS socket needs the GIL)");
        return NULL;
    }
    SetCommand *sets = PyMem_Calloc(most, sizeof(SetCommand));
    if (sets == NULL) {
        return PyErr_NoMemory();
    }
    pthread_mutex_lock(&self->lock);
    int busy = self->running[lane] || self->flight[lane] != NULL;
    self->running[lane] = !busy;
    unsigned long long interrupts = self->interrupts;
    pthread_mutex_unlock(&self->lock);
    if (busy) {
        PyMem_Free(sets);
        PyErr_SetString(PyExc_RuntimeError, "RespWriter.run: the lane is running, or has a batch in flight");
        return NULL;
    }
    char error[ERROR_TEXT];
    size_t error_length = 0;
    int outcome = 0;
    int flags = -1;
    Py_BEGIN_ALLOW_THREADS
    flags = link_block(&link);
    pthread_mutex_lock(&self->lock);
    self->awake++;
    self->batch_most = most;
    self->batch_deadline_s = batch_deadline_s;
    for (;;) {
        if (self->interrupts != interrupts) {
            break;
        }
        if (self->stopping && (self->head == NULL || past(&self->stop_at))) {
            break;
        }
        if (self->head != NULL && self->head->key == NULL && lane == 0) {
            break; /* Python runs it (pop) */
        }
        if (self->head == NULL || self->head->key == NULL || self->barrier) {
            self->awake--;
            self->waiting++;
            pthread_cond_wait(&self->work, &self->lock);
            self->waiting--;
            self->awake++;
            self->wake_sent = 0;
            continue;
        }
        size_t count = writer_take(self, lane, lane_batch(self, most, batch_deadline_s), LANE_BATCH_BYTES);
        if (self->head != NULL && self->head->key != NULL) {
            wake_lane(self); /* more than this lane's batch was queued: another lane takes the rest */
        }
        self->sending++;
        pthread_mutex_unlock(&self->lock);
        size_t bytes = 0, i = 0;
        for (WriterEntry *entry = self->flight[lane]; entry != NULL; entry = entry->next, i++) {
            sets[i] = (SetCommand){.key = entry->key, .key_length = entry->key_length, .parts = entry->parts,
                                   .part_count = entry->part_count, .ttl_ms = entry->ttl_ms};
            bytes += entry->value_length;
        }
        struct timespec start;
        clock_gettime(CLOCK_MONOTONIC, &start);
        if (link.has_deadline) { /* each batch's exchange has the whole deadline */
            link.deadline = deadline_after(batch_deadline_s);
        }
        size_t answered = 0;
        outcome = set_exchange(&link, sets, count, LANE_DEPTH, error, &error_length, &answered);
        double seconds = seconds_since(&start);
        WriterBatch *batch = outcome == 0 ? PyMem_RawMalloc(sizeof(WriterBatch)) : NULL;
        pthread_mutex_lock(&self->lock);
        self->sending--;
        if (outcome == 0) {
            observe_pace(self, seconds, count, 0);
        } else if (outcome == -1 && link.status == IO_DEADLINE) {
            observe_pace(self, seconds, answered + 1, 1);
        }
        if (outcome == 0 && batch == NULL) {
            outcome = -2;
        }
        if (outcome != 0) {
            break; /* the batch stays in flight for Python */
        }
        *batch = (WriterBatch){.entries = self->flight[lane], .bytes = bytes, .seconds = seconds,
                               .trips = (count + LANE_DEPTH - 1) / LANE_DEPTH};
        self->flight[lane] = NULL;
        if (self->done_tail != NULL) {
            self->done_tail->next = batch;
        } else {
            self->done_head = batch;
        }
        self->done_tail = batch;
        pthread_cond_broadcast(&self->changed);
        if (self->stopping) {
            pthread_cond_broadcast(&self->work); /* lanes waiting behind this batch may now end */
        }
    }
    self->running[lane] = 0;
    self->awake--;
    if (self->awake == 0 && self->head != NULL && self->head->key != NULL && !self->barrier) {
        wake_lane(self); /* SETs pushed while this lane was sending: pushes woke no one for them */
    }
    pthread_mutex_unlock(&self->lock);
    link_unblock(&link, flags);
    Py_END_ALLOW_THREADS
    PyMem_Free(sets);
    if (outcome == -2) {
        return PyErr_NoMemory();
    }
    if (outcome == -1) {
        raise_fault(&link);
        return NULL;
    }
    if (outcome == 1) {
        return PyBytes_FromStringAndSize(error, (Py_ssize_t)error_length);
    }
    Py_RETURN_NONE;
}

/* wait_done(timeout_s) -> False once shutdown() was called and no done batch is left; else True,
 * as soon as one is (or after timeout_s). */
static PyObject *
writer_wait_done(RespWriter *self, PyObject *arg)
{
    double timeout;
    if (seconds_arg(arg, &timeout) < 0) {
        return NULL;
    }
    struct timespec at = deadline_after(timeout);
    int more;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    while (self->done_head == NULL && !self->shut && !past(&at)) {
        pthread_cond_timedwait(&self->changed, &self->lock, &at);
    }
    more = self->done_head != NULL || !self->shut;
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(more);
}

/* completed() -> [(ops, bytes, seconds, round trips)] of the batches run() wrote since the last
 * call, their buffers released. */
static PyObject *
writer_completed(RespWriter *self, PyObject *unused)
{
    pthread_mutex_lock(&self->lock);
    WriterBatch *batches = self->done_head;
    self->done_head = self->done_tail = NULL;
    pthread_mutex_unlock(&self->lock);
    PyObject *result = PyList_New(0);
    while (batches != NULL) {
        WriterBatch *next = batches->next;
        PyObject *ops = entries_release(batches->entries);
        PyObject *item = ops ? Py_BuildValue("(Nndn)", ops, (Py_ssize_t)batches->bytes, batches->seconds,
                                                 (Py_ssize_t)batches->trips) : NULL;
        if (item == NULL || result == NULL || PyList_Append(result, item) < 0) {
            Py_CLEAR(result);
        }
        Py_XDECREF(item);
        PyMem_RawFree(batches);
        batches = next;
    }
    return result;
}

/* own_queued() -> [(op, value)] for every queued SET whose value lay in the caller's buffers: it
 * is copied into `value` (bytes), which the writer sends from now on. */
static PyObject *
writer_own_queued(RespWriter *self, PyObject *unused)
{
    pthread_mutex_lock(&self->lock); /* taken out while copying, so no lane sends from them */
    WriterEntry *first = self->head, *last = self->tail;
    Py_ssize_t queued = self->queued;
    size_t queued_bytes = self->queued_bytes;
    self->head = self->tail = NULL;
    self->queued = 0;
    self->queued_bytes = 0;
    pthread_mutex_unlock(&self->lock);
    PyObject *owned = PyList_New(0);
    for (WriterEntry *entry = first; entry != NULL; entry = entry->next) {
        if (owned == NULL || entry->key == NULL || !entry->borrowed) {
            continue;
        }
        PyObject *value = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)entry->value_length);
        PyObject *item = value ? PyTuple_Pack(2, entry->op, value) : NULL;
        Py_buffer view;
        if (item == NULL || PyList_Append(owned, item) < 0 || PyObject_GetBuffer(value, &view, PyBUF_SIMPLE) < 0) {
            Py_CLEAR(owned);
        } else {
            char *at = PyBytes_AS_STRING(value);
            for (Py_ssize_t j = 0; j < entry->part_count; j++) {
                memcpy(at, entry->parts[j].buf, (size_t)entry->parts[j].len);
                at += entry->parts[j].len;
                PyBuffer_Release(&entry->parts[j]);
            }
            entry->parts[0] = view; /* (parts has room for at least one) */
            entry->part_count = 1;
            entry->borrowed = 0;
        }
        Py_XDECREF(item);
        Py_XDECREF(value);
    }
    pthread_mutex_lock(&self->lock); /* back in front of whatever was pushed meanwhile */
    if (first != NULL) {
        last->next = self->head;
        self->head = first;
        if (self->tail == NULL) {
            self->tail = last;
        }
        self->queued += queued;
        self->queued_bytes += queued_bytes;
        wake_all(self);
    }
    pthread_mutex_unlock(&self->lock);
    return owned;
}

/* drain() -> the ops of everything queued (not in flight), removed and released. */
static PyObject *
writer_drain(RespWriter *self, PyObject *unused)
{
    pthread_mutex_lock(&self->lock);
    WriterEntry *first = self->head;
    self->head = self->tail = NULL;
    self->queued = 0;
    self->queued_bytes = 0;
    pthread_mutex_unlock(&self->lock);
    return entries_release(first);
}

static PyObject *
writer_interrupt(RespWriter *self, PyObject *unused)
{
    pthread_mutex_lock(&self->lock);
    self->interrupts++;
    wake_all(self);
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

/* stop(timeout_s): run() returns once nothing is queued, or after its batch in flight at the deadline. */
static PyObject *
writer_stop(RespWriter *self, PyObject *arg)
{
    double timeout;
    if (seconds_arg(arg, &timeout) < 0) {
        return NULL;
    }
    pthread_mutex_lock(&self->lock);
    self->stopping = 1;
    self->stop_at = deadline_after(timeout);
    wake_all(self);
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

/* shutdown(): wait_done() returns False once every done batch was handed over. */
static PyObject *
writer_shutdown(RespWriter *self, PyObject *unused)
{
    pthread_mutex_lock(&self->lock);
    self->shut = 1;
    wake_all(self);
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

static PyMethodDef writer_methods[] = {
    {"push", (PyCFunction)(void (*)(void))writer_push, METH_FASTCALL,
     "push(op, key, value, ttl_ms): queue PSETEX key ttl_ms value; key None: an operation Python runs"},
    {"head", (PyCFunction)writer_head, METH_NOARGS, "head() -> 0 (empty), 1 (a SET first), 2 (a Python op first)"},
    {"pop", (PyCFunction)(void (*)(void))writer_pop, METH_FASTCALL,
     "pop(max_batch, deadline_s=None) -> the ops of the next batch, now in lane 0's flight"},
    {"paced", (PyCFunction)(void (*)(void))writer_paced, METH_FASTCALL,
     "paced(seconds, sets, past_deadline): how long a batch Python ran took, for the pace"},
    {"flight", (PyCFunction)writer_flight, METH_O, "flight(lane) -> the ops in a lane's flight (every lane's for -1)"},
    {"finish", (PyCFunction)writer_finish, METH_O, "finish(lane) -> the ops of the lane's batch in flight, now over"},
    {"run", (PyCFunction)(void (*)(void))writer_run, METH_FASTCALL,
     "run(fd, timeout_s, max_batch, lane, deadline_s=None) -> None, or the error reply's text of the batch left in "
     "flight; deadline_s bounds each batch's exchange"},
    {"wait_done", (PyCFunction)writer_wait_done, METH_O,
     "wait_done(timeout_s) -> True once a batch is done (or after timeout_s); False once shut down and none is"},
    {"completed", (PyCFunction)writer_completed, METH_NOARGS,
     "completed() -> [(ops, bytes, seconds, round trips)] of the batches run() wrote since the last call"},
    {"own_queued", (PyCFunction)writer_own_queued, METH_NOARGS,
     "own_queued() -> [(op, value)]: queued values copied out of the caller's buffers"},
    {"drain", (PyCFunction)writer_drain, METH_NOARGS, "drain() -> the ops of everything queued, removed"},
    {"interrupt", (PyCFunction)writer_interrupt, METH_NOARGS, "interrupt(): every run() returns after its batch"},
    {"stop", (PyCFunction)writer_stop, METH_O, "stop(timeout_s): run() returns once idle or past the deadline"},
    {"shutdown", (PyCFunction)writer_shutdown, METH_NOARGS, "shutdown(): wait_done() returns False once drained"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods writer_sequence = {.sq_length = (lenfunc)writer_length};

static PyObject *
writer_get_set_seconds(RespWriter *self, void *unused)
{
    pthread_mutex_lock(&self->lock);
    double set_s = self->set_s;
    pthread_mutex_unlock(&self->lock);
    return PyFloat_FromDouble(set_s);
}

static PyGetSetDef writer_getset[] = {
    {"set_seconds", (getter)writer_get_set_seconds, NULL,
     "seconds per SET measured on the link, by run() or paced() (0.0 until a batch is over): with a deadline, a "
     "batch takes no more SETs than half of it fits",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef writer_members[] = {
    {"lanes", T_INT, offsetof(RespWriter, lanes), READONLY, "lanes run() may be called on, each on its own connection"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject RespWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefixcache._core.RespWriter",
    .tp_doc = "RespWriter(lanes=1): the Redis tier's write queue, written to Redis by run() without the GIL",
    .tp_basicsize = sizeof(RespWriter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)writer_init,
    .tp_dealloc = (destructor)writer_dealloc,
    .tp_methods = writer_methods,
    .tp_members = writer_members,
    .tp_getset = writer_getset,
    .tp_as_sequence = &writer_sequence,
};

int
resp_register(PyObject *module)
{
    if (PyType_Ready(&RespWriterType) < 0) {
        return -1;
    }
    Py_INCREF(&RespWriterType);
    if (PyModule_AddObject(module, "RespWriter", (PyObject *)&RespWriterType) < 0) {
        Py_DECREF(&RespWriterType);
        return -1;
    }
    return 0;
}
