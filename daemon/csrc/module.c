/* daemon._speedups: optional native kernels of the daemon's ingest path.
 *
 * Each function does exactly what a pure-Python reference in daemon/ does, only without the
 * interpreter loop; daemon/native.py loads this module if it was built and falls back to the
 * Python code otherwise (or when LPCAL_NATIVE=0). tests/daemon/test_native.py checks every
 * function against its reference on random and adversarial input.
 *
 * Parts: scan.c, event_json.c, blake2b.c, join.c; this file only assembles the module.
 *
 *   scan(ds, max_model_len, max_id_len)        columns of a batch of parsed events, or None
 *                                              (reference: daemon.columns.columns_python);
 *                                              given message values, the common shape is read
 *                                              from the bytes (event_json.c)
 *   event_fields(value, max_model, max_id)     one value's fields as scan reads them, or None
 *   route_u64(ids)                             blake2b-64 of each id's UTF-8, or None
 *                                              (reference: lpcal.pools.route_uniform)
 *   hash_lanes(n=0)                            ids hashed side by side (1, 4: AVX2, 8: AVX-512F)
 *   sample_out(values, rates, max_bytes, max_id_len, fallback=None, placed=None)
 *   sample_records(records, rates, ...)        events of sampled models dropped on their raw
 *                                              bytes (reference: ModelState.sample)
 *   offer_loop(m, ttl, event_time, clock, wm0, wm1, kind, ids, ts, labels)
 *                                              the per-event join loop of JoinStore.offer, on
 *                                              the model's state m (a daemon.join_loop._ModelJoin)
 *   attach_rows(entries, block)                entry[E_PAYLOAD] = (block, r) for each entry
 *
 * Constants: the codes of speedups.h (KIND_*, JOINED, EXPIRED, E_*, ENTRY_LEN, and the MJ_*
 * attribute names of a model's join state), whose Python definitions are in daemon/codes.py.
 *
 * No NumPy C API: arrays cross the boundary as bytearrays (np.frombuffer on the Python side),
 * so the module builds with nothing but a C compiler and the Python headers.
 */
#include "speedups.h"

static const struct {
    const char *name;
    long value;
} codes[] = {{"KIND_PREDICTION", KIND_PREDICTION}, {"KIND_OUTCOME", KIND_OUTCOME},
             {"KIND_SAMPLE", KIND_SAMPLE},         {"KIND_DEAD", KIND_DEAD},
             {"JOINED", JOINED},                   {"EXPIRED", EXPIRED},
             {"E_KIND", E_KIND},                   {"E_DEADLINE", E_DEADLINE},
             {"E_TS", E_TS},                       {"E_PAYLOAD", E_PAYLOAD},
             {"E_ID", E_ID},                       {"ENTRY_LEN", ENTRY_LEN}};

/* the attribute names of a model's join state that join.c reads (daemon.codes MJ_*) */
static const struct {
    const char *name;
    const char *value;
} names[] = {{"MJ_PENDING", MJ_PENDING},         {"MJ_QUEUE", MJ_QUEUE},
             {"MJ_RECENT", MJ_RECENT},           {"MJ_RECENT_ORDER", MJ_RECENT_ORDER},
             {"MJ_CAP_PENDING", MJ_CAP_PENDING}, {"MJ_CAP_RECENT", MJ_CAP_RECENT}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "daemon._speedups",
                                    "Optional native kernels of the lpcal daemon's ingest path.",
                                    -1, NULL};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (speedups_add_scan(m) < 0 || speedups_add_event_json(m) < 0 ||
        speedups_add_blake2b(m) < 0 || speedups_add_join(m) < 0)
        goto fail;
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++)
        if (PyModule_AddIntConstant(m, codes[i].name, codes[i].value) < 0)
            goto fail;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (PyModule_AddStringConstant(m, names[i].name, names[i].value) < 0)
            goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
