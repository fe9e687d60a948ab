/* XXH3-64 (seed 0, default secret) of a page read in pieces, with the GIL released.
 *
 * The stored page format checksums header + key + payload with XXH3-64 (page_format.py).
 * python-xxhash holds the GIL while it hashes, so the file tier's reader threads took turns
 * over each 1.5 MB page. This computes the same value over a list of buffers, as one input
 * (the pieces in order), for inputs over 240 bytes: the algorithm's "long" path, stripes of 64
 * bytes folded into 8 accumulators, scrambled every 16 stripes (one block), then a last
 * stripe over the final 64 bytes and a merge. Shorter inputs return None: page_format hashes
 * them with python-xxhash, and a stored page is never that short.
 *
 * Constants and steps follow the published XXH3 specification; the tests compare every
 * length class of the long path and any split into pieces with python-xxhash.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

#define STRIPE 64
#define STRIPES_PER_BLOCK 16 /* (sizeof(SECRET) - STRIPE) / 8 */
#define LONG_INPUT_MIN 241
#define RELEASE_GIL_BYTES (64 << 10)

static const uint8_t SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define PRIME32_1 0x9E3779B1ULL
#define PRIME32_2 0x85EBCA77ULL
#define PRIME32_3 0xC2B2AE3DULL
#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PRIME64_3 0x165667B19E3779F9ULL
#define PRIME64_4 0x85EBCA77C2B2AE63ULL
#define PRIME64_5 0x27D4EB2F165667C5ULL

static inline uint64_t le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* Fold one 64-byte stripe into the accumulators with the 64 secret bytes at `key`. */
static inline void accumulate(uint64_t acc[8], const uint8_t *stripe, const uint8_t *key) {
    for (int i = 0; i < 8; i++) {
        uint64_t data = le64(stripe + 8 * i);
        uint64_t keyed = data ^ le64(key + 8 * i);
        acc[i ^ 1] += data;
        acc[i] += (keyed & 0xFFFFFFFFULL) * (keyed >> 32);
    }
}

static inline void scramble(uint64_t acc[8]) {
    const uint8_t *key = SECRET + sizeof SECRET - STRIPE;
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= le64(key + 8 * i);
        acc[i] = a * PRIME32_1;
    }
}

static inline uint64_t mul_fold(uint64_t a, uint64_t b) {
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
}

typedef struct {
    uint64_t acc[8];
    size_t done; /* stripes folded so far */
} state;

/* Fold `count` stripes from `p`, in order: stripe s's key steps 8 bytes per stripe within its
 * block of 16, and each block's end scrambles. */
static void fold_scalar(state *st, const uint8_t *p, size_t count) {
    for (size_t k = 0; k < count; k++, p += STRIPE) {
        size_t in_block = st->done++ % STRIPES_PER_BLOCK;
        accumulate(st->acc, p, SECRET + 8 * in_block);
        if (in_block == STRIPES_PER_BLOCK - 1) scramble(st->acc);
    }
}

/* Each stripe's 64-byte key within a block (SECRET + 8 * stripe), copied once to aligned rows:
 * read straight from SECRET, 7 of 8 of these loads would straddle two cache lines. */
static uint8_t STRIPE_KEYS[STRIPES_PER_BLOCK][STRIPE] __attribute__((aligned(64))); /* made at import */

static void make_stripe_keys(void) {
    for (int k = 0; k < STRIPES_PER_BLOCK; k++) memcpy(STRIPE_KEYS[k], SECRET + 8 * k, STRIPE);
}

/* The stripe loops: the portable one, and where the CPU has them AVX2 and AVX-512 (chosen at
 * the first hash; set_loop picks another, for the tests). */
enum { LOOP_PORTABLE, LOOP_AVX2, LOOP_AVX512 };
static const char *const LOOP_NAMES[] = {"portable", "avx2", "avx512"};
static int loop = -1; /* -1: not yet asked of the CPU */
static int best_loop(void);

