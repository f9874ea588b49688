/* prefixcache._core: the index's per-block loops, compiled (issue 17).
 *
 * - xxh3_128 / xxh3_chain: the block hashes (hashing.py), h_i = xxh3_128(h_{i-1} || tokens_i),
 *   digests in xxHash's canonical (big-endian) byte order, as python-xxhash's xxh3_128_digest.
 * - HashTable: the block map's open-addressing table (blockmap.py) over arrays that Python owns
 *   (numpy, viewed through the buffer protocol): find, get_many, insert_many, insert_prefix, place,
 *   delete_many.
 * - IndexCore: the index's per-row loops over its arrays (index.py): match (probe every hash of
 *   a prompt and verify the chain: parent links, namespace, token ids, TTL, in one call),
 *   add_chain (fill a new chain's rows), touch (log a path in LRU order), pins, eviction's
 *   leaf-first picking (pick_leaves, or pick_lru over the whole touch log) and batch removal
 *   (remove_many).
 * - current_entries: the touch log's scan step (touchlog.py).
 * - copy_rows: blocks' raw bytes into a slot pool's rows (tiers/pool.py); flip_flags: a free
 *   list's flags for the slots it hands out and takes back (tiers/base.py).
 * - resp_set / resp_getex: the Redis tier's pipelines, without the GIL (prefixcache/_resp.c).
 *
 * Arrays come in through the buffer protocol and must be C-contiguous with the expected item
 * type; anything else is a TypeError or ValueError that names the argument. No state lives here
 * beyond the buffers a HashTable or an IndexCore holds (released with it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#include "_resp.h"

#define BUCKET 4     /* cells per bucket (blockmap.BUCKET) */
#define EMPTY (-1)   /* a never-used cell: ends a probe path */
#define DELETED (-2) /* a tombstone: free for an insert, not the end of a search */
#define ROOT (-1)    /* parent of a namespace's first block (index.ROOT) */

/* Stop reasons of `match` (index.py maps them onto MissReason). */
enum { STOP_NONE = 0, STOP_NOT_CACHED = 1, STOP_EXPIRED = 2, STOP_VERIFICATION_FAILED = 3 };

/* ---- buffers ------------------------------------------------------------------------------- */

/* The item kind of a struct-module format code: 'i' signed, 'u' unsigned, 'f' float, 0 other. */
static char
format_kind(const char *format)
{
    if (format == NULL) {
        return 'u'; /* plain bytes */
    }
    if (*format == '@' || *format == '=' || *format == '<') {
        format++;
    }
    if (format[0] == 0 || format[1] != 0) {
        return 0;
    }
    switch (format[0]) {
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n':
        return 'i';
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N':
        return 'u';
    case 'f': case 'd':
        return 'f';
    default:
        return 0;
    }
}

static const char *
kind_name(char kind, Py_ssize_t itemsize)
{
    if (kind == 'i') {
        return itemsize == 1 ? "int8" : itemsize == 2 ? "int16" : itemsize == 4 ? "int32" : "int64";
    }
    if (kind == 'u') {
        return itemsize == 1 ? "uint8" : itemsize == 4 ? "uint32" : "uint64";
    }
    return "float64";
}

/* A C-contiguous buffer of `ndim` dimensions (0: any) whose items are `kind` of `itemsize` bytes.
 * On failure sets a TypeError/ValueError naming `name` and returns -1 (nothing to release). */
static int
get_array(PyObject *obj, const char *name, char kind, Py_ssize_t itemsize, int ndim, int writable, Py_buffer *view)
{
    const char *want = kind_name(kind, itemsize);
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous %s array, got %.100s", name, want,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int flags = PyBUF_FORMAT | PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected a %sC-contiguous %s array, got an unreadable %.100s", name,
                     writable ? "writable " : "", want, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (format_kind(view->format) != kind || view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: expected %s items, got format '%s' of %zd bytes", name, want,
                     view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    if (ndim && view->ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s: expected %d dimension(s), got %d", name, ndim, view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s: must be C-contiguous (pass numpy.ascontiguousarray(...))", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static Py_ssize_t
length_of(const Py_buffer *view)
{
    return view->len / view->itemsize;
}

static int
index_arg(PyObject *obj, const char *name, Py_ssize_t low, Py_ssize_t *out)
{
    Py_ssize_t value = PyLong_Check(obj) ? PyLong_AsSsize_t(obj) : -1;
    if (!PyLong_Check(obj) || (value == -1 && PyErr_Occurred()) || value < low) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: expected an integer >= %zd", name, low);
        return -1;
    }
    *out = value;
    return 0;
}

/* Rows (or slots) given as an int64 array or a list/tuple of ints, each in [0, limit). */
typedef struct {
    const int64_t *rows;
    Py_ssize_t count;
    Py_buffer view;
    int has_view;
    int64_t *owned; /* the converted list or tuple */
} Rows;

static void
release_rows(Rows *r)
{
    if (r->has_view) {
        PyBuffer_Release(&r->view);
        r->has_view = 0;
    }
    PyMem_Free(r->owned);
    r->owned = NULL;
}

static int
get_rows(PyObject *obj, const char *name, Py_ssize_t limit, Rows *r)
{
    memset(r, 0, sizeof(*r));
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        r->count = PySequence_Fast_GET_SIZE(obj);
        PyObject **items = PySequence_Fast_ITEMS(obj);
        r->owned = PyMem_Malloc(sizeof(int64_t) * (size_t)(r->count + 1));
        if (r->owned == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = 0; i < r->count; i++) {
            r->owned[i] = PyLong_AsLongLong(items[i]);
            if (r->owned[i] == -1 && PyErr_Occurred()) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "%s[%zd]: expected an int", name, i);
                release_rows(r);
                return -1;
            }
        }
        r->rows = r->owned;
    } else {
        if (get_array(obj, name, 'i', 8, 1, 0, &r->view) < 0) {
            return -1;
        }
        r->has_view = 1;
        r->rows = r->view.buf;
        r->count = length_of(&r->view);
    }
    for (Py_ssize_t i = 0; i < r->count; i++) {
        if (r->rows[i] < 0 || r->rows[i] >= limit) {
            PyErr_Format(PyExc_ValueError, "%s[%zd]: %lld outside [0, %zd)", name, i, (long long)r->rows[i], limit);
            release_rows(r);
            return -1;
        }
    }
    return 0;
}

/* ---- hashing ------------------------------------------------------------------------------- */

static void
digest_into(const void *data, size_t size, unsigned char *out)
{
    XXH128_canonical_t canonical;
    XXH128_canonicalFromHash(&canonical, XXH3_128bits(data, size));
    memcpy(out, canonical.digest, 16);
}

static PyObject *
core_xxh3_128(PyObject *module, PyObject *arg)
{
    Py_buffer data;
    unsigned char out[16];
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    digest_into(data.buf, (size_t)data.len, out);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, 16);
}

