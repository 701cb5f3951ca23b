/* daemon._speedups, part 2: BLAKE2b-64 of event ids, the pool routing hash (reference:
 * lpcal.pools.route_uniform, i.e. hashlib.blake2b). */
#include "speedups.h"
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


/* ---------------------------------------------------------------- sampling prefilter
 * sample_out: the sampling decision of daemon.model_state.ModelState.sample, taken on the raw
 * message bytes, before any JSON parsing. A message is scanned as one JSON object (strings
 * skipped with their escapes, nested values by depth) only to find its top-level "model" and
 * "id" strings (the scan stops once both are found: the rest must end the object and hold no
 * other "model" or "id" bytes); nothing else is read or validated. It is *decided* (dropped) only when
 * everything is plain: a bytes value of at most max_bytes bytes, one top-level object, "model"
 * and "id" each present once as ASCII strings without escapes or control characters (so their
 * bytes are their UTF-8 form), id of 1..max_id bytes, the model in rates, and
 * u = blake2b_64(id) / 2**64 not below the model's rate. Anything else stays undecided (0) and
 * takes the full path, where ModelState.sample applies the same rule to the parsed event. */

static const char *
skip_ws(const char *p, const char *e)
{
    while (p < e && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'))
        p++;
    return p;
}

/* p at an opening quote: the position after the closing quote, or NULL. *esc: saw a backslash,
 * a control character or a non-ASCII byte. */
static const char *
skip_string(const char *p, const char *e, int *esc)
{
    p++;
    while (p < e) {
        unsigned char c = (unsigned char)*p;
        if (c == '"')
            return p + 1;
        if (c == '\\') {
            *esc = 1;
            p += 2;
            continue;
        }
        if (c < 0x20 || c >= 0x80)
            *esc = 1;
        p++;
    }
    return NULL;
}

/* p at the start of a value: the position after it, or NULL (structure only). */
static const char *
skip_value(const char *p, const char *e)
{
    int depth = 0, esc = 0;
    do {
        if (p >= e)
            return NULL;
        char c = *p;
        if (c == '"') {
            p = skip_string(p, e, &esc);
            if (!p)
                return NULL;
        } else if (c == '{' || c == '[') {
            depth++;
            p++;
        } else if (c == '}' || c == ']') {
            if (depth == 0)
                return NULL;
            depth--;
            p++;
        } else if (depth > 0) {
            p++; /* commas, colons, blanks, scalars inside a container */
        } else { /* a top-level scalar: up to the next delimiter */
            const char *q = p;
            while (q < e && *q != ',' && *q != '}' && *q != ' ' && *q != '\t' && *q != '\n'
                   && *q != '\r')
                q++;
            if (q == p)
                return NULL;
            p = q;
        }
    } while (depth > 0);
    return p;
}

/* 1: found plain model and id (pointers set); 0: not decidable here. */
static int
find_model_id(const char *p, const char *e, const char **m, Py_ssize_t *mlen,
              const char **id, Py_ssize_t *idlen)
{
    *m = *id = NULL;
    p = skip_ws(p, e);
    if (p >= e || *p != '{')
        return 0;
    p = skip_ws(p + 1, e);
    if (p < e && *p == '}')
        return 0;
    for (;;) {
        if (p >= e || *p != '"')
            return 0;
        int esc = 0;
        const char *k = p + 1, *q = skip_string(p, e, &esc);
        if (!q || esc)
            return 0;
        Py_ssize_t klen = q - 1 - k;
        p = skip_ws(q, e);
        if (p >= e || *p != ':')
            return 0;
        p = skip_ws(p + 1, e);
        int which = (klen == 5 && memcmp(k, "model", 5) == 0) ? 1
                    : (klen == 2 && memcmp(k, "id", 2) == 0) ? 2 : 0;
        if (which) {
            if (p >= e || *p != '"')
                return 0;
            const char *s = p + 1;
            q = skip_string(p, e, &esc);
            if (!q || esc)
                return 0;
            if (which == 1) {
                if (*m)
                    return 0; /* a duplicate key: leave it to the parser */
                *m = s;
                *mlen = q - 1 - s;
            } else {
                if (*id)
                    return 0;
                *id = s;
                *idlen = q - 1 - s;
            }
            p = q;
            if (*m && *id) {
                /* both found: the rest is not parsed; it must end the object and hold no
                 * second "model" or "id" key (any such bytes, even inside a string: undecided) */
                const char *t = e;
                while (t > p && (t[-1] == ' ' || t[-1] == '\t' || t[-1] == '\n' || t[-1] == '\r'))
                    t--;
                if (t == p || t[-1] != '}')
                    return 0;
                for (const char *r = p; (r = memchr(r, '"', (size_t)(t - r))) != NULL; r++) {
                    if ((t - r >= 4 && memcmp(r, "\"id\"", 4) == 0)
                        || (t - r >= 7 && memcmp(r, "\"model\"", 7) == 0))
                        return 0;
                }
                return 1;
            }
        } else {
            p = skip_value(p, e);
            if (!p)
                return 0;
        }
        p = skip_ws(p, e);
        if (p < e && *p == ',') {
            p = skip_ws(p + 1, e);
            continue;
        }
        if (p < e && *p == '}') {
            p = skip_ws(p + 1, e);
            return p == e && *m && *id;
        }
        return 0;
    }
}

/* The per-call state of a sampling pass: the last model looked up, its rate, and its run of
 * dropped events not yet added to counts. */
typedef struct {
    PyObject *rates, *counts, *last;
    const char *last_m;
    Py_ssize_t last_len, run, max_bytes, max_id;
    double rate;
} Sampler;

static int
sampler_flush(Sampler *z)
{
    if (!z->last || !z->run)
        return 0;
    PyObject *c = PyDict_GetItemWithError(z->counts, z->last);
    if (!c && PyErr_Occurred())
        return -1;
    long prev = c ? PyLong_AsLong(c) : 0;
    PyObject *nc = PyLong_FromLong(prev + (long)z->run);
    if (!nc || PyDict_SetItem(z->counts, z->last, nc) < 0) {
        Py_XDECREF(nc);
        return -1;
    }
    Py_DECREF(nc);
    z->run = 0;
    return 0;
}

/* 1: drop v; 0: keep or undecided; -1: error. */
static int
sampler_decide(Sampler *z, PyObject *v)
{
    if (!PyBytes_CheckExact(v) || PyBytes_GET_SIZE(v) > z->max_bytes)
        return 0;
    const char *p = PyBytes_AS_STRING(v), *m, *id;
    Py_ssize_t mlen = 0, idlen = 0;
    if (!find_model_id(p, p + PyBytes_GET_SIZE(v), &m, &mlen, &id, &idlen))
        return 0;
    if (mlen < 1 || idlen < 1 || idlen > z->max_id)
        return 0;
    if (!(z->last_m && mlen == z->last_len && memcmp(m, z->last_m, (size_t)mlen) == 0)) {
        if (sampler_flush(z) < 0)
            return -1;
        Py_XDECREF(z->last);
        z->last = PyUnicode_DecodeASCII(m, mlen, NULL);
        if (!z->last)
            return -1;
        z->last_m = m;
        z->last_len = mlen;
        PyObject *r = PyDict_GetItemWithError(z->rates, z->last);
        if (!r && PyErr_Occurred())
            return -1;
        z->rate = r ? PyFloat_AsDouble(r) : 1.0;
        if (z->rate == -1.0 && PyErr_Occurred())
            return -1;
    }
    if (!(z->rate < 1.0))
        return 0;
    double u = (double)blake2b_64((const uint8_t *)id, idlen) / 18446744073709551616.0;
    if (u < z->rate)
        return 0;
    z->run++;
    return 1;
}

PyDoc_STRVAR(sample_out_doc,
"sample_out(values, rates, max_bytes, max_id_len) -> (mask, counts)\n\n"
"mask: bytes, 1 for each message sampled out on its raw bytes (see the comment above),\n"
"0 for the others (parse them); counts: {model: messages sampled out}. rates: {model: rate}\n"
"of the models to sample (rate < 1).");

static PyObject *
sample_out(PyObject *self, PyObject *args)
{
    PyObject *values;
    Sampler z = {0};
    if (!PyArg_ParseTuple(args, "O!O!nn", &PyList_Type, &values, &PyDict_Type, &z.rates,
                          &z.max_bytes, &z.max_id))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(values);
    PyObject *mask = PyBytes_FromStringAndSize(NULL, n);
    z.counts = PyDict_New();
    if (!mask || !z.counts)
        goto fail;
    char *o = PyBytes_AS_STRING(mask);
    for (Py_ssize_t i = 0; i < n; i++) {
        int d = sampler_decide(&z, PyList_GET_ITEM(values, i));
        if (d < 0)
            goto fail;
        o[i] = (char)d;
    }
    if (sampler_flush(&z) < 0)
        goto fail;
    Py_XDECREF(z.last);
    return Py_BuildValue("(NN)", mask, z.counts);
fail:
    Py_XDECREF(z.last);
    Py_XDECREF(mask);
    Py_XDECREF(z.counts);
    return NULL;
}

PyDoc_STRVAR(sample_records_doc,
"sample_records(records, rates, max_bytes, max_id_len) -> (kept, values, counts)\n\n"
"sample_out on the .value of Kafka records: the records kept (in order), their values, and\n"
"{model: records sampled out}.");

static PyObject *
sample_records(PyObject *self, PyObject *args)
{
    static PyObject *value_name = NULL;
    PyObject *records, *kept = NULL, *vals = NULL;
    Sampler z = {0};
    if (!PyArg_ParseTuple(args, "O!O!nn", &PyList_Type, &records, &PyDict_Type, &z.rates,
                          &z.max_bytes, &z.max_id))
        return NULL;
    if (!value_name && speedups_intern(&value_name, "value") < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(records);
    kept = PyList_New(0);
    vals = PyList_New(0);
    z.counts = PyDict_New();
    if (!kept || !vals || !z.counts)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyList_GET_ITEM(records, i);
        PyObject *v = PyObject_GetAttr(r, value_name);
        if (!v)
            goto fail;
        int d = sampler_decide(&z, v);
        if (d < 0 || (d == 0 && (PyList_Append(kept, r) < 0 || PyList_Append(vals, v) < 0))) {
            Py_DECREF(v);
            goto fail;
        }
        Py_DECREF(v); /* a dropped value's bytes stay alive in its record: last_m is valid */
    }
    if (sampler_flush(&z) < 0)
        goto fail;
    Py_XDECREF(z.last);
    return Py_BuildValue("(NNN)", kept, vals, z.counts);
fail:
    Py_XDECREF(z.last);
    Py_XDECREF(kept);
    Py_XDECREF(vals);
    Py_XDECREF(z.counts);
    return NULL;
}

static PyMethodDef blake2b_methods[] = {
    {"route_u64", route_u64, METH_O, route_u64_doc},
    {"sample_out", sample_out, METH_VARARGS, sample_out_doc},
    {"sample_records", sample_records, METH_VARARGS, sample_records_doc},
    {NULL, NULL, 0, NULL}};

int
speedups_add_blake2b(PyObject *module)
{
    return PyModule_AddFunctions(module, blake2b_methods);
}
