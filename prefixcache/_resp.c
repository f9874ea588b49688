/* The Redis tier's RESP exchanges (tiers/resp.py), compiled into prefixcache._core (issue 17).
 *
 * - resp_set(sock, keys, values, ttls_ms, timeout_s): `SET key value PX ttl` for each entry in one
 *   pipeline: the command bytes built here, every value sent from the caller's buffers (a value is
 *   one buffer or a tuple of its parts, e.g. a frame's header and the payload in a host slot; a
 *   small part is joined into the command bytes), then every reply read.
 * - resp_getex(sock, keys, ttl_ms, timeout_s): `GETEX key PX ttl` (plain `GET` when ttl_ms is None)
 *   for each key in one pipeline, each bulk reply read straight into a bytearray of its exact size.
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
 * after the last reply); the caller must then drop the connection. Error replies are data:
 * resp_set returns the first one's text, resp_getex each one's with the key's position.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "_resp.h"

#define JOIN_MAX (1 << 14)      /* values up to this size are copied into the command bytes */
#define IOV_PER_CALL 512        /* buffers per sendmsg (Linux allows 1024) */
#define READ_BUFFER (1 << 16)   /* reply lines; a bulk value beyond what is buffered is read in place */
#define ERROR_TEXT 512          /* kept of an error reply's text */
#define HEADER_ROOM 128         /* a SET's or GETEX's fixed bytes and its numbers, at most */

/* ---- socket I/O, without the GIL ---------------------------------------------------------- */

enum { IO_OK = 0, IO_ERRNO, IO_TIMEOUT, IO_CLOSED, IO_PROTOCOL, IO_PYTHON /* exception set */ };