/* xxh3_chain(root, tokens, block_size) -> list[bytes]: the chained digest of every full block. */
static PyObject *
core_xxh3_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer root, tokens;
    Py_ssize_t block_size;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "xxh3_chain(root, tokens, block_size) takes 3 arguments");
        return NULL;
    }
    if (index_arg(args[2], "block_size", 1, &block_size) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &root, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "root: expected bytes, got %.100s", Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    if (get_array(args[1], "tokens", 'u', 4, 1, 0, &tokens) < 0) {
        PyBuffer_Release(&root);
        return NULL;
    }
    Py_ssize_t count = length_of(&tokens) / block_size;
    size_t stride = (size_t)block_size * 4;
    size_t head = root.len > 16 ? (size_t)root.len : 16;
    unsigned char *scratch = PyMem_RawMalloc(head + stride + (size_t)count * 16 + 1);
    PyObject *list = NULL;
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    unsigned char *digests = scratch + head + stride;
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *source = tokens.buf;
    size_t parent = (size_t)root.len;
    memcpy(scratch, root.buf, parent);
    for (Py_ssize_t i = 0; i < count; i++) {
        /* parent digest || block i, hashed as one message */
        memcpy(scratch + parent, source + (size_t)i * stride, stride);
        digest_into(scratch, parent + stride, digests + 16 * i);
        memcpy(scratch, digests + 16 * i, 16);
        parent = 16;
    }
    Py_END_ALLOW_THREADS
    list = PyList_New(count);
    for (Py_ssize_t i = 0; list != NULL && i < count; i++) {
        PyObject *digest = PyBytes_FromStringAndSize((const char *)digests + 16 * i, 16);
        if (digest == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, digest);
    }
done:
    PyMem_RawFree(scratch);
    PyBuffer_Release(&root);
    PyBuffer_Release(&tokens);
    return list;
}

/* ---- the block map's table ------------------------------------------------------------------- */

#define MAX_WORDS 8 /* digests of up to 64 bytes */

typedef struct {
    PyObject_HEAD
    Py_buffer cells_view, cell_of_view, words_view;
    int held; /* the three views are held */
    int32_t *cells;   /* [buckets * BUCKET]: a row, EMPTY or DELETED */
    int32_t *cell_of; /* [capacity]: the cell holding a row, EMPTY when unmapped */
    uint64_t *words;  /* [word_count][capacity]: word k of row r at k * capacity + r */
    Py_ssize_t capacity, buckets, digest_size;
    uint64_t mask;
    int word_count;
} HashTable;

static void
split(const HashTable *t, const char *digest, uint64_t *query)
{
    memset(query, 0, sizeof(uint64_t) * MAX_WORDS);
    memcpy(query, digest, (size_t)t->digest_size);
}

static int
row_is(const HashTable *t, int32_t row, const uint64_t *query)
{
    for (int k = 0; k < t->word_count; k++) {
        if (t->words[(Py_ssize_t)k * t->capacity + row] != query[k]) {
            return 0;
        }
    }
    return 1;
}

/* The cell holding `query`'s row (>= 0), or -1 - the first free cell on its probe path, or
 * PY_SSIZE_T_MIN when the table has neither (it never does: blockmap.py rebuilds before). */
static Py_ssize_t
find(const HashTable *t, const uint64_t *query)
{
    uint64_t bucket = query[0] & t->mask;
    Py_ssize_t free = -1;
    for (Py_ssize_t step = 0; step < t->buckets; step++) {
        int has_empty = 0;
        const int32_t *cells = t->cells + bucket * BUCKET;
        for (int j = 0; j < BUCKET; j++) {
            int32_t row = cells[j];
            if (row < 0) {
                if (free < 0) {
                    free = (Py_ssize_t)(bucket * BUCKET) + j;
                }
                has_empty |= row == EMPTY;
            } else if (row_is(t, row, query)) {
                return (Py_ssize_t)(bucket * BUCKET) + j;
            }
        }
        if (has_empty) { /* nothing on this path overflowed past a bucket with an empty cell */
            return -1 - free;
        }
        bucket = (bucket + 1) & t->mask;
    }
    return free >= 0 ? -1 - free : PY_SSIZE_T_MIN;
}

static int
check_digest(const HashTable *t, PyObject *digest, Py_ssize_t i)
{
    if (!PyBytes_Check(digest) || PyBytes_GET_SIZE(digest) != t->digest_size) {
        PyErr_Format(PyExc_ValueError, "digests[%zd]: expected bytes of length %zd", i, t->digest_size);
        return -1;
    }
    return 0;
}

/* Rows of `digests` (a list or tuple) into `out`, -1 where unmapped (a foreign size never is). */
static int
get_many_into(const HashTable *t, PyObject *digests, int64_t *out)
{
    Py_ssize_t count = PySequence_Fast_GET_SIZE(digests);
    PyObject **items = PySequence_Fast_ITEMS(digests);
    uint64_t query[MAX_WORDS];
    for (Py_ssize_t i = 0; i < count; i++) { /* the home buckets are random: fetch them early */
        if (PyBytes_Check(items[i]) && PyBytes_GET_SIZE(items[i]) == t->digest_size) {
            uint64_t first = 0;
            memcpy(&first, PyBytes_AS_STRING(items[i]), t->digest_size < 8 ? (size_t)t->digest_size : 8);
            __builtin_prefetch(t->cells + (first & t->mask) * BUCKET);
        }
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        out[i] = -1;
        if (!PyBytes_Check(items[i]) || PyBytes_GET_SIZE(items[i]) != t->digest_size) {
            continue;
        }
        split(t, PyBytes_AS_STRING(items[i]), query);
        Py_ssize_t cell = find(t, query);
        if (cell >= 0) {
            out[i] = t->cells[cell];
        }
    }
    return 0;
}

static void
table_release(HashTable *t)
{
    if (t->held) {
        PyBuffer_Release(&t->cells_view);
        PyBuffer_Release(&t->cell_of_view);
        PyBuffer_Release(&t->words_view);
        t->held = 0;
    }
}

static int
table_init(HashTable *t, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"cells", "cell_of", "words", "digest_size", NULL};
    PyObject *cells, *cell_of, *words;
    Py_ssize_t digest_size;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOn", names, &cells, &cell_of, &words, &digest_size)) {
        return -1;
    }
    table_release(t);
    if (digest_size < 1 || digest_size > 8 * MAX_WORDS) {
        PyErr_Format(PyExc_ValueError, "digest_size: expected 1..%d bytes, got %zd", 8 * MAX_WORDS, digest_size);
        return -1;
    }
    if (get_array(cells, "cells", 'i', 4, 0, 1, &t->cells_view) < 0) {
        return -1;
    }
    if (get_array(cell_of, "cell_of", 'i', 4, 1, 1, &t->cell_of_view) < 0) {
        PyBuffer_Release(&t->cells_view);
        return -1;
    }
    if (get_array(words, "words", 'u', 8, 0, 1, &t->words_view) < 0) {
        PyBuffer_Release(&t->cells_view);
        PyBuffer_Release(&t->cell_of_view);
        return -1;
    }
    t->held = 1;
    t->digest_size = digest_size;
    t->word_count = (int)((digest_size + 7) / 8);
    t->capacity = length_of(&t->cell_of_view);
    t->buckets = length_of(&t->cells_view) / BUCKET;
    if (t->buckets < 1 || t->buckets * BUCKET != length_of(&t->cells_view) || (t->buckets & (t->buckets - 1))) {
        PyErr_SetString(PyExc_ValueError, "cells: expected a power of two of 4-cell buckets");
        table_release(t);
        return -1;
    }
    if (length_of(&t->words_view) != (Py_ssize_t)t->word_count * t->capacity) {
        PyErr_Format(PyExc_ValueError, "words: expected %d x %zd words", t->word_count, t->capacity);
        table_release(t);
        return -1;
    }
    t->cells = t->cells_view.buf;
    t->cell_of = t->cell_of_view.buf;
    t->words = t->words_view.buf;
    t->mask = (uint64_t)t->buckets - 1;
    return 0;
}

