/* The descriptors of a large transfer: built, sorted and merged here, in C, with the GIL held throughout. Done with numpy, each operation on a large array released
 * and retook the GIL; beside a busy Python thread every retake waited out a switch interval
 * (5 ms by default), and a 256-page transfer's descriptors took 100 ms instead of 0.6.
 *
 * Results are bytearrays of int64 (descriptors: n x 6, see CopyDesc; positions and layer
 * ends: n), which hicache/transfer/native.py views as numpy arrays without a copy. What to
 * sort by, and when to merge, is native.py's choice; this file only carries it out.
 */
#include "_native.h"

#include <stdlib.h>
#include <string.h>

int get_int64s(PyObject *obj, Py_buffer *view, Py_ssize_t cols, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format != NULL ? view->format : "B";
    if (*f == '=' || *f == '@' || *f == '<')
        f++;
    int int64 = view->itemsize == 8 && (strcmp(f, "q") == 0 || (strcmp(f, "l") == 0 && sizeof(long) == 8));
    int shape_ok = cols > 0 ? view->ndim == 2 && view->shape[1] == cols : view->ndim == 1;
    if (!int64 || !shape_ok) {
        PyBuffer_Release(view);
        if (cols > 0)
            PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous int64 array of shape (n, %zd)", what, cols);
        else
            PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous 1-d int64 array", what);
        return -1;
    }
    return 0;
}

static Py_ssize_t rows_of(const Py_buffer *view) { return view->ndim == 0 ? 0 : view->shape[0]; }

/* A new bytearray of n int64s, its data in *out (NULL with an exception). */
static PyObject *int64_bytearray(Py_ssize_t n, int64_t **out) {
    if (n < 0 || n > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(int64_t))
        return PyErr_NoMemory();
    PyObject *ba = PyByteArray_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (ba != NULL)
        *out = (int64_t *)PyByteArray_AS_STRING(ba);
    return ba;
}

/* ---- build: one descriptor per (buffer, page, layer) chunk, stably sorted ------------- */

enum { BASE, PAGE_STRIDE, LAYER_STRIDE, TOKEN_STRIDE, ROW_BYTES, STRIDE_FIELDS };

typedef struct {
    int64_t position, key, index;
} SortKey;