static int current_loop(void) {
    if (loop < 0) loop = best_loop();
    return loop;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2")))
#define PREFETCH_AHEAD 384 /* bytes: the input ahead of the stripe being folded (harmless past its end) */

/* How many of `count` stripes are left in the current block, and where in it they start. */
static inline size_t block_run(const state *st, size_t count, size_t *in_block) {
    *in_block = st->done % STRIPES_PER_BLOCK;
    return STRIPES_PER_BLOCK - *in_block < count ? STRIPES_PER_BLOCK - *in_block : count;
}

/* fold_scalar's steps four lanes at a time, the accumulators held in two registers: the
 * 32x32->64 product is vpmuludq of the keyed word and its upper half moved down, and
 * acc[i ^ 1] += data adds the data with its 64-bit lanes swapped in pairs. */
AVX2 static void fold_avx2(state *st, const uint8_t *p, size_t count) {
    const uint8_t *scramble_key = SECRET + sizeof SECRET - STRIPE;
    const __m256i prime = _mm256_set1_epi32((int)PRIME32_1);
    __m256i acc[2] = {_mm256_loadu_si256((const __m256i *)st->acc), _mm256_loadu_si256((const __m256i *)(st->acc + 4))};
    while (count) {
        /* the stripes left in this block, folded by a loop with only local counters (the
         * compiler keeps everything in registers and unrolls it), then the block's scramble */
        size_t in_block, run = block_run(st, count, &in_block);
        const uint8_t *key = STRIPE_KEYS[in_block];
        for (size_t k = 0; k < run; k++, p += STRIPE, key += STRIPE) {
            _mm_prefetch((const char *)p + PREFETCH_AHEAD, _MM_HINT_T0);
            for (int h = 0; h < 2; h++) {
                __m256i data = _mm256_loadu_si256((const __m256i *)(p + 32 * h));
                __m256i keyed = _mm256_xor_si256(data, _mm256_load_si256((const __m256i *)(key + 32 * h)));
                __m256i product = _mm256_mul_epu32(keyed, _mm256_srli_epi64(keyed, 32));
                __m256i swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
                acc[h] = _mm256_add_epi64(acc[h], _mm256_add_epi64(product, swapped));
            }
        }
        st->done += run;
        count -= run;
        if (in_block + run != STRIPES_PER_BLOCK) continue;
        for (int h = 0; h < 2; h++) {
            __m256i a = _mm256_xor_si256(acc[h], _mm256_srli_epi64(acc[h], 47));
            a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(scramble_key + 32 * h)));
            __m256i low = _mm256_mul_epu32(a, prime);
            __m256i high = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
            acc[h] = _mm256_add_epi64(low, _mm256_slli_epi64(high, 32));
        }
    }
    _mm256_storeu_si256((__m256i *)st->acc, acc[0]);
    _mm256_storeu_si256((__m256i *)(st->acc + 4), acc[1]);
}

#define AVX512 __attribute__((target("avx512f")))

/* The same with one 512-bit register for all 8 accumulators: a stripe is one load. */
AVX512 static void fold_avx512(state *st, const uint8_t *p, size_t count) {
    const __m512i prime = _mm512_set1_epi32((int)PRIME32_1);
    const __m512i scramble_key = _mm512_loadu_si512((const void *)(SECRET + sizeof SECRET - STRIPE));
    __m512i acc = _mm512_loadu_si512((const void *)st->acc);
    while (count) {
        size_t in_block, run = block_run(st, count, &in_block);
        const uint8_t *key = STRIPE_KEYS[in_block];
        for (size_t k = 0; k < run; k++, p += STRIPE, key += STRIPE) {
            _mm_prefetch((const char *)p + PREFETCH_AHEAD, _MM_HINT_T0);
            __m512i data = _mm512_loadu_si512((const void *)p);
            __m512i keyed = _mm512_xor_si512(data, _mm512_load_si512((const void *)key));
            __m512i product = _mm512_mul_epu32(keyed, _mm512_srli_epi64(keyed, 32));
            __m512i swapped = _mm512_shuffle_epi32(data, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2));
            acc = _mm512_add_epi64(acc, _mm512_add_epi64(product, swapped));
        }
        st->done += run;
        count -= run;
        if (in_block + run != STRIPES_PER_BLOCK) continue;
        __m512i a = _mm512_xor_si512(_mm512_xor_si512(acc, _mm512_srli_epi64(acc, 47)), scramble_key);
        __m512i low = _mm512_mul_epu32(a, prime);
        __m512i high = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime);
        acc = _mm512_add_epi64(low, _mm512_slli_epi64(high, 32));
    }
    _mm512_storeu_si512((void *)st->acc, acc);
}

