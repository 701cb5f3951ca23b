/* daemon._speedups: optional native kernels of the daemon's ingest path.
 *
 * Each function does exactly what a pure-Python reference in daemon/ does, only without the
 * interpreter loop; daemon/native.py loads this module if it was built and falls back to the
 * Python code otherwise (or when LPCAL_NATIVE=0). tests/daemon/test_native.py checks every
 * function against its reference on random and adversarial input.
 *
 *   all_bytes_within(values, max_bytes)       every value bytes of at most max_bytes bytes
 *   scan(ds, max_model_len, max_id_len)        columns of a batch of parsed events, or None
 *                                              (reference: daemon.columns.columns_python)
 *   route_u64(ids)                             blake2b-64 of each id's UTF-8, or None
 *                                              (reference: lpcal.pools.route_uniform)
 *   offer_loop(...)                            the per-event join loop of JoinStore.offer
 *   attach_rows(entries, block)                entry[3] = (block, r) for each pending entry
 *
 * No NumPy C API: arrays cross the boundary as bytearrays (np.frombuffer on the Python side),
 * so the module builds with nothing but a C compiler and the Python headers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static PyObject *s_model, *s_id, *s_ts, *s_probs, *s_logits, *s_label;
static PyObject *s_append, *s_popleft;

#define EXACT_INT_LIMIT 9007199254740992.0 /* 2**53: ints beyond it are left to NumPy's rules */

/* ------------------------------------------------------------------------------------ scan */

/* A numeric JSON value (exact float or exact int) as a double; 0 on success, 1 when the value
 * is not one the fast path takes (other type, or an int beyond 2**53). */
static int
number(PyObject *v, double *out)
{
    if (PyFloat_CheckExact(v)) {
        *out = PyFloat_AS_DOUBLE(v);
        return 0;
    }
    if (PyLong_CheckExact(v)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || x > 9007199254740992LL || x < -9007199254740992LL)
            return 1;
        *out = (double)x;
        return 0;
    }
    return 1;
}

static PyObject *
get(PyObject *d, PyObject *key)
{   /* d.get(key) with JSON null read as absent: borrowed, or NULL */
    PyObject *v = PyDict_GetItemWithError(d, key);
    return v == Py_None ? NULL : v;
}

PyDoc_STRVAR(scan_doc,
"scan(ds, max_model_len, max_id_len, loads=None, max_bytes=0)\n"
"-> (models, ids, ts, labels, vlen, flat) | None\n\n"
"Columns of a list of parsed events, if every one is a dict with a str 'model' of\n"
"1..max_model_len and a str 'id' of 1..max_id_len characters, a float/int 'ts', no\n"
"'logits', and a list 'probs' of floats/ints (|int| <= 2**53) and/or an int 'label'\n"
"in [0, 2**63); else None. ts: float64 bytes; labels, vlen: int64 bytes (-1: absent);\n"
"flat: the float64 entries of all vectors, concatenated in event order.\n"
"With loads (orjson.loads), ds are message values instead: each must be bytes of at most\n"
"max_bytes bytes and is parsed by loads, read and dropped at once (the parsed batch is never\n"
"alive as a whole; a ValueError from loads gives None).");

