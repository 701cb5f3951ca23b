/* Shared declarations of the parts of daemon._speedups (see module.c). */
#ifndef LPCAL_SPEEDUPS_H
#define LPCAL_SPEEDUPS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Each part adds its functions (and interns the strings it needs) to the module. */
int speedups_add_scan(PyObject *module);    /* scan.c: all_bytes_within, scan */
int speedups_add_blake2b(PyObject *module); /* blake2b.c: route_u64, hash_lanes, sample_* */
int speedups_add_join(PyObject *module);    /* join.c: offer_loop, attach_rows */
int speedups_add_event_json(PyObject *module); /* event_json.c: event_fields */

/* Codes shared with the Python side, which defines them in daemon/codes.py (SHARED_WITH_C).
 * module.c exports each under its name; daemon/native.py does not use a module whose values
 * differ, and tests/daemon/test_native.py asserts that they are equal. */
#define KIND_PREDICTION 0 /* event kinds (daemon.events ModelBatch.kind, JoinStore.offer) */
#define KIND_OUTCOME 1
#define KIND_SAMPLE 2
#define KIND_DEAD (-1)    /* a pending entry that left the pending dict */
#define JOINED 0          /* states of an id in the join's recent dict */
#define EXPIRED 1
#define E_KIND 0          /* a pending join entry: a list [kind, deadline, ts, payload, id] */
#define E_DEADLINE 1
#define E_TS 2
#define E_PAYLOAD 3
#define E_ID 4
#define ENTRY_LEN 5
/* attributes of a model's join state (daemon.join_loop._ModelJoin) the join loop reads by name */
#define MJ_PENDING "pending"
#define MJ_QUEUE "queue"
#define MJ_RECENT "recent"
#define MJ_RECENT_ORDER "recent_order"
#define MJ_CAP_PENDING "cap_pending"
#define MJ_CAP_RECENT "cap_recent"

/* The interned str of a C string, kept for the life of the process; NULL on error. */
static inline int
speedups_intern(PyObject **slot, const char *name)
{
    *slot = PyUnicode_InternFromString(name);
    return *slot ? 0 : -1;
}

/* A growable array of 8-byte numbers (int64 or float64), handed to Python as a bytearray
 * (np.frombuffer on the Python side). Zero-initialise; free data with PyMem_Free. */
typedef struct {
    char *data;
    Py_ssize_t len, cap; /* in items */
} Buf;

/* Room for extra more items; -1 with MemoryError if there is none. */
static inline int
buf_reserve(Buf *b, Py_ssize_t extra)
{
    if (b->len + extra <= b->cap)
        return 0;
    Py_ssize_t cap = b->cap ? 2 * b->cap : 256;
    while (cap < b->len + extra)
        cap *= 2;
    char *d = PyMem_Realloc(b->data, (size_t)cap * 8);
    if (!d) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = d;
    b->cap = cap;
    return 0;
}

static inline int
push_i64(Buf *b, int64_t x)
{
    if (buf_reserve(b, 1) < 0)
        return -1;
    ((int64_t *)b->data)[b->len++] = x;
    return 0;
}

static inline int
push_f64(Buf *b, double x)
{
    if (buf_reserve(b, 1) < 0)
        return -1;
    ((double *)b->data)[b->len++] = x;
    return 0;
}

static inline PyObject *
buf_bytes(const Buf *b)
{
    return PyByteArray_FromStringAndSize(b->data ? b->data : "", b->len * 8);
}

/* The fields of one JSON event read from its bytes (event_json.c); the strings point into the
 * bytes. */
typedef struct {
    const char *model, *id;
    Py_ssize_t model_len, id_len;
    double ts;
    int64_t label;    /* -1: absent */
    Py_ssize_t vlen;  /* -1: absent; else the entries appended to the flat Buf */
} EventFields;

/* 1: read (vlen entries appended to flat), 0: declined (flat as it was: parse the value with
 * orjson.loads), -1: MemoryError set. */
int event_json_read(const char *s, Py_ssize_t n, Py_ssize_t max_model, Py_ssize_t max_id,
                    EventFields *ev, Buf *flat);
/* Whether numbers may be read in the x87 format (checked again at every scan call: nothing
 * may have changed the FPU's precision or rounding since); else only exact doubles are read. */
int event_json_check(void);

#endif
