/* infer.kernels_cpu._C: the CPython module over the kernels.
 *
 * A plain extension (no PyTorch C++ API): arguments are data pointers and sizes as
 * Python ints, which kernels_cpu/ops.py takes from tensors after checking their shapes,
 * dtypes and contiguity. The checks here only keep a wrong call from reading out of
 * bounds in obvious ways (sizes, group size, path). The GIL is released while a kernel
 * runs.
 */
#include "binding.h"
#include "kernels.h"

/* Other kernel files add functions to the module (see kernels.h). */
extern PyMethodDef infer_lut_methods[] __attribute__((weak));
extern PyMethodDef infer_decode_methods[] __attribute__((weak));

int infer_parse_ints(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, long long *out,
                     const char *name) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static int check_isa(long long isa) {
    if (isa < 0 || isa >= ISA_COUNT || !kernels_for((int)isa) || !isa_supported((int)isa)) {
        PyErr_Format(PyExc_ValueError, "instruction set %lld is not available on this CPU", isa);
        return -1;
    }
    return 0;
}

/* Shared by q8_matmul, q6_matmul, q5_matmul and q4_matmul: v = x, qw, scales, mins, y, M, N,
 * K, g, isa, threads; qh: int5's high bits (0 for the others) */
static PyObject *matmul(int bits, const long long *v, long long qh) {
    qmat a = {
        .x = (const float *)(intptr_t)v[0],
        .qw = (const void *)(intptr_t)v[1],
        .scales = (const void *)(intptr_t)v[2],
        .mins = (const uint16_t *)(intptr_t)v[3],
        .y = (float *)(intptr_t)v[4],
        .M = v[5],
        .N = v[6],
        .K = v[7],
        .g = v[8],
        .qh = (const uint8_t *)(intptr_t)qh,
    };
    const long long isa = v[9], threads = v[10];
    const int g_ok = bits == 6 || bits >= Q2K ? a.g == 256 && !a.scales && !a.mins
                     : bits == 5 ? a.g == 32
                                 : a.g == 32 || a.g == 64 || a.g == 128 || (bits == 8 && a.g == 0);
    if (a.M < 0 || a.N < 0 || a.K <= 0 || !g_ok || (a.g && a.K % a.g)) {
        PyErr_Format(PyExc_ValueError, "int%d matmul: bad sizes M=%lld N=%lld K=%lld g=%lld", bits,
                     (long long)a.M, (long long)a.N, (long long)a.K, (long long)a.g);
        return NULL;
    }
    if (bits == 8 && a.mins) {
        PyErr_SetString(PyExc_ValueError, "int8 matmul takes no mins");
        return NULL;
    }
    const int needs_scales = bits == 8 || bits == 5 || bits == 4; /* the others: in their blocks */
    if ((a.M && a.N) &&
        (!a.x || !a.qw || (!a.scales && needs_scales) || !a.y || (bits == 5) != !!a.qh)) {
        PyErr_SetString(PyExc_ValueError, "null data pointer");
        return NULL;
    }
    if (check_isa(isa)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = q_matmul(bits, &a, (int)isa, threads < 1 ? 1 : threads > 255 ? 255 : (int)threads);
    Py_END_ALLOW_THREADS;
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_q8_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[11];
    /* (x, qw, scales, y, M, N, K, g, isa, threads): no mins */
    if (infer_parse_ints(args, nargs, 10, v, "q8_matmul")) return NULL;
    long long w[11] = {v[0], v[1], v[2], 0, v[3], v[4], v[5], v[6], v[7], v[8], v[9]};
    return matmul(8, w, 0);
}

static PyObject *py_q4_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[11];
    if (infer_parse_ints(args, nargs, 11, v, "q4_matmul")) return NULL;
    return matmul(4, v, 0);
}

static PyObject *py_q5_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[12];
    /* (x, qw, qh, scales, mins, y, M, N, K, g, isa, threads) */
    if (infer_parse_ints(args, nargs, 12, v, "q5_matmul")) return NULL;
    long long w[11] = {v[0], v[1], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11]};
    return matmul(5, w, v[2]);
}

/* (x, qw, y, M, N, K, g, isa, threads) of int6 or a super-block kind: no scales or mins,
 * g = 256 */
static PyObject *superblock_matmul(int kind, const char *name, PyObject *const *args,
                                   Py_ssize_t nargs) {
    long long v[9];
    if (infer_parse_ints(args, nargs, 9, v, name)) return NULL;
    long long w[11] = {v[0], v[1], 0, 0, v[2], v[3], v[4], v[5], v[6], v[7], v[8]};
    return matmul(kind, w, 0);
}