static PyObject *
scan(PyObject *self, PyObject *args)
{
    PyObject *ds, *loads = Py_None, *owned = NULL;
    Py_ssize_t max_model, max_id, max_bytes = 0;
    if (!PyArg_ParseTuple(args, "O!nn|On", &PyList_Type, &ds, &max_model, &max_id, &loads,
                          &max_bytes))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ds);
    PyObject *models = PyList_New(n), *ids = PyList_New(n);
    PyObject *ts = PyByteArray_FromStringAndSize(NULL, n * 8);
    PyObject *labels = PyByteArray_FromStringAndSize(NULL, n * 8);
    PyObject *vlen = PyByteArray_FromStringAndSize(NULL, n * 8);
    double *flat = NULL;
    Py_ssize_t nflat = 0, capflat = 0;
    PyObject *result = NULL;
    if (!models || !ids || !ts || !labels || !vlen)
        goto done;
    double *tsv = (double *)PyByteArray_AS_STRING(ts);
    int64_t *labv = (int64_t *)PyByteArray_AS_STRING(labels);
    int64_t *lenv = (int64_t *)PyByteArray_AS_STRING(vlen);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyList_GET_ITEM(ds, i);
        Py_CLEAR(owned);
        if (loads != Py_None) { /* d is a message value: parse it, keep it only while read */
            if (!PyBytes_CheckExact(d) || PyBytes_GET_SIZE(d) > max_bytes)
                goto reject;
            d = owned = PyObject_CallOneArg(loads, d);
            if (!d) {
                if (!PyErr_ExceptionMatches(PyExc_ValueError))
                    goto done;
                PyErr_Clear(); /* bad JSON: the general path says which and where */
                goto reject;
            }
        }
        if (!PyDict_CheckExact(d))
            goto reject;
        PyObject *model = get(d, s_model), *eid = get(d, s_id), *t = get(d, s_ts);
        if (PyErr_Occurred())
            goto done;
        if (!model || !PyUnicode_CheckExact(model) || PyUnicode_GET_LENGTH(model) < 1 ||
            PyUnicode_GET_LENGTH(model) > max_model)
            goto reject;
        if (!eid || !PyUnicode_CheckExact(eid) || PyUnicode_GET_LENGTH(eid) < 1 ||
            PyUnicode_GET_LENGTH(eid) > max_id)
            goto reject;
        if (!t)
            goto reject;
        if (PyFloat_CheckExact(t))
            tsv[i] = PyFloat_AS_DOUBLE(t);
        else if (PyLong_CheckExact(t)) {
            double x = PyLong_AsDouble(t);
            if (x == -1.0 && PyErr_Occurred()) {
                PyErr_Clear();
                goto reject;
            }
            tsv[i] = x;
        }
        else
            goto reject;
        if (get(d, s_logits))
            goto reject;
        PyObject *vec = get(d, s_probs), *lab = get(d, s_label);
        if (PyErr_Occurred())
            goto done;
        if (!vec && !lab)
            goto reject;
        if (lab) {
            if (!PyLong_CheckExact(lab))
                goto reject;
            int overflow = 0;
            long long y = PyLong_AsLongLongAndOverflow(lab, &overflow);
            if (overflow || y < 0) /* out of range: the general path says so */
                goto reject;
            labv[i] = (int64_t)y;
        }
        else
            labv[i] = -1;
        if (vec) {
            if (!PyList_CheckExact(vec))
                goto reject;
            Py_ssize_t m = PyList_GET_SIZE(vec);
            if (nflat + m > capflat) {
                Py_ssize_t want = capflat ? capflat * 2 : 16 * (m > 0 ? m : 1) + 64;
                while (want < nflat + m)
                    want *= 2;
                double *grown = PyMem_Realloc(flat, (size_t)want * sizeof(double));
                if (!grown) {
                    PyErr_NoMemory();
                    goto done;
                }
                flat = grown;
                capflat = want;
            }
            for (Py_ssize_t j = 0; j < m; j++)
                if (number(PyList_GET_ITEM(vec, j), flat + nflat + j))
                    goto reject;
            nflat += m;
            lenv[i] = m;
        }
        else
            lenv[i] = -1;
        Py_INCREF(model);
        PyList_SET_ITEM(models, i, model);
        Py_INCREF(eid);
        PyList_SET_ITEM(ids, i, eid);
    }
    {
        PyObject *fl = PyByteArray_FromStringAndSize((const char *)flat, nflat * 8);
        if (fl)
            result = Py_BuildValue("(NNNNNN)", models, ids, ts, labels, vlen, fl);
        if (result) {
            models = ids = ts = labels = vlen = NULL; /* stolen by "N" */
        }
    }
    goto done;
reject:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(owned);
    PyMem_Free(flat);
    Py_XDECREF(models);
    Py_XDECREF(ids);
    Py_XDECREF(ts);
    Py_XDECREF(labels);
    Py_XDECREF(vlen);
    return result;
}

PyDoc_STRVAR(all_bytes_within_doc,
"all_bytes_within(values, max_bytes) -> bool\n\n"
"Whether every item of the list is a bytes object of at most max_bytes bytes.");

