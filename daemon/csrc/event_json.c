/* daemon._speedups: the fields of one event read straight from its JSON bytes.
 *
 * scan() (scan.c) gives every message value to event_json_read first. It reads the common
 * shape of an event, an object whose keys are plain ASCII and whose values are numbers, plain
 * ASCII strings and one flat list of numbers, without building the parsed object (a dict, a
 * list and a float object per probability: most of what orjson.loads costs). It reads only
 * what it can read exactly as orjson.loads followed by scan's field checks would, and
 * declines everything else, with nothing written: the caller then parses that message with
 * orjson.loads as before, which accepts, rejects or reports it. Declined: escapes, bytes
 * outside printable ASCII in strings, nested values of other keys, null, a repeated key,
 * numbers with more than 19 significant digits or a decimal exponent beyond +-27 (see
 * read_double), and every event scan itself rejects (the general path says why).
 *
 * Exactness. A JSON number is read as w * 10^q with w < 10^19 (an exact uint64) and
 * |q| <= 27, so that both w and 10^q are exact in the x87 80-bit format (10^27 = 5^27 * 2^27,
 * 5^27 < 2^63). One multiplication or division rounds the exact value t to the nearest 64-bit
 * mantissa r; rounding r to double then gives the double nearest t unless r lies exactly on a
 * halfway point between two doubles (its 11 extra bits are 0x400): any halfway point is itself
 * an 80-bit number, so t and r fall on the same side of every other one. That case is declined.
 * Where long double is not the x87 format (or runs at less precision), only Clinger's fast
 * path is taken: w <= 2^53 and |q| <= 22, exact operands and one rounding in double. An
 * integer token is read as an int: exact up to 2^53 (beyond, declined), "-0" as 0.
 */
#include "speedups.h"

#include <float.h>

#define MAX_POW10 27

static long double pow10_ld[MAX_POW10 + 1];
static double pow10_d[23];
static int extended_ok; /* the x87 80-bit format at full precision (event_json_check) */

/* JSON whitespace */
static inline const char *
ws(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t'))
        p++;
    return p;
}

typedef struct {
    uint64_t w;  /* the significant digits, leading zeros dropped */
    int q;       /* the value is (neg ? -1 : 1) * w * 10^q */
    int neg;
    int is_int;  /* no fraction and no exponent: orjson gives an int */
} Number;

/* A JSON number at p (strict grammar); the end of it, or NULL to decline (bad grammar, more
 * than 19 significant digits, an exponent of more than 4 digits). */
static const char *
read_number(const char *p, const char *end, Number *x)
{
    uint64_t w = 0;
    int digits = 0, frac = 0, e = 0;
    x->neg = 0;
    x->is_int = 1;
    if (p < end && *p == '-') {
        x->neg = 1;
        p++;
    }
    if (p >= end)
        return NULL;
    if (*p == '0')
        p++;
    else if (*p >= '1' && *p <= '9') {
        while (p < end && *p >= '0' && *p <= '9') {
            if (++digits > 19)
                return NULL;
            w = w * 10 + (uint64_t)(*p++ - '0');
        }
    }
    else
        return NULL;
    if (p < end && *p == '.') {
        x->is_int = 0;
        p++;
        if (p >= end || *p < '0' || *p > '9')
            return NULL;
        while (p < end && *p >= '0' && *p <= '9') {
            if (w || *p != '0') { /* leading zeros of the fraction are not significant */
                if (++digits > 19)
                    return NULL;
            }
            w = w * 10 + (uint64_t)(*p++ - '0');
            frac++;
        }
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        int eneg = 0, ed = 0;
        x->is_int = 0;
        p++;
        if (p < end && (*p == '+' || *p == '-'))
            eneg = *p++ == '-';
        if (p >= end || *p < '0' || *p > '9')
            return NULL;
        while (p < end && *p >= '0' && *p <= '9') {
            if (++ed > 4)
                return NULL;
            e = e * 10 + (*p++ - '0');
        }
        if (eneg)
            e = -e;
    }
    x->w = w;
    x->q = e - frac;
    return p;
}