static PyObject *py_q6_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return superblock_matmul(6, "q6_matmul", args, nargs);
}

static PyObject *py_q4k_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return superblock_matmul(Q4K, "q4k_matmul", args, nargs);
}

static PyObject *py_q5k_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return superblock_matmul(Q5K, "q5k_matmul", args, nargs);
}

static PyObject *py_iq4xs_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return superblock_matmul(IQ4XS, "iq4xs_matmul", args, nargs);
}

static PyObject *py_q3k_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return superblock_matmul(Q3K, "q3k_matmul", args, nargs);
}

static PyObject *py_q2k_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return superblock_matmul(Q2K, "q2k_matmul", args, nargs);
}

static PyObject *py_stream_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long v[4];
    if (infer_parse_ints(args, nargs, 4, v, "stream_read")) return NULL;
    if (!v[0] || v[1] < 0 || v[1] % 256) {
        PyErr_SetString(PyExc_ValueError, "stream_read: null pointer or size not a multiple of 256");
        return NULL;
    }
    if (check_isa(v[2])) return NULL;
    double s;
    Py_BEGIN_ALLOW_THREADS;
    s = stream_read((const void *)(intptr_t)v[0], v[1], (int)v[2], v[3] < 1 ? 1 : (int)v[3]);
    Py_END_ALLOW_THREADS;
    return PyFloat_FromDouble(s);
}

static PyObject *py_isa_names(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    PyObject *t = PyTuple_New(ISA_COUNT);
    for (int i = 0; t && i < ISA_COUNT; i++) PyTuple_SET_ITEM(t, i, PyUnicode_FromString(isa_name(i)));
    return t;
}

