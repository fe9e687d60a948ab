/* hicache.transfer._native: one call copies a whole batch of strided row blocks (the
 * descriptors of a large transfer are planned in _native_plan.c).
 *
 * A copy descriptor is six int64s: (dst, src, rows, row_bytes, dst_stride, src_stride),
 * byte offsets into two flat buffers. copy_pieces() takes a private copy of a transfer's
 * descriptors, layer by layer, and checks every one against both buffers' sizes before it
 * copies anything (rows must not overlap on the destination, which also bounds the work). It
 * cuts each layer into pieces of about equal bytes, which the calling thread and the copy
 * crew's threads (_native_crew.c) take one at a time, in order, without the GIL (a small
 * copy on the calling thread alone keeps it: see run_job_in_turn). Once a
 * layer and every one before it are copied, the thread that finished the last of their
 * pieces raises the transfer's 32-bit progress word to the count of layers done (release
 * order) and wakes its futex waiters, so another thread, or another process that maps the
 * word (a shared-memory progress block), waits for a layer with wait_progress() without
 * holding the GIL and without a message per layer.
 *
 * With streaming=True, x86-64 builds write with non-temporal stores: a transfer larger than
 * the caches saves the read-for-ownership traffic that ordinary stores cost (each destination
 * line read before it is overwritten), and does not evict the caller's working set. Other CPUs use memcpy either way.
 */
#include "_native.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
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
 * page_first, 2-core VM, alternating runs: layer-wise over plain reload 1.52-1.56 -> 1.27-1.31.
 * Into L2, not L1 (locality 2, prefetcht1 on x86): four rows of 2.5 KB ahead are 160 lines,
 * more misses than L1 keeps in flight, so prefetches into L1 held back the copy's own loads
 * (2-core AMD EPYC VM: layer-wise over plain 1.66-1.80 -> 1.34, on one copy thread 50 -> 36 ms
 * for 377 MB). */
#define PREFETCH_ROWS 4

static void prefetch_row(const char *s, size_t n) {
    for (size_t i = 0; i < n; i += 64)
        __builtin_prefetch(s + i, 0, 2);
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

static void wake_word(uint32_t *word) {
#ifdef __linux__
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0); /* shared: waiters may be other processes */
#else
    (void)word;
#endif
}

static void publish_word(uint32_t *word, uint32_t value) {
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    wake_word(word);
}

/* A 32-bit word value: "O&" converter that refuses what does not fit (PyArg's "I" wraps). */
static int to_word(PyObject *obj, void *out) {
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred())
        return 0;
    if (v < 0 || v > (long long)UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "a progress word holds 0..%lu, got %lld", (unsigned long)UINT32_MAX, v);
        return 0;
    }
    *(uint32_t *)out = (uint32_t)v;
    return 1;
}

