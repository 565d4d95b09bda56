/* The per-step part of a run of decode-only steps, written straight into the timeline's
 * staging columns (sim/engine/timeline.py) instead of into Python lists of boxed floats and ints.
 *
 * An optimisation of the same arithmetic as sim/model/costmodel.py (`CostModel.step`, a decode step)
 * and sim/engine/stepping.py (`_used_by_step`): the same operations in the same order on IEEE doubles
 * and 64-bit integers, so the results are equal bit for bit (built with -ffp-contract=off: no
 * fused multiply-adds); `deliver_rows` does sim/engine/frontend.py's `FrontEnd.deliver` for a run
 * of steps. Used only with the compiled build (sim/native/compiled.py), never under
 * SERVESIM_PURE=1; tests/sim/model/test_costmodel.py holds `decode_rows` to `CostModel.step` over
 * random coefficients, tests/test_compiled.py compares whole runs against pure Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>

/* A writable, C-contiguous, 8-byte aligned buffer of at least `need` items of the C type
 * `kind` ('d': double, 'q': long long) (a NumPy column of float64 or int64). Checked before any
 * item is touched: a misaligned or differently typed buffer would be undefined behaviour. */
static int column(PyObject *obj, Py_buffer *view, char kind, Py_ssize_t need) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')  /* (native order on the little-endian builds) */
        f++;
    const int typed = f[0] != '\0' && f[1] == '\0'
        && (kind == 'd' ? f[0] == 'd' : (f[0] == 'q' || f[0] == 'l'));
    if (!typed || view->itemsize != 8) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "_rows: a column of %s expected",
                     kind == 'd' ? "float64" : "int64");
        return -1;
    }
    if (view->len > 0 && (((uintptr_t)view->buf) % _Alignof(long long) != 0
                          || ((uintptr_t)view->buf) % _Alignof(double) != 0)) {
        /* (an empty buffer is never read: its pointer need not be aligned) */
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "_rows: a column not aligned to 8 bytes");
        return -1;
    }
    if (view->len / 8 < need) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "_rows: a column too short for the rows asked");
        return -1;
    }
    return 0;
}

/* The checked sum, difference or product (GCC's and Clang's `__builtin_*_overflow`): 0, or -1
 * with OverflowError set when it overflowed (signed overflow is undefined in C). */
static int fits(int overflowed) {
    if (overflowed) {
        PyErr_SetString(PyExc_OverflowError, "_rows: a value out of the int64 range");
        return -1;
    }
    return 0;
}

#define add_ll(a, b, out) fits(__builtin_add_overflow(a, b, out))
#define sub_ll(a, b, out) fits(__builtin_sub_overflow(a, b, out))
#define mul_ll(a, b, out) fits(__builtin_mul_overflow(a, b, out))

/* Arguments and list items as C numbers, taking only ints (and bools) and floats, so that no
 * Python code (an `__index__`, `__float__` or `__bool__`) runs while this module holds borrowed
 * references; -1 with an exception set otherwise. */
static int get_ll(PyObject *v, long long *out) {
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "_rows: an int expected, got %.100s", Py_TYPE(v)->tp_name);
        return -1;
    }
    *out = PyLong_AsLongLong(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static int get_size(PyObject *v, Py_ssize_t *out) {
    long long x;
    if (get_ll(v, &x) < 0)
        return -1;
    if (x < PY_SSIZE_T_MIN || x > PY_SSIZE_T_MAX) {
        PyErr_SetString(PyExc_OverflowError, "_rows: an int out of range");
        return -1;
    }
    *out = (Py_ssize_t)x;
    return 0;
}

static int get_double(PyObject *v, double *out) {
    if (PyFloat_Check(v)) {
        *out = PyFloat_AS_DOUBLE(v);
        return 0;
    }
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "_rows: a number expected, got %.100s", Py_TYPE(v)->tp_name);
        return -1;
    }
    *out = PyLong_AsDouble(v);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* decode_rows(end, dur, energy, at, n, t, t_ext, b, c0, coefficients, wave, pad)
 *     -> (k, first, last)
 *
 * The first (at most n) steps of a run of decode-only steps of b sequences holding c0 cached
 * tokens, the first starting at t, up to the first that ends at or after t_ext: end times,
 * durations and energies written to rows at, at + 1, ... of the three float64 columns.
 * Returns how many, and the first and last end times (NaN without a row: saves reading them
 * back as NumPy scalars). `coefficients` is CostModel.kernel_coefficients, `pad` its
 * graph_pad(b) and `wave` its wave_factor(b + pad) (the same for every step of the run); step j is
 * CostModel.step(0, 0, 0, b, c0 + b j, b, b) of the kernel model, its terms that stay the same
 * along the run computed once (tests/sim/model/test_costmodel.py holds the two equal bit for bit). */