/* The double nearest x (not an int token); 0 on success, 1 to decline. */
static int
read_double(const Number *x, double *out)
{
    double d;
    if (x->w == 0)
        d = 0.0;
    else if (extended_ok && x->q >= -MAX_POW10 && x->q <= MAX_POW10) {
        long double r = x->q >= 0 ? (long double)x->w * pow10_ld[x->q]
                                  : (long double)x->w / pow10_ld[-x->q];
        uint64_t mant;
        memcpy(&mant, &r, sizeof mant); /* x87: the 64-bit mantissa comes first */
        if ((mant & 0x7FF) == 0x400)
            return 1;
        d = (double)r;
    }
    else if (x->w <= (1ULL << 53) && x->q >= -22 && x->q <= 22)
        d = x->q >= 0 ? (double)x->w * pow10_d[x->q] : (double)x->w / pow10_d[-x->q];
    else
        return 1;
    *out = x->neg ? -d : d;
    return 0;
}

/* A number as orjson gives it to scan (an int up to 2^53, or a float) as a double. */
static inline const char *
number_value(const char *p, const char *end, double *out)
{
    Number x;
    p = read_number(p, end, &x);
    if (!p)
        return NULL;
    if (x.is_int) {
        if (x.w > (1ULL << 53))
            return NULL;
        *out = x.neg && x.w ? -(double)x.w : (double)x.w; /* "-0" is the int 0 */
        return p;
    }
    return read_double(&x, out) ? NULL : p;
}

/* A string of printable ASCII without escapes at p (after its opening quote): its characters
 * in [*s, *s + *len); the end after the closing quote, or NULL to decline. */
static inline const char *
read_string(const char *p, const char *end, const char **s, Py_ssize_t *len)
{
    const char *a = p;
    while (p < end) {
        unsigned char c = (unsigned char)*p;
        if (c == '"') {
            *s = a;
            *len = p - a;
            return p + 1;
        }
        if (c < 0x20 || c >= 0x7F || c == '\\')
            return NULL;
        p++;
    }
    return NULL;
}

enum { K_MODEL = 1, K_ID = 2, K_TS = 4, K_PROBS = 8, K_LABEL = 16 };

int
event_json_read(const char *s, Py_ssize_t n, Py_ssize_t max_model, Py_ssize_t max_id,
                EventFields *ev, Buf *flat)
{
    const char *p = ws(s, s + n), *end = s + n;
    Py_ssize_t flat0 = flat->len;
    int seen = 0;
    ev->label = -1;
    ev->vlen = -1;
    if (p >= end || *p != '{')
        return 0;
    p = ws(p + 1, end);
    if (p < end && *p == '}')
        return 0; /* no fields */
    for (;;) {
        const char *key;
        Py_ssize_t klen;
        int which = 0;
        if (p >= end || *p != '"' || !(p = read_string(p + 1, end, &key, &klen)))
            goto decline;
        if (klen == 5 && !memcmp(key, "model", 5))
            which = K_MODEL;
        else if (klen == 2 && !memcmp(key, "id", 2))
            which = K_ID;
        else if (klen == 2 && !memcmp(key, "ts", 2))
            which = K_TS;
        else if (klen == 5 && !memcmp(key, "probs", 5))
            which = K_PROBS;
        else if (klen == 5 && !memcmp(key, "label", 5))
            which = K_LABEL;
        else if (klen == 6 && !memcmp(key, "logits", 6))
            goto decline; /* scan rejects logits */
        if (which & seen)
            goto decline; /* a repeated key: the last one wins in orjson */
        seen |= which;
        p = ws(p, end);
        if (p >= end || *p != ':')
            goto decline;
        p = ws(p + 1, end);
        if (p >= end)
            goto decline;
        switch (which) {
        case K_MODEL:
        case K_ID: {
            const char *v;
            Py_ssize_t vlen;
            if (*p != '"' || !(p = read_string(p + 1, end, &v, &vlen)))
                goto decline;
            if (vlen < 1 || vlen > (which == K_MODEL ? max_model : max_id))
                goto decline;
            if (which == K_MODEL) {
                ev->model = v;
                ev->model_len = vlen;
            }
            else {
                ev->id = v;
                ev->id_len = vlen;
            }
            break;
        }
        case K_TS:
            if (!(p = number_value(p, end, &ev->ts)))
                goto decline;
            break;
        case K_LABEL: {
            Number x;
            if (!(p = read_number(p, end, &x)) || !x.is_int || x.neg || x.w > INT64_MAX)
                goto decline;
            ev->label = (int64_t)x.w;
            break;
        }
        case K_PROBS: {
            Py_ssize_t m = 0;
            if (*p != '[')
                goto decline;
            p = ws(p + 1, end);
            if (p < end && *p == ']')
                p++;
            else
                for (;;) {
                    double v;
                    if (!(p = number_value(p, end, &v)))
                        goto decline;
                    if (buf_reserve(flat, 1) < 0)
                        return -1;
                    ((double *)flat->data)[flat->len++] = v;
                    m++;
                    p = ws(p, end);
                    if (p < end && *p == ',') {
                        p = ws(p + 1, end);
                        continue;
                    }
                    if (p < end && *p == ']') {
                        p++;
                        break;
                    }
                    goto decline;
                }
            ev->vlen = m;
            break;
        }
        default: /* another key: a string, a number, true or false */
            if (*p == '"') {
                const char *v;
                Py_ssize_t vlen;
                if (!(p = read_string(p + 1, end, &v, &vlen)))
                    goto decline;
            }
            else if (*p == '-' || (*p >= '0' && *p <= '9')) {
                Number x;
                if (!(p = read_number(p, end, &x)))
                    goto decline;
            }
            else if (end - p >= 4 && !memcmp(p, "true", 4))
                p += 4;
            else if (end - p >= 5 && !memcmp(p, "false", 5))
                p += 5;
            else
                goto decline; /* null, a nested list or object */
        }
        p = ws(p, end);
        if (p < end && *p == ',') {
            p = ws(p + 1, end);
            continue;
        }
        if (p < end && *p == '}') {
            p = ws(p + 1, end);
            break;
        }
        goto decline;
    }
    if (p != end)
        goto decline; /* anything after the object */
    if ((seen & (K_MODEL | K_ID | K_TS)) != (K_MODEL | K_ID | K_TS) ||
        !(seen & (K_PROBS | K_LABEL)))
        goto decline;
    return 1;
decline:
    flat->len = flat0;
    return 0;
}

