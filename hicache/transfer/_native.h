/* Shared by the parts of hicache.transfer._native: the copy (_native.c), the planning of a
 * large transfer's descriptors (_native_plan.c), the queue of asynchronous transfers
 * (_native_queue.c) and the threads that copy a transfer's shares (_native_crew.c). */
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

enum { MAX_SHARES = 64 };

/* One thread's part of a transfer: its descriptors, layer by layer (layer i is
 * descs[ends[i-1]:ends[i]]), and the 32-bit word (NULL: none) it stores its layer count into. */
typedef struct {
    char *dst;
    const char *src;
    CopyDesc *descs;
    int64_t *ends;
    Py_ssize_t layers, group;
    int streaming;
    uint32_t *progress;
} Share;

/* PyArg "O&" converter: a Python int in [0, 2**64) as a uintptr_t address. */
int to_address(PyObject *obj, void *out);

/* copy_shares' arguments as a checked private array of `*count_out` shares (free_shares it,
 * with the GIL), or NULL with an exception set. Needs the GIL. */
Share *load_shares(uintptr_t dst_addr, long long dst_size, uintptr_t src_addr, long long src_size,
                   PyObject *shares_obj, Py_ssize_t group, int streaming, PyObject *progress_obj, Py_ssize_t *count_out);
/* Copy one share, publishing its layers (_native.c). Needs no GIL. */
void run_share(const Share *sh);
/* Copy every share: share 0 in the calling thread, the others on the copy crew's threads
 * (_native_crew.c), or on threads of their own while the crew is in use; count <=
 * MAX_SHARES (load_shares checks it). Needs no GIL;
 * non-zero when such a thread could not be joined (its copy is done anyway). */
int run_shares(const Share *shares, Py_ssize_t count);
void free_shares(Share *shares, Py_ssize_t count);

/* Adds the CopyQueue type (_native_queue.c) to the module; 0, or -1 with an exception. */
int add_copy_queue(PyObject *module);

PyObject *build_descriptors(PyObject *self, PyObject *args);
PyObject *merge_descriptors(PyObject *self, PyObject *args);
PyObject *split_descriptors(PyObject *self, PyObject *args);

#endif