typedef struct {
    int fd;
    PyObject *sock; /* a TLS socket, driven through its own methods with the GIL held; NULL for fd */
    PyThreadState *released; /* set while the GIL is released (fd only) */
    int timeout_ms; /* per wait; -1 waits for ever */
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

/* Waits until the socket is ready for `events`; -1 (the fault recorded) on a timeout or an error. */
static int
link_wait(Link *link, short events)
{
    struct pollfd ready = {.fd = link->fd, .events = events};
    for (;;) {
        int count = poll(&ready, 1, link->timeout_ms);
        if (count > 0) {
            return 0;
        }
        if (count == 0) {
            return link_fail(link, IO_TIMEOUT, NULL);
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
        }
        return 0;
    }
    size_t first = 0;
    while (first < count) {
        struct msghdr message = {.msg_iov = iov + first,
                                 .msg_iovlen = count - first < IOV_PER_CALL ? count - first : IOV_PER_CALL};
        ssize_t sent = sendmsg(link->fd, &message, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
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
        return got == 0 ? link_fail(link, IO_CLOSED, NULL) : got;
    }
    for (;;) {
        ssize_t got = recv(link->fd, buf, room, 0);
        if (got > 0) {
            return got;
        }
        if (got == 0) {
            return link_fail(link, IO_CLOSED, NULL);
        }
        if (errno == EINTR) {
            continue;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
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
    case IO_CLOSED:
        PyErr_SetString(PyExc_ConnectionError, "Connection closed by server.");
        break;
    case IO_PROTOCOL: {
        PyObject *seen = PyBytes_FromStringAndSize(link->seen, (Py_ssize_t)link->seen_length);
        if (seen != NULL) {
            PyErr_Format(PyExc_ValueError, "unexpected reply: %s (%R)", link->what, seen);
            Py_DECREF(seen);
        }
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

static int
link_args(PyObject *sock_arg, PyObject *timeout_arg, Link *link)
{
    *link = (Link){.fd = -1, .timeout_ms = -1};
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

/* ---- SET --------------------------------------------------------------------------------- */

PyObject *
core_resp_set(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "resp_set(sock, keys, values, ttls_ms, timeout_s) takes 5 arguments");
        return NULL;
    }
    Link link;
    if (link_args(args[0], args[4], &link) < 0) {
        return NULL;
    }
    PyObject *keys = PySequence_Fast(args[1], "keys: expected a sequence of bytes");
    PyObject *values = keys ? PySequence_Fast(args[2], "values: expected a sequence of buffers") : NULL;
    PyObject *ttls = values ? PySequence_Fast(args[3], "ttls_ms: expected a sequence of ints") : NULL;
    Py_buffer *views = NULL; /* every part of every value, in order */
    Py_ssize_t *ends = NULL; /* ends[i]: one past value i's last part in views */
    char *command = NULL;
    struct iovec *iov = NULL;
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
    ends = PyMem_Calloc((size_t)count + 1, sizeof(Py_ssize_t));
    if (views == NULL || ends == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* Sizes first: the command bytes go in one allocation whose pieces the iovecs point into. */
    size_t command_bytes = 0, pieces = 1;
    for (Py_ssize_t i = 0; i < count; i++) {
        const char *key = NULL;
        Py_ssize_t key_length = 0;
        if (key_of(keys, i, &key, &key_length) < 0) {
            goto done;
        }
        command_bytes += HEADER_ROOM + (size_t)key_length;
        PyObject *value = PySequence_Fast_GET_ITEM(values, i);
        Py_ssize_t own = PyTuple_Check(value) ? PyTuple_GET_SIZE(value) : 1;
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
            size_t part_length = (size_t)views[viewed].len;
            command_bytes += part_length <= JOIN_MAX ? part_length : 0;
            pieces += part_length <= JOIN_MAX ? 0 : 2;
        }
        ends[i] = viewed;
    }
    command = PyMem_RawMalloc(command_bytes + 1);
    iov = PyMem_RawMalloc(pieces * sizeof(struct iovec));
    if (command == NULL || iov == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    char *at = command, *piece = command;
    size_t used = 0;
    for (Py_ssize_t i = 0, first = 0; i < count; first = ends[i++]) {
        const char *key = NULL;
        Py_ssize_t key_length = 0;
        (void)key_of(keys, i, &key, &key_length); /* checked above */
        long long ttl = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(ttls, i));
        if (ttl == -1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "ttls_ms[%zd]: expected an int", i);
            goto done;
        }
        size_t value_length = 0;
        for (Py_ssize_t j = first; j < ends[i]; j++) {
            value_length += (size_t)views[j].len;
        }
        at += sprintf(at, "*5\r\n$3\r\nSET\r\n");
        at = put_bulk(at, key, (size_t)key_length);
        at += sprintf(at, "$%zu\r\n", value_length);
        for (Py_ssize_t j = first; j < ends[i]; j++) {
            size_t part_length = (size_t)views[j].len;
            if (part_length <= JOIN_MAX) {
                memcpy(at, views[j].buf, part_length);
                at += part_length;
            } else { /* the command so far, then the part from the caller's buffer */
                iov[used++] = (struct iovec){.iov_base = piece, .iov_len = (size_t)(at - piece)};
                iov[used++] = (struct iovec){.iov_base = views[j].buf, .iov_len = part_length};
                piece = at;
            }
        }
        at += sprintf(at, "\r\n$2\r\nPX\r\n");
        char number[24];
        int digits = sprintf(number, "%lld", ttl);
        at = put_bulk(at, number, (size_t)digits);
    }
    iov[used++] = (struct iovec){.iov_base = piece, .iov_len = (size_t)(at - piece)};

    char error[ERROR_TEXT];
    size_t error_length = 0;
    int failed = 0;
    link_release(&link);
    Reader *reader = PyMem_RawMalloc(sizeof(Reader));
    if (reader == NULL) {
        failed = -2;
    } else if (link_send(&link, iov, used) < 0) {
        failed = -1;
    } else {
        reader->link = &link; /* field by field: the 64 KiB buffer needs no clearing */
        reader->start = reader->end = 0;
        int errors = 0;
        for (Py_ssize_t i = 0; i < count && !failed; i++) {
            const char *line;
            size_t length;
            if (reader_line(reader, &line, &length) < 0) {
                failed = -1;
            } else if (length == 3 && memcmp(line, "+OK", 3) == 0) {
                continue;
            } else if (length && line[0] == '-') {
                if (!errors++) {
                    error_length = length - 1 < ERROR_TEXT ? length - 1 : ERROR_TEXT;
                    memcpy(error, line + 1, error_length);
                }
            } else {
                failed = link_bad_line(&link, "a SET answered neither +OK nor an error", line, length);
            }
        }
        if (!failed && reader->start != reader->end) {
            failed = link_fail(&link, IO_PROTOCOL, "more reply bytes than commands");
        }
        if (!failed && !errors) {
            error_length = SIZE_MAX;
        }
        PyMem_RawFree(reader);
    }
    link_acquire(&link);
    if (failed == -2) {
        PyErr_NoMemory();
    } else if (failed) {
        raise_fault(&link);
    } else if (error_length == SIZE_MAX) {
        result = Py_NewRef(Py_None);
    } else {
        result = PyBytes_FromStringAndSize(error, (Py_ssize_t)error_length);
    }
done:
    for (Py_ssize_t i = 0; i < viewed; i++) {
        PyBuffer_Release(&views[i]);
    }
    PyMem_Free(views);
    PyMem_Free(ends);
    PyMem_RawFree(command);
    PyMem_RawFree(iov);
    Py_XDECREF(ttls);
    Py_XDECREF(values);
    Py_XDECREF(keys);
    return result;
}

/* ---- GETEX ------------------------------------------------------------------------------- */

PyObject *
core_resp_getex(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "resp_getex(sock, keys, ttl_ms, timeout_s) takes 4 arguments");
        return NULL;
    }
    Link link;
    if (link_args(args[0], args[3], &link) < 0) {
        return NULL;
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
        command_bytes += HEADER_ROOM + (size_t)key_length;
        PyList_SET_ITEM(values, i, Py_NewRef(Py_None));
    }
    command = PyMem_RawMalloc(command_bytes);
    if (command == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    char px[64];
    size_t px_length = args[2] == Py_None ? 0 : (size_t)sprintf(px, "$2\r\nPX\r\n$%d\r\n%lld\r\n",
                                                                   snprintf(NULL, 0, "%lld", ttl), ttl);
    char *at = command;
    for (Py_ssize_t i = 0; i < count; i++) {
        const char *key = NULL;
        Py_ssize_t key_length = 0;
        (void)key_of(keys, i, &key, &key_length); /* checked above */
        at += sprintf(at, px_length ? "*4\r\n$5\r\nGETEX\r\n" : "*2\r\n$3\r\nGET\r\n");
        at = put_bulk(at, key, (size_t)key_length);
        memcpy(at, px, px_length);
        at += px_length;
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
                continue; /* RESP3's null, for a connection that said HELLO 3 */
            } else if (length && line[0] == '-') {
                link_acquire(&link);
                size_t kept = length - 1 < ERROR_TEXT ? length - 1 : ERROR_TEXT;
                PyObject *error = Py_BuildValue("(ny#)", i, line + 1, (Py_ssize_t)kept);
                if (error == NULL || PyList_Append(errors, error) < 0) {
                    failed = -3;
                }
                Py_XDECREF(error);
                link_release(&link);
            } else {
                failed = link_bad_line(&link, "a GETEX answered neither a bulk string nor an error", line, length);
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