static PyObject *py_isa_supported(PyObject *self, PyObject *arg) {
    (void)self;
    long isa = PyLong_AsLong(arg);
    if (isa == -1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(isa >= 0 && isa < ISA_COUNT && kernels_for((int)isa) && isa_supported((int)isa));
}

/* The kernel table of the path id `arg` into *kt (NULL when not built in); -1 with a
 * Python error set when `arg` is not an integer. */
static int table_of(PyObject *arg, const kernel_table **kt) {
    long isa = PyLong_AsLong(arg);
    if (isa == -1 && PyErr_Occurred()) return -1;
    *kt = isa >= 0 && isa < ISA_COUNT ? kernels_for((int)isa) : NULL;
    return 0;
}

static PyObject *py_isa_integer_gemm(PyObject *self, PyObject *arg) {
    (void)self;
    const kernel_table *kt;
    return table_of(arg, &kt) ? NULL : PyLong_FromUnsignedLong(kt && kt->ig_xprep ? kt->ig_kinds : 0);
}

static PyObject *py_isa_int4_digits(PyObject *self, PyObject *arg) {
    (void)self;
    const kernel_table *kt;
    return table_of(arg, &kt) ? NULL : PyBool_FromLong(kt && kt->q4_xprep);
}

static PyObject *py_isa_int5_digits(PyObject *self, PyObject *arg) {
    (void)self;
    const kernel_table *kt;
    return table_of(arg, &kt) ? NULL : PyBool_FromLong(kt && kt->q5_xprep);
}

static PyObject *py_isa_int6_x16(PyObject *self, PyObject *arg) {
    (void)self;
    const kernel_table *kt;
    return table_of(arg, &kt) ? NULL : PyLong_FromLong(kt ? kt->q6_xblock : 0);
}

static PyObject *py_isa_q4k_digits(PyObject *self, PyObject *arg) {
    (void)self;
    const kernel_table *kt;
    return table_of(arg, &kt) ? NULL : PyBool_FromLong(kt && q4k_for(kt)->xprep);
}

static PyObject *py_isa_best(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLong(isa_best());
}

static PyObject *py_matmul_paths(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return Py_BuildValue("(iiii)", (int)SMALL_M, (int)WIDE_M, (int)WIDE_K, (int)IGEMM_MIN_M);
}

static PyObject *py_cpu_has(PyObject *self, PyObject *arg) {
    (void)self;
    const char *f = PyUnicode_AsUTF8(arg);
    return f ? PyBool_FromLong(cpu_has(f)) : NULL;
}

static PyMethodDef methods[] = {
    {"q8_matmul", (PyCFunction)(void (*)(void))py_q8_matmul, METH_FASTCALL,
     "q8_matmul(x, qweight, scales, y, M, N, K, group_size, isa, threads): y = x W^T, int8 W"},
    {"q4_matmul", (PyCFunction)(void (*)(void))py_q4_matmul, METH_FASTCALL,
     "q4_matmul(x, qweight, scales, mins, y, M, N, K, group_size, isa, threads): y = x W^T, "
     "int4 W (mins 0: symmetric)"},
    {"q5_matmul", (PyCFunction)(void (*)(void))py_q5_matmul, METH_FASTCALL,
     "q5_matmul(x, qweight, qh, scales, mins, y, M, N, K, 32, isa, threads): y = x W^T, "
     "int5 W (mins 0: symmetric)"},
    {"q6_matmul", (PyCFunction)(void (*)(void))py_q6_matmul, METH_FASTCALL,
     "q6_matmul(x, qweight, y, M, N, K, 256, isa, threads): y = x W^T, int6 W (Q6_K blocks)"},
    {"q4k_matmul", (PyCFunction)(void (*)(void))py_q4k_matmul, METH_FASTCALL,
     "q4k_matmul(x, qweight, y, M, N, K, 256, isa, threads): y = x W^T, q4_k W (Q4_K blocks)"},
    {"q5k_matmul", (PyCFunction)(void (*)(void))py_q5k_matmul, METH_FASTCALL,
     "q5k_matmul(x, qweight, y, M, N, K, 256, isa, threads): y = x W^T, q5_k W (Q5_K blocks)"},
    {"iq4xs_matmul", (PyCFunction)(void (*)(void))py_iq4xs_matmul, METH_FASTCALL,
     "iq4xs_matmul(x, qweight, y, M, N, K, 256, isa, threads): y = x W^T, iq4_xs W (IQ4_XS blocks)"},
    {"q3k_matmul", (PyCFunction)(void (*)(void))py_q3k_matmul, METH_FASTCALL,
     "q3k_matmul(x, qweight, y, M, N, K, 256, isa, threads): y = x W^T, q3_k W (Q3_K blocks)"},
    {"q2k_matmul", (PyCFunction)(void (*)(void))py_q2k_matmul, METH_FASTCALL,
     "q2k_matmul(x, qweight, y, M, N, K, 256, isa, threads): y = x W^T, q2_k W (Q2_K blocks)"},
    {"stream_read", (PyCFunction)(void (*)(void))py_stream_read, METH_FASTCALL,
     "stream_read(ptr, nbytes, isa, threads): sum a buffer (read-bandwidth probe)"},
    {"isa_names", py_isa_names, METH_NOARGS, "names of the instruction-set paths, by id"},
    {"isa_supported", py_isa_supported, METH_O, "whether this CPU can run path `isa`"},
    {"isa_best", py_isa_best, METH_NOARGS, "the fastest path this CPU can run"},
    {"isa_integer_gemm", py_isa_integer_gemm, METH_O,
     "the formats path `isa` multiplies prompts (the GEMM) of with integer dot products: "
     "bit b set for bits b (4, 5, 8; 13 q5_k, 12 q4_k, 11 q3_k, 23 iq4_xs)"},
    {"isa_int4_digits", py_isa_int4_digits, METH_O,
     "whether path `isa`'s int4 GEMV takes x as the integer GEMM's two int8 digits"},
    {"isa_int5_digits", py_isa_int5_digits, METH_O,
     "whether path `isa`'s int5 GEMV takes x as the integer GEMM's two int8 digits"},
    {"isa_int6_x16", py_isa_int6_x16, METH_O,
     "the block of x per scale if path `isa`'s int6 GEMV takes x as int16 (15 bits), else 0"},
    {"isa_q4k_digits", py_isa_q4k_digits, METH_O,
     "whether path `isa`'s q4_k GEMV takes x as two int8 digits per block of 256"},
    {"cpu_has", py_cpu_has, METH_O, "whether the CPU has a feature (e.g. 'avx512vnni')"},
    {"matmul_paths", py_matmul_paths, METH_NOARGS,
     "(SMALL_M, WIDE_M, WIDE_K, IGEMM_MIN_M): which rows run the GEMVs, which the integer "
     "GEMM (kernels.h)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_C",
    .m_doc = "CPU kernels of infer (see kernels_cpu/ops.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__C(void) {
    PyObject *m = PyModule_Create(&module);
    PyMethodDef *more[] = {infer_lut_methods, infer_decode_methods};
    for (size_t i = 0; m && i < sizeof more / sizeof *more; i++)
        if (more[i] && PyModule_AddFunctions(m, more[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    return m;
}
