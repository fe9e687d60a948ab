/* Shared by the two halves of hicache.transfer._native: the copy (_native.c) and the planning
 * of a large transfer's descriptors (_native_plan.c). */
#ifndef HICACHE_NATIVE_H
#define HICACHE_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

enum { DESC_FIELDS = 6 };

/* Byte offsets into two flat buffers: `rows` rows of `row_bytes`, strided on each side. */
typedef struct {
    int64_t dst, src, rows, row_bytes, dst_stride, src_stride;
} CopyDesc;

/* The borrowed int64 contents of `obj` (C-contiguous; 1-D, or 2-D with `cols` columns when
 * cols > 0) as `view`; 0, or -1 with ValueError naming `what`. */
int get_int64s(PyObject *obj, Py_buffer *view, Py_ssize_t cols, const char *what);

PyObject *build_descriptors(PyObject *self, PyObject *args);
PyObject *merge_descriptors(PyObject *self, PyObject *args);
PyObject *split_descriptors(PyObject *self, PyObject *args);

#endif
