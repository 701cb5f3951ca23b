/* daemon._speedups: the fields of a batch of events (see daemon/columns.py, whose
 * columns_python is the reference). */
#include "speedups.h"

static PyObject *s_model, *s_id, *s_ts, *s_probs, *s_logits, *s_label;

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
"max_bytes bytes; the common shape of an event is read from the bytes (event_fields), any\n"
"other value is parsed by loads, read and dropped at once (the parsed batch is never alive\n"
"as a whole; a ValueError from loads gives None).");

/* A str of n printable ASCII characters (checked by the caller). */
static PyObject *
ascii_str(const char *s, Py_ssize_t n)
{
    PyObject *u = PyUnicode_New(n, 127);
    if (u)
        memcpy(PyUnicode_1BYTE_DATA(u), s, (size_t)n);
    return u;
}

static PyObject *
scan(PyObject *self, PyObject *args)
{
    PyObject *ds, *loads = Py_None, *owned = NULL;
    PyObject *last_model = NULL; /* consecutive events of a model share its str */
    Py_ssize_t max_model, max_id, max_bytes = 0;
    if (!PyArg_ParseTuple(args, "O!nn|On", &PyList_Type, &ds, &max_model, &max_id, &loads,
                          &max_bytes))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ds);
    if (loads != Py_None)
        event_json_check();
    PyObject *models = PyList_New(n), *ids = PyList_New(n);
    PyObject *ts = PyByteArray_FromStringAndSize(NULL, n * 8);
    PyObject *labels = PyByteArray_FromStringAndSize(NULL, n * 8);
    PyObject *vlen = PyByteArray_FromStringAndSize(NULL, n * 8);
    Buf flat = {0};
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
            EventFields ev; /* the common shape straight from the bytes (event_json.c) */
            int r = event_json_read(PyBytes_AS_STRING(d), PyBytes_GET_SIZE(d), max_model, max_id,
                                    &ev, &flat);
            if (r < 0)
                goto done;
            if (r == 1) {
                PyObject *eid = ascii_str(ev.id, ev.id_len);
                if (!eid)
                    goto done;
                PyList_SET_ITEM(ids, i, eid);
                if (!last_model || PyUnicode_GET_LENGTH(last_model) != ev.model_len ||
                    memcmp(PyUnicode_1BYTE_DATA(last_model), ev.model, ev.model_len)) {
                    Py_XDECREF(last_model);
                    if (!(last_model = ascii_str(ev.model, ev.model_len)))
                        goto done;
                }
                PyList_SET_ITEM(models, i, Py_NewRef(last_model));
                tsv[i] = ev.ts;
                labv[i] = ev.label;
                lenv[i] = ev.vlen;
                continue;
            }
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
            if (buf_reserve(&flat, m) < 0)
                goto done;
            double *out = (double *)flat.data + flat.len;
            for (Py_ssize_t j = 0; j < m; j++)
                if (number(PyList_GET_ITEM(vec, j), out + j))
                    goto reject;
            flat.len += m;
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
        PyObject *fl = buf_bytes(&flat);
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
    Py_XDECREF(last_model);
    PyMem_Free(flat.data);
    Py_XDECREF(models);
    Py_XDECREF(ids);
    Py_XDECREF(ts);
    Py_XDECREF(labels);
    Py_XDECREF(vlen);
    return result;
}

static PyMethodDef scan_methods[] = {
    {"scan", scan, METH_VARARGS, scan_doc},
    {NULL, NULL, 0, NULL}};

int
speedups_add_scan(PyObject *module)
{
    if (speedups_intern(&s_model, "model") < 0 || speedups_intern(&s_id, "id") < 0 ||
        speedups_intern(&s_ts, "ts") < 0 || speedups_intern(&s_probs, "probs") < 0 ||
        speedups_intern(&s_logits, "logits") < 0 || speedups_intern(&s_label, "label") < 0)
        return -1;
    return PyModule_AddFunctions(module, scan_methods);
}
