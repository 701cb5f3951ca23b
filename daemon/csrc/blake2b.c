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

static PyMethodDef blake2b_methods[] = {
    {"route_u64", route_u64, METH_O, route_u64_doc},
    {NULL, NULL, 0, NULL}};

int
speedups_add_blake2b(PyObject *module)
{
    return PyModule_AddFunctions(module, blake2b_methods);
}