static PyObject *decode_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12 || !PyTuple_Check(args[9]) || PyTuple_GET_SIZE(args[9]) != 29) {
        PyErr_SetString(PyExc_TypeError,
                        "_rows.decode_rows takes 12 arguments, the tenth 29 coefficients");
        return NULL;
    }
    PyObject *oe = args[0], *od = args[1], *oen = args[2];
    Py_ssize_t at, n;
    long long b, c0, overlap;
    double t, t_ext, wave, pad, k_[29];
    if (get_size(args[3], &at) < 0 || get_size(args[4], &n) < 0 || get_double(args[5], &t) < 0
            || get_double(args[6], &t_ext) < 0 || get_ll(args[7], &b) < 0
            || get_ll(args[8], &c0) < 0 || get_double(args[10], &wave) < 0
            || get_double(args[11], &pad) < 0)
        return NULL;
    for (int i = 0; i < 29; i++) {
        PyObject *v = PyTuple_GET_ITEM(args[9], i);
        if (i == 12 ? get_ll(v, &overlap) < 0 : get_double(v, &k_[i]) < 0)
            return NULL;
    }
    const double blk_c = k_[0], blk_m = k_[1], head_c = k_[2], head_m = k_[3], elem = k_[4],
        attn_f = k_[5], kv = k_[6], kv_read = k_[7], fixed = k_[8], ar_tok = k_[9],
        cpu0 = k_[10], cpu1 = k_[11], idle = k_[13], dyn = k_[14], moe_c = k_[15],
        moe_m = k_[16], moe_cap = k_[17], moe_mean = k_[18], moe_sd = k_[19], moe_lam = k_[20],
        ar_a0 = k_[21], ar_a1 = k_[22], ar_b0 = k_[23], ar_b1 = k_[24], ar_c0 = k_[25],
        ar_c1 = k_[26], kv_occ = k_[27], kv_occ_sm = k_[28];
    if (at < 0 || n < 0 || n > PY_SSIZE_T_MAX - at || b < 0 || c0 < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "_rows.decode_rows: a row out of range, or a negative batch or context");
        return NULL;
    }
    Py_buffer ve, vd, ven;
    if (column(oe, &ve, 'd', at + n) < 0)
        return NULL;
    if (column(od, &vd, 'd', at + n) < 0) {
        PyBuffer_Release(&ve);
        return NULL;
    }
    if (column(oen, &ven, 'd', at + n) < 0) {
        PyBuffer_Release(&ve);
        PyBuffer_Release(&vd);
        return NULL;
    }
    double *ends = (double *)ve.buf + at, *durs = (double *)vd.buf + at;
    double *ens = (double *)ven.buf + at;
    /* CostModel.step with p_tokens = p_attended = p_cached = 0, d_seqs = num_seqs = sampled = D:
     * the terms without Kd, once (T and S with the CUDA graph's padding). */
    const double D = (double)b, T = 0.0 + D + pad, S = D + pad;
    double c = blk_c * wave * T;
    const double t_blocks = sqrt(c * c + blk_m * blk_m);
    c = head_c * S;
    const double m = head_m * (S > 0 ? 1.0 : 0.0);
    const double t_head = sqrt(c * c + m * m);
    const double t_elem = elem * T;
    const double x0 = attn_f * 0.0, y0 = kv * (0.0 + 0.0);
    const double t_pa = x0 >= y0 ? x0 : y0;
    const double before_da = t_blocks + t_head + t_elem + t_pa;
    /* t_moe (0 for a dense model, whose coefficients are 0: adding it changes no bit) */
    const double n_a = moe_cap * T, n_b = moe_mean * T + moe_sd * sqrt(T);
    const double x_moe = moe_lam * T, c_moe = moe_c * (n_a <= n_b ? n_a : n_b);
    const double m_moe = moe_m * (1.0 - 1.0 / (1.0 + x_moe * (1.0 + x_moe * (0.5 + x_moe / 6.0))));
    const double t_moe = sqrt(c_moe * c_moe + m_moe * m_moe);
    const double ar_a = ar_a0 + ar_a1 * T, ar_b = ar_b0 + ar_b1 * T, ar_c = ar_c0 + ar_c1 * T;
    const double ar_ab = ar_a <= ar_b ? ar_a : ar_b;
    /* + t_ar (on one GPU, where `step` skips it, the first two lines are 0 and the third
     * infinite: adding 0 changes no bit) */
    const double t_fixed = fixed + ar_tok * T + (ar_ab <= ar_c ? ar_ab : ar_c);
    const double t_cpu = cpu0 + cpu1 * D;
    long long kr = c0;
    Py_ssize_t k = 0;
    while (k < n) {
        const double Kd = (double)kr;
        const double r_bw = kv_read * Kd, r_one = kv_occ * Kd / (D >= 1.0 ? D : 1.0),
            r_sm = kv_occ_sm * Kd, r_occ = r_one >= r_sm ? r_one : r_sm;
        const double x = attn_f * (Kd + D), y = (r_bw >= r_occ ? r_bw : r_occ) + kv * D;
        const double busy = before_da + (x >= y ? x : y) + t_moe;  /* + t_da + t_moe */
        const double t_gpu = busy + t_fixed;
        const double d = overlap ? (t_gpu >= t_cpu ? t_gpu : t_cpu) : t_gpu + t_cpu;
        t = t + d;
        ends[k] = t;
        durs[k] = d;
        ens[k] = idle * d + dyn * busy;
        k++;
        if (t >= t_ext || k == n)
            break;
        if (add_ll(kr, b, &kr) < 0) {  /* (rows written so far are left: staging rows) */
            PyBuffer_Release(&ve);
            PyBuffer_Release(&vd);
            PyBuffer_Release(&ven);
            return NULL;
        }
    }
    double first = k ? ends[0] : Py_NAN, last = k ? ends[k - 1] : Py_NAN;
    PyBuffer_Release(&ve);
    PyBuffer_Release(&vd);
    PyBuffer_Release(&ven);
    return Py_BuildValue("(ndd)", k, first, last);
}

