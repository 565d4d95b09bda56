/* The block pool's two bulk moves (sim/kv.py `BlockPool`) without sharing: taking `n` blocks
 * from the head of the free queue, and freeing a request's whole table. A `chat` request holds
 * ~175 blocks; compiled Python spends ~130 machine instructions a block on each move (a boxed
 * int read and written per reference count), this ~15.
 *
 * An optimisation of the same list operations as the Python it stands in for, in the same order,
 * so the pool ends in the same state and the same errors are raised: `BlockPool.allocate` (the
 * path with no stale queue entry) and `BlockPool._free_unshared`. Used only with the compiled
 * build (sim/_compiled.py), never under SERVESIM_PURE=1; tests/sim/test_blocks.py compares it
 * with the Python on random pools, tests/test_compiled.py whole runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The ids of list `blocks` as indices into a list of `nref` counts, in a new buffer (freed by
 * the caller with PyMem_Free), or NULL with an exception set. */
static Py_ssize_t *block_indices(PyObject *blocks, Py_ssize_t nref) {
    Py_ssize_t n = PyList_GET_SIZE(blocks);
    Py_ssize_t *idx = PyMem_Malloc((n ? n : 1) * sizeof(Py_ssize_t));
    if (idx == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t b = PyLong_AsSsize_t(PyList_GET_ITEM(blocks, i));
        if (b < 0 || b >= nref) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_IndexError, "_blocks: block %zd outside the pool", b);
            PyMem_Free(idx);
            return NULL;
        }
        idx[i] = b;
    }
    return idx;
}

/* ref[b] = value (a new reference to `value` is stored). */
static inline void set_ref(PyObject *ref, Py_ssize_t b, PyObject *value) {
    PyObject *old = PyList_GET_ITEM(ref, b);
    Py_INCREF(value);
    PyList_SET_ITEM(ref, b, value);
    Py_DECREF(old);
}

/* take(front, queue, head, n, ref) -> list
 *
 * `BlockPool.allocate` with no stale entry: k = min(n, len(front)) blocks from the top of the
 * `front` stack (top first), which loses them, then queue[head:head + n - k]; each block's
 * ref[b] becomes 1. The caller checked that n blocks are free and advances its head by n - k.
 */
static PyObject *take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_Check(args[0]) || !PyList_Check(args[1])
            || !PyList_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "_blocks.take(front, queue, head, n, ref): lists and ints");
        return NULL;
    }
    PyObject *front = args[0], *queue = args[1], *ref = args[4];
    Py_ssize_t head = PyLong_AsSsize_t(args[2]), n = PyLong_AsSsize_t(args[3]);
    if ((head == -1 || n == -1) && PyErr_Occurred())
        return NULL;
    Py_ssize_t nf = PyList_GET_SIZE(front), k = n < nf ? n : nf;
    if (n < 0 || head < 0 || head + (n - k) > PyList_GET_SIZE(queue)) {
        PyErr_SetString(PyExc_ValueError, "_blocks.take: fewer blocks queued than asked for");
        return NULL;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = i < k ? PyList_GET_ITEM(front, nf - 1 - i)
                            : PyList_GET_ITEM(queue, head + i - k);
        Py_INCREF(b);
        PyList_SET_ITEM(out, i, b);
    }
    /* every id checked before any count changes: a bad one leaves the pool as it was */
    Py_ssize_t *idx = block_indices(out, PyList_GET_SIZE(ref));
    if (idx == NULL || (k && PyList_SetSlice(front, nf - k, nf, NULL) < 0)) {
        PyMem_Free(idx);
        Py_DECREF(out);
        return NULL;
    }
    PyObject *one = PyLong_FromLong(1);  /* (a cached small int: cannot fail) */
    for (Py_ssize_t i = 0; i < n; i++)
        set_ref(ref, idx[i], one);
    Py_DECREF(one);
    PyMem_Free(idx);
    return out;
}

/* release(ref, table) -> None
 *
 * `BlockPool._free_unshared`'s counts: each of `table`'s blocks, tail first, from ref 1 to 0.
 * A block not at 1 (freed twice, or twice in the table) raises AssertionError("block B freed
 * twice") with the counts set back as they were.
 */
static PyObject *release(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "_blocks.release(ref, table): two lists");
        return NULL;
    }
    PyObject *ref = args[0], *table = args[1];
    Py_ssize_t n = PyList_GET_SIZE(table);
    Py_ssize_t *idx = block_indices(table, PyList_GET_SIZE(ref));
    if (idx == NULL)
        return NULL;
    PyObject *zero = PyLong_FromLong(0), *one = PyLong_FromLong(1);  /* (cached small ints) */
    PyObject *result = Py_None;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        PyObject *rc = PyList_GET_ITEM(ref, idx[i]);
        if (rc != one) {  /* (a count of 1 is the cached int 1; anything else is checked) */
            long v = PyLong_AsLong(rc);
            if (v != 1) {
                for (Py_ssize_t j = i + 1; j < n; j++)  /* (nothing freed: as it was) */
                    set_ref(ref, idx[j], one);
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_AssertionError, "block %zd freed twice", idx[i]);
                result = NULL;
                break;
            }
        }
        set_ref(ref, idx[i], zero);
    }
    Py_DECREF(zero);
    Py_DECREF(one);
    PyMem_Free(idx);
    Py_XINCREF(result);
    return result;
}

static PyMethodDef methods[] = {
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL, "BlockPool.allocate's bulk move (no stale queue entry)."},
    {"release", (PyCFunction)(void (*)(void))release, METH_FASTCALL, "BlockPool._free_unshared's reference counts."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blocks", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blocks(void) { return PyModule_Create(&module); }