static void
table_dealloc(HashTable *t)
{
    table_release(t);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int
ready(const HashTable *t)
{
    if (!t->held) {
        PyErr_SetString(PyExc_RuntimeError, "HashTable is not initialised");
        return 0;
    }
    return 1;
}

/* get(digest) -> row or -1 */
static PyObject *
table_get(HashTable *t, PyObject *digest)
{
    uint64_t query[MAX_WORDS];
    if (!ready(t)) {
        return NULL;
    }
    if (!PyBytes_Check(digest) || PyBytes_GET_SIZE(digest) != t->digest_size) {
        return PyLong_FromLong(-1);
    }
    split(t, PyBytes_AS_STRING(digest), query);
    Py_ssize_t cell = find(t, query);
    return PyLong_FromLong(cell >= 0 ? t->cells[cell] : -1);
}

/* get_many(digests, out): out[i] = row of digests[i], -1 where unmapped. */
static PyObject *
table_get_many(HashTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer out;
    if (!ready(t)) {
        return NULL;
    }
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "get_many(digests, out) takes 2 arguments");
        return NULL;
    }
    PyObject *digests = PySequence_Fast(args[0], "digests: expected a list of bytes");
    if (digests == NULL) {
        return NULL;
    }
    if (get_array(args[1], "out", 'i', 8, 1, 1, &out) < 0) {
        Py_DECREF(digests);
        return NULL;
    }
    if (length_of(&out) != PySequence_Fast_GET_SIZE(digests)) {
        PyErr_SetString(PyExc_ValueError, "out: expected one int64 per digest");
    } else {
        get_many_into(t, digests, out.buf);
    }
    PyBuffer_Release(&out);
    Py_DECREF(digests);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Put unmapped `row` (its words already written) into the first free cell of its probe path;
 * returns 1 when that cell was EMPTY (0 for a tombstone), -1 with an error when none is free. */
static int
place_row(HashTable *t, int32_t row, Py_ssize_t cell)
{
    if (cell == PY_SSIZE_T_MIN) {
        PyErr_SetString(PyExc_RuntimeError, "block map table has no free cell");
        return -1;
    }
    int was_empty = t->cells[cell] == EMPTY;
    t->cells[cell] = row;
    t->cell_of[row] = (int32_t)cell;
    return was_empty;
}

/* Map digests[i] to rows[i] (unmapped rows) in order. At a digest mapped already or repeated in
 * the batch: with `prefix`, stop there (the rest stay unmapped); without, raise KeyError and undo
 * the batch. ValueError for a digest of a foreign size or a row out of range or mapped (nothing
 * changed). Sets *inserted and *used (EMPTY cells taken); -1 with an error set. */