static int has_avx2(void) { return __builtin_cpu_supports("avx2"); }

static int best_loop(void) {
    return __builtin_cpu_supports("avx512f") ? LOOP_AVX512 : has_avx2() ? LOOP_AVX2 : LOOP_PORTABLE;
}

static void fold_run(state *st, const uint8_t *p, size_t count) {
    switch (current_loop()) {
    case LOOP_AVX512:
        fold_avx512(st, p, count);
        break;
    case LOOP_AVX2:
        fold_avx2(st, p, count);
        break;
    default:
        fold_scalar(st, p, count);
    }
}
#else
static int has_avx2(void) { return 0; }
static int best_loop(void) { return LOOP_PORTABLE; }
#define fold_run fold_scalar
#endif

/* The long path fed in order, piece by piece, the whole length known from the start: every
 * stripe before the last (total - 1) / 64 is folded as its bytes arrive (a stripe split over
 * two pieces is gathered into `gathered`), then finish() folds the input's final 64 bytes,
 * which may overlap stripes already folded, and merges. */
typedef struct {
    state st;
    size_t stripes, total, have;
    uint8_t gathered[STRIPE];
} hasher;

static void hasher_init(hasher *h, size_t total) {
    state first = {{PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1}, 0};
    h->st = first;
    h->total = total;
    h->stripes = (total - 1) / STRIPE;
    h->have = 0;
}

static void hasher_feed(hasher *h, const uint8_t *p, size_t left) {
    state *st = &h->st;
    if (h->have && st->done < h->stripes) {
        size_t take = STRIPE - h->have < left ? STRIPE - h->have : left;
        memcpy(h->gathered + h->have, p, take);
        h->have += take, p += take, left -= take;
        if (h->have < STRIPE) return;
        fold_run(st, h->gathered, 1);
        h->have = 0;
    }
    size_t whole = left / STRIPE < h->stripes - st->done ? left / STRIPE : h->stripes - st->done;
    fold_run(st, p, whole);
    p += whole * STRIPE, left -= whole * STRIPE;
    if (left && st->done < h->stripes) {
        memcpy(h->gathered, p, left);
        h->have = left;
    }
}

/* Fill out[0, need) with the last `need` bytes of the n buffers taken as one input (out's
 * end first); returns how many bytes the buffers were short of. */
static size_t fill_tail(const Py_buffer *parts, Py_ssize_t n, uint8_t *out, size_t need) {
    for (Py_ssize_t i = n - 1; i >= 0 && need; i--) {
        size_t len = (size_t)parts[i].len, take = len < need ? len : need;
        memcpy(out + need - take, (const uint8_t *)parts[i].buf + len - take, take);
        need -= take;
    }
    return need;
}

static uint64_t hasher_finish(hasher *h, const uint8_t last[STRIPE]) {
    accumulate(h->st.acc, last, SECRET + sizeof SECRET - STRIPE - 7);
    uint64_t v = (uint64_t)h->total * PRIME64_1;
    for (int i = 0; i < 4; i++)
        v += mul_fold(h->st.acc[2 * i] ^ le64(SECRET + 11 + 16 * i), h->st.acc[2 * i + 1] ^ le64(SECRET + 11 + 16 * i + 8));
    return avalanche(v);
}

static uint64_t xxh3_long(const Py_buffer *parts, Py_ssize_t n, size_t total) {
    hasher h;
    uint8_t last[STRIPE];
    hasher_init(&h, total);
    for (Py_ssize_t i = 0; i < n; i++) hasher_feed(&h, parts[i].buf, (size_t)parts[i].len);
    fill_tail(parts, n, last, STRIPE);
    return hasher_finish(&h, last);
}