/* used_rows(used, at, steps, k, bs, used0, first) -> the blocks used after the last step
 *
 * The blocks used after each of the k steps of a decode run that starts with used0, the
 * requests first crossing a block boundary at `steps` (a list of ints in [0, k); then every bs
 * steps), written to rows at, ..., at + k - 1 of the int64 column `used`: stepping's
 * _used_by_step; then row at gets `first` instead (a run's first row counts the blocks of the
 * requests that finished before it) and the last row's count (before that) is returned. */
static PyObject *used_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "_rows.used_rows(used, at, steps, k, bs, used0, first): steps a list");
        return NULL;
    }
    PyObject *ou = args[0], *steps = args[2];
    Py_ssize_t at, k, bs;
    long long used0, first;
    if (get_size(args[1], &at) < 0 || get_size(args[3], &k) < 0 || get_size(args[4], &bs) < 0
            || get_ll(args[5], &used0) < 0 || get_ll(args[6], &first) < 0)
        return NULL;
    if (at < 0 || k < 1 || bs < 1 || k > PY_SSIZE_T_MAX - at) {
        PyErr_SetString(PyExc_ValueError, "_rows.used_rows: bad row, length or block size");
        return NULL;
    }
    Py_buffer vu;
    if (column(ou, &vu, 'q', at + k) < 0)
        return NULL;
    long long *out = (long long *)vu.buf + at;
    for (Py_ssize_t j = 0; j < k; j++)
        out[j] = 0;
    Py_ssize_t m = PyList_GET_SIZE(steps);
    for (Py_ssize_t i = 0; i < m; i++) {
        long long j0;
        if (get_ll(PyList_GET_ITEM(steps, i), &j0) < 0 || j0 < 0 || j0 >= k) {
            PyBuffer_Release(&vu);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "_rows.used_rows: a step out of the run");
            return NULL;
        }
        out[j0] += 1;
    }
    int bad = 0;  /* taken at step j: first crossings at j, j - bs, ... */
    for (Py_ssize_t j = bs; j < k && !bad; j++)
        bad = add_ll(out[j], out[j - bs], &out[j]) < 0;
    bad = bad || add_ll(out[0], used0, &out[0]) < 0;
    for (Py_ssize_t j = 1; j < k && !bad; j++)
        bad = add_ll(out[j], out[j - 1], &out[j]) < 0;
    if (bad) {
        PyBuffer_Release(&vu);
        return NULL;
    }
    long long last = out[k - 1];
    out[0] = first;
    PyBuffer_Release(&vu);
    return PyLong_FromLongLong(last);
}