static int by_key(const void *a, const void *b) {
    const SortKey *x = a, *y = b;
    if (x->position != y->position)
        return x->position < y->position ? -1 : 1;
    if (x->key != y->key)
        return x->key < y->key ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

static int64_t wrap_offset(const int64_t *s, int64_t page, int64_t layer) {
    /* unsigned: a bad stride wraps (and the copy's checks refuse the descriptor) instead of
     * overflowing a signed integer */
    return (int64_t)((uint64_t)s[BASE] + (uint64_t)page * (uint64_t)s[PAGE_STRIDE] +
                     (uint64_t)layer * (uint64_t)s[LAYER_STRIDE]);
}

/* build_descriptors(src_strides, dst_strides, page_size, src_pages, dst_pages, layers,
 *                   by_layer, key_is_src) -> (descriptors, positions) */
PyObject *build_descriptors(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[5];
    long long page_size;
    int by_layer, key_is_src;
    if (!PyArg_ParseTuple(args, "OOLOOOpp", &objs[0], &objs[1], &page_size, &objs[2], &objs[3], &objs[4], &by_layer,
                          &key_is_src))
        return NULL;
    static const char *names[5] = {"src_strides", "dst_strides", "src_pages", "dst_pages", "layers"};
    Py_buffer views[5];
    int got = 0;
    PyObject *descs_obj = NULL, *pos_obj = NULL;
    SortKey *keys = NULL;
    CopyDesc *raw = NULL;
    for (; got < 5; got++)
        if (get_int64s(objs[got], &views[got], got < 2 ? STRIDE_FIELDS : 0, names[got]) < 0)
            goto done;
    Py_ssize_t buffers = rows_of(&views[0]), pages = rows_of(&views[2]), layers = rows_of(&views[4]);
    if (rows_of(&views[1]) != buffers || rows_of(&views[3]) != pages || page_size < 1) {
        PyErr_Format(PyExc_ValueError, "strides for %zd and %zd buffers, %zd and %zd pages, page_size %lld", buffers,
                     rows_of(&views[1]), pages, rows_of(&views[3]), page_size);
        goto done;
    }
    Py_ssize_t n;
    if (__builtin_mul_overflow(buffers, pages, &n) || __builtin_mul_overflow(n, layers, &n) ||
        n > PY_SSIZE_T_MAX / (Py_ssize_t)sizeof(CopyDesc)) {
        PyErr_SetString(PyExc_OverflowError, "too many descriptors");
        goto done;
    }
    const int64_t *src_s = views[0].buf, *dst_s = views[1].buf;
    const int64_t *src_p = views[2].buf, *dst_p = views[3].buf, *lay = views[4].buf;
    raw = PyMem_Malloc(n > 0 ? (size_t)n * sizeof(CopyDesc) : 1);
    keys = PyMem_Malloc(n > 0 ? (size_t)n * sizeof(SortKey) : 1);
    if (raw == NULL || keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t i = 0;
    for (Py_ssize_t b = 0; b < buffers; b++) {
        const int64_t *s = src_s + b * STRIDE_FIELDS, *d = dst_s + b * STRIDE_FIELDS;
        int whole = s[TOKEN_STRIDE] == s[ROW_BYTES] && d[TOKEN_STRIDE] == d[ROW_BYTES]; /* one block each side */
        int64_t block = (int64_t)((uint64_t)page_size * (uint64_t)s[ROW_BYTES]);
        for (Py_ssize_t p = 0; p < pages; p++) {
            for (Py_ssize_t l = 0; l < layers; l++, i++) {
                CopyDesc *c = &raw[i];
                c->dst = wrap_offset(d, dst_p[p], lay[l]);
                c->src = wrap_offset(s, src_p[p], lay[l]);
                if (whole) {
                    c->rows = 1;
                    c->row_bytes = c->dst_stride = c->src_stride = block;
                } else {
                    c->rows = page_size;
                    c->row_bytes = s[ROW_BYTES];
                    c->dst_stride = d[TOKEN_STRIDE];
                    c->src_stride = s[TOKEN_STRIDE];
                }
                keys[i] = (SortKey){by_layer ? l : 0, key_is_src ? c->src : c->dst, i};
            }
        }
    }
    qsort(keys, (size_t)n, sizeof(SortKey), by_key);
    int64_t *descs, *pos;
    descs_obj = int64_bytearray(n * DESC_FIELDS, &descs);
    pos_obj = descs_obj != NULL ? int64_bytearray(n, &pos) : NULL;
    if (pos_obj == NULL)
        goto done;
    for (Py_ssize_t j = 0; j < n; j++) {
        memcpy(descs + j * DESC_FIELDS, &raw[keys[j].index], sizeof(CopyDesc));
        pos[j] = keys[j].position;
    }
done:
    for (int k = 0; k < got; k++)
        PyBuffer_Release(&views[k]);
    PyMem_Free(raw);
    PyMem_Free(keys);
    if (pos_obj == NULL) {
        Py_XDECREF(descs_obj);
        return NULL;
    }
    return Py_BuildValue("(NN)", descs_obj, pos_obj); /* N: the tuple takes both references */
}

/* ---- merge: join single-row copies that continue each other on both sides ------------- */

/* merge_descriptors(descs, positions | None, layers, cap) -> (descriptors, layer_ends)
 * A copy that continues the previous one on both sides (both single rows, same layer
 * position) joins it while the bytes of its run ahead of it stay within the same multiple of
 * cap, so a merged copy ends below cap plus one chunk; cap <= 0 merges nothing. positions
 * must be sorted, each in [0, layers); layer_ends[i] counts the copies of positions <= i. */
PyObject *merge_descriptors(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *descs_in, *pos_in;
    Py_ssize_t layers;
    long long cap;
    if (!PyArg_ParseTuple(args, "OOnL", &descs_in, &pos_in, &layers, &cap))
        return NULL;
    Py_buffer dv, pv;
    int have_pos = pos_in != Py_None;
    if (get_int64s(descs_in, &dv, DESC_FIELDS, "descriptors") < 0)
        return NULL;
    if (have_pos && get_int64s(pos_in, &pv, 0, "positions") < 0) {
        PyBuffer_Release(&dv);
        return NULL;
    }
    Py_ssize_t n = rows_of(&dv);
    const CopyDesc *in = dv.buf;
    const int64_t *pos = have_pos ? pv.buf : NULL;
    PyObject *descs_obj = NULL, *ends_obj = NULL;
    int64_t *out, *ends;
    if (layers < 1 || (have_pos && rows_of(&pv) != n)) {
        PyErr_Format(PyExc_ValueError, "%zd positions for %zd descriptors, %zd layers", have_pos ? rows_of(&pv) : n, n,
                     layers);
        goto done;
    }
    for (Py_ssize_t i = 0; have_pos && i < n; i++) {
        if (pos[i] < 0 || pos[i] >= layers || (i > 0 && pos[i] < pos[i - 1])) {
            PyErr_Format(PyExc_ValueError, "position %zd (%lld) is out of order or range [0, %zd)", i,
                         (long long)pos[i], layers);
            goto done;
        }
    }
    descs_obj = int64_bytearray(n * DESC_FIELDS, &out);
    ends_obj = descs_obj != NULL ? int64_bytearray(layers, &ends) : NULL;
    if (ends_obj == NULL)
        goto done;
    Py_ssize_t m = 0, layer = 0;
    int64_t run_before = 0, prev_piece = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const CopyDesc *c = &in[i], *prev = i > 0 ? &in[i - 1] : NULL;
        int64_t here = have_pos ? pos[i] : 0;
        int follows = cap > 0 && prev != NULL && c->rows == 1 && prev->rows == 1 && (!have_pos || here == pos[i - 1]) &&
                      (uint64_t)c->dst == (uint64_t)prev->dst + (uint64_t)prev->row_bytes &&
                      (uint64_t)c->src == (uint64_t)prev->src + (uint64_t)prev->row_bytes;
        run_before = follows ? (int64_t)((uint64_t)run_before + (uint64_t)prev->row_bytes) : 0;
        int64_t piece = cap > 0 ? run_before / cap : 0;
        if (follows && piece == prev_piece) {
            ((CopyDesc *)out)[m - 1].row_bytes += c->row_bytes;
        } else {
            for (; layer < here; layer++)
                ends[layer] = m;
            memcpy(&((CopyDesc *)out)[m++], c, sizeof(CopyDesc));
        }
        prev_piece = piece;
    }
    for (; layer < layers; layer++)
        ends[layer] = m;
    for (Py_ssize_t j = 0; cap > 0 && j < m; j++) {
        CopyDesc *c = &((CopyDesc *)out)[j];
        if (c->rows == 1)
            c->dst_stride = c->src_stride = c->row_bytes;
    }
    if (PyByteArray_Resize(descs_obj, m * DESC_FIELDS * (Py_ssize_t)sizeof(int64_t)) < 0)
        goto done;
done:
    PyBuffer_Release(&dv);
    if (have_pos)
        PyBuffer_Release(&pv);
    if (PyErr_Occurred()) {
        Py_XDECREF(descs_obj);
        Py_XDECREF(ends_obj);
        return NULL;
    }
    return Py_BuildValue("(NN)", descs_obj, ends_obj);
}