static int
insert_rows(HashTable *t, PyObject *const *args, Py_ssize_t nargs, int prefix, Py_ssize_t *inserted, long *used)
{
    Rows rows_view;
    if (!ready(t)) {
        return -1;
    }
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s(digests, rows) takes 2 arguments", prefix ? "insert_prefix" : "insert_many");
        return -1;
    }
    PyObject *digests = PySequence_Fast(args[0], "digests: expected a list of bytes");
    if (digests == NULL) {
        return -1;
    }
    if (get_rows(args[1], "rows", t->capacity, &rows_view) < 0) {
        Py_DECREF(digests);
        return -1;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(digests);
    PyObject **items = PySequence_Fast_ITEMS(digests);
    const int64_t *rows = rows_view.rows;
    Py_ssize_t *undo = NULL; /* [cell, previous content] per placed digest */
    Py_ssize_t i = 0;
    *used = 0;
    if (rows_view.count != count) {
        PyErr_SetString(PyExc_ValueError, "rows: expected one row per digest");
        goto fail;
    }
    for (i = 0; i < count; i++) {
        if (check_digest(t, items[i], i) < 0) {
            goto fail;
        }
        if (t->cell_of[rows[i]] != EMPTY) {
            PyErr_Format(PyExc_ValueError, "rows[%zd]: %lld is out of range or mapped already", i,
                         (long long)rows[i]);
            goto fail;
        }
    }
    undo = PyMem_Malloc(sizeof(Py_ssize_t) * 2 * (size_t)(count + 1));
    if (undo == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    uint64_t query[MAX_WORDS];
    for (i = 0; i < count; i++) {
        split(t, PyBytes_AS_STRING(items[i]), query);
        Py_ssize_t cell = find(t, query);
        int was_empty = -1;
        if (cell >= 0) { /* mapped already, or placed earlier in this batch */
            if (prefix) {
                break;
            }
            PyErr_SetString(PyExc_KeyError, "digest already mapped (or repeated in the batch)");
        } else {
            cell = cell == PY_SSIZE_T_MIN ? cell : -1 - cell;
            int32_t previous = cell >= 0 ? t->cells[cell] : EMPTY;
            was_empty = place_row(t, (int32_t)rows[i], cell);
            undo[2 * i] = cell;
            undo[2 * i + 1] = previous;
        }
        if (was_empty < 0) {
            for (Py_ssize_t j = i - 1; j >= 0; j--) { /* all or nothing */
                t->cells[undo[2 * j]] = (int32_t)undo[2 * j + 1];
                t->cell_of[rows[j]] = EMPTY;
            }
            goto fail;
        }
        *used += was_empty;
        for (int k = 0; k < t->word_count; k++) {
            t->words[(Py_ssize_t)k * t->capacity + rows[i]] = query[k];
        }
    }
    *inserted = i;
    PyMem_Free(undo);
    release_rows(&rows_view);
    Py_DECREF(digests);
    return 0;
fail:
    PyMem_Free(undo);
    release_rows(&rows_view);
    Py_DECREF(digests);
    return -1;
}

/* insert_many(digests, rows) -> EMPTY cells used: every digest, all or nothing (KeyError at a
 * digest mapped already or repeated in the batch). */
static PyObject *
table_insert_many(HashTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t inserted;
    long used;
    if (insert_rows(t, args, nargs, 0, &inserted, &used) < 0) {
        return NULL;
    }
    return PyLong_FromLong(used);
}

/* insert_prefix(digests, rows) -> (inserted, EMPTY cells used): the leading digests up to (not
 * including) the first one mapped already or repeated among those before it. */
static PyObject *
table_insert_prefix(HashTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t inserted;
    long used;
    if (insert_rows(t, args, nargs, 1, &inserted, &used) < 0) {
        return NULL;
    }
    return Py_BuildValue("(nl)", inserted, used);
}

/* place(rows) -> EMPTY cells used: put unmapped rows whose words are stored (a rebuild) back. */
static PyObject *
table_place(HashTable *t, PyObject *arg)
{
    Py_buffer rows_view;
    if (!ready(t) || get_array(arg, "rows", 'i', 8, 1, 0, &rows_view) < 0) {
        return NULL;
    }
    const int64_t *rows = rows_view.buf;
    long used = 0;
    uint64_t query[MAX_WORDS];
    for (Py_ssize_t i = 0; i < length_of(&rows_view); i++) {
        if (rows[i] < 0 || rows[i] >= t->capacity || t->cell_of[rows[i]] != EMPTY) {
            PyErr_Format(PyExc_ValueError, "rows[%zd]: %lld is out of range or mapped already", i,
                         (long long)rows[i]);
            break;
        }
        memset(query, 0, sizeof(query));
        for (int k = 0; k < t->word_count; k++) {
            query[k] = t->words[(Py_ssize_t)k * t->capacity + rows[i]];
        }
        Py_ssize_t cell = find(t, query);
        if (cell >= 0) {
            PyErr_Format(PyExc_ValueError, "rows[%zd]: its digest is mapped already", i);
            break;
        }
        int was_empty = place_row(t, (int32_t)rows[i], cell == PY_SSIZE_T_MIN ? cell : -1 - cell);
        if (was_empty < 0) {
            break;
        }
        used += was_empty;
    }
    PyBuffer_Release(&rows_view);
    return PyErr_Occurred() ? NULL : PyLong_FromLong(used);
}

/* delete_many(rows): unmap distinct mapped rows (each cell becomes a tombstone); KeyError,
 * changing nothing, if one is not mapped or repeats. O(n): a repeat finds its cell already a
 * tombstone, and the cells before it are put back. */
static PyObject *
table_delete_many(HashTable *t, PyObject *arg)
{
    Rows r;
    if (!ready(t) || get_rows(arg, "rows", t->capacity, &r) < 0) {
        return NULL;
    }
    Py_ssize_t i = 0;
    for (; i < r.count; i++) {
        int32_t cell = t->cell_of[r.rows[i]];
        if (cell < 0 || t->cells[cell] != r.rows[i]) {
            PyErr_Format(PyExc_KeyError, "rows[%zd]: %lld is not mapped, or repeats", i, (long long)r.rows[i]);
            break;
        }
        t->cells[cell] = DELETED;
    }
    for (Py_ssize_t j = 0; j < r.count; j++) {
        if (i < r.count) {
            if (j < i) {
                t->cells[t->cell_of[r.rows[j]]] = (int32_t)r.rows[j]; /* refused: put the cells back */
            }
        } else {
            t->cell_of[r.rows[j]] = EMPTY;
        }
    }
    release_rows(&r);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef table_methods[] = {
    {"get", (PyCFunction)table_get, METH_O, "get(digest) -> row, or -1 when unmapped"},
    {"get_many", (PyCFunction)(void (*)(void))table_get_many, METH_FASTCALL,
     "get_many(digests, out): out[i] = row of digests[i] (int64), -1 when unmapped"},
    {"insert_many", (PyCFunction)(void (*)(void))table_insert_many, METH_FASTCALL,
     "insert_many(digests, rows) -> EMPTY cells used; KeyError (nothing changed) on a mapped or repeated digest"},
    {"insert_prefix", (PyCFunction)(void (*)(void))table_insert_prefix, METH_FASTCALL,
     "insert_prefix(digests, rows) -> (inserted, EMPTY cells used): up to the first mapped or repeated digest"},
    {"delete_many", (PyCFunction)table_delete_many, METH_O,
     "delete_many(rows): unmap distinct mapped rows; KeyError (nothing changed) on an unmapped or repeated row"},
    {"place", (PyCFunction)table_place, METH_O,
     "place(rows) -> EMPTY cells used: re-place unmapped rows by their stored digests"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HashTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefixcache._core.HashTable",
    .tp_doc = "HashTable(cells, cell_of, words, digest_size): the block map's table over caller-owned arrays",
    .tp_basicsize = sizeof(HashTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)table_init,
    .tp_dealloc = (destructor)table_dealloc,
    .tp_methods = table_methods,
};

/* ---- the index's rows ---------------------------------------------------------------------- */

/* IndexCore(table, parent, namespace, tier, slot, tick, last_access, pins, children, tokens):
 * the per-row arrays of one RadixIndex (index.py), held for the object's life (numpy arrays of
 * fixed size: the pointers stay valid). */
enum { A_PARENT, A_NAMESPACE, A_TIER, A_SLOT, A_TICK, A_ACCESS, A_PINS, A_CHILDREN, A_TOKENS, A_COUNT };

static const struct {
    const char *name;
    char kind;
    Py_ssize_t itemsize;
    int ndim;
} index_arrays[A_COUNT] = {
    {"parent", 'i', 4, 1},  {"namespace", 'i', 2, 1},   {"tier", 'i', 1, 1}, {"slot", 'i', 4, 1},
    {"tick", 'i', 8, 1},    {"last_access", 'f', 8, 1}, {"pins", 'i', 4, 1}, {"children", 'i', 4, 1},
    {"tokens", 'u', 4, 2},
};

typedef struct {
    PyObject_HEAD
    HashTable *table;
    Py_buffer views[A_COUNT];
    int held;
    Py_ssize_t capacity, block_size;
    int32_t *parent, *slot, *pins, *children;
    int16_t *namespace;
    int8_t *tier;
    int64_t *tick;
    double *access;
    uint32_t *tokens;
    int32_t *gone; /* pick_leaves: children of each row picked so far (zero between picks); lazy */
} IndexCore;

static void
index_release(IndexCore *x)
{
    for (int a = 0; a < x->held; a++) {
        PyBuffer_Release(&x->views[a]);
    }
    x->held = 0;
    Py_CLEAR(x->table);
    PyMem_RawFree(x->gone);
    x->gone = NULL;
}

static int
index_init(IndexCore *x, PyObject *args, PyObject *kwargs)
{
    PyObject *objects[A_COUNT + 1];
    index_release(x);
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "IndexCore takes positional arguments only");
        return -1;
    }
    if (!PyArg_UnpackTuple(args, "IndexCore", A_COUNT + 1, A_COUNT + 1, &objects[0], &objects[1], &objects[2],
                           &objects[3], &objects[4], &objects[5], &objects[6], &objects[7], &objects[8], &objects[9])) {
        return -1;
    }
    if (!PyObject_TypeCheck(objects[0], &HashTableType) || !((HashTable *)objects[0])->held) {
        PyErr_SetString(PyExc_TypeError, "table: expected an initialised HashTable");
        return -1;
    }
    for (int a = 0; a < A_COUNT; a++) {
        if (get_array(objects[a + 1], index_arrays[a].name, index_arrays[a].kind, index_arrays[a].itemsize,
                      index_arrays[a].ndim, 1, &x->views[a]) < 0) {
            index_release(x);
            return -1;
        }
        x->held = a + 1;
    }
    x->table = (HashTable *)objects[0];
    Py_INCREF(x->table);
    x->capacity = x->table->capacity;
    x->block_size = x->views[A_TOKENS].shape[1];
    for (int a = 0; a < A_COUNT; a++) {
        Py_ssize_t rows = a == A_TOKENS ? x->views[a].shape[0] : length_of(&x->views[a]);
        if (rows != x->capacity) {
            PyErr_Format(PyExc_ValueError, "%s: expected %zd rows (the table's capacity), got %zd",
                         index_arrays[a].name, x->capacity, rows);
            index_release(x);
            return -1;
        }
    }
    x->parent = x->views[A_PARENT].buf;
    x->namespace = x->views[A_NAMESPACE].buf;
    x->tier = x->views[A_TIER].buf;
    x->slot = x->views[A_SLOT].buf;
    x->tick = x->views[A_TICK].buf;
    x->access = x->views[A_ACCESS].buf;
    x->pins = x->views[A_PINS].buf;
    x->children = x->views[A_CHILDREN].buf;
    x->tokens = x->views[A_TOKENS].buf;
    return 0;
}

static void
index_dealloc(IndexCore *x)
{
    index_release(x);
    Py_TYPE(x)->tp_free((PyObject *)x);
}

static int
index_ready(const IndexCore *x)
{
    if (!x->held || !x->table->held) {
        PyErr_SetString(PyExc_RuntimeError, "IndexCore is not initialised");
        return 0;
    }
    return 1;
}

/* A C-contiguous [rows, block_size] uint32 buffer with at least `rows` rows. */
static int
get_blocks(const IndexCore *x, PyObject *obj, Py_ssize_t rows, Py_buffer *view)
{
    if (get_array(obj, "blocks", 'u', 4, 2, 0, view) < 0) {
        return -1;
    }
    if (view->shape[1] != x->block_size || view->shape[0] < rows) {
        PyErr_Format(PyExc_ValueError, "blocks: expected at least %zd rows of %zd tokens, got [%zd, %zd]", rows,
                     x->block_size, view->shape[0], view->shape[1]);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* match(digests, blocks, ns, oldest, found[, extra]) -> (matched, stop)
 * found[i] = the table's row for digests[i] (-1 absent), for every digest. The match is the
 * longest prefix of found that is all present, starts at a ROOT row of namespace `ns`, links
 * each row to the one before (parent), holds the prompt's tokens (blocks[i] == tokens[row]) and
 * was used at or after `oldest`; it stops at the first failing row, verification winning ties
 * with expiry. stop: 0 every digest matched, 1 not cached, 2 expired, 3 verification failed.
 * extra (float64, one per row): seconds a row is kept past `oldest` (a retention hint): it has
 * expired only when used before oldest - extra[row]. */
static PyObject *
index_match(IndexCore *x, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer blocks_v, found_v, extra_v;
    const double *extra = NULL;
    if (!index_ready(x)) {
        return NULL;
    }
    if (nargs != 5 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "match(digests, blocks, ns, oldest, found[, extra]) takes 5 or 6 arguments");
        return NULL;
    }
    if (!PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "ns: expected an int");
        return NULL;
    }
    long ns = PyLong_AsLong(args[2]);
    double oldest = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "ns: expected an int, oldest: expected a float");
        return NULL;
    }
    PyObject *digests = PySequence_Fast(args[0], "digests: expected a list of bytes");
    if (digests == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(digests);
    PyObject *result = NULL;
    if (get_blocks(x, args[1], count, &blocks_v) < 0) {
        goto no_blocks;
    }
    if (get_array(args[4], "found", 'i', 8, 1, 1, &found_v) < 0) {
        goto no_found;
    }
    if (length_of(&found_v) != count) {
        PyErr_SetString(PyExc_ValueError, "found: expected one int64 per digest");
        goto done;
    }
    if (nargs == 6) {
        if (get_array(args[5], "extra", 'f', 8, 1, 0, &extra_v) < 0) {
            goto done;
        }
        if (length_of(&extra_v) != x->capacity) {
            PyBuffer_Release(&extra_v);
            PyErr_SetString(PyExc_ValueError, "extra: expected one float64 per row");
            goto done;
        }
        extra = extra_v.buf;
    }
    int64_t *found = found_v.buf;
    get_many_into(x->table, digests, found);
    const uint32_t *blocks = blocks_v.buf;
    Py_ssize_t bs = x->block_size;
    int stop = STOP_NONE;
    Py_ssize_t matched = 0;
    for (; matched < count; matched++) {
        int64_t row = found[matched];
        if (row < 0) {
            stop = STOP_NOT_CACHED;
            break;
        }
        int64_t expected_parent = matched ? found[matched - 1] : ROOT;
        if (x->parent[row] != expected_parent || (matched == 0 && x->namespace[row] != ns) ||
            memcmp(x->tokens + row * bs, blocks + matched * bs, (size_t)bs * sizeof(uint32_t)) != 0) {
            stop = STOP_VERIFICATION_FAILED;
            break;
        }
        if (x->access[row] < oldest && x->pins[row] == 0 && /* pinned: expire() keeps it, so it matches */
            (extra == NULL || x->access[row] < oldest - extra[row])) {
            stop = STOP_EXPIRED;
            break;
        }
    }
    result = Py_BuildValue("(ni)", matched, stop);
    if (extra != NULL) {
        PyBuffer_Release(&extra_v);
    }
done:
    PyBuffer_Release(&found_v);
no_found:
    PyBuffer_Release(&blocks_v);
no_blocks:
    Py_DECREF(digests);
    return result;
}