/* deliver_rows(end, out, at, k, free, cost, spells, i) -> (first, last, i)
 *
 * Behind an API server (sim/engine/frontend.py `FrontEnd.deliver`, step after step): when it
 * hands out the tokens of the k steps ending at rows at, ..., at + k - 1 of the float64 column
 * `end`, each step's taking `cost` seconds after the server is free (from `free`), its step has
 * ended and, with one loop, the intake spell it meets is over (`spells`: a float64 buffer of
 * the spells' starts and ends, read from index `i` on), written to the same rows of `out`.
 * Returns the first, the last and the spell index reached
 * (tests/sim/engine/test_frontend.py holds them to `deliver` bit for bit). */
static PyObject *deliver_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "_rows.deliver_rows(end, out, at, k, free, cost, spells, i)");
        return NULL;
    }
    Py_ssize_t at, k, i;
    double d, cost;
    if (get_size(args[2], &at) < 0 || get_size(args[3], &k) < 0
            || get_double(args[4], &d) < 0 || get_double(args[5], &cost) < 0
            || get_size(args[7], &i) < 0)
        return NULL;
    if (at < 0 || k < 1 || k > PY_SSIZE_T_MAX - at) {
        PyErr_SetString(PyExc_ValueError, "_rows.deliver_rows: bad row or length");
        return NULL;
    }
    Py_buffer ve, vo, vs;
    if (column(args[6], &vs, 'd', 0) < 0)
        return NULL;
    const Py_ssize_t n = vs.len / 8;
    if (n % 2 != 0 || i % 2 != 0 || i < 0 || i > n) {
        PyBuffer_Release(&vs);
        PyErr_SetString(PyExc_ValueError, "_rows.deliver_rows: bad spells");
        return NULL;
    }
    if (column(args[0], &ve, 'd', at + k) < 0) {
        PyBuffer_Release(&vs);
        return NULL;
    }
    if (column(args[1], &vo, 'd', at + k) < 0) {
        PyBuffer_Release(&ve);
        PyBuffer_Release(&vs);
        return NULL;
    }
    const double *end = (const double *)ve.buf + at;
    double *out = (double *)vo.buf + at;
    const double *spell = (const double *)vs.buf;
    for (Py_ssize_t j = 0; j < k; j++) {
        d = end[j] > d ? end[j] : d;
        while (i < n && spell[i + 1] <= d)
            i += 2;
        if (i < n && spell[i] < d)
            d = spell[i + 1];
        d = d + cost;
        out[j] = d;
    }
    double first = out[0];
    PyBuffer_Release(&ve);
    PyBuffer_Release(&vo);
    PyBuffer_Release(&vs);
    return Py_BuildValue("(ddn)", first, d, i);
}

/* expand(runs, used, k, out) -> None
 *
 * The timeline's flush (sim/engine/timeline.py `Timeline.flush`): the staged runs' shared values onto
 * their rows. `runs` is a list of ten equally long lists of ints, a value per staged run: its
 * rows, tokens, prefill tokens, batch, sampled, waiting, first row's itl_count, and kv_empty's
 * base, per-block factor and first-row extra; `used` the int64 staging column of blocks used
 * (k rows, the runs' rows in order); `out` a list of seven int64 columns of at least k rows,
 * given row g, the r-th of its run i:
 *   tokens[i], prefill[i], batch[i], sampled[i], r ? batch[i] : itl_first[i],
 *   e_base[i] - batch[i] * r + e_block[i] * used[g] + (r ? 0 : e_first[i]), waiting[i]. */
