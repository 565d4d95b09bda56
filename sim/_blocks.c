/* The block pool's two bulk moves (sim/engine/kv.py `BlockPool`) without sharing: taking `n` blocks
 * from the head of the free queue, and freeing a request's whole table; and a decode run's
 * block crossings in allocation order (sim/engine/stepping.py `crossing_order`), dealt onto the
 * requests' tables. A `chat` request holds ~175 blocks; compiled Python spends ~130 machine
 * instructions a block on each move (a boxed int read and written per reference count), this
 * ~40 (callgrind).
 *
 * An optimisation of the same list operations as the Python it stands in for, in the same order,
 * so the pool ends in the same state and the same errors are raised: `BlockPool.allocate` (the
 * path with no stale queue entry), `BlockPool._release` and `crossing_order`. Used only with the compiled
 * build (sim/_compiled.py), never under SERVESIM_PURE=1; tests/sim/test_blocks.py compares it
 * with the Python on random pools, tests/test_compiled.py whole runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* An int argument or list item as a C integer, or -1 with an exception set. Only ints (and
 * their subclasses) are taken, so no Python code (an `__index__`) runs while a list is walked. */
static inline Py_ssize_t as_index(PyObject *v) {
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "_blocks: an int expected, got %.100s", Py_TYPE(v)->tp_name);
        return -1;
    }
#if PY_VERSION_HEX < 0x030C0000
    /* (CPython 3.11's ints: a block id below 2**30 is one digit, read here in a few
     * instructions; PyLong_AsSsize_t's call costs ~15 a block, on every block moved) */
    Py_ssize_t size = Py_SIZE(v);
    if (size == 0)
        return 0;
    if (size == 1)
        return (Py_ssize_t)((PyLongObject *)v)->ob_digit[0];
#endif
    return PyLong_AsSsize_t(v);
}

