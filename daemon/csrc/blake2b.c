/* daemon._speedups: BLAKE2b-64 of event ids, the pool routing hash (reference:
 * lpcal.pools.route_uniform, i.e. hashlib.blake2b), one id at a time or several side by side in
 * vector lanes; and the sampling prefilter on raw message bytes (reference:
 * daemon.model_state.ModelState.sample). */
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

/* ---------------------------------------------------------------- many ids at once
 * Ids of at most one block (128 bytes: every id of up to 128 UTF-8 bytes, i.e. nearly all) are
 * hashed LANES at a time, one id per 64-bit lane of a vector register (AVX2: 4 lanes, AVX-512F:
 * 8; chosen at import from what the CPU supports, see hash_lanes). Each lane computes exactly
 * the scalar blake2b_64 above: the same rounds on the same words, only side by side. Longer ids
 * and the last few of a batch take the scalar path. */

static int hash_lanes_now = 1;   /* 1, 4 or 8: the width hash_many uses */
static int hash_lanes_max = 1;   /* the widest this CPU runs */

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define LPCAL_LANES 1
#define DEFINE_LANES(NAME, LANES, TARGET)                                                    \
    typedef uint64_t NAME##_v __attribute__((vector_size(8 * LANES)));                      \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *const *data,            \
                                                     const Py_ssize_t *len, uint64_t *out)   \
    {                                                                                         \
        NAME##_v m[16], v[16];                                                                \
        uint64_t blk[LANES][16];                                                              \
        memset(blk, 0, sizeof blk);                                                           \
        for (int l = 0; l < LANES; l++)                                                       \
            memcpy(blk[l], data[l], (size_t)len[l]);                                          \
        for (int i = 0; i < 16; i++)                                                          \
            for (int l = 0; l < LANES; l++)                                                   \
                m[i][l] = load64((const uint8_t *)&blk[l][i]);                                \
        for (int i = 0; i < 8; i++) {                                                         \
            v[i] = (NAME##_v){0} + blake2b_iv[i];                                             \
            v[i + 8] = (NAME##_v){0} + blake2b_iv[i];                                         \
        }                                                                                     \
        v[0] ^= (NAME##_v){0} + (0x01010000ULL ^ 8);                                          \
        NAME##_v h0 = v[0];                                                                   \
        for (int l = 0; l < LANES; l++)                                                       \
            v[12][l] ^= (uint64_t)len[l];                                                     \
        v[14] = ~v[14];                                                                       \
        ROUND(0); ROUND(1); ROUND(2); ROUND(3); ROUND(4); ROUND(5);                           \
        ROUND(6); ROUND(7); ROUND(8); ROUND(9); ROUND(10); ROUND(11);                         \
        h0 ^= v[0] ^ v[8];                                                                    \
        for (int l = 0; l < LANES; l++)                                                       \
            out[l] = __builtin_bswap64(h0[l]);                                                \
    }
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
DEFINE_LANES(blake2b_64_x4, 4, "avx2")
DEFINE_LANES(blake2b_64_x8, 8, "avx512f")
#undef ROUND
#endif

static void
hash_lanes_init(void)
{
#ifdef LPCAL_LANES
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        hash_lanes_max = 8;
    else if (__builtin_cpu_supports("avx2"))
        hash_lanes_max = 4;
#endif
    hash_lanes_now = hash_lanes_max;
}

/* out[i] = blake2b_64(p[i], len[i]) for i < n. */
static void
hash_many(const uint8_t *const *p, const Py_ssize_t *len, Py_ssize_t n, uint64_t *out)
{
    Py_ssize_t i = 0;
#ifdef LPCAL_LANES
    int lanes = hash_lanes_now;
    if (lanes > 1) {
        const uint8_t *gp[8];
        Py_ssize_t gl[8], gi[8];
        uint64_t go[8];
        int g = 0;
        for (; i < n; i++) {
            if (len[i] > 128) {
                out[i] = blake2b_64(p[i], len[i]);
                continue;
            }
            gp[g] = p[i];
            gl[g] = len[i];
            gi[g++] = i;
            if (g == lanes) {
                if (lanes == 8)
                    blake2b_64_x8(gp, gl, go);
                else
                    blake2b_64_x4(gp, gl, go);
                for (int l = 0; l < g; l++)
                    out[gi[l]] = go[l];
                g = 0;
            }
        }
        for (int l = 0; l < g; l++) /* the last few */
            out[gi[l]] = blake2b_64(gp[l], gl[l]);
        return;
    }
#endif
    for (; i < n; i++)
        out[i] = blake2b_64(p[i], len[i]);
}

PyDoc_STRVAR(hash_lanes_doc,
"hash_lanes(n=0) -> int\n\n"
"The number of ids hashed side by side (1: scalar; 4: AVX2; 8: AVX-512F), the widest this\n"
"CPU supports unless set. n > 0 sets it (ValueError if the CPU cannot) and returns the\n"
"previous value: for the equivalence tests, which run every width.");

static PyObject *
hash_lanes(PyObject *self, PyObject *args)
{
    int n = 0;
    if (!PyArg_ParseTuple(args, "|i", &n))
        return NULL;
    int prev = hash_lanes_now;
    if (n > 0) {
        if (!(n == 1 || (n == 4 && hash_lanes_max >= 4) || (n == 8 && hash_lanes_max >= 8))) {
            PyErr_Format(PyExc_ValueError, "hash_lanes(%d): this CPU runs 1 to %d lanes", n,
                         hash_lanes_max);
            return NULL;
        }
        hash_lanes_now = n;
    }
    return PyLong_FromLong(prev);
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
    const uint8_t **p = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *p);
    Py_ssize_t *len = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *len);
    if (!out || !p || !len) {
        Py_XDECREF(out);
        PyMem_Free(p);
        PyMem_Free(len);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyList_GET_ITEM(arg, i);
        const char *u = PyUnicode_CheckExact(s) ? PyUnicode_AsUTF8AndSize(s, &len[i]) : NULL;
        if (!u) { /* the list holds the strs (and their cached UTF-8) for the whole call */
            PyErr_Clear();
            Py_DECREF(out);
            PyMem_Free(p);
            PyMem_Free(len);
            Py_RETURN_NONE;
        }
        p[i] = (const uint8_t *)u;
    }
    hash_many(p, len, n, (uint64_t *)PyBytes_AS_STRING(out));
    PyMem_Free(p);
    PyMem_Free(len);
    return out;
}


/* ---------------------------------------------------------------- sampling prefilter
 * sample_out: the sampling decision of daemon.model_state.ModelState.sample, taken on the raw
 * message bytes, before any JSON parsing. A message is scanned as one JSON object (strings
 * skipped with their escapes, nested values by depth) only to find its top-level "model" and
 * "id" strings (the scan stops once both are found: the rest must end the object and hold no
 * other "model" or "id" bytes); nothing else is read or validated. It is *decided* (dropped)
 * only when everything is plain: a bytes value of at most max_bytes bytes, one top-level
 * object, "model" and "id" each present once as ASCII strings without escapes or control
 * characters (so their bytes are their UTF-8 form), id of 1..max_id bytes, the model sampled
 * (in rates, or in fallback and not placed; see sampler_rate) and u = blake2b_64(id) / 2**64
 * not below the model's rate. Anything else stays undecided (0) and takes the full path, where
 * ModelState.sample applies the same rule to the parsed event. */

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

/* A sampling pass over one batch, in three steps: scan every message for its model and id and
 * note the candidates (decidable, of a model with a rate < 1); hash all candidate ids at once
 * (hash_many: side by side in vector lanes); drop the candidates whose u is not below their
 * model's rate. Python objects are only made per model (its name, for the rate look-up and the
 * counts), never per message. */
typedef struct {
    PyObject *name;        /* the model (str) */
    double rate;
    Py_ssize_t dropped;
} Slot;

typedef struct {
    PyObject *rates;       /* {model: rate} */
    PyObject *fallback;    /* {model: rate} of models not in placed, or NULL */
    PyObject *placed;      /* a container of models (membership), or NULL */
    Py_ssize_t max_bytes, max_id;
    PyObject *slot_of;     /* {model: slot index} */
    Slot *slots;
    Py_ssize_t nslots, cap;
    const char *last_m;    /* the last model's bytes (in a message value alive for the call) */
    Py_ssize_t last_len, last_slot;
    Py_ssize_t ncand, ndone; /* candidates (message index, slot, id bytes); decided */
    Py_ssize_t *cand_msg, *cand_slot, *cand_len;
    const uint8_t **cand_id;
} Sampler;

static void
sampler_free(Sampler *z)
{
    for (Py_ssize_t s = 0; s < z->nslots; s++)
        Py_DECREF(z->slots[s].name);
    PyMem_Free(z->slots);
    PyMem_Free(z->cand_msg);
    PyMem_Free(z->cand_slot);
    PyMem_Free(z->cand_len);
    PyMem_Free((void *)z->cand_id);
    Py_XDECREF(z->slot_of);
}

static int
sampler_init(Sampler *z, Py_ssize_t n)
{
    size_t m = (size_t)(n ? n : 1);
    z->slot_of = PyDict_New();
    z->cand_msg = PyMem_Malloc(m * sizeof(Py_ssize_t));
    z->cand_slot = PyMem_Malloc(m * sizeof(Py_ssize_t));
    z->cand_len = PyMem_Malloc(m * sizeof(Py_ssize_t));
    z->cand_id = PyMem_Malloc(m * sizeof(const uint8_t *));
    if (!z->slot_of || !z->cand_msg || !z->cand_slot || !z->cand_len || !z->cand_id) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* A model's rate: rates[m]; else fallback[m] if m is not in placed; else 1. -1 on error. */
static int
sampler_rate(Sampler *z, PyObject *name, double *rate)
{
    *rate = 1.0;
    PyObject *r = PyDict_GetItemWithError(z->rates, name);
    if (!r && PyErr_Occurred())
        return -1;
    if (!r && z->fallback) {
        int placed = z->placed ? PySequence_Contains(z->placed, name) : 0;
        if (placed < 0)
            return -1;
        if (!placed) {
            r = PyDict_GetItemWithError(z->fallback, name);
            if (!r && PyErr_Occurred())
                return -1;
        }
    }
    if (r) {
        *rate = PyFloat_AsDouble(r);
        if (*rate == -1.0 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

/* The slot of the model whose ASCII bytes are m[0:mlen]; -1 on error. */
static Py_ssize_t
sampler_slot(Sampler *z, const char *m, Py_ssize_t mlen)
{
    if (z->last_m && mlen == z->last_len && memcmp(m, z->last_m, (size_t)mlen) == 0)
        return z->last_slot;
    PyObject *name = PyUnicode_DecodeASCII(m, mlen, NULL);
    if (!name)
        return -1;
    Py_ssize_t s;
    PyObject *idx = PyDict_GetItemWithError(z->slot_of, name);
    if (idx) {
        s = PyLong_AsSsize_t(idx);
        Py_DECREF(name);
    } else {
        double rate;
        if (PyErr_Occurred() || sampler_rate(z, name, &rate) < 0) {
            Py_DECREF(name);
            return -1;
        }
        if (z->nslots == z->cap) {
            Py_ssize_t cap = z->cap ? 2 * z->cap : 8;
            Slot *sl = PyMem_Realloc(z->slots, (size_t)cap * sizeof(Slot));
            if (!sl) {
                Py_DECREF(name);
                PyErr_NoMemory();
                return -1;
            }
            z->slots = sl;
            z->cap = cap;
        }
        s = z->nslots;
        PyObject *si = PyLong_FromSsize_t(s);
        if (!si || PyDict_SetItem(z->slot_of, name, si) < 0) {
            Py_XDECREF(si);
            Py_DECREF(name);
            return -1;
        }
        Py_DECREF(si);
        z->slots[s] = (Slot){name, rate, 0}; /* owns the reference */
        z->nslots++;
    }
    z->last_m = m;
    z->last_len = mlen;
    z->last_slot = s;
    return s;
}

/* Step 1 for message i (value v): note it as a candidate if it is decidable here and its model
 * samples. 0 or -1 (error). */
static int
sampler_scan(Sampler *z, Py_ssize_t i, PyObject *v)
{
    if (!PyBytes_CheckExact(v) || PyBytes_GET_SIZE(v) > z->max_bytes)
        return 0;
    const char *p = PyBytes_AS_STRING(v), *m, *id;
    Py_ssize_t mlen = 0, idlen = 0;
    if (!find_model_id(p, p + PyBytes_GET_SIZE(v), &m, &mlen, &id, &idlen))
        return 0;
    if (mlen < 1 || idlen < 1 || idlen > z->max_id)
        return 0;
    Py_ssize_t s = sampler_slot(z, m, mlen);
    if (s < 0)
        return -1;
    if (!(z->slots[s].rate < 1.0))
        return 0;
    Py_ssize_t c = z->ncand++;
    z->cand_msg[c] = i;
    z->cand_slot[c] = s;
    z->cand_id[c] = (const uint8_t *)id;
    z->cand_len[c] = idlen;
    return 0;
}

/* Steps 2 and 3 for the candidates noted since the last call: drop[i] = 1 for each candidate
 * i with u = blake2b_64(id) / 2**64 >= its model's rate (the others are left as they are);
 * counts per model. Called every SAMPLE_BLOCK candidates while scanning (so that their ids are
 * still in the cache) and once at the end. */
#define SAMPLE_BLOCK 64 /* a multiple of every lane count */

static void
sampler_decide(Sampler *z, char *drop)
{
    uint64_t h[SAMPLE_BLOCK];
    while (z->ndone < z->ncand) {
        Py_ssize_t c0 = z->ndone, nc = z->ncand - c0;
        if (nc > SAMPLE_BLOCK)
            nc = SAMPLE_BLOCK;
        hash_many(z->cand_id + c0, z->cand_len + c0, nc, h);
        for (Py_ssize_t c = 0; c < nc; c++) {
            Slot *sl = &z->slots[z->cand_slot[c0 + c]];
            double u = (double)h[c] / 18446744073709551616.0; /* as route_uniform computes it */
            if (!(u < sl->rate)) {
                drop[z->cand_msg[c0 + c]] = 1;
                sl->dropped++;
            }
        }
        z->ndone = c0 + nc;
    }
}

/* Step 1 for message i (value v), then steps 2 and 3 once a block of candidates is ready. */
static int
sampler_step(Sampler *z, Py_ssize_t i, PyObject *v, char *drop)
{
    if (sampler_scan(z, i, v) < 0)
        return -1;
    if (z->ncand - z->ndone >= SAMPLE_BLOCK)
        sampler_decide(z, drop);
    return 0;
}

/* {model: dropped} of the models that dropped any; NULL on error. */
static PyObject *
sampler_counts(Sampler *z)
{
    PyObject *counts = PyDict_New();
    if (!counts)
        return NULL;
    for (Py_ssize_t s = 0; s < z->nslots; s++) {
        if (!z->slots[s].dropped)
            continue;
        PyObject *c = PyLong_FromSsize_t(z->slots[s].dropped);
        if (!c || PyDict_SetItem(counts, z->slots[s].name, c) < 0) {
            Py_XDECREF(c);
            Py_DECREF(counts);
            return NULL;
        }
        Py_DECREF(c);
    }
    return counts;
}

/* The optional (fallback, placed) arguments: None or absent is NULL. */
static int
sampler_args(Sampler *z, PyObject *fallback, PyObject *placed)
{
    if (fallback == Py_None)
        fallback = NULL;
    if (placed == Py_None)
        placed = NULL;
    if (fallback && !PyDict_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "fallback must be a dict or None");
        return -1;
    }
    z->fallback = fallback;
    z->placed = placed;
    return 0;
}

#define SAMPLE_ARGS_DOC                                                                       \
"rates: {model: rate} of the models to sample (a rate >= 1 keeps every event). fallback\n"  \
"(optional): {model: rate} used for a model absent from rates and not in placed (a\n"       \
"container of models, e.g. {model: partition}): the configured rates of models not seen\n"  \
"yet, so that they are sampled from their first event on."

PyDoc_STRVAR(sample_out_doc,
"sample_out(values, rates, max_bytes, max_id_len, fallback=None, placed=None)\n"
"    -> (mask, counts)\n\n"
"mask: bytes, 1 for each message sampled out on its raw bytes (see the comment above),\n"
"0 for the others (parse them); counts: {model: messages sampled out}.\n" SAMPLE_ARGS_DOC);

static PyObject *
sample_out(PyObject *self, PyObject *args)
{
    PyObject *values, *fallback = NULL, *placed = NULL, *mask = NULL, *counts = NULL;
    Sampler z = {0};
    if (!PyArg_ParseTuple(args, "O!O!nn|OO", &PyList_Type, &values, &PyDict_Type, &z.rates,
                          &z.max_bytes, &z.max_id, &fallback, &placed))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(values);
    if (sampler_args(&z, fallback, placed) < 0 || sampler_init(&z, n) < 0)
        goto fail;
    mask = PyBytes_FromStringAndSize(NULL, n);
    if (!mask)
        goto fail;
    char *o = PyBytes_AS_STRING(mask);
    memset(o, 0, (size_t)n);
    for (Py_ssize_t i = 0; i < n; i++)
        if (sampler_step(&z, i, PyList_GET_ITEM(values, i), o) < 0)
            goto fail;
    sampler_decide(&z, o);
    if (!(counts = sampler_counts(&z)))
        goto fail;
    sampler_free(&z);
    return Py_BuildValue("(NN)", mask, counts);
fail:
    sampler_free(&z);
    Py_XDECREF(mask);
    return NULL;
}

PyDoc_STRVAR(sample_records_doc,
"sample_records(records, rates, max_bytes, max_id_len, fallback=None, placed=None)\n"
"    -> (kept, values, counts)\n\n"
"sample_out on the .value of Kafka records: the records kept (in order), their values, and\n"
"{model: records sampled out}.\n" SAMPLE_ARGS_DOC);

static PyObject *
sample_records(PyObject *self, PyObject *args)
{
    static PyObject *value_name = NULL;
    PyObject *records, *fallback = NULL, *placed = NULL, *kept = NULL, *vals = NULL;
    PyObject **v = NULL, *counts = NULL;
    char *drop = NULL;
    Sampler z = {0};
    if (!PyArg_ParseTuple(args, "O!O!nn|OO", &PyList_Type, &records, &PyDict_Type, &z.rates,
                          &z.max_bytes, &z.max_id, &fallback, &placed))
        return NULL;
    if (!value_name && speedups_intern(&value_name, "value") < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(records);
    if (sampler_args(&z, fallback, placed) < 0 || sampler_init(&z, n) < 0)
        goto fail;
    v = PyMem_Calloc((size_t)(n ? n : 1), sizeof *v); /* the values: owned references, which
                                                        * keep the candidates' id bytes alive */
    drop = PyMem_Calloc((size_t)(n ? n : 1), 1);
    if (!v || !drop) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        v[i] = PyObject_GetAttr(PyList_GET_ITEM(records, i), value_name);
        if (!v[i] || sampler_step(&z, i, v[i], drop) < 0)
            goto fail;
    }
    sampler_decide(&z, drop);
    Py_ssize_t nk = n;
    for (Py_ssize_t i = 0; i < n; i++)
        nk -= drop[i];
    kept = PyList_New(nk);
    vals = PyList_New(nk);
    if (!kept || !vals || !(counts = sampler_counts(&z)))
        goto fail;
    for (Py_ssize_t i = 0, j = 0; i < n; i++) {
        if (drop[i])
            continue;
        PyObject *r = PyList_GET_ITEM(records, i);
        Py_INCREF(r);
        PyList_SET_ITEM(kept, j, r);
        Py_INCREF(v[i]);
        PyList_SET_ITEM(vals, j, v[i]);
        j++;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(v[i]);
    PyMem_Free(v);
    PyMem_Free(drop);
    sampler_free(&z);
    return Py_BuildValue("(NNN)", kept, vals, counts);
fail:
    if (v)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_XDECREF(v[i]);
    PyMem_Free(v);
    PyMem_Free(drop);
    sampler_free(&z);
    Py_XDECREF(kept);
    Py_XDECREF(vals);
    Py_XDECREF(counts);
    return NULL;
}

static PyMethodDef blake2b_methods[] = {
    {"route_u64", route_u64, METH_O, route_u64_doc},
    {"hash_lanes", hash_lanes, METH_VARARGS, hash_lanes_doc},
    {"sample_out", sample_out, METH_VARARGS, sample_out_doc},
    {"sample_records", sample_records, METH_VARARGS, sample_records_doc},
    {NULL, NULL, 0, NULL}};

int
speedups_add_blake2b(PyObject *module)
{
    hash_lanes_init();
    return PyModule_AddFunctions(module, blake2b_methods);
}
