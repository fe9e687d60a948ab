/* hicache.transfer._native: one call copies a whole batch of strided row blocks (the
 * descriptors of a large transfer are planned in _native_plan.c).
 *
 * A copy descriptor is six int64s: (dst, src, rows, row_bytes, dst_stride, src_stride),
 * byte offsets into two flat buffers. copy_shares() takes a private copy of a transfer's
 * descriptors, cut into shares and, within each, into layers; it checks every descriptor
 * against both buffers' sizes before it copies anything (rows must not overlap on the
 * destination, which also bounds the work), then runs the shares in the calling thread and
 * on the copy crew's threads (_native_crew.c), all without the GIL. After each layer, a share stores the
 * count of layers it has done into its 32-bit progress word (release order) and wakes its
 * futex waiters, so another thread, or another process that maps the word (a shared-memory
 * progress block), waits for a layer with wait_progress() without holding the GIL and
 * without a message per layer.
 *
 * With streaming=True, x86-64 builds write with non-temporal stores: a transfer larger than
 * the caches saves the read-for-ownership traffic that ordinary stores cost (each destination
 * line read before it is overwritten), and does not evict the caller's working set. Other CPUs use memcpy either way.
 */
#include "_native.h"

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <pthread.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HICACHE_HAVE_STREAM 1
#else
#define HICACHE_HAVE_STREAM 0
#endif

#if HICACHE_HAVE_STREAM
static void stream_row(char *d, const char *s, size_t n) {
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(d, s, head);
    size_t i = head;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + i, s + i, n - i);
}
#endif

/* The byte just past the last row of a descriptor side, or -1 on overflow. */
static int64_t side_end(int64_t offset, int64_t rows, int64_t row_bytes, int64_t stride) {
    int64_t span, end;
    if (__builtin_mul_overflow(rows - 1, stride, &span) || __builtin_add_overflow(offset, span, &end) ||
        __builtin_add_overflow(end, row_bytes, &end))
        return -1;
    return end;
}

static int check_desc(const CopyDesc *c, Py_ssize_t i, int64_t dst_size, int64_t src_size) {
    if (c->dst < 0 || c->src < 0 || c->rows < 0 || c->row_bytes < 0 || c->dst_stride < 0 || c->src_stride < 0) {
        PyErr_Format(PyExc_ValueError, "copy descriptor %zd has a negative field", i);
        return -1;
    }
    if (c->rows == 0 || c->row_bytes == 0)
        return 0;
    if (c->rows > 1 && c->dst_stride < c->row_bytes) { /* also bounds the work: rows <= dst_size / row_bytes */
        PyErr_Format(PyExc_ValueError, "copy descriptor %zd writes overlapping rows (stride %lld < row %lld bytes)", i,
                     (long long)c->dst_stride, (long long)c->row_bytes);
        return -1;
    }
    int64_t dst_end = side_end(c->dst, c->rows, c->row_bytes, c->dst_stride);
    int64_t src_end = side_end(c->src, c->rows, c->row_bytes, c->src_stride);
    if (dst_end < 0 || dst_end > dst_size) {
        PyErr_Format(PyExc_ValueError, "copy descriptor %zd writes past the destination's %lld bytes", i,
                     (long long)dst_size);
        return -1;
    }
    if (src_end < 0 || src_end > src_size) {
        PyErr_Format(PyExc_ValueError, "copy descriptor %zd reads past the source's %lld bytes", i,
                     (long long)src_size);
        return -1;
    }
    return 0;
}

static void copy_row(char *d, const char *s, size_t n, int streaming) {
#if HICACHE_HAVE_STREAM
    if (streaming) {
        stream_row(d, s, n);
        return;
    }
#endif
    (void)streaming;
    memcpy(d, s, n);
}

/* Where a group's rows leave gaps in the source (a page_first page read one layer at a time:
 * a few KB of each token's row, then a jump), each source row is prefetched this many rows
 * ahead: the hardware prefetcher starts over after every jump. benchmarks/transfer.py,
 * page_first, 2-core VM, alternating runs: layer-wise over plain reload 1.52-1.56 -> 1.27-1.31. */
