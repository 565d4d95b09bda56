/* One step's socket writes in one call: `servesim serve`'s send pass without Python per write.

At a step's end the server writes one frame to each of hundreds of sockets. Written from Python
(the transport's `write`, or `os.write`), each frame costs the send system call (a loopback TCP
send runs the receiver's TCP path: ~4-5 us here) plus about as much again in the interpreter.
`write_many` makes the same calls from one C loop, with the GIL released, and stamps each one's
return on CLOCK_MONOTONIC (the clock of Python's `time.monotonic` on Linux).

    write_many(fds: list[int], datas: list[bytes], want_times: bool)
        -> (sent: list[int], times: list[float] | None)

sent[i] is what send(2) took of datas[i] (it may be less than all of it), 0 when the socket
buffer was full (EAGAIN), -1 on any other error (the transport's own write then meets it and
closes). Non-blocking sends, no SIGPIPE. The Python stand-in is `sender.write_many_py`; the
tests compare the two on real sockets. The caller guarantees that each fd is a socket it owns
(the server's own duplicate of a connection's fd, closed only by the loop's thread) and that
nothing else writes to these sockets meanwhile.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

static PyObject *
write_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "write_many(fds: list, datas: list, want_times)");
        return NULL;
    }
    PyObject *fds = args[0], *datas = args[1];
    int want_times = PyObject_IsTrue(args[2]);
    if (want_times < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(fds);
    if (PyList_GET_SIZE(datas) != n) {
        PyErr_SetString(PyExc_ValueError, "write_many: fds and datas differ in length");
        return NULL;
    }
    if (n > (Py_ssize_t)(PY_SSIZE_T_MAX / (4 * sizeof(double) + sizeof(PyObject *)))) {
        PyErr_SetString(PyExc_OverflowError, "write_many: too many writes");
        return NULL;
    }
    /* Everything is read, and every bytes object held, before the GIL is let go: another
       thread may change the lists meanwhile, never what is being sent. */
    int *fd = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int));
    PyObject **held = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(PyObject *));
    Py_ssize_t *sent = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    double *stamp = want_times ? PyMem_Malloc((size_t)(n ? n : 1) * sizeof(double)) : NULL;
    Py_ssize_t ready = 0;
    PyObject *result = NULL;
    if (fd == NULL || held == NULL || sent == NULL || (want_times && stamp == NULL)) {
        PyErr_NoMemory();
        goto done;
    }
    for (; ready < n; ready++) {
        PyObject *f = PyList_GET_ITEM(fds, ready), *d = PyList_GET_ITEM(datas, ready);
        if (!PyLong_CheckExact(f) || !PyBytes_CheckExact(d)) {
            PyErr_SetString(PyExc_TypeError, "write_many: fds must be ints and datas bytes");
            goto done;
        }
        long v = PyLong_AsLong(f);
        if (v == -1 && PyErr_Occurred())
            goto done;
        if (v < 0 || v > 0x7fffffff) {
            PyErr_Format(PyExc_ValueError, "write_many: bad file descriptor %ld", v);
            goto done;
        }
        fd[ready] = (int)v;
        Py_INCREF(d);
        held[ready] = d;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *p = PyBytes_AS_STRING(held[i]);
        size_t len = (size_t)PyBytes_GET_SIZE(held[i]);
        ssize_t k;
        do {
            k = send(fd[i], p, len, MSG_DONTWAIT | MSG_NOSIGNAL);
        } while (k < 0 && errno == EINTR);
        sent[i] = k >= 0 ? (Py_ssize_t)k : (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
        if (stamp != NULL) {
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            stamp[i] = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
        }
    }
    Py_END_ALLOW_THREADS
    {
        PyObject *s = PyList_New(n), *t = want_times ? PyList_New(n) : (Py_INCREF(Py_None), Py_None);
        if (s == NULL || t == NULL) {
            Py_XDECREF(s);
            Py_XDECREF(t);
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = PyLong_FromSsize_t(sent[i]);
            PyObject *w = want_times ? PyFloat_FromDouble(stamp[i]) : NULL;
            if (v == NULL || (want_times && w == NULL)) {
                Py_XDECREF(v);
                Py_XDECREF(w);
                Py_DECREF(s);
                Py_DECREF(t);
                goto done;
            }
            PyList_SET_ITEM(s, i, v);
            if (want_times)
                PyList_SET_ITEM(t, i, w);
        }
        result = PyTuple_Pack(2, s, t);
        Py_DECREF(s);
        Py_DECREF(t);
    }
done:
    for (Py_ssize_t i = 0; i < ready; i++)
        Py_DECREF(held[i]);
    PyMem_Free(fd);
    PyMem_Free(held);
    PyMem_Free(sent);
    PyMem_Free(stamp);
    return result;
}

static PyMethodDef methods[] = {
    {"write_many", (PyCFunction)(void (*)(void))write_many, METH_FASTCALL,
     "write_many(fds, datas, want_times) -> (sent, times): one non-blocking send per socket"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_send", "servesim serve's send pass in C.", -1, methods,
};

PyMODINIT_FUNC
PyInit__send(void)
{
    return PyModule_Create(&module);
}