/* Buffers of the objects in `seq` (a sequence), C-contiguous, writable if asked; their count
 * in *n and byte total in *total. NULL with an exception set (nothing held) on failure. */
static Py_buffer *get_buffers(PyObject *seq, int flags, const char *what, Py_ssize_t *n, size_t *total) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast), got = 0;
    Py_buffer *parts = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_buffer));
    if (parts == NULL) PyErr_NoMemory();
    *total = 0;
    for (; parts != NULL && got < count; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &parts[got], flags) < 0) {
            for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&parts[i]);
            PyMem_Free(parts);
            parts = NULL;
            break;
        }
        *total += (size_t)parts[got].len;
    }
    Py_DECREF(fast);
    *n = count;
    return parts;
}

static void release_buffers(Py_buffer *parts, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&parts[i]);
    PyMem_Free(parts);
}

static PyObject *xxh3_64_long(PyObject *self, PyObject *arg) {
    (void)self;
    Py_ssize_t n;
    size_t total;
    Py_buffer *parts = get_buffers(arg, PyBUF_C_CONTIGUOUS, "xxh3_64_long takes a sequence of buffers", &n, &total);
    if (parts == NULL) return NULL;
    if (total < LONG_INPUT_MIN) {
        release_buffers(parts, n);
        Py_RETURN_NONE;
    }
    uint64_t h;
    if (total >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS h = xxh3_long(parts, n, total);
        Py_END_ALLOW_THREADS
    } else {
        h = xxh3_long(parts, n, total);
    }
    release_buffers(parts, n);
    return PyLong_FromUnsignedLongLong(h);
}

/* Read `pieces` in order from fd at `offset` in windows of about WINDOW_BYTES, and fold each
 * window into the hash while it is still in the CPU's cache (the hash runs over `prefix`, then
 * the pieces). Returns the bytes read, and sets *err to errno on a failed read; a short read
 * (end of file) stops early. */
#define WINDOW_BYTES (256 << 10)
#define WINDOW_IOVS 64

static size_t read_and_fold(int fd, off_t offset, Py_buffer *pieces, Py_ssize_t n, hasher *h, int *err) {
    struct iovec iov[WINDOW_IOVS];
    size_t read_total = 0, at = 0; /* at: bytes of pieces[i] already read */
    Py_ssize_t i = 0;
    *err = 0;
    while (i < n) {
        int cnt = 0;
        size_t want = 0;
        Py_ssize_t j = i;
        size_t j_at = at;
        while (j < n && cnt < WINDOW_IOVS && want < WINDOW_BYTES) {
            size_t left = (size_t)pieces[j].len - j_at, take = left < WINDOW_BYTES - want ? left : WINDOW_BYTES - want;
            if (take) {
                iov[cnt].iov_base = (uint8_t *)pieces[j].buf + j_at;
                iov[cnt].iov_len = take;
                cnt++, want += take;
            }
            j_at += take;
            if (j_at == (size_t)pieces[j].len) j++, j_at = 0;
        }
        if (want == 0) break;
        ssize_t got;
        do got = preadv(fd, iov, cnt, offset + (off_t)read_total);
        while (got < 0 && errno == EINTR);
        if (got < 0) {
            *err = errno;
            return read_total;
        }
        read_total += (size_t)got;
        if ((size_t)got < want) return read_total; /* the file is shorter: the caller reports it */
        if (h != NULL)
            for (int k = 0; k < cnt; k++) hasher_feed(h, iov[k].iov_base, iov[k].iov_len);
        i = j, at = j_at;
    }
    return read_total;
}