/* add_chain(rows, parent, ns, tier, slots, blocks, now): fill the rows of a chain just mapped in
 * the table (block i+1 the child of block i, the first the child of `parent`, ROOT or a live row):
 * links, namespace, tier, slots, tokens, time; tick 0 and no pins (the caller touches the path);
 * children 1 but the last's 0, and one more child for `parent`. */
static PyObject *
index_add_chain(IndexCore *x, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer blocks_v;
    Rows rows_v, slots_v;
    if (!index_ready(x)) {
        return NULL;
    }
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "add_chain(rows, parent, ns, tier, slots, blocks, now) takes 7 arguments");
        return NULL;
    }
    long parent = PyLong_Check(args[1]) ? PyLong_AsLong(args[1]) : -2;
    long ns = PyLong_Check(args[2]) ? PyLong_AsLong(args[2]) : -1;
    long tier = PyLong_Check(args[3]) ? PyLong_AsLong(args[3]) : -1;
    double now = PyFloat_AsDouble(args[6]);
    if (PyErr_Occurred() || parent < ROOT || parent >= x->capacity || ns < 0 || ns > INT16_MAX || tier < 0 ||
        tier > INT8_MAX) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "parent: expected ROOT or a row, ns: a namespace row, tier: a tier, now: "
                                          "a float");
        return NULL;
    }
    if (get_rows(args[0], "rows", x->capacity, &rows_v) < 0) {
        return NULL;
    }
    Py_ssize_t count = rows_v.count;
    PyObject *result = NULL;
    if (get_rows(args[4], "slots", INT32_MAX, &slots_v) < 0) {
        goto no_slots;
    }
    if (get_blocks(x, args[5], count, &blocks_v) < 0) {
        goto no_blocks;
    }
    if (slots_v.count != count) {
        PyErr_SetString(PyExc_ValueError, "slots: expected one slot per row");
        goto done;
    }
    const int64_t *rows = rows_v.rows, *slots = slots_v.rows;
    const uint32_t *blocks = blocks_v.buf;
    Py_ssize_t bs = x->block_size;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t row = rows[i];
        x->parent[row] = (int32_t)(i ? rows[i - 1] : parent);
        x->namespace[row] = (int16_t)ns;
        x->tier[row] = (int8_t)tier;
        x->slot[row] = (int32_t)slots[i];
        x->access[row] = now;
        x->tick[row] = 0; /* below every logged tick, and not in the LRU scan until touched */
        x->pins[row] = 0;
        x->children[row] = i + 1 < count;
        memcpy(x->tokens + row * bs, blocks + i * bs, (size_t)bs * sizeof(uint32_t));
    }
    if (count && parent != ROOT) {
        x->children[parent] += 1;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&blocks_v);