#define PREFETCH_ROWS 4

static void prefetch_row(const char *s, size_t n) {
    for (size_t i = 0; i < n; i += 64)
        __builtin_prefetch(s + i, 0, 3);
}

/* Descriptors go in groups of `group`; within a group, row r of every descriptor is copied
 * before row r + 1 of any, so a group of chunks that interleave row by row on one side (the
 * (layer, buffer) chunks of a page_first page) is walked through that side in address order. */
static void copy_all(char *dst, const char *src, const CopyDesc *descs, Py_ssize_t n, Py_ssize_t group,
                     int streaming) {
    for (Py_ssize_t first = 0; first < n; first += group) {
        Py_ssize_t last = first + group < n ? first + group : n;
        int64_t rows = 0, span = 0; /* span: the bytes a row of the group reads */
        for (Py_ssize_t i = first; i < last; i++) {
            if (descs[i].row_bytes > 0 && descs[i].rows > 0) { /* checked: within the buffers */
                rows = descs[i].rows > rows ? descs[i].rows : rows;
                span += descs[i].row_bytes;
            }
        }
        for (int64_t r = 0; r < rows; r++) {
            for (Py_ssize_t i = first; i < last; i++) {
                const CopyDesc *c = &descs[i];
                if (r + PREFETCH_ROWS < c->rows && c->src_stride > span)
                    prefetch_row(src + c->src + (r + PREFETCH_ROWS) * c->src_stride, (size_t)c->row_bytes);
                if (r < c->rows && c->row_bytes > 0)
                    copy_row(dst + c->dst + r * c->dst_stride, src + c->src + r * c->src_stride, (size_t)c->row_bytes,
                             streaming);
            }
        }
    }
#if HICACHE_HAVE_STREAM
    if (streaming)
        _mm_sfence();
#endif
}

static int is_int64_format(const char *format) {
    const uint16_t probe = 1;
    int little_endian = *(const unsigned char *)&probe == 1;
    if (format == NULL)
        return 0;
    if (*format == '=' || *format == '@' || (*format == (little_endian ? '<' : '>')))
        format++;
    return (strcmp(format, "q") == 0 || (strcmp(format, "l") == 0 && sizeof(long) == 8));
}

/* PyArg "O&" converter: a Python int in [0, 2**64) as an address (OverflowError otherwise). */
int to_address(PyObject *obj, void *out) {
    unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *(uintptr_t *)out = (uintptr_t)value;
    return 1;
}

/* The descriptors of `desc_obj` (an int64 (n, 6) C-contiguous array) as a private, checked
 * copy (PyMem_Free it), or NULL with an exception set. */
static CopyDesc *load_descs(PyObject *desc_obj, Py_ssize_t *n_out, int64_t dst_size, int64_t src_size) {
    Py_buffer view;
    if (PyObject_GetBuffer(desc_obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (view.itemsize != 8 || !is_int64_format(view.format) || view.ndim != 2 || view.shape[1] != DESC_FIELDS) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "descriptors must be a C-contiguous int64 array of shape (n, %d)",
                     DESC_FIELDS);
        return NULL;
    }
    /* A private copy: checked and copied from memory no other thread can change meanwhile
     * (and aligned, whatever the caller's buffer). */
    Py_ssize_t n = view.shape[0];
    CopyDesc *descs = PyMem_Malloc(n > 0 ? (size_t)n * sizeof(CopyDesc) : 1);
    if (descs == NULL) {
        PyBuffer_Release(&view);
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(descs, view.buf, (size_t)n * sizeof(CopyDesc));
    PyBuffer_Release(&view);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (check_desc(&descs[i], i, dst_size, src_size) < 0) {
            PyMem_Free(descs);
            return NULL;
        }
    }
    *n_out = n;
    return descs;
}