static PyObject *pread_xxh3(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    long long offset;
    PyObject *prefix_seq, *pieces_seq;
    if (!PyArg_ParseTuple(args, "iLOO:pread_xxh3", &fd, &offset, &prefix_seq, &pieces_seq)) return NULL;
    if (offset < 0) return PyErr_Format(PyExc_ValueError, "offset must be >= 0, got %lld", offset);
    Py_ssize_t np, nq;
    size_t prefix_bytes, piece_bytes;
    Py_buffer *prefix = get_buffers(prefix_seq, PyBUF_C_CONTIGUOUS, "prefix must be a sequence of buffers", &np, &prefix_bytes);
    if (prefix == NULL) return NULL;
    Py_buffer *pieces = get_buffers(pieces_seq, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, "pieces must be a sequence of writable buffers", &nq, &piece_bytes);
    if (pieces == NULL) {
        release_buffers(prefix, np);
        return NULL;
    }
    size_t total = prefix_bytes + piece_bytes, got;
    int err, hashed = total >= LONG_INPUT_MIN;
    uint64_t digest = 0;
    Py_BEGIN_ALLOW_THREADS;
    hasher h;
    if (hashed) {
        hasher_init(&h, total);
        for (Py_ssize_t i = 0; i < np; i++) hasher_feed(&h, prefix[i].buf, (size_t)prefix[i].len);
    }
    got = read_and_fold(fd, (off_t)offset, pieces, nq, hashed ? &h : NULL, &err);
    if (hashed && !err && got == piece_bytes) {
        uint8_t last[STRIPE]; /* the input's last 64 bytes: from the pieces, then the prefix */
        fill_tail(prefix, np, last, fill_tail(pieces, nq, last, STRIPE));
        digest = hasher_finish(&h, last);
    }
    Py_END_ALLOW_THREADS;
    release_buffers(prefix, np);
    release_buffers(pieces, nq);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (!hashed || got != piece_bytes) return Py_BuildValue("(nO)", (Py_ssize_t)got, Py_None);
    return Py_BuildValue("(nK)", (Py_ssize_t)got, (unsigned long long)digest);
}

/* Copy `sources` back to back into `dests` (the same bytes in all, each list in order) in
 * chunks of at most WINDOW_BYTES, folding each chunk into the hash right after it lands, while
 * it is in the CPU's cache; the hash runs over prefix, then the bytes copied. */
static void copy_and_fold(Py_buffer *src, Py_ssize_t ns, Py_buffer *dst, Py_ssize_t nd, hasher *h) {
    Py_ssize_t i = 0, j = 0;
    size_t si = 0, dj = 0; /* bytes of src[i] / dst[j] already copied */
    while (i < ns && j < nd) {
        size_t s_left = (size_t)src[i].len - si, d_left = (size_t)dst[j].len - dj;
        size_t take = s_left < d_left ? s_left : d_left;
        if (take > WINDOW_BYTES) take = WINDOW_BYTES;
        uint8_t *to = (uint8_t *)dst[j].buf + dj;
        memcpy(to, (const uint8_t *)src[i].buf + si, take);
        if (h != NULL) hasher_feed(h, to, take);
        si += take, dj += take;
        if (si == (size_t)src[i].len) i++, si = 0;
        if (dj == (size_t)dst[j].len) j++, dj = 0;
    }
}

static PyObject *copy_xxh3(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *prefix_seq, *src_seq, *dst_seq;
    if (!PyArg_ParseTuple(args, "OOO:copy_xxh3", &prefix_seq, &src_seq, &dst_seq)) return NULL;
    Py_ssize_t np, ns, nd;
    size_t prefix_bytes, src_bytes, dst_bytes;
    Py_buffer *prefix = get_buffers(prefix_seq, PyBUF_C_CONTIGUOUS, "prefix must be a sequence of buffers", &np, &prefix_bytes);
    if (prefix == NULL) return NULL;
    Py_buffer *src = get_buffers(src_seq, PyBUF_C_CONTIGUOUS, "sources must be a sequence of buffers", &ns, &src_bytes);
    if (src == NULL) {
        release_buffers(prefix, np);
        return NULL;
    }
    Py_buffer *dst = get_buffers(dst_seq, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE, "dests must be a sequence of writable buffers", &nd, &dst_bytes);
    if (dst == NULL) {
        release_buffers(prefix, np);
        release_buffers(src, ns);
        return NULL;
    }
    PyObject *out = NULL;
    size_t total = prefix_bytes + src_bytes;
    if (src_bytes != dst_bytes) {
        PyErr_Format(PyExc_ValueError, "copy_xxh3: %zu source bytes for %zu destination bytes", src_bytes, dst_bytes);
    } else {
        int hashed = total >= LONG_INPUT_MIN;
        uint64_t digest = 0;
        Py_BEGIN_ALLOW_THREADS;
        hasher h;
        if (hashed) {
            hasher_init(&h, total);
            for (Py_ssize_t i = 0; i < np; i++) hasher_feed(&h, prefix[i].buf, (size_t)prefix[i].len);
        }
        copy_and_fold(src, ns, dst, nd, hashed ? &h : NULL);
        if (hashed) {
            uint8_t last[STRIPE]; /* the input's last 64 bytes: from the copied bytes, then the prefix */
            fill_tail(prefix, np, last, fill_tail(dst, nd, last, STRIPE));
            digest = hasher_finish(&h, last);
        }
        Py_END_ALLOW_THREADS;
        out = hashed ? PyLong_FromUnsignedLongLong(digest) : Py_NewRef(Py_None);
    }
    release_buffers(prefix, np);
    release_buffers(src, ns);
    release_buffers(dst, nd);
    return out;
}