static PyObject *publish(PyObject *self, PyObject *args) {
    uintptr_t addr;
    uint32_t value;
    (void)self;
    if (!PyArg_ParseTuple(args, "O&O&", to_address, &addr, to_word, &value))
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

/* Wait until *word >= target, at most timeout_s seconds (< 0 or infinite: no limit); returns
 * what it read last. Runs without the GIL, sleeping at most a second at a time. */
static PyObject *wait_progress(PyObject *self, PyObject *args) {
    uintptr_t addr;
    uint32_t target;
    double timeout_s;
    (void)self;
    if (!PyArg_ParseTuple(args, "O&O&d", to_address, &addr, to_word, &target, &timeout_s))
        return NULL;
    if (addr == 0 || addr % 4 != 0)
        return PyErr_Format(PyExc_ValueError, "a progress word needs a non-zero 4-byte aligned address");
    if (isnan(timeout_s))
        return PyErr_Format(PyExc_ValueError, "timeout_s must be a number of seconds (< 0 or inf: no limit), got nan");
    if (isinf(timeout_s))
        timeout_s = -1.0;
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
        if (left > 1.0)
            left = 1.0; /* in range for time_t, and the loop checks again */
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

/* Raise *word to value unless it is already there (or FAILED, the largest value), and wake
 * its waiters: threads that finish layers out of order never move it back. Only the CAS
 * writes: storing again after it could lower a word that another thread raised meanwhile. */
static void raise_word(uint32_t *word, uint32_t value) {
    uint32_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    while (seen < value)
        if (__atomic_compare_exchange_n(word, &seen, value, 0, __ATOMIC_RELEASE, __ATOMIC_ACQUIRE)) {
            wake_word(word);
            return;
        }
}

/* Count the layers done from the first one on, after a thread has finished the last piece of
 * a layer; publish the count when it grew. The counts are sequentially consistent: two threads
 * that finish layers 0 and 1 at once must not both read the other's count as not yet zero
 * (a store-then-load pair, which acquire/release alone allows on weak memory). */
static void advance(Job *job) {
    uint32_t done = __atomic_load_n(&job->layers_done, __ATOMIC_SEQ_CST);
    while ((Py_ssize_t)done < job->layers && __atomic_load_n(&job->left[done], __ATOMIC_SEQ_CST) == 0)
        if (__atomic_compare_exchange_n(&job->layers_done, &done, done + 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            done++;
    if (job->progress != NULL)
        raise_word(job->progress, done);
}

void run_piece(Job *job, Py_ssize_t i) {
    const Piece *p = &job->pieces[i];
    Py_ssize_t count = p->stop - p->first;
    if (count > 0)
        copy_all(job->dst, job->src, job->descs + p->first, count, job->group < count ? job->group : count,
                 job->streaming);
    if (__atomic_sub_fetch(&job->left[p->layer], 1, __ATOMIC_SEQ_CST) == 0)
        advance(job);
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
    *layers_out = layers;
    return ends;
}

/* Whether ends (layers entries) rise to n; ValueError otherwise. */
static int check_ends(const int64_t *ends, Py_ssize_t layers, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < layers; i++) {
        int64_t before = i == 0 ? 0 : ends[i - 1];
        if (ends[i] < before || ends[i] > n || (i == layers - 1 && ends[i] != n)) {
            PyErr_Format(PyExc_ValueError, "layer_ends must rise to the descriptor count %zd; entry %zd is %lld", n, i,
                         (long long)ends[i]);
            return -1;
        }
    }
    if (layers == 0 && n != 0) {
        PyErr_Format(PyExc_ValueError, "%zd descriptors but no layer", n);
        return -1;
    }
    if (layers > MAX_PIECES / 2) {
        PyErr_Format(PyExc_ValueError, "%zd layers is more than one copy runs (%d)", layers, MAX_PIECES / 2);
        return -1;
    }
    return 0;
}

static int64_t desc_bytes(const CopyDesc *c) { return c->rows * c->row_bytes; /* checked: within a buffer */ }

/* The bytes of every descriptor together, at most INT64_MAX. */
static int64_t total_bytes(const CopyDesc *descs, Py_ssize_t n) {
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (__builtin_add_overflow(total, desc_bytes(&descs[i]), &total))
            return INT64_MAX;
    return total;
}

/* Cut each layer into pieces that end at the first group boundary past piece_bytes (every
 * layer has at least one piece, maybe empty, so that each layer's end is noticed). Writes
 * them into `out` when not NULL; returns how many there are. */
static Py_ssize_t cut_pieces(const CopyDesc *descs, const int64_t *ends, Py_ssize_t layers, Py_ssize_t group,
                             int64_t piece_bytes, Piece *out) {
    Py_ssize_t count = 0;
    for (Py_ssize_t l = 0; l < layers; l++) {
        Py_ssize_t first = l == 0 ? 0 : (Py_ssize_t)ends[l - 1], stop = (Py_ssize_t)ends[l], start = first;
        int64_t bytes = 0;
        for (Py_ssize_t i = first; i < stop; i++) {
            if (__builtin_add_overflow(bytes, desc_bytes(&descs[i]), &bytes))
                bytes = INT64_MAX;
            int at_group_end = (i + 1 - first) % group == 0 || i + 1 == stop;
            if (at_group_end && (bytes >= piece_bytes || i + 1 == stop)) {
                if (out != NULL)
                    out[count] = (Piece){start, i + 1, l};
                count++;
                start = i + 1;
                bytes = 0;
            }
        }
        if (start == first && stop == first) { /* an empty layer */
            if (out != NULL)
                out[count] = (Piece){first, first, l};
            count++;
        }
    }
    return count;
}

void free_job(Job *job) {
    if (job == NULL)
        return;
    PyMem_Free(job->descs);
    PyMem_Free(job->pieces);
    PyMem_Free(job->left);
    PyMem_Free(job);
}

Job *new_job(char *dst, const char *src, CopyDesc *descs, Py_ssize_t n, const int64_t *ends, Py_ssize_t layers,
             Py_ssize_t group, int streaming, Py_ssize_t threads, int64_t piece_bytes, uint32_t *progress) {
    if (check_ends(ends, layers, n) < 0) {
        PyMem_Free(descs);
        return NULL;
    }
    if (threads < 1 || threads > MAX_THREADS) {
        PyMem_Free(descs);
        PyErr_Format(PyExc_ValueError, "threads must be 1 to %d, got %zd", MAX_THREADS, threads);
        return NULL;
    }
    Job *job = PyMem_Calloc(1, sizeof(Job));
    if (job == NULL) {
        PyMem_Free(descs);
        PyErr_NoMemory();
        return NULL;
    }
    *job = (Job){.dst = dst, .src = src, .descs = descs, .layers = layers, .group = group, .threads = threads,
                 .bytes = total_bytes(descs, n), .streaming = streaming, .progress = progress};
    /* each layer has fewer than bytes / piece_bytes + 2 pieces: keep the count in bounds */
    int64_t floor_bytes = job->bytes / (MAX_PIECES - 2 * layers) + 1;
    if (piece_bytes <= 0 || threads == 1)
        piece_bytes = INT64_MAX; /* one thread: one piece per layer */
    else if (piece_bytes < floor_bytes)
        piece_bytes = floor_bytes;
    job->count = cut_pieces(descs, ends, layers, group, piece_bytes, NULL);
    job->pieces = PyMem_Malloc((size_t)(job->count > 0 ? job->count : 1) * sizeof(Piece));
    job->left = PyMem_Calloc((size_t)(layers > 0 ? layers : 1), sizeof(uint32_t));
    if (job->pieces == NULL || job->left == NULL) {
        free_job(job);
        PyErr_NoMemory();
        return NULL;
    }
    cut_pieces(descs, ends, layers, group, piece_bytes, job->pieces);
    for (Py_ssize_t i = 0; i < job->count; i++)
        job->left[job->pieces[i].layer]++;
    return job;
}

Job *load_job(uintptr_t dst_addr, long long dst_size, uintptr_t src_addr, long long src_size, PyObject *descs_obj,
              PyObject *ends_obj, Py_ssize_t group, int streaming, Py_ssize_t threads, long long piece_bytes,
              uintptr_t progress) {
    Py_ssize_t n, layers;
    if (check_buffers(dst_addr, dst_size, src_addr, src_size, group) < 0)
        return NULL;
    if (progress % 4 != 0) {
        PyErr_Format(PyExc_ValueError, "the progress word must be 4-byte aligned");
        return NULL;
    }
    CopyDesc *descs = load_descs(descs_obj, &n, dst_size, src_size);
    if (descs == NULL)
        return NULL;
    int64_t *ends = load_ends(ends_obj, n, &layers);
    if (ends == NULL) {
        PyMem_Free(descs);
        return NULL;
    }
    Job *job = new_job((char *)dst_addr, (const char *)src_addr, descs, n, ends, layers, group, streaming, threads,
                       piece_bytes, (uint32_t *)progress);
    PyMem_Free(ends);
    return job;
}

/* ---- whether a copy lets go of the GIL ---------------------------------------------- */

/* A copy on the calling thread alone of at most hold_bytes keeps the GIL. Released, the GIL
 * must be taken back afterwards, and beside a busy Python thread (one that holds it whenever
 * it can) that can wait until the interpreter makes that thread switch: a switch interval,
 * 5 ms, after a copy of tens of microseconds. Held, the copy delays the other threads by its
 * own time only, as the caller's Python code would. Larger copies, and those the copy crew
 * shares (its threads need no GIL, but the caller would hold it while it waits for them),
 * let go of it.
 *
 * HOLD_GIL_BYTES by measurement (benchmarks/transfer.py --gil-sweep: copies on one thread
 * from and into memory not in cache, beside a spinning Python thread; 2-core AMD EPYC VM
 * under other load, so the means are noisy): alone, 1 MB copies in 115 us, 1.47 MB (a MiMo
 * page of 64 tokens) 165, 4 MB 460, 8 MB 930. Beside the spinner, mean held / released:
 * 1 MB 0.83 / 1.07 ms, 1.47 MB 0.97 / 1.56, 2 MB 1.7 / 3.3, 4 MB 3.1 / 5.5. From cache, on
 * a quieter machine, a released 1 MB copy took 35 us at the median in one run and 5.2 ms in
 * another (the spinner took the GIL in 97% of the calls); held, 31-38 us every time. 4 MB
 * keeps what a held copy costs the other threads below a tenth of a switch interval (about
 * 0.46 ms from memory, 0.13 ms from cache). */
#define HOLD_GIL_BYTES (4LL << 20)
static long long hold_bytes = HOLD_GIL_BYTES;
static unsigned long long released; /* copies that let go of the GIL; changed under the GIL */

static int run_job_in_turn(Job *job) {
    int failed;
    if ((job->threads == 1 || job->count <= 1) && job->bytes <= hold_bytes)
        return run_job(job); /* on this thread alone (no helper): the GIL stays held */
    released++;
    Py_BEGIN_ALLOW_THREADS
    failed = run_job(job);
    Py_END_ALLOW_THREADS
    return failed;
}

/* hold_gil_bytes([n]) -> int: the bound (as it was before n, if given). */
static PyObject *hold_gil_bytes(PyObject *self, PyObject *args) {
    long long n = -1, before = hold_bytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "|L", &n))
        return NULL;
    if (PyTuple_GET_SIZE(args) > 0) {
        if (n < 0)
            return PyErr_Format(PyExc_ValueError, "hold_gil_bytes must be >= 0, got %lld", n);
        hold_bytes = n;
    }
    return PyLong_FromLongLong(before);
}

static PyObject *gil_releases(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromUnsignedLongLong(released);
}

/* copy_pieces(dst_addr, dst_size, src_addr, src_size, descs, layer_ends, group, streaming,
 * threads, piece_bytes, progress_addr): the calling thread and up to threads - 1 of the copy
 * crew take the job's pieces in order (run_job); returns when all are done. Everything is
 * checked before any copy starts. */
static PyObject *copy_pieces(PyObject *self, PyObject *args) {
    uintptr_t dst_addr, src_addr, progress;
    long long dst_size, src_size, piece_bytes;
    PyObject *descs_obj, *ends_obj;
    Py_ssize_t group, threads;
    int streaming, failed;
    (void)self;
    if (!PyArg_ParseTuple(args, "O&LO&LOOnpnLO&", to_address, &dst_addr, &dst_size, to_address, &src_addr, &src_size,
                          &descs_obj, &ends_obj, &group, &streaming, &threads, &piece_bytes, to_address, &progress))
        return NULL;
    Job *job = load_job(dst_addr, dst_size, src_addr, src_size, descs_obj, ends_obj, group, streaming, threads,
                        piece_bytes, progress);
    if (job == NULL)
        return NULL;
    failed = run_job_in_turn(job);
    free_job(job);
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
 * dst_pages, layers, streaming, threads, piece_bytes, progress_addr): copy every page pair
 * src_pages[p] -> dst_pages[p] as the template's (k, 6) descriptors of page 0 -> page 0 moved
 * by each row's page steps, layer by layer, as copy_pieces does (storing the count of layers
 * done into the word at progress_addr, 0: none), without descriptors built in Python first.
 * Everything is checked before any copy. */