no_blocks:
    release_rows(&slots_v);
no_slots:
    release_rows(&rows_v);
    return result;
}

/* touch(log_rows, path, position, tick, now): log the root-first `path` leaf first at
 * log_rows[position..] (a touch log's entries, touchlog.py), giving the entry at position + j the
 * tick `tick + j`, and mark the path used at `now`. */
static PyObject *
index_touch(IndexCore *x, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer log_v;
    Rows path_v;
    Py_ssize_t position;
    if (!index_ready(x)) {
        return NULL;
    }
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "touch(log_rows, path, position, tick, now) takes 5 arguments");
        return NULL;
    }
    if (index_arg(args[2], "position", 0, &position) < 0) {
        return NULL;
    }
    long long tick = PyLong_Check(args[3]) ? PyLong_AsLongLong(args[3]) : -1;
    double now = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred() || tick < 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "tick: expected an integer >= 0, now: a float");
        return NULL;
    }
    if (get_array(args[0], "log_rows", 'i', 4, 1, 1, &log_v) < 0) {
        return NULL;
    }
    if (get_rows(args[1], "path", x->capacity, &path_v) < 0) {
        PyBuffer_Release(&log_v);
        return NULL;
    }
    Py_ssize_t count = path_v.count;
    if (position + count > length_of(&log_v)) {
        PyErr_Format(PyExc_ValueError, "position: %zd entries from %zd overrun the log's %zd", count, position,
                     length_of(&log_v));
    } else {
        const int64_t *path = path_v.rows;
        int32_t *log = log_v.buf;
        for (Py_ssize_t j = 0; j < count; j++) {
            int64_t row = path[count - 1 - j];
            log[position + j] = (int32_t)row;
            x->tick[row] = tick + j;
            x->access[row] = now;
        }
    }
    release_rows(&path_v);
    PyBuffer_Release(&log_v);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* pin(path): one more pin on each row of a path (a path holds no row twice). */
static PyObject *
index_pin(IndexCore *x, PyObject *path)
{
    Rows r;
    if (!index_ready(x) || get_rows(path, "path", x->capacity, &r) < 0) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < r.count; i++) {
        x->pins[r.rows[i]] += 1;
    }
    release_rows(&r);
    Py_RETURN_NONE;
}

/* unpin(path): one pin less on each row; RuntimeError, changing nothing, if one has none. */
static PyObject *
index_unpin(IndexCore *x, PyObject *path)
{
    Rows r;
    if (!index_ready(x) || get_rows(path, "path", x->capacity, &r) < 0) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < r.count; i++) {
        if (x->pins[r.rows[i]] <= 0) {
            release_rows(&r);
            PyErr_SetString(PyExc_RuntimeError, "unpinned more than pinned");
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < r.count; i++) {
        x->pins[r.rows[i]] -= 1;
    }
    release_rows(&r);
    Py_RETURN_NONE;
}

