/* Shared declarations of the parts of daemon._speedups (see module.c). */
#ifndef LPCAL_SPEEDUPS_H
#define LPCAL_SPEEDUPS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Each part adds its functions (and interns the strings it needs) to the module. */
int speedups_add_scan(PyObject *module);    /* scan.c: all_bytes_within, scan */
int speedups_add_blake2b(PyObject *module); /* blake2b.c: route_u64 */
int speedups_add_join(PyObject *module);    /* join.c: offer_loop, attach_rows */

/* The interned str of a C string, kept for the life of the process; NULL on error. */
static inline int
speedups_intern(PyObject **slot, const char *name)
{
    *slot = PyUnicode_InternFromString(name);
    return *slot ? 0 : -1;
}

#endif
