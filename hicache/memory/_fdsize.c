/* The size of an open file, by fstat, keeping the GIL (hicache/memory/buffer.py: shrunk).
 *
 * The sidecar checks before every copy that the engine has not shrunk a shared file under
 * its mapping (a copy from the lost pages would fault with SIGBUS). os.fstat lets go of the
 * GIL around the system call, and taking it back beside a busy Python thread can cost a
 * switch interval (5 ms) for a check of about a microsecond. fstat of an open fd never
 * waits on I/O (the files are tmpfs files and memfds), so this keeps the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <sys/stat.h>

static PyObject *fd_size(PyObject *self, PyObject *arg) {
    (void)self;
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (fd < 0 || fd > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "fd must be an int in [0, %d], got %ld", INT_MAX, fd);
        return NULL;
    }
    struct stat st;
    if (fstat((int)fd, &st) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLongLong((long long)st.st_size);
}

static PyMethodDef methods[] = {
    {"fd_size", fd_size, METH_O, "fd_size(fd) -> the open file's size in bytes (fstat), keeping the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fdsize", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fdsize(void) { return PyModule_Create(&module); }