static PyObject *
all_bytes_within(PyObject *self, PyObject *args)
{
    PyObject *values;
    Py_ssize_t max_bytes;
    if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &values, &max_bytes))
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(values); i++) {
        PyObject *v = PyList_GET_ITEM(values, i);
        if (!PyBytes_CheckExact(v) || PyBytes_GET_SIZE(v) > max_bytes)
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* ------------------------------------------------------------------------------- blake2b */
/* BLAKE2b (RFC 7693) for an unkeyed 8-byte digest, the routing hash of lpcal.pools. */

static const uint64_t blake2b_iv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

static const uint8_t sigma[12][16] = { /* message word order of each round */
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

#define ROTR64(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define G(a, b, c, d, x, y)                                                                   \
    do {                                                                                      \
        v[a] = v[a] + v[b] + (x); v[d] = ROTR64(v[d] ^ v[a], 32);                             \
        v[c] = v[c] + v[d];       v[b] = ROTR64(v[b] ^ v[c], 24);                             \
        v[a] = v[a] + v[b] + (y); v[d] = ROTR64(v[d] ^ v[a], 16);                             \
        v[c] = v[c] + v[d];       v[b] = ROTR64(v[b] ^ v[c], 63);                             \
    } while (0)

static uint64_t
load64(const uint8_t *p)
{   /* little-endian, whatever the host's order (compilers turn this into one load) */
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 |
           (uint64_t)p[7] << 56;
}

static void
compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last)
{
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++)
        m[i] = load64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = blake2b_iv[i];
    }
    v[12] ^= t; /* inputs here are far below 2**64 bytes: the high counter word stays 0 */
    if (last)
        v[14] = ~v[14];
    /* the 12 rounds written out, so that every message index is a constant */
#define ROUND(r)                                                                              \
    do {                                                                                      \
        G(0, 4, 8, 12, m[sigma[r][0]], m[sigma[r][1]]);                                       \
        G(1, 5, 9, 13, m[sigma[r][2]], m[sigma[r][3]]);                                       \
        G(2, 6, 10, 14, m[sigma[r][4]], m[sigma[r][5]]);                                      \
        G(3, 7, 11, 15, m[sigma[r][6]], m[sigma[r][7]]);                                      \
        G(0, 5, 10, 15, m[sigma[r][8]], m[sigma[r][9]]);                                      \
        G(1, 6, 11, 12, m[sigma[r][10]], m[sigma[r][11]]);                                    \
        G(2, 7, 8, 13, m[sigma[r][12]], m[sigma[r][13]]);                                     \
        G(3, 4, 9, 14, m[sigma[r][14]], m[sigma[r][15]]);                                     \
    } while (0)
    ROUND(0); ROUND(1); ROUND(2); ROUND(3); ROUND(4); ROUND(5);
    ROUND(6); ROUND(7); ROUND(8); ROUND(9); ROUND(10); ROUND(11);
#undef ROUND
    for (int i = 0; i < 8; i++)
        h[i] ^= v[i] ^ v[i + 8];
}

/* The 8-byte digest of data, read as a big-endian integer (int.from_bytes(digest, "big")). */
static uint64_t
blake2b_64(const uint8_t *data, Py_ssize_t len)
{
    uint64_t h[8];
    uint8_t block[128];
    memcpy(h, blake2b_iv, sizeof h);
    h[0] ^= 0x01010000ULL ^ 8; /* depth 1, fanout 1, no key, digest length 8 */
    Py_ssize_t done = 0;
    while (len - done > 128) {
        compress(h, data + done, (uint64_t)(done + 128), 0);
        done += 128;
    }
    memset(block, 0, sizeof block);
    memcpy(block, data + done, (size_t)(len - done));
    compress(h, block, (uint64_t)len, 1);
    uint64_t x = h[0], be = 0; /* digest bytes = h[0] little-endian; read them big-endian */
    for (int i = 0; i < 8; i++) {
        be = (be << 8) | (x & 0xff);
        x >>= 8;
    }
    return be;
}

PyDoc_STRVAR(route_u64_doc,
"route_u64(ids) -> bytes | None\n\n"
"int.from_bytes(blake2b(id.encode(), digest_size=8).digest(), 'big') of each str id, as\n"
"native uint64 bytes; None if an id is not a str (or has no UTF-8 form).");

