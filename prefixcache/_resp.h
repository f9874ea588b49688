/* The Redis tier's RESP exchanges (prefixcache/_resp.c), registered by prefixcache/_core.c. */
#ifndef PREFIXCACHE_RESP_H
#define PREFIXCACHE_RESP_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyObject *core_resp_set(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *core_resp_getex(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* Adds the RespWriter type (the tier's write queue) to the module; -1 with an exception set on failure. */
int resp_register(PyObject *module);

#endif
