/* Shared by the parts of hicache.transfer._native: the copy (_native.c), the planning of a
 * large transfer's descriptors (_native_plan.c), the queue of asynchronous transfers
 * (_native_queue.c) and the threads that copy a transfer's pieces (_native_crew.c). */
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

enum { MAX_THREADS = 64 };
/* A job's pieces are counted in 20 bits of the crew's claim word (_native_crew.c). */
enum { MAX_PIECES = (1 << 20) - 1 };

/* A run of a job's descriptors, descs[first:stop], all of one layer. */
typedef struct {
    Py_ssize_t first, stop, layer;
} Piece;

/* One transfer: its descriptors layer by layer, cut into pieces of about equal bytes (between
 * groups of `group`, never across a layer) that the copying threads take one at a time in
 * order, so that a thread slowed down (its core busy) takes fewer of them instead of holding
 * back the whole copy. Layer l is done once its pieces and those of every layer before it
 * are: the count of done layers goes into the 32-bit word `progress` (NULL: none). */
typedef struct {
    char *dst;
    const char *src;
    CopyDesc *descs;
    Piece *pieces;
    uint32_t *left; /* per layer: its pieces not yet done */
    Py_ssize_t count, layers, group, threads;
    int64_t bytes; /* all its descriptors copy, at most INT64_MAX */
    uint32_t layers_done;
    int streaming;
    uint32_t *progress;
} Job;

/* PyArg "O&" converter: a Python int in [0, 2**64) as a uintptr_t address. */
int to_address(PyObject *obj, void *out);

/* A job over `descs` (taken: freed with the job, also on failure) whose layer l ends at
 * descriptor ends[l] (checked to rise to n), cut into pieces of about piece_bytes (<= 0: one
 * piece per layer), run by up to `threads` threads; NULL with an exception set. The
 * descriptors must already be checked against both buffers. Needs the GIL. */
Job *new_job(char *dst, const char *src, CopyDesc *descs, Py_ssize_t n, const int64_t *ends, Py_ssize_t layers,
             Py_ssize_t group, int streaming, Py_ssize_t threads, int64_t piece_bytes, uint32_t *progress);
/* copy_pieces' arguments as a checked job (free_job it), or NULL with an exception set. Needs the GIL. */
Job *load_job(uintptr_t dst_addr, long long dst_size, uintptr_t src_addr, long long src_size, PyObject *descs_obj,
              PyObject *ends_obj, Py_ssize_t group, int streaming, Py_ssize_t threads, long long piece_bytes,
              uintptr_t progress);
void free_job(Job *job);
/* Copy piece i of the job, then publish the layers it completes (_native.c). Needs no GIL. */
void run_piece(Job *job, Py_ssize_t i);
/* Copy the whole job: in the calling thread and on up to threads - 1 of the copy crew's
 * threads (_native_crew.c), or on threads of their own while the crew is in use. Needs no
 * GIL; non-zero when such a thread could not be joined (its copy is done anyway). */
int run_job(Job *job);

/* Adds the CopyQueue type (_native_queue.c) to the module; 0, or -1 with an exception. */
int add_copy_queue(PyObject *module);

PyObject *build_descriptors(PyObject *self, PyObject *args);
PyObject *merge_descriptors(PyObject *self, PyObject *args);

#endif