static PyObject *expand(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyList_Check(args[0]) || PyList_GET_SIZE(args[0]) != 10
            || !PyList_Check(args[3]) || PyList_GET_SIZE(args[3]) != 7) {
        PyErr_SetString(PyExc_TypeError, "_rows.expand(runs, used, k, out): ten lists, a column, an int, seven columns");
        return NULL;
    }
    Py_ssize_t k;
    if (get_size(args[2], &k) < 0)
        return NULL;
    /* The columns first: taking a buffer may run Python code (a `__buffer__`), which could
     * change the lists; the lists are read only afterwards, when no Python code runs. */
    PyObject *outs = PyList_AsTuple(args[3]);
    if (outs == NULL)
        return NULL;
    Py_buffer views[8];
    int got = 0;
    PyObject *result = NULL;
    PyObject *lists[10];
    Py_ssize_t nruns = -1;
    if (column(args[1], &views[0], 'q', k) < 0)
        goto done;
    for (got = 1; got < 8; got++)
        if (column(PyTuple_GET_ITEM(outs, got - 1), &views[got], 'q', k) < 0)
            goto done;
    if (!PyList_Check(args[0]) || PyList_GET_SIZE(args[0]) != 10) {
        PyErr_SetString(PyExc_TypeError, "_rows.expand: runs changed while read");
        goto done;
    }
    for (int c = 0; c < 10; c++) {
        lists[c] = PyList_GET_ITEM(args[0], c);
        if (!PyList_Check(lists[c]) || (nruns >= 0 && PyList_GET_SIZE(lists[c]) != nruns)) {
            PyErr_SetString(PyExc_ValueError, "_rows.expand: the run lists differ in length");
            goto done;
        }
        nruns = PyList_GET_SIZE(lists[c]);
    }
    const long long *used = views[0].buf;
    long long *out[7];
    for (int c = 0; c < 7; c++)
        out[c] = views[c + 1].buf;
    Py_ssize_t g = 0;
    for (Py_ssize_t i = 0; i < nruns; i++) {
        long long v[10];
        for (int c = 0; c < 10; c++) {
            if (get_ll(PyList_GET_ITEM(lists[c], i), &v[c]) < 0)
                goto done;
        }
        long long rows = v[0];
        if (rows < 0 || rows > k - g) {
            PyErr_SetString(PyExc_ValueError, "_rows.expand: runs longer than the staged rows");
            goto done;
        }
        for (long long r = 0; r < rows; r++, g++) {
            long long drop, per_block, empty;  /* (in the order written above) */
            if (mul_ll(v[3], r, &drop) < 0 || sub_ll(v[7], drop, &empty) < 0
                    || mul_ll(v[8], used[g], &per_block) < 0
                    || add_ll(empty, per_block, &empty) < 0
                    || add_ll(empty, r ? 0 : v[9], &empty) < 0)
                goto done;
            out[0][g] = v[1];
            out[1][g] = v[2];
            out[2][g] = v[3];
            out[3][g] = v[4];
            out[4][g] = r ? v[3] : v[6];
            out[5][g] = empty;
            out[6][g] = v[5];
        }
    }
    if (g != k) {
        PyErr_SetString(PyExc_ValueError, "_rows.expand: runs shorter than the staged rows");
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (int c = 0; c < got; c++)
        PyBuffer_Release(&views[c]);
    Py_DECREF(outs);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_rows", (PyCFunction)(void (*)(void))decode_rows, METH_FASTCALL, "A decode run's end times, durations and energies."},
    {"used_rows", (PyCFunction)(void (*)(void))used_rows, METH_FASTCALL, "A decode run's blocks used after each step."},
    {"expand", (PyCFunction)(void (*)(void))expand, METH_FASTCALL, "The timeline's staged runs onto their rows."},
    {"deliver_rows", (PyCFunction)(void (*)(void))deliver_rows, METH_FASTCALL, "When an API server hands out a decode run's tokens."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rows(void) { return PyModule_Create(&module); }