static PyObject *
route_u64(PyObject *self, PyObject *arg)
{
    if (!PyList_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "route_u64 takes a list of str");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (!out)
        return NULL;
    uint64_t *o = (uint64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyList_GET_ITEM(arg, i);
        Py_ssize_t len;
        const char *u = PyUnicode_CheckExact(s) ? PyUnicode_AsUTF8AndSize(s, &len) : NULL;
        if (!u) {
            PyErr_Clear();
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        o[i] = blake2b_64((const uint8_t *)u, len);
    }
    return out;
}

/* ---------------------------------------------------------------------------- join loop */
/* The per-event loop of daemon.join.JoinStore.offer, on the store's own Python objects. */

enum { KIND_PREDICTION = 0, KIND_OUTCOME = 1, KIND_SAMPLE = 2, DEAD = -1 };
enum { JOINED = 0, EXPIRED = 1 };
enum { EV_TTL, EV_CAPACITY, UM_LATE, UM_DUPLICATE, UM_ORPHAN, NCOUNT };

typedef struct {
    PyObject *pend;      /* dict id -> [kind, deadline, ts, payload, id] */
    PyObject *queue;     /* deque of the pending entries, oldest first (and DEAD ones) */
    PyObject *q_append, *q_popleft; /* its bound methods */
    PyObject *recent;    /* dict id -> JOINED | EXPIRED */
    PyObject *order;     /* deque of the ids of recent, oldest first */
    PyObject *append, *popleft; /* its bound methods */
    Py_ssize_t order_len; /* len(order), kept in step */
    PyObject *joined, *expired, *dead;
    Py_ssize_t max_recent, cap;
    long long count[NCOUNT];
} Join;

static int
entry_ok(PyObject *e)
{
    if (PyList_CheckExact(e) && PyList_GET_SIZE(e) == 5)
        return 1;
    PyErr_SetString(PyExc_RuntimeError, "join: malformed pending entry");
    return 0;
}

/* Mark an entry that left the pending dict (its queue slot is then skipped). */
static void
mark_dead(Join *j, PyObject *e)
{
    PyObject *old = PyList_GET_ITEM(e, 0);
    PyList_SET_ITEM(e, 0, Py_NewRef(j->dead));
    Py_DECREF(old);
}

/* JoinStore._remember: remember eid as state (a remembered id keeps its place). One lookup for
 * the common case, a new id: setdefault inserts it. */
static int
remember(Join *j, PyObject *eid, PyObject *state)
{
    if (j->max_recent == 0)
        return 0;
    Py_ssize_t before = PyDict_GET_SIZE(j->recent);
    PyObject *cur = PyDict_SetDefault(j->recent, eid, state); /* borrowed */
    if (!cur)
        return -1;
    if (PyDict_GET_SIZE(j->recent) == before) /* known id: keeps its place, takes the state */
        return cur == state ? 0 : PyDict_SetItem(j->recent, eid, state);
    PyObject *r = PyObject_CallOneArg(j->append, eid);
    if (!r)
        return -1;
    Py_DECREF(r);
    if (++j->order_len > j->max_recent) {
        PyObject *old = PyObject_CallNoArgs(j->popleft);
        if (!old)
            return -1;
        j->order_len--;
        int rc = PyDict_DelItem(j->recent, old);
        Py_DECREF(old);
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* _ModelJoin.oldest: the oldest pending entry (borrowed; NULL without error: none), dropping
 * DEAD entries from the front of the queue. */
static PyObject *
oldest(Join *j)
{
    for (;;) {
        if (PyObject_Size(j->queue) == 0)
            return NULL;
        PyObject *e = PySequence_GetItem(j->queue, 0);
        if (!e)
            return NULL;
        Py_DECREF(e); /* the queue holds it */
        if (!entry_ok(e))
            return NULL;
        long k = PyLong_AsLong(PyList_GET_ITEM(e, 0));
        if (k == -1 && PyErr_Occurred())
            return NULL;
        if (k != DEAD)
            return e;
        PyObject *r = PyObject_CallNoArgs(j->q_popleft);
        if (!r)
            return NULL;
        Py_DECREF(r);
    }
}

/* The oldest pending entry's deadline, or +inf when nothing is pending. */
static int
front_deadline(Join *j, double *out)
{
    PyObject *e = oldest(j);
    if (!e) {
        if (PyErr_Occurred())
            return -1;
        *out = INFINITY;
        return 0;
    }
    double d = PyFloat_AsDouble(PyList_GET_ITEM(e, 1));
    if (d == -1.0 && PyErr_Occurred())
        return -1;
    *out = d;
    return 0;
}

/* _ModelJoin.pop_oldest: remove the oldest pending entry (one must exist); its id (a new
 * reference) and kind; the entry is marked DEAD. */
static int
pop_oldest(Join *j, PyObject **eid, long *kind)
{
    if (!oldest(j)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "join: nothing pending to evict");
        return -1;
    }
    PyObject *e = PyObject_CallNoArgs(j->q_popleft);
    if (!e)
        return -1;
    *kind = PyLong_AsLong(PyList_GET_ITEM(e, 0));
    *eid = Py_NewRef(PyList_GET_ITEM(e, 4));
    mark_dead(j, e);
    Py_DECREF(e);
    if (PyDict_DelItem(j->pend, *eid) < 0) {
        Py_CLEAR(*eid);
        return -1;
    }
    return 0;
}

/* JoinStore._expire: evict by TTL every pending entry whose deadline is before clock. */
static int
expire(Join *j, double clock)
{
    for (;;) {
        double d;
        if (front_deadline(j, &d) < 0)
            return -1;
        if (d >= clock) /* also +inf: nothing pending */
            return 0;
        PyObject *eid;
        long kd;
        if (pop_oldest(j, &eid, &kd) < 0)
            return -1;
        j->count[EV_TTL]++;
        if (kd == KIND_OUTCOME)
            j->count[UM_ORPHAN]++;
        int rc = remember(j, eid, j->expired);
        Py_DECREF(eid);
        if (rc < 0)
            return -1;
    }
}

/* A growable array of 8-byte numbers, handed to Python as a bytearray (np.frombuffer). */
typedef struct {
    char *data;
    Py_ssize_t len, cap; /* in items */
} Buf;

static int
buf_grow(Buf *b)
{
    Py_ssize_t cap = b->cap ? 2 * b->cap : 256;
    char *d = PyMem_Realloc(b->data, (size_t)cap * 8);
    if (!d) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = d;
    b->cap = cap;
    return 0;
}

static int
push_i64(Buf *b, int64_t x)
{
    if (b->len == b->cap && buf_grow(b) < 0)
        return -1;
    ((int64_t *)b->data)[b->len++] = x;
    return 0;
}

static int
push_f64(Buf *b, double x)
{
    if (b->len == b->cap && buf_grow(b) < 0)
        return -1;
    ((double *)b->data)[b->len++] = x;
    return 0;
}

static int
push_long(Buf *b, PyObject *v)
{   /* a Python int (a label or a row index) */
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    return push_i64(b, x);
}

static PyObject *
buf_bytes(Buf *b)
{
    return PyByteArray_FromStringAndSize(b->data ? b->data : "", b->len * 8);
}

/* Rows of the output held by earlier batches, grouped by block: out[pos] = block[row]. */
typedef struct {
    PyObject *blk; /* a strong reference: its entries leave the pending buffer */
    Buf pos, row;
} Group;

typedef struct {
    Group *g;
    Py_ssize_t len, cap;
} Groups;

/* Row pos of the output is payload = (block, row) of an earlier batch. Consecutive rows of
 * one block share a group: the caller gathers each group with one fancy index. */
static int
add_to_group(Groups *gs, PyObject *payload, Py_ssize_t pos)
{
    if (!PyTuple_CheckExact(payload) || PyTuple_GET_SIZE(payload) != 2) {
        PyErr_SetString(PyExc_RuntimeError, "join: malformed pending prediction payload");
        return -1;
    }
    PyObject *blk = PyTuple_GET_ITEM(payload, 0);
    if (!gs->len || gs->g[gs->len - 1].blk != blk) {
        if (gs->len == gs->cap) {
            Py_ssize_t cap = gs->cap ? 2 * gs->cap : 8;
            Group *g = PyMem_Realloc(gs->g, (size_t)cap * sizeof(Group));
            if (!g) {
                PyErr_NoMemory();
                return -1;
            }
            gs->g = g;
            gs->cap = cap;
        }
        memset(&gs->g[gs->len], 0, sizeof(Group));
        gs->g[gs->len++].blk = Py_NewRef(blk);
    }
    Group *g = &gs->g[gs->len - 1];
    if (push_i64(&g->pos, pos) < 0)
        return -1;
    return push_long(&g->row, PyTuple_GET_ITEM(payload, 1));
}

PyDoc_STRVAR(offer_loop_doc,
"offer_loop(pend, queue, recent, order, max_recent, cap, ttl, event_time, clock, wm0,\n"
"           wm1, kind, ids, ts, labels, joined, expired, dead)\n"
"-> (clock, wm0, wm1, counts, out_ids, out_ts, out_lab, b_out, b_idx, p_groups,\n"
"    live_entries, live_rows)\n\n"
"The event loop of JoinStore.offer (see daemon/join.py, whose Python loop is the reference):\n"
"updates pend/queue/recent/order in place and returns what the Python loop leaves in its\n"
"locals,\n"
"its number lists as bytearrays (out_ts float64; the rest int64). counts: (ttl, capacity,\n"
"late, duplicate, orphan). p_groups: [(block, out positions, rows)] of the joined rows held\n"
"by earlier batches. live_*: the new prediction entries of this batch still pending at the\n"
"end, and their rows.");

static PyObject *
offer_loop(PyObject *self, PyObject *args)
{
    Join j;
    double ttl, clock, wm0, wm1;
    int event_time;
    PyObject *kind, *ids, *ts, *labs;
    memset(&j, 0, sizeof j);
    if (!PyArg_ParseTuple(args, "O!OO!OnndpdddO!O!O!O!OOO", &PyDict_Type, &j.pend, &j.queue,
                          &PyDict_Type, &j.recent, &j.order, &j.max_recent, &j.cap, &ttl,
                          &event_time, &clock, &wm0, &wm1, &PyList_Type, &kind, &PyList_Type,
                          &ids, &PyList_Type, &ts, &PyList_Type, &labs, &j.joined, &j.expired,
                          &j.dead))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(kind);
    if (PyList_GET_SIZE(ids) != n || PyList_GET_SIZE(ts) != n || PyList_GET_SIZE(labs) != n) {
        PyErr_SetString(PyExc_ValueError, "offer_loop: kind/ids/ts/labels lengths differ");
        return NULL;
    }
    j.order_len = PyObject_Size(j.order);
    if (j.order_len < 0)
        return NULL;
    Buf out_ts = {0}, out_lab = {0}, b_out = {0}, b_idx = {0}, new_i = {0}, live_r = {0};
    Groups groups = {0};
    PyObject *out_ids = PyList_New(0), *new_e = PyList_New(0), *live_e = PyList_New(0);
    PyObject *result = NULL, *p_groups = NULL;
    j.append = PyObject_GetAttr(j.order, s_append);
    j.popleft = PyObject_GetAttr(j.order, s_popleft);
    j.q_append = PyObject_GetAttr(j.queue, s_append);
    j.q_popleft = PyObject_GetAttr(j.queue, s_popleft);
    if (!out_ids || !new_e || !live_e || !j.append || !j.popleft || !j.q_append || !j.q_popleft)
        goto done;
    double front;
    if (front_deadline(&j, &front) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *tobj = PyList_GET_ITEM(ts, i);
        double t = PyFloat_AsDouble(tobj);
        long kd = PyLong_AsLong(PyList_GET_ITEM(kind, i));
        if (PyErr_Occurred())
            goto done;
        if (event_time) {
            if (kd != KIND_OUTCOME && t > wm0)
                wm0 = t;
            if (kd != KIND_PREDICTION && t > wm1)
                wm1 = t;
            double c = wm0 < wm1 ? wm0 : wm1;
            if (c > clock)
                clock = c;
        }
        if (front < clock) {
            if (expire(&j, clock) < 0 || front_deadline(&j, &front) < 0)
                goto done;
        }
        PyObject *eid = PyList_GET_ITEM(ids, i);
        PyObject *entry = PyDict_GetItemWithError(j.pend, eid); /* borrowed */
        if (!entry && PyErr_Occurred())
            goto done;
        if (entry && !entry_ok(entry))
            goto done;
        if (kd == KIND_SAMPLE) {
            int rec = entry ? 1 : PyDict_Contains(j.recent, eid);
            if (rec < 0)
                goto done;
            if (rec) {
                j.count[UM_DUPLICATE]++;
                continue;
            }
            if (push_i64(&b_out, PyList_GET_SIZE(out_ids)) < 0 || push_i64(&b_idx, i) < 0 ||
                PyList_Append(out_ids, eid) < 0 || push_f64(&out_ts, t) < 0 ||
                push_long(&out_lab, PyList_GET_ITEM(labs, i)) < 0 ||
                remember(&j, eid, j.joined) < 0)
                goto done;
            continue;
        }
        if (entry) {
            long ekd = PyLong_AsLong(PyList_GET_ITEM(entry, 0));
            if (ekd == kd) {
                j.count[UM_DUPLICATE]++;
                continue;
            }
            Py_INCREF(entry);
            double et = PyFloat_AsDouble(PyList_GET_ITEM(entry, 2));
            int rc = PyErr_Occurred() ? -1 : PyDict_DelItem(j.pend, eid);
            if (rc == 0) {
                Py_ssize_t pos = PyList_GET_SIZE(out_ids);
                PyObject *payload = PyList_GET_ITEM(entry, 3);
                if (kd == KIND_PREDICTION) {
                    rc = push_i64(&b_out, pos) < 0 || push_i64(&b_idx, i) < 0 ||
                         push_long(&out_lab, payload) < 0 ? -1 : 0;
                }
                else {
                    if (PyLong_CheckExact(payload)) /* a prediction of this batch */
                        rc = push_i64(&b_out, pos) < 0 || push_long(&b_idx, payload) < 0 ? -1 : 0;
                    else
                        rc = add_to_group(&groups, payload, pos);
                    if (rc == 0)
                        rc = push_long(&out_lab, PyList_GET_ITEM(labs, i));
                }
                if (rc == 0)
                    rc = PyList_Append(out_ids, eid) < 0 || push_f64(&out_ts, et > t ? et : t) < 0
                             ? -1 : 0;
                if (rc == 0)
                    rc = remember(&j, eid, j.joined);
                mark_dead(&j, entry);
            }
            Py_DECREF(entry);
            if (rc < 0)
                goto done;
            continue;
        }
        PyObject *state = PyDict_GetItemWithError(j.recent, eid);
        if (state) {
            long st = PyLong_AsLong(state);
            if (kd == KIND_OUTCOME || st == EXPIRED)
                j.count[UM_LATE]++;
            else
                j.count[UM_DUPLICATE]++;
            continue;
        }
        if (PyErr_Occurred())
            goto done;
        double deadline = (event_time ? (clock > t ? clock : t) : clock) + ttl;
        PyObject *e = PyList_New(5);
        if (!e)
            goto done;
        PyObject *dl = PyFloat_FromDouble(deadline);
        PyObject *payload = kd == KIND_PREDICTION ? PyLong_FromSsize_t(i)
                                                  : Py_NewRef(PyList_GET_ITEM(labs, i));
        if (!dl || !payload) {
            Py_XDECREF(dl);
            Py_XDECREF(payload);
            Py_DECREF(e);
            goto done;
        }
        PyList_SET_ITEM(e, 0, Py_NewRef(PyList_GET_ITEM(kind, i)));
        PyList_SET_ITEM(e, 1, dl);
        PyList_SET_ITEM(e, 2, Py_NewRef(tobj));
        PyList_SET_ITEM(e, 3, payload);
        PyList_SET_ITEM(e, 4, Py_NewRef(eid));
        int rc = 0;
        if (kd == KIND_PREDICTION)
            rc = PyList_Append(new_e, e) < 0 || push_i64(&new_i, i) < 0 ? -1 : 0;
        if (rc == 0 && PyDict_GET_SIZE(j.pend) == 0)
            front = deadline;
        if (rc == 0)
            rc = PyDict_SetItem(j.pend, eid, e);
        if (rc == 0) {
            PyObject *r = PyObject_CallOneArg(j.q_append, e);
            rc = r ? 0 : -1;
            Py_XDECREF(r);
        }
        Py_DECREF(e);
        if (rc < 0)
            goto done;
        if (PyDict_GET_SIZE(j.pend) > j.cap) {
            PyObject *old_id;
            long old_kind;
            if (pop_oldest(&j, &old_id, &old_kind) < 0)
                goto done;
            j.count[EV_CAPACITY]++;
            rc = remember(&j, old_id, j.expired);
            Py_DECREF(old_id);
            if (rc < 0)
                goto done;
        }
    }
    /* predictions of this batch still pending (not joined or evicted since: not DEAD) */
    for (Py_ssize_t r = 0; r < new_i.len; r++) {
        PyObject *e = PyList_GET_ITEM(new_e, r);
        Py_ssize_t i = (Py_ssize_t)((const int64_t *)new_i.data)[r];
        if (PyLong_AsLong(PyList_GET_ITEM(e, 0)) != DEAD &&
            (PyList_Append(live_e, e) < 0 || push_i64(&live_r, i) < 0))
            goto done;
    }
    p_groups = PyList_New(groups.len);
    if (!p_groups)
        goto done;
    for (Py_ssize_t q = 0; q < groups.len; q++) {
        Group *g = &groups.g[q];
        PyObject *item = Py_BuildValue("(ONN)", g->blk, buf_bytes(&g->pos), buf_bytes(&g->row));
        if (!item)
            goto done;
        PyList_SET_ITEM(p_groups, q, item);
    }
    result = Py_BuildValue("(ddd(LLLLL)ONNNNOON)", clock, wm0, wm1, j.count[EV_TTL],
                           j.count[EV_CAPACITY], j.count[UM_LATE], j.count[UM_DUPLICATE],
                           j.count[UM_ORPHAN], out_ids, buf_bytes(&out_ts), buf_bytes(&out_lab),
                           buf_bytes(&b_out), buf_bytes(&b_idx), p_groups, live_e,
                           buf_bytes(&live_r));
done:
    for (Py_ssize_t q = 0; q < groups.len; q++) {
        Py_DECREF(groups.g[q].blk);
        PyMem_Free(groups.g[q].pos.data);
        PyMem_Free(groups.g[q].row.data);
    }
    PyMem_Free(groups.g);
    PyMem_Free(out_ts.data);
    PyMem_Free(out_lab.data);
    PyMem_Free(b_out.data);
    PyMem_Free(b_idx.data);
    PyMem_Free(new_i.data);
    PyMem_Free(live_r.data);
    Py_XDECREF(j.append);
    Py_XDECREF(j.popleft);
    Py_XDECREF(j.q_append);
    Py_XDECREF(j.q_popleft);
    Py_XDECREF(out_ids);
    Py_XDECREF(new_e);
    Py_XDECREF(live_e);
    Py_XDECREF(p_groups);
    return result;
}

PyDoc_STRVAR(attach_rows_doc,
"attach_rows(entries, block) -> None\n\n"
"entries[r][3] = (block, r) for every r: the pending predictions' rows, in one block.");

static PyObject *
attach_rows(PyObject *self, PyObject *args)
{
    PyObject *entries, *block;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &entries, &block))
        return NULL;
    for (Py_ssize_t r = 0; r < PyList_GET_SIZE(entries); r++) {
        PyObject *e = PyList_GET_ITEM(entries, r);
        if (!PyList_Check(e) || PyList_GET_SIZE(e) != 5) {
            PyErr_SetString(PyExc_TypeError, "attach_rows: entries must be pending entries (5-item lists)");
            return NULL;
        }
        PyObject *pair = Py_BuildValue("(On)", block, r);
        if (!pair || PyList_SetItem(e, 3, pair) < 0) /* steals pair */
            return NULL;
    }
    Py_RETURN_NONE;
}

/* --------------------------------------------------------------------------------- module */

static PyMethodDef methods[] = {
    {"all_bytes_within", all_bytes_within, METH_VARARGS, all_bytes_within_doc},
    {"scan", scan, METH_VARARGS, scan_doc},
    {"route_u64", route_u64, METH_O, route_u64_doc},
    {"offer_loop", offer_loop, METH_VARARGS, offer_loop_doc},
    {"attach_rows", attach_rows, METH_VARARGS, attach_rows_doc},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "daemon._speedups",
                                    "Optional native kernels of the lpcal daemon's ingest path.",
                                    -1, methods};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    const char *names[] = {"model", "id", "ts", "probs", "logits", "label", "append", "popleft"};
    PyObject **slots[] = {&s_model, &s_id, &s_ts, &s_probs, &s_logits, &s_label, &s_append,
                          &s_popleft};
    for (int i = 0; i < 8; i++) {
        *slots[i] = PyUnicode_InternFromString(names[i]);
        if (!*slots[i])
            return NULL;
    }
    return PyModule_Create(&module);
}