/* x->gone, allocated at its first use (zero between calls of the kernels that use it). */
static int
scratch(IndexCore *x)
{
    if (x->gone == NULL && (x->gone = PyMem_RawCalloc((size_t)x->capacity + 1, sizeof(int32_t))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

#define MEMBER (1 << 30) /* remove_many's mark in x->gone (a row's child count stays below it) */

/* remove_many(rows): retire distinct live, unpinned rows each of whose children is among them
 * (what removing each leaf in turn, descendants first, leaves behind): tier -1, one child less
 * for each parent. Checked before any change (KeyError on a repeat, RuntimeError otherwise).
 * The block map's cells are the caller's (BlockMap.delete_many). O(n) in the rows given: x->gone
 * (zero between calls) marks the rows and counts each one's children among them. */
static PyObject *
index_remove_many(IndexCore *x, PyObject *arg)
{
    Rows r;
    if (!index_ready(x)) {
        return NULL;
    }
    if (scratch(x) < 0) {
        return NULL;
    }
    if (get_rows(arg, "rows", x->capacity, &r) < 0) {
        return NULL;
    }
    Py_ssize_t n = r.count, marked = 0;
    int32_t *gone = x->gone;
    for (; marked < n; marked++) {
        int64_t row = r.rows[marked];
        if (x->tier[row] < 0) {
            PyErr_SetString(PyExc_RuntimeError, "a node to remove is not live");
            goto done;
        }
        if (gone[row] & MEMBER) {
            PyErr_Format(PyExc_KeyError, "rows: %lld repeats", (long long)row);
            goto done;
        }
        gone[row] |= MEMBER;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t parent = x->parent[r.rows[i]];
        if (parent != ROOT && (gone[parent] & MEMBER)) {
            gone[parent] += 1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = r.rows[i];
        if (x->children[row] != (gone[row] & ~MEMBER) || x->pins[row]) {
            PyErr_SetString(PyExc_RuntimeError, "nodes to remove have children outside them, or pins");
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = r.rows[i];
        if (x->parent[row] != ROOT) {
            x->children[x->parent[row]] -= 1;
        }
        x->tier[row] = -1;
    }
done:
    for (Py_ssize_t i = 0; i < marked; i++) {
        gone[r.rows[i]] = 0; /* rows past `marked` were never marked (a repeat's first is cleared here) */
    }
    release_rows(&r);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* A row goes when it has no children or all of them were picked before it (x->gone counts them). */
static inline void
pick_leaf(IndexCore *x, int64_t row, int64_t *out, Py_ssize_t *count)
{
    int32_t kids = x->children[row];
    if (kids == 0 || kids == x->gone[row]) {
        out[(*count)++] = row;
        if (x->parent[row] != ROOT) {
            x->gone[x->parent[row]] += 1;
        }
    }
}

/* pick_leaves(nodes, out, count) -> count: extend the victims out[:count] from `nodes` (eligible
 * rows in LRU order, one touch-log chunk) as evicting each in turn would: a row goes when it has
 * no children or all of them were picked before it; stops when out is full. forget_picks(victims)
 * must follow the last pick (it zeroes the per-row counts the picks left). */
static PyObject *
index_pick_leaves(IndexCore *x, PyObject *const *args, Py_ssize_t nargs)
{
    Rows nodes;
    Py_buffer out_v;
    Py_ssize_t count = 0;
    if (!index_ready(x)) {
        return NULL;
    }
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "pick_leaves(nodes, out, count) takes 3 arguments");
        return NULL;
    }
    if (scratch(x) < 0) {
        return NULL;
    }
    if (get_rows(args[0], "nodes", x->capacity, &nodes) < 0) {
        return NULL;
    }
    if (get_array(args[1], "out", 'i', 8, 1, 1, &out_v) < 0) {
        release_rows(&nodes);
        return NULL;
    }
    if (index_arg(args[2], "count", 0, &count) == 0 && count > length_of(&out_v)) {
        PyErr_SetString(PyExc_ValueError, "count: more than out holds");
    }
    if (!PyErr_Occurred()) {
        int64_t *out = out_v.buf;
        Py_ssize_t size = length_of(&out_v);
        for (Py_ssize_t i = 0; i < nodes.count && count < size; i++) {
            pick_leaf(x, nodes.rows[i], out, &count);
        }
    }
    PyBuffer_Release(&out_v);
    release_rows(&nodes);
    return PyErr_Occurred() ? NULL : PyLong_FromSsize_t(count);
}

static void
forget(IndexCore *x, const int64_t *victims, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; x->gone != NULL && i < count; i++) {
        int32_t parent = x->parent[victims[i]];
        if (parent != ROOT) {
            x->gone[parent] = 0;
        }
    }
}

/* forget_picks(victims): zero the counts pick_leaves left (call before the rows are reused). */
static PyObject *
index_forget_picks(IndexCore *x, PyObject *arg)
{
    Rows victims;
    if (!index_ready(x) || get_rows(arg, "victims", x->capacity, &victims) < 0) {
        return NULL;
    }
    forget(x, victims.rows, victims.count);
    release_rows(&victims);
    Py_RETURN_NONE;
}

/* pick_lru(log_rows, position, end, base, tier, out) -> (count, head): pick_leaves over the whole
 * touch log (touchlog.py) from `position` in one call, then forget_picks: the current entries of
 * log_rows[position:end] (live rows still carrying tick base + their position) whose row is in
 * `tier` and unpinned, in log (LRU) order, until out is full. `head`: the first current entry's
 * position (where the scan stopped if none), where the log may start from now. What the chunked scan with
 * pick_leaves gives, without a Python step per chunk. */
static PyObject *
index_pick_lru(IndexCore *x, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer log_v, out_v;
    Py_ssize_t position, end, tier;
    Py_ssize_t base;
    if (!index_ready(x)) {
        return NULL;
    }
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "pick_lru(log_rows, position, end, base, tier, out) takes 6 arguments");
        return NULL;
    }
    if (index_arg(args[1], "position", 0, &position) < 0 || index_arg(args[2], "end", position, &end) < 0 ||
        index_arg(args[4], "tier", 0, &tier) < 0) {
        return NULL;
    }
    if (index_arg(args[3], "base", 0, &base) < 0) {
        return NULL;
    }
    if (scratch(x) < 0) {
        return NULL;
    }
    if (get_array(args[0], "log_rows", 'i', 4, 1, 0, &log_v) < 0) {
        return NULL;
    }
    if (get_array(args[5], "out", 'i', 8, 1, 1, &out_v) < 0) {
        PyBuffer_Release(&log_v);
        return NULL;
    }
    PyObject *result = NULL;
    if (end > length_of(&log_v)) {
        PyErr_SetString(PyExc_ValueError, "end: past the log");
    } else {
        const int32_t *log = log_v.buf;
        int64_t *out = out_v.buf;
        Py_ssize_t size = length_of(&out_v), count = 0, head = -1, j;
        for (j = position; j < end && count < size; j++) {
            int32_t row = log[j];
            if (row < 0 || row >= x->capacity || x->tier[row] < 0 || x->tick[row] != base + j) {
                continue; /* stale: the row was touched again, or removed */
            }
            if (head < 0) {
                head = j;
            }
            if (x->tier[row] == tier && !x->pins[row]) {
                pick_leaf(x, row, out, &count);
            }
        }
        forget(x, out, count);
        result = Py_BuildValue("(nn)", count, head < 0 ? j : head);
    }
    PyBuffer_Release(&out_v);
    PyBuffer_Release(&log_v);
    return result;
}

static PyMethodDef index_methods[] = {
    {"match", (PyCFunction)(void (*)(void))index_match, METH_FASTCALL,
     "match(digests, blocks, ns, oldest, found) -> (matched, stop): probe and verify a prompt's chain"},
    {"add_chain", (PyCFunction)(void (*)(void))index_add_chain, METH_FASTCALL,
     "add_chain(rows, parent, ns, tier, slots, blocks, now): fill the rows of a newly mapped chain"},
    {"touch", (PyCFunction)(void (*)(void))index_touch, METH_FASTCALL,
     "touch(log_rows, path, position, tick, now): log a root-first path leaf first and mark it used"},
    {"pin", (PyCFunction)index_pin, METH_O, "pin(path): one more pin on each row"},
    {"unpin", (PyCFunction)index_unpin, METH_O, "unpin(path): one pin less on each row (RuntimeError if one has none)"},
    {"pick_leaves", (PyCFunction)(void (*)(void))index_pick_leaves, METH_FASTCALL,
     "pick_leaves(nodes, out, count) -> count: leaf-first victims from an LRU chunk"},
    {"forget_picks", (PyCFunction)index_forget_picks, METH_O, "forget_picks(victims): end a pick"},
    {"pick_lru", (PyCFunction)(void (*)(void))index_pick_lru, METH_FASTCALL,
     "pick_lru(log_rows, position, end, base, tier, out) -> (count, head): leaf-first LRU victims of a tier"},
    {"remove_many", (PyCFunction)index_remove_many, METH_O,
     "remove_many(rows): retire live unpinned rows closed under children (the map's cells are the caller's)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IndexCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "prefixcache._core.IndexCore",
    .tp_doc = "IndexCore(table, parent, namespace, tier, slot, tick, last_access, pins, children, tokens): "
              "kernels over one index's rows",
    .tp_basicsize = sizeof(IndexCore),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)index_init,
    .tp_dealloc = (destructor)index_dealloc,
    .tp_methods = index_methods,
};

/* ---- the touch log ---------------------------------------------------------------------------- */

/* current_entries(log_rows, tick, tier, position, stop, base, out) -> (count, leading)
 * The touch log's (touchlog.py) current entries among log_rows[position:stop]: a row that is live
 * (tier >= 0) and still carries the entry's tick (base + its position), into out[:count] in log
 * order; `leading` counts the entries before the first current one (stop - position if none). */
static PyObject *
core_current_entries(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer log_v, tick_v, tier_v, out_v;
    Py_ssize_t position, stop;
    Py_ssize_t base;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "current_entries(log_rows, tick, tier, position, stop, base, out) takes 7 "
                                         "arguments");
        return NULL;
    }
    if (index_arg(args[3], "position", 0, &position) < 0 || index_arg(args[4], "stop", position, &stop) < 0) {
        return NULL;
    }
    if (index_arg(args[5], "base", 0, &base) < 0) {
        return NULL;
    }
    if (get_array(args[0], "log_rows", 'i', 4, 1, 0, &log_v) < 0) {
        return NULL;
    }
    PyObject *result = NULL;
    if (get_array(args[1], "tick", 'i', 8, 1, 0, &tick_v) < 0) {
        goto no_tick;
    }
    if (get_array(args[2], "tier", 'i', 1, 1, 0, &tier_v) < 0) {
        goto no_tier;
    }
    if (get_array(args[6], "out", 'i', 8, 1, 1, &out_v) < 0) {
        goto no_out;
    }
    Py_ssize_t rows = length_of(&tick_v);
    if (length_of(&tier_v) != rows) {
        PyErr_SetString(PyExc_ValueError, "tier: expected as many rows as tick");
        goto done;
    }
    if (stop > length_of(&log_v) || length_of(&out_v) < stop - position) {
        PyErr_SetString(PyExc_ValueError, "stop: past the log, or out: shorter than stop - position");
        goto done;
    }
    const int32_t *log = log_v.buf;
    const int64_t *tick = tick_v.buf;
    const int8_t *tier = tier_v.buf;
    int64_t *out = out_v.buf;
    Py_ssize_t count = 0, leading = stop - position;
    for (Py_ssize_t j = position; j < stop; j++) {
        int32_t row = log[j];
        if (row >= 0 && row < rows && tier[row] >= 0 && tick[row] == base + j) {
            if (!count) {
                leading = j - position;
            }
            out[count++] = row;
        }
    }
    result = Py_BuildValue("(nn)", count, leading);