/* Whether this CPU can run loop i. */
static int can_run(int i) { return i <= best_loop() && (i != LOOP_AVX2 || has_avx2()); }

/* For the tests: hash with the named loop ("best": the CPU's best); returns the name of the
 * loop in use before. ValueError for a name this CPU cannot run. */
static PyObject *set_loop(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (name == NULL) return PyErr_Format(PyExc_TypeError, "set_loop needs a loop name, got %R", arg);
    int want = strcmp(name, "best") == 0 ? best_loop() : -1;
    for (int i = 0; want < 0 && i <= LOOP_AVX512; i++)
        if (strcmp(name, LOOP_NAMES[i]) == 0) want = i;
    if (want < 0 || !can_run(want))
        return PyErr_Format(PyExc_ValueError, "xxh3 loop %R is unknown or not supported by this CPU", arg);
    int before = current_loop();
    loop = want;
    return PyUnicode_FromString(LOOP_NAMES[before]);
}

/* The loops this CPU can run, best last. */
static PyObject *loops(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    PyObject *out = PyList_New(0);
    for (int i = 0; out != NULL && i <= LOOP_AVX512; i++) {
        if (!can_run(i)) continue;
        PyObject *name = PyUnicode_FromString(LOOP_NAMES[i]);
        if (name == NULL || PyList_Append(out, name) < 0) Py_CLEAR(out);
        Py_XDECREF(name);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"xxh3_64_long", xxh3_64_long, METH_O,
     "xxh3_64_long(parts) -> int | None\n\nXXH3-64 of the buffers in `parts` taken as one input, "
     "computed without the GIL from 64 KiB; None when the input is 240 bytes or shorter."},
    {"pread_xxh3", pread_xxh3, METH_VARARGS,
     "pread_xxh3(fd, offset, prefix, pieces) -> (bytes read, int | None)\n\nRead fd from `offset` into the "
     "writable buffers `pieces`, in order and without the GIL, and return the bytes read with the XXH3-64 "
     "of prefix + pieces, computed as each window of bytes lands; the hash is None after a short read or "
     "when prefix + pieces is 240 bytes or shorter. OSError for a failed read."},
    {"copy_xxh3", copy_xxh3, METH_VARARGS,
     "copy_xxh3(prefix, sources, dests) -> int | None\n\nCopy the buffers `sources` back to back into the "
     "writable buffers `dests` (the same total) without the GIL, and return the XXH3-64 of prefix + the "
     "bytes copied, folded as each chunk lands; None when that is 240 bytes or shorter. ValueError when "
     "the totals differ."},
    {"set_loop", set_loop, METH_O,
     "set_loop(name) -> str\n\nFor tests: hash with the named stripe loop ('portable', 'avx2', 'avx512' or "
     "'best'); returns the name of the loop in use before. ValueError for one this CPU cannot run."},
    {"loops", loops, METH_NOARGS, "loops() -> list[str]\n\nThe stripe loops this CPU can run, best last."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_xxh3", NULL, -1, methods};

PyMODINIT_FUNC PyInit__xxh3(void) {
    make_stripe_keys();
    return PyModule_Create(&module);
}