static PyObject *copy_pages(PyObject *self, PyObject *args) {
    uintptr_t dst_addr, src_addr, progress;
    long long dst_size, src_size, piece_bytes;
    PyObject *tpl_obj, *sstep_obj, *dstep_obj, *spages_obj, *dpages_obj;
    Py_ssize_t layers, threads;
    int streaming, failed;
    Py_buffer views[5];
    int got = 0;
    PyObject *result = NULL;
    CopyDesc *descs = NULL;
    int64_t *ends = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "O&LO&LOOOOOnpnLO&", to_address, &dst_addr, &dst_size, to_address, &src_addr,
                          &src_size, &tpl_obj, &sstep_obj, &dstep_obj, &spages_obj, &dpages_obj, &layers, &streaming,
                          &threads, &piece_bytes, to_address, &progress))
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
    ends = PyMem_Malloc((size_t)layers * sizeof(int64_t));
    if (descs == NULL || ends == NULL) {
        if (ends == NULL && !PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t l = 0; l < layers; l++)
        ends[l] = (int64_t)(l + 1) * (int64_t)(k / layers) * (int64_t)n;
    Job *job = new_job((char *)dst_addr, (const char *)src_addr, descs, k * n, ends, layers, 1, streaming, threads,
                       piece_bytes, (uint32_t *)progress);
    descs = NULL; /* the job's now, or freed */
    if (job == NULL)
        goto done;
    failed = run_job_in_turn(job);
    free_job(job);
    if (failed)
        PyErr_Format(PyExc_OSError, "a copy thread could not be joined");
    else
        result = Py_NewRef(Py_None);
done:
    PyMem_Free(descs);
    PyMem_Free(ends);
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"wait_progress", wait_progress, METH_VARARGS,
     "wait_progress(addr, target, timeout_s) -> int\n\n"
     "Wait, without the GIL, until the 32-bit word at addr is >= target or timeout_s seconds\n"
     "pass (< 0: no limit); returns the value read last."},
    {"copy_pieces", copy_pieces, METH_VARARGS,
     "copy_pieces(dst_addr, dst_size, src_addr, src_size, descs, layer_ends, group, streaming, threads,\n"
     "            piece_bytes, progress_addr) -> None\n\n"
     "Copy the (n, 6) descriptors, layer l ending at descriptor layer_ends[l], cut into pieces of\n"
     "about piece_bytes that this thread and up to threads - 1 of the copy crew's take in order,\n"
     "without the GIL, storing the count of layers done into the word at progress_addr (0: none).\n"
     "Checks everything first."},
    {"copy_pages", copy_pages, METH_VARARGS,
     "copy_pages(dst_addr, dst_size, src_addr, src_size, template, src_step, dst_step, src_pages, dst_pages,\n"
     "           layers, streaming, threads, piece_bytes, progress_addr) -> None\n\n"
     "copy_pieces of the (k, 6) page-0 template moved to every page pair by its rows' page steps,\n"
     "layer by layer (template row j: layer j % layers). Checks everything first."},
    {"build_descriptors", build_descriptors, METH_VARARGS,
     "build_descriptors(src_strides, dst_strides, page_size, src_pages, dst_pages, layers, by_layer, key_is_src)\n"
     "-> (descriptors, positions)\n\n"
     "One descriptor per (buffer, page, layer) chunk, stably sorted by (layer position if by_layer,\n"
     "source offset if key_is_src else destination offset); int64 bytearrays (see _native_plan.c)."},
    {"merge_descriptors", merge_descriptors, METH_VARARGS,
     "merge_descriptors(descs, positions_or_None, layers, cap) -> (descriptors, layer_ends)\n\n"
     "Join single-row copies that continue each other (cap <= 0: none); see _native_plan.c."},
    {"hold_gil_bytes", hold_gil_bytes, METH_VARARGS,
     "hold_gil_bytes([n]) -> int\n\n"
     "The most bytes a copy on the calling thread alone copies holding the GIL; with n, set it\n"
     "to n (>= 0) and return the bound before."},
    {"gil_releases", gil_releases, METH_NOARGS,
     "gil_releases() -> int\n\nHow many copies (copy_pieces, copy_pages) let go of the GIL so far."},
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
                      PyModule_AddIntConstant(m, "HOLD_GIL_BYTES", HOLD_GIL_BYTES) < 0 ||
                      add_copy_queue(m) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