done:
    PyBuffer_Release(&out_v);
no_out:
    PyBuffer_Release(&tier_v);
no_tier:
    PyBuffer_Release(&tick_v);
no_tick:
    PyBuffer_Release(&log_v);
    return result;
}

/* ---- slot pools ------------------------------------------------------------------------------ */

/* copy_rows(dst, slots, src): row i of `src` into row slots[i] of `dst` (tiers/pool.py's writes).
 * dst: writable C-contiguous [rows, row bytes] uint8; src: C-contiguous uint8 holding
 * len(slots) rows of that size (any shape); slots: ints in [0, rows). Raw bytes, so every dtype
 * (float8 NaN payloads included) moves exactly; a large copy runs without the GIL. */
static PyObject *
core_copy_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer dst_v, src_v;
    Rows slots;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy_rows(dst, slots, src) takes 3 arguments");
        return NULL;
    }
    if (get_array(args[0], "dst", 'u', 1, 2, 1, &dst_v) < 0) {
        return NULL;
    }
    if (get_rows(args[1], "slots", dst_v.shape[0], &slots) < 0) {
        PyBuffer_Release(&dst_v);
        return NULL;
    }
    if (get_array(args[2], "src", 'u', 1, 0, 0, &src_v) < 0) {
        release_rows(&slots);
        PyBuffer_Release(&dst_v);
        return NULL;
    }
    size_t row = (size_t)dst_v.shape[1];
    if ((size_t)src_v.len != row * (size_t)slots.count) {
        PyErr_Format(PyExc_ValueError, "src: expected %zd rows of %zu bytes (one per slot), got %zd bytes",
                     slots.count, row, src_v.len);
    } else {
        char *dst = dst_v.buf;
        const char *src = src_v.buf;
        const int64_t *to = slots.rows;
        Py_ssize_t count = slots.count;
        if (src_v.len >= (1 << 20)) {
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < count; i++) {
                memcpy(dst + (size_t)to[i] * row, src + (size_t)i * row, row);
            }
            Py_END_ALLOW_THREADS
        } else {
            for (Py_ssize_t i = 0; i < count; i++) {
                memcpy(dst + (size_t)to[i] * row, src + (size_t)i * row, row);
            }
        }
    }
    PyBuffer_Release(&src_v);
    release_rows(&slots);
    PyBuffer_Release(&dst_v);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* flip_flags(flags, rows, value): flags[rows[i]] = value (0 or 1) where each was the other (a free
 * list's flags, tiers/base.py: slots handed out, or given back); ValueError, changing nothing,
 * if one already holds `value` (a slot freed twice, or taken twice) or repeats. */
static PyObject *
core_flip_flags(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer flags_v;
    Rows rows;
    Py_ssize_t value;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "flip_flags(flags, rows, value) takes 3 arguments");
        return NULL;
    }
    if (index_arg(args[2], "value", 0, &value) < 0) {
        return NULL;
    }
    if (value > 1) {
        PyErr_SetString(PyExc_ValueError, "value: expected 0 or 1");
        return NULL;
    }
    if (get_array(args[0], "flags", 'u', 1, 1, 1, &flags_v) < 0) {
        return NULL;
    }
    if (get_rows(args[1], "rows", flags_v.len, &rows) < 0) {
        PyBuffer_Release(&flags_v);
        return NULL;
    }
    uint8_t *flags = flags_v.buf;
    Py_ssize_t i = 0;
    for (; i < rows.count; i++) {
        if (flags[rows.rows[i]] != 1 - value) {
            PyErr_Format(PyExc_ValueError, "rows[%zd]: %lld is %zd already, or repeats", i, (long long)rows.rows[i],
                         value);
            break;
        }
        flags[rows.rows[i]] = (uint8_t)value;
    }
    if (i < rows.count) {
        for (Py_ssize_t j = 0; j < i; j++) {
            flags[rows.rows[j]] = (uint8_t)(1 - value); /* refused: put them back */
        }
    }
    release_rows(&rows);
    PyBuffer_Release(&flags_v);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- module ---------------------------------------------------------------------------------- */

static PyMethodDef core_methods[] = {
    {"xxh3_128", (PyCFunction)core_xxh3_128, METH_O, "xxh3_128(data) -> 16-byte canonical digest"},
    {"xxh3_chain", (PyCFunction)(void (*)(void))core_xxh3_chain, METH_FASTCALL,
     "xxh3_chain(root, tokens, block_size) -> list of the chained digests of every full block"},
    {"current_entries", (PyCFunction)(void (*)(void))core_current_entries, METH_FASTCALL,
     "current_entries(log_rows, tick, tier, position, stop, base, out) -> (count, leading)"},
    {"flip_flags", (PyCFunction)(void (*)(void))core_flip_flags, METH_FASTCALL,
     "flip_flags(flags, rows, value): flags[rows[i]] = value (0 or 1) where each was the other"},
    {"copy_rows", (PyCFunction)(void (*)(void))core_copy_rows, METH_FASTCALL,
     "copy_rows(dst, slots, src): row i of src into row slots[i] of dst (raw bytes)"},
    {"resp_set", (PyCFunction)(void (*)(void))core_resp_set, METH_FASTCALL,
     "resp_set(sock, keys, values, ttls_ms, timeout_s, deadline_s=None) -> None, or the first error reply's text"},
    {"resp_getex", (PyCFunction)(void (*)(void))core_resp_getex, METH_FASTCALL,
     "resp_getex(sock, keys, ttl_ms, timeout_s, max_value=None, deadline_s=None, reset=False) -> (values, [(position, error reply text)])"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "prefixcache._core",
    .m_doc = "prefixcache's compiled core: block hashing, the block map's table, prompt matching",
    .m_size = -1,
    .m_methods = core_methods,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    if (PyType_Ready(&HashTableType) < 0 || PyType_Ready(&IndexCoreType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&core_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&HashTableType);
    Py_INCREF(&IndexCoreType);
    if (PyModule_AddObject(module, "HashTable", (PyObject *)&HashTableType) < 0 ||
        PyModule_AddObject(module, "IndexCore", (PyObject *)&IndexCoreType) < 0 || resp_register(module) < 0 ||
        PyModule_AddIntConstant(module, "STOP_NONE", STOP_NONE) < 0 ||
        PyModule_AddIntConstant(module, "STOP_NOT_CACHED", STOP_NOT_CACHED) < 0 ||
        PyModule_AddIntConstant(module, "STOP_EXPIRED", STOP_EXPIRED) < 0 ||
        PyModule_AddIntConstant(module, "STOP_VERIFICATION_FAILED", STOP_VERIFICATION_FAILED) < 0 ||
        PyModule_AddObject(module, "XXHASH_VERSION",
                           PyUnicode_FromFormat("%d.%d.%d", XXH_VERSION_MAJOR, XXH_VERSION_MINOR,
                                                XXH_VERSION_RELEASE)) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