static int check_buffers(uintptr_t dst_addr, long long dst_size, uintptr_t src_addr, long long src_size,
                         Py_ssize_t group) {
    if (group < 1) {
        PyErr_Format(PyExc_ValueError, "group must be >= 1, got %zd", group);
        return -1;
    }
    if (dst_size < 0 || src_size < 0) {
        PyErr_Format(PyExc_ValueError, "buffer sizes must be >= 0, got %lld and %lld", dst_size, src_size);
        return -1;
    }
    if (dst_addr == 0 || src_addr == 0) {
        PyErr_Format(PyExc_ValueError, "buffer addresses must be non-zero");
        return -1;
    }
    return 0;
}

/* ---- progress words ------------------------------------------------------------------ */

static void publish_word(uint32_t *word, uint32_t value) {
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
#ifdef __linux__
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); /* shared: waiters may be other processes */
#endif
}

static PyObject *publish(PyObject *self, PyObject *args) {
    uintptr_t addr;
    unsigned int value;
    (void)self;
    if (!PyArg_ParseTuple(args, "O&I", to_address, &addr, &value))
        return NULL;
    if (addr == 0 || addr % 4 != 0)
        return PyErr_Format(PyExc_ValueError, "a progress word needs a non-zero 4-byte aligned address");
    publish_word((uint32_t *)addr, value);
    Py_RETURN_NONE;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* Wait until *word >= target, at most timeout_s seconds (< 0: no limit); returns what it read
 * last. Runs without the GIL. */
static PyObject *wait_progress(PyObject *self, PyObject *args) {
    uintptr_t addr;
    unsigned int target;
    double timeout_s;
    (void)self;
    if (!PyArg_ParseTuple(args, "O&Id", to_address, &addr, &target, &timeout_s))
        return NULL;
    if (addr == 0 || addr % 4 != 0)
        return PyErr_Format(PyExc_ValueError, "a progress word needs a non-zero 4-byte aligned address");
    uint32_t *word = (uint32_t *)addr;
    uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    if (seen >= target)
        return PyLong_FromUnsignedLong(seen);
    Py_BEGIN_ALLOW_THREADS
    double deadline = timeout_s < 0 ? -1.0 : now_s() + timeout_s;
    while ((seen = __atomic_load_n(word, __ATOMIC_ACQUIRE)) < target) {
        double left = deadline < 0 ? 1.0 : deadline - now_s();
        if (left <= 0)
            break;
#ifdef __linux__
        struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
        syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, NULL, 0); /* returns at once if *word != seen */
#else
        struct timespec ts = {0, 50000};
        nanosleep(&ts, NULL);
#endif
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(seen);
}

/* ---- one call, several threads ------------------------------------------------------ */

void run_share(const Share *sh) {
    for (Py_ssize_t i = 0; i < sh->layers; i++) {
        int64_t first = i == 0 ? 0 : sh->ends[i - 1];
        Py_ssize_t count = (Py_ssize_t)(sh->ends[i] - first);
        if (count > 0)
            copy_all(sh->dst, sh->src, sh->descs + first, count, sh->group < count ? sh->group : count, sh->streaming);
        if (sh->progress != NULL)
            publish_word(sh->progress, (uint32_t)(i + 1));
    }
}

/* ends as a private int64 copy checked against n descriptors, or NULL with an exception. */
static int64_t *load_ends(PyObject *ends_obj, Py_ssize_t n, Py_ssize_t *layers_out) {
    Py_buffer v;
    if (PyObject_GetBuffer(ends_obj, &v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (v.itemsize != 8 || !is_int64_format(v.format) || v.ndim != 1) {
        PyBuffer_Release(&v);
        PyErr_Format(PyExc_ValueError, "layer_ends must be a C-contiguous 1-d int64 array");
        return NULL;
    }
    Py_ssize_t layers = v.shape[0];
    int64_t *ends = PyMem_Malloc(layers > 0 ? (size_t)layers * sizeof(int64_t) : 1);
    if (ends == NULL) {
        PyBuffer_Release(&v);
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(ends, v.buf, (size_t)layers * sizeof(int64_t));
    PyBuffer_Release(&v);
    for (Py_ssize_t i = 0; i < layers; i++) {
        int64_t before = i == 0 ? 0 : ends[i - 1];
        if (ends[i] < before || ends[i] > n || (i == layers - 1 && ends[i] != n)) {
            PyErr_Format(PyExc_ValueError, "layer_ends must rise to the descriptor count %zd; entry %zd is %lld", n, i,
                         (long long)ends[i]);
            PyMem_Free(ends);
            return NULL;
        }
    }
    if (layers == 0 && n != 0) {
        PyErr_Format(PyExc_ValueError, "%zd descriptors but no layer", n);
        PyMem_Free(ends);
        return NULL;
    }
    *layers_out = layers;
    return ends;
}

void free_shares(Share *shares, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        PyMem_Free(shares[i].descs);
        PyMem_Free(shares[i].ends);
    }
    PyMem_Free(shares);
}

Share *load_shares(uintptr_t dst_addr, long long dst_size, uintptr_t src_addr, long long src_size,
                   PyObject *shares_obj, Py_ssize_t group, int streaming, PyObject *progress_obj, Py_ssize_t *count_out) {
    if (check_buffers(dst_addr, dst_size, src_addr, src_size, group) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(shares_obj, "shares must be a sequence of (descriptors, layer_ends)");
    if (seq == NULL)
        return NULL;
    PyObject *pseq = PySequence_Fast(progress_obj, "progress_addrs must be a sequence of ints");
    if (pseq == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count < 1 || count > MAX_SHARES || PySequence_Fast_GET_SIZE(pseq) != count) {
        PyErr_Format(PyExc_ValueError, "need 1 to %d shares and one progress address each, got %zd and %zd",
                     MAX_SHARES, count, PySequence_Fast_GET_SIZE(pseq));
        Py_DECREF(seq);
        Py_DECREF(pseq);
        return NULL;
    }
    Share *shares = PyMem_Calloc((size_t)count, sizeof(Share));
    if (shares == NULL) {
        Py_DECREF(seq);
        Py_DECREF(pseq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *descs_obj, *ends_obj;
        uintptr_t progress;
        Py_ssize_t n;
        if (!PyArg_ParseTuple(item, "OO", &descs_obj, &ends_obj) ||
            !to_address(PySequence_Fast_GET_ITEM(pseq, i), &progress))
            goto fail;
        if (progress % 4 != 0) {
            PyErr_Format(PyExc_ValueError, "progress word %zd must be 4-byte aligned", i);
            goto fail;
        }
        shares[i].descs = load_descs(descs_obj, &n, dst_size, src_size);
        if (shares[i].descs == NULL)
            goto fail;
        shares[i].ends = load_ends(ends_obj, n, &shares[i].layers);
        if (shares[i].ends == NULL)
            goto fail;
        shares[i].dst = (char *)dst_addr;
        shares[i].src = (const char *)src_addr;
        shares[i].group = group;
        shares[i].streaming = streaming;
        shares[i].progress = (uint32_t *)progress;
    }
    Py_DECREF(seq);
    Py_DECREF(pseq);
    *count_out = count;
    return shares;
fail:
    Py_DECREF(seq);
    Py_DECREF(pseq);
    free_shares(shares, count);
    return NULL;
}

/* copy_shares(dst_addr, dst_size, src_addr, src_size, shares, group, streaming, progress_addrs):
 * shares is a sequence of (descriptors, layer_ends), progress_addrs one address (0: none) per
 * share. The calling thread and the copy crew run them (run_shares); returns when all are
 * done. Everything is checked before any copy starts. */
static PyObject *copy_shares(PyObject *self, PyObject *args) {
    uintptr_t dst_addr, src_addr;
    long long dst_size, src_size;
    PyObject *shares_obj, *progress_obj;
    Py_ssize_t group, count;
    int streaming, failed;
    (void)self;
    if (!PyArg_ParseTuple(args, "O&LO&LOnpO", to_address, &dst_addr, &dst_size, to_address, &src_addr, &src_size,
                          &shares_obj, &group, &streaming, &progress_obj))
        return NULL;
    Share *shares =
        load_shares(dst_addr, dst_size, src_addr, src_size, shares_obj, group, streaming, progress_obj, &count);
    if (shares == NULL)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    failed = run_shares(shares, count);
    Py_END_ALLOW_THREADS
    free_shares(shares, count);
    if (failed)
        return PyErr_Format(PyExc_OSError, "a copy thread could not be joined");
    Py_RETURN_NONE;
}

/* ---- a small transfer: one call, no descriptors from Python ------------------------ */

/* The descriptors of moving template row j (buffer j / layers, layer position j % layers, of
 * page 0 to page 0) to every page pair, in (layer, page, buffer) order: layer i's are
 * descs[i * n * buffers, (i + 1) * n * buffers). NULL with an exception on overflow or a
 * descriptor outside either buffer. */
static CopyDesc *page_descs(const CopyDesc *tpl, const int64_t *src_step, const int64_t *dst_step, Py_ssize_t k,
                            Py_ssize_t layers, const int64_t *src_pages, const int64_t *dst_pages, Py_ssize_t n,
                            int64_t dst_size, int64_t src_size) {
    Py_ssize_t buffers = k / layers, total;
    if (__builtin_mul_overflow(k, n, &total) || (size_t)total > PY_SSIZE_T_MAX / sizeof(CopyDesc)) {
        PyErr_NoMemory();
        return NULL;
    }
    CopyDesc *descs = PyMem_Malloc(total > 0 ? (size_t)total * sizeof(CopyDesc) : 1);
    if (descs == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t l = 0; l < layers; l++)
        for (Py_ssize_t p = 0; p < n; p++)
            for (Py_ssize_t b = 0; b < buffers; b++, at++) {
                Py_ssize_t j = b * layers + l;
                CopyDesc c = tpl[j];
                int64_t src_off, dst_off;
                if (src_pages[p] < 0 || dst_pages[p] < 0 || __builtin_mul_overflow(src_pages[p], src_step[j], &src_off) ||
                    __builtin_mul_overflow(dst_pages[p], dst_step[j], &dst_off) ||
                    __builtin_add_overflow(c.src, src_off, &c.src) || __builtin_add_overflow(c.dst, dst_off, &c.dst)) {
                    PyMem_Free(descs);
                    PyErr_Format(PyExc_ValueError, "page pair %zd (%lld -> %lld) is out of range", p,
                                 (long long)src_pages[p], (long long)dst_pages[p]);
                    return NULL;
                }
                if (check_desc(&c, at, dst_size, src_size) < 0) {
                    PyMem_Free(descs);
                    return NULL;
                }
                descs[at] = c;
            }
    return descs;
}

/* copy_pages(dst_addr, dst_size, src_addr, src_size, template, src_step, dst_step, src_pages,
 * dst_pages, layers, streaming, progress_addr): copy every page pair src_pages[p] ->
 * dst_pages[p] as the template's (k, 6) descriptors of page 0 -> page 0 moved by each row's
 * page steps, in the calling thread without the GIL, layer by layer, storing the count of
 * layers done into the word at progress_addr (0: none). What copy_shares does for one share,
 * without building descriptors in Python first. Everything is checked before any copy. */
static PyObject *copy_pages(PyObject *self, PyObject *args) {
    uintptr_t dst_addr, src_addr, progress;
    long long dst_size, src_size;
    PyObject *tpl_obj, *sstep_obj, *dstep_obj, *spages_obj, *dpages_obj;
    Py_ssize_t layers;
    int streaming;
    Py_buffer views[5];
    int got = 0;
    PyObject *result = NULL;
    CopyDesc *descs = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "O&LO&LOOOOOnpO&", to_address, &dst_addr, &dst_size, to_address, &src_addr, &src_size,
                          &tpl_obj, &sstep_obj, &dstep_obj, &spages_obj, &dpages_obj, &layers, &streaming, to_address,
                          &progress))
        return NULL;
    if (check_buffers(dst_addr, dst_size, src_addr, src_size, 1) < 0)
        return NULL;
    if (progress % 4 != 0)
        return PyErr_Format(PyExc_ValueError, "the progress word must be 4-byte aligned");
    PyObject *objs[5] = {tpl_obj, sstep_obj, dstep_obj, spages_obj, dpages_obj};
    const char *names[5] = {"template", "src_step", "dst_step", "src_pages", "dst_pages"};
    for (; got < 5; got++)
        if (get_int64s(objs[got], &views[got], got == 0 ? DESC_FIELDS : 0, names[got]) < 0)
            goto done;
    Py_ssize_t k = views[0].shape[0], n = views[3].shape[0];
    if (layers < 1 || k < layers || k % layers != 0 || views[1].shape[0] != k || views[2].shape[0] != k ||
        views[4].shape[0] != n) {
        PyErr_Format(PyExc_ValueError,
                     "need a template of buffers x %zd layers rows with a page step each, and as many destination "
                     "as source pages; got %zd rows, %zd and %zd steps, %zd and %zd pages",
                     layers, k, views[1].shape[0], views[2].shape[0], n, views[4].shape[0]);
        goto done;
    }
    descs = page_descs(views[0].buf, views[1].buf, views[2].buf, k, layers, views[3].buf, views[4].buf, n, dst_size,
                       src_size);
    if (descs == NULL)
        goto done;
    int64_t *ends = PyMem_Malloc((size_t)layers * sizeof(int64_t));
    if (ends == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t l = 0; l < layers; l++)
        ends[l] = (int64_t)(l + 1) * (int64_t)(k / layers) * (int64_t)n;
    Share share = {(char *)dst_addr, (const char *)src_addr, descs, ends, layers, 1, streaming,
                   (uint32_t *)progress};
    Py_BEGIN_ALLOW_THREADS
    run_share(&share);
    Py_END_ALLOW_THREADS
    PyMem_Free(ends);
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(descs);
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"wait_progress", wait_progress, METH_VARARGS,
     "wait_progress(addr, target, timeout_s) -> int\n\n"
     "Wait, without the GIL, until the 32-bit word at addr is >= target or timeout_s seconds\n"
     "pass (< 0: no limit); returns the value read last."},
    {"copy_shares", copy_shares, METH_VARARGS,
     "copy_shares(dst_addr, dst_size, src_addr, src_size, shares, group, streaming, progress_addrs) -> None\n\n"
     "copy_layers for several shares at once: in this thread and on the copy crew's threads, all\n"
     "without the GIL; shares is a sequence of (descriptors, layer_ends) and\n"
     "progress_addrs one word address (0: none) per share. Checks everything first."},
    {"copy_pages", copy_pages, METH_VARARGS,
     "copy_pages(dst_addr, dst_size, src_addr, src_size, template, src_step, dst_step, src_pages, dst_pages,\n"
     "           layers, streaming, progress_addr) -> None\n\n"
     "A small transfer in this thread, without the GIL: the (k, 6) page-0 template moved to every\n"
     "page pair by its rows' page steps, layer by layer (template row j: layer j % layers),\n"
     "publishing layers into the word at progress_addr (0: none). Checks everything first."},
    {"build_descriptors", build_descriptors, METH_VARARGS,
     "build_descriptors(src_strides, dst_strides, page_size, src_pages, dst_pages, layers, by_layer, key_is_src)\n"
     "-> (descriptors, positions)\n\n"
     "One descriptor per (buffer, page, layer) chunk, stably sorted by (layer position if by_layer,\n"
     "source offset if key_is_src else destination offset); int64 bytearrays (see _native_plan.c)."},
    {"merge_descriptors", merge_descriptors, METH_VARARGS,
     "merge_descriptors(descs, positions_or_None, layers, cap) -> (descriptors, layer_ends)\n\n"
     "Join single-row copies that continue each other (cap <= 0: none); see _native_plan.c."},
    {"split_descriptors", split_descriptors, METH_VARARGS,
     "split_descriptors(descs, layer_ends, group, shares, per_layer) -> [(descriptors, layer_ends)]\n\n"
     "Cut copies into shares of about equal bytes, between groups; see _native_plan.c."},
    {"publish", publish, METH_VARARGS,
     "publish(addr, value) -> None\n\nStore value into the 32-bit word at addr and wake its waiters."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "Batched strided row copies for hicache's CPU transfer path.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddIntConstant(m, "HAVE_STREAMING_STORES", HICACHE_HAVE_STREAM) < 0 ||
                      add_copy_queue(m) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