PyDoc_STRVAR(event_fields_doc,
"event_fields(value, max_model_len, max_id_len) -> (model, id, ts, label, probs) | None\n\n"
"The fields scan() reads from one message value without parsing it into objects (label -1\n"
"and probs None when absent); None when it declines the value (scan then parses it with\n"
"loads). For tests.");

static PyObject *
event_fields(PyObject *self, PyObject *args)
{
    const char *s;
    Py_ssize_t n, max_model, max_id;
    if (!PyArg_ParseTuple(args, "y#nn", &s, &n, &max_model, &max_id))
        return NULL;
    EventFields ev;
    Buf flat = {0};
    int r = event_json_read(s, n, max_model, max_id, &ev, &flat);
    PyObject *result = NULL;
    if (r < 0)
        goto done;
    if (r == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *probs;
    if (ev.vlen < 0)
        probs = Py_NewRef(Py_None);
    else {
        probs = PyList_New(ev.vlen);
        if (!probs)
            goto done;
        for (Py_ssize_t j = 0; j < ev.vlen; j++) {
            PyObject *f = PyFloat_FromDouble(((double *)flat.data)[j]);
            if (!f) {
                Py_DECREF(probs);
                goto done;
            }
            PyList_SET_ITEM(probs, j, f);
        }
    }
    result = Py_BuildValue("(s#s#dLN)", ev.model, ev.model_len, ev.id, ev.id_len, ev.ts,
                           (long long)ev.label, probs);
done:
    PyMem_Free(flat.data);
    return result;
}

static PyMethodDef event_json_methods[] = {
    {"event_fields", event_fields, METH_VARARGS, event_fields_doc},
    {NULL, NULL, 0, NULL}};

int
event_json_check(void)
{
    /* the x87 format at full precision and rounding to nearest: 64 mantissa bits, 1 + 2^-63
     * distinct from 1, 1 + 2^-64 (halfway, to even) equal to it, 1 + 3 * 2^-65 rounded up */
    volatile long double one = 1.0L, half_ulp = 0x1p-64L, more = 0x3p-65L;
    extended_ok = LDBL_MANT_DIG == 64 && sizeof(long double) >= 10 &&
                  one + 2 * half_ulp != one && one + half_ulp == one &&
                  one + more == one + 2 * half_ulp;
    return extended_ok;
}

int
speedups_add_event_json(PyObject *module)
{
    long double p = 1.0L;
    for (int i = 0; i <= MAX_POW10; i++, p *= 10.0L)
        pow10_ld[i] = p;
    double q = 1.0;
    for (int i = 0; i <= 22; i++, q *= 10.0)
        pow10_d[i] = q;
    if (PyModule_AddIntConstant(module, "EVENT_JSON_EXTENDED", event_json_check()) < 0)
        return -1;
    return PyModule_AddFunctions(module, event_json_methods);
}