/* An int argument into `out`: 0, or -1 with an exception set. */
static int get_index(PyObject *v, Py_ssize_t *out) {
    *out = as_index(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* The ids of list `blocks` as indices into the list of counts `ref`, in a new buffer (freed by
 * the caller with PyMem_Free), or NULL with an exception set. Each count must be an exact int,
 * so that replacing one (its decref) runs no Python code that could change `ref` under the
 * caller's loop. */
static Py_ssize_t *block_indices(PyObject *blocks, PyObject *ref) {
    Py_ssize_t n = PyList_GET_SIZE(blocks), nref = PyList_GET_SIZE(ref);
    Py_ssize_t *idx = PyMem_Malloc((n ? n : 1) * sizeof(Py_ssize_t));
    if (idx == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t b = as_index(PyList_GET_ITEM(blocks, i));
        if (b < 0 || b >= nref || !PyLong_CheckExact(PyList_GET_ITEM(ref, b))) {
            if (!PyErr_Occurred() && b >= 0 && b < nref)
                PyErr_SetString(PyExc_TypeError, "_blocks: a reference count that is not an int");
            else if (!PyErr_Occurred())
                PyErr_Format(PyExc_IndexError, "_blocks: block %zd outside the pool", b);
            PyMem_Free(idx);
            return NULL;
        }
        idx[i] = b;
    }
    return idx;
}

/* ref[b] = value (a new reference to `value` is stored; the old, an int, freed). */
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
    if (ref == front || ref == queue) {
        PyErr_SetString(PyExc_ValueError, "_blocks.take: the counts are one of the queues");
        return NULL;
    }
    Py_ssize_t head, n;
    if (get_index(args[2], &head) < 0 || get_index(args[3], &n) < 0)
        return NULL;
    Py_ssize_t nf = PyList_GET_SIZE(front), k = n < nf ? n : nf, nq = PyList_GET_SIZE(queue);
    if (n < 0 || head < 0 || head > nq || n - k > nq - head) {
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
    Py_ssize_t *idx = block_indices(out, ref);
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
    Py_ssize_t *idx = block_indices(table, ref);
    if (idx == NULL)
        return NULL;
    PyObject *zero = PyLong_FromLong(0), *one = PyLong_FromLong(1);  /* (cached small ints) */
    PyObject *result = Py_None;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        PyObject *rc = PyList_GET_ITEM(ref, idx[i]);
        if (rc != one) {  /* (a count of 1 is the cached int 1; anything else is checked) */
            int overflow;
            long v = PyLong_AsLongAndOverflow(rc, &overflow);  /* (an exact int: no error) */
            if (v != 1 || overflow) {
                for (Py_ssize_t j = i + 1; j < n; j++)  /* (nothing freed: as it was) */
                    set_ref(ref, idx[j], one);
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

/* crossings(first_cross, k, bs) -> (steps, order)
 *
 * `stepping.crossing_order`: request i of a decode run's batch first needs a block at step
 * first_cross[i], then every `bs` steps; over the run's `k` steps, `order` is the batch index of
 * each block to allocate in the order step-by-step scheduling takes them (by step, then batch
 * index) and `steps` the sorted first crossings of the requests that cross.
 */
static int cmp_ll(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

/* Sort `n` ints ascending: insertion sort for a run's few dozen (qsort's calls cost ~100
 * instructions an item there), qsort beyond. */
static void sort_ll(long long *v, Py_ssize_t n) {
    if (n > 64) {
        qsort(v, n, sizeof(long long), cmp_ll);
        return;
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        long long x = v[i];
        Py_ssize_t j = i;
        for (; j > 0 && v[j - 1] > x; j--)
            v[j] = v[j - 1];
        v[j] = x;
    }
}

static PyObject *crossings(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "_blocks.crossings(first_cross, k, bs): a list, two ints");
        return NULL;
    }
    PyObject *first = args[0];
    Py_ssize_t k, bs;
    if (get_index(args[1], &k) < 0 || get_index(args[2], &bs) < 0)
        return NULL;
    Py_ssize_t b = PyList_GET_SIZE(first), m = 0, total = 0;
    if (bs < 1 || k < 0 || bs > PY_SSIZE_T_MAX - k
            || (b && k > (PY_SSIZE_T_MAX - b) / b)) {  /* (keys j * b + i and j + bs fit) */
        PyErr_SetString(PyExc_ValueError, "_blocks.crossings: a block size below 1, or a run out of range");
        return NULL;
    }
    long long *j0 = PyMem_Malloc((b ? b : 1) * sizeof(long long));
    if (j0 == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < b; i++) {
        j0[i] = as_index(PyList_GET_ITEM(first, i));
        if (j0[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(j0);
            return NULL;
        }
        if (j0[i] < 1) {  /* (a table always holds the token of the run's first step) */
            PyMem_Free(j0);
            PyErr_SetString(PyExc_ValueError, "_blocks.crossings: a crossing before the run");
            return NULL;
        }
        if (j0[i] < k) {
            Py_ssize_t c = (k - 1 - (Py_ssize_t)j0[i]) / bs + 1;
            if (c > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(long long) - total) {
                PyMem_Free(j0);
                return PyErr_NoMemory();
            }
            m++;
            total += c;
        }
    }
    /* keys j * b + i sort as the pairs (step, batch index) do */
    long long *keys = PyMem_Malloc((m ? m : 1) * sizeof(long long));
    long long *cross = PyMem_Malloc((total ? total : 1) * sizeof(long long));
    PyObject *steps = PyList_New(m), *order = PyList_New(total), *out = NULL;
    if (keys == NULL || cross == NULL || steps == NULL || order == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t a = 0, c = 0;
    for (Py_ssize_t i = 0; i < b; i++) {
        if (j0[i] >= k)
            continue;
        keys[a++] = j0[i] * b + i;
        for (long long j = j0[i]; j < k; j += bs)
            cross[c++] = j * b + i;
    }
    sort_ll(keys, m);
    sort_ll(cross, total);
    for (Py_ssize_t q = 0; q < m; q++) {
        PyObject *v = PyLong_FromLongLong(keys[q] / b);
        if (v == NULL)
            goto done;
        PyList_SET_ITEM(steps, q, v);
    }
    for (Py_ssize_t q = 0; q < total; q++) {
        PyObject *v = PyLong_FromLongLong(cross[q] % b);
        if (v == NULL)
            goto done;
        PyList_SET_ITEM(order, q, v);
    }
    out = PyTuple_Pack(2, steps, order);
done:
    PyMem_Free(j0);
    PyMem_Free(keys);
    PyMem_Free(cross);
    Py_XDECREF(steps);
    Py_XDECREF(order);
    return out;
}

/* deal(reqs, order, blocks) -> None
 *
 * Block blocks[q] onto the end of reqs[order[q]].block_table, for each q in turn.
 */
static PyObject *deal(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0]) || !PyList_Check(args[1])
            || !PyList_Check(args[2]) || PyList_GET_SIZE(args[1]) != PyList_GET_SIZE(args[2])) {
        PyErr_SetString(PyExc_TypeError, "_blocks.deal(reqs, order, blocks): lists, order and blocks alike long");
        return NULL;
    }
    PyObject *reqs = args[0], *order = args[1], *blocks = args[2];
    static PyObject *name = NULL;
    if (name == NULL && (name = PyUnicode_InternFromString("block_table")) == NULL)
        return NULL;
    for (Py_ssize_t q = 0; q < PyList_GET_SIZE(order); q++) {
        /* (sizes read again each time: the attribute look-up may run Python code) */
        if (q >= PyList_GET_SIZE(blocks)) {
            PyErr_SetString(PyExc_ValueError, "_blocks.deal: fewer blocks than the order names");
            return NULL;
        }
        Py_ssize_t i = as_index(PyList_GET_ITEM(order, q));
        if (i < 0 || i >= PyList_GET_SIZE(reqs)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "_blocks.deal: a request outside the batch");
            return NULL;
        }
        PyObject *req = PyList_GET_ITEM(reqs, i), *blk = PyList_GET_ITEM(blocks, q);
        Py_INCREF(req);
        Py_INCREF(blk);
        PyObject *table = PyObject_GetAttr(req, name);
        Py_DECREF(req);
        int bad = table == NULL || !PyList_Check(table) || PyList_Append(table, blk) < 0;
        if (bad && !PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "_blocks.deal: a block table that is not a list");
        Py_DECREF(blk);
        Py_XDECREF(table);
        if (bad)
            return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL, "BlockPool.allocate's bulk move (no stale queue entry)."},
    {"release", (PyCFunction)(void (*)(void))release, METH_FASTCALL, "BlockPool._free_unshared's reference counts."},
    {"crossings", (PyCFunction)(void (*)(void))crossings, METH_FASTCALL, "A decode run's block crossings in allocation order."},
    {"deal", (PyCFunction)(void (*)(void))deal, METH_FASTCALL, "Blocks onto the block tables of a run's requests."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blocks", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blocks(void) { return PyModule_Create(&module); }
