/* What the CPython entry files (module.c, lut.c, decode.c) share. Not for the kernels
 * themselves, which build without Python (tests/native/). */
#ifndef INFER_BINDING_H
#define INFER_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The `want` positional arguments of `name`, all Python ints, into out; -1 with a Python
 * exception set when the count or a value is wrong. */
int infer_parse_ints(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, long long *out,
                     const char *name);

#endif
