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
#include <stdint.h>
#include <string.h>

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

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2")))

/* fold_scalar's steps four lanes at a time, the accumulators held in two registers: the
 * 32x32->64 product is vpmuludq of the keyed word and its upper half moved down, and
 * acc[i ^ 1] += data adds the data with its 64-bit lanes swapped in pairs. */
AVX2 static void fold_avx2(state *st, const uint8_t *p, size_t count) {
    const uint8_t *scramble_key = SECRET + sizeof SECRET - STRIPE;
    const __m256i prime = _mm256_set1_epi32((int)PRIME32_1);
    __m256i acc[2] = {_mm256_loadu_si256((const __m256i *)st->acc), _mm256_loadu_si256((const __m256i *)(st->acc + 4))};
    for (size_t k = 0; k < count; k++, p += STRIPE) {
        size_t in_block = st->done++ % STRIPES_PER_BLOCK;
        const uint8_t *key = SECRET + 8 * in_block;
        for (int h = 0; h < 2; h++) {
            __m256i data = _mm256_loadu_si256((const __m256i *)(p + 32 * h));
            __m256i keyed = _mm256_xor_si256(data, _mm256_loadu_si256((const __m256i *)(key + 32 * h)));
            __m256i product = _mm256_mul_epu32(keyed, _mm256_srli_epi64(keyed, 32));
            __m256i swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
            acc[h] = _mm256_add_epi64(acc[h], _mm256_add_epi64(product, swapped));
        }
        if (in_block != STRIPES_PER_BLOCK - 1) continue;
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

static int use_avx2 = -1; /* -1: not yet asked of the CPU */

static int avx2_on(void) {
    if (use_avx2 < 0) use_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    return use_avx2;
}

static void fold_run(state *st, const uint8_t *p, size_t count) {
    if (avx2_on())
        fold_avx2(st, p, count);
    else
        fold_scalar(st, p, count);
}
#else
static int avx2_on(void) { return 0; }
#define fold_run fold_scalar
#endif

/* XXH3-64 of the concatenation of n pieces of `total` (> 240) bytes. Every stripe before the
 * last (total - 1) / 64 is folded in order (a stripe split over two pieces is gathered into a
 * small buffer), then the input's final 64 bytes, which may overlap stripes already folded. */
static uint64_t xxh3_long(const Py_buffer *parts, Py_ssize_t n, size_t total) {
    state st = {{PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1}, 0};
    const size_t stripes = (total - 1) / STRIPE;
    uint8_t gathered[STRIPE];
    size_t have = 0;
    for (Py_ssize_t i = 0; i < n && st.done < stripes; i++) {
        const uint8_t *p = parts[i].buf;
        size_t left = (size_t)parts[i].len;
        if (have) {
            size_t take = STRIPE - have < left ? STRIPE - have : left;
            memcpy(gathered + have, p, take);
            have += take, p += take, left -= take;
            if (have < STRIPE) continue;
            fold_run(&st, gathered, 1);
            have = 0;
        }
        size_t whole = left / STRIPE < stripes - st.done ? left / STRIPE : stripes - st.done;
        fold_run(&st, p, whole);
        p += whole * STRIPE, left -= whole * STRIPE;
        if (left && st.done < stripes) {
            memcpy(gathered, p, left);
            have = left;
        }
    }
    uint8_t last[STRIPE];
    size_t need = STRIPE;
    for (Py_ssize_t i = n - 1; i >= 0 && need; i--) {
        size_t len = (size_t)parts[i].len, take = len < need ? len : need;
        memcpy(last + need - take, (const uint8_t *)parts[i].buf + len - take, take);
        need -= take;
    }
    accumulate(st.acc, last, SECRET + sizeof SECRET - STRIPE - 7);
    uint64_t h = (uint64_t)total * PRIME64_1;
    for (int i = 0; i < 4; i++)
        h += mul_fold(st.acc[2 * i] ^ le64(SECRET + 11 + 16 * i), st.acc[2 * i + 1] ^ le64(SECRET + 11 + 16 * i + 8));
    return avalanche(h);
}

static PyObject *xxh3_64_long(PyObject *self, PyObject *arg) {
    (void)self;
    PyObject *seq = PySequence_Fast(arg, "xxh3_64_long takes a sequence of buffers");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), got = 0;
    Py_buffer *parts = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Py_buffer));
    PyObject *result = NULL;
    if (parts == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    size_t total = 0;
    for (; got < n; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, got), &parts[got], PyBUF_C_CONTIGUOUS) < 0) goto out;
        total += (size_t)parts[got].len;
    }
    if (total < LONG_INPUT_MIN) {
        result = Py_NewRef(Py_None);
        goto out;
    }
    uint64_t h;
    if (total >= RELEASE_GIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS h = xxh3_long(parts, n, total);
        Py_END_ALLOW_THREADS
    } else {
        h = xxh3_long(parts, n, total);
    }
    result = PyLong_FromUnsignedLongLong(h);
out:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&parts[i]);
    PyMem_Free(parts);
    Py_DECREF(seq);
    return result;
}

/* For the tests: run the portable loop even where AVX2 is there (scalar=True), or not. */
static PyObject *set_scalar(PyObject *self, PyObject *arg) {
    (void)self;
    int scalar = PyObject_IsTrue(arg);
    if (scalar < 0) return NULL;
    int before = !avx2_on();
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    use_avx2 = scalar ? 0 : __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    return PyBool_FromLong(before);
}

static PyMethodDef methods[] = {
    {"xxh3_64_long", xxh3_64_long, METH_O,
     "xxh3_64_long(parts) -> int | None\n\nXXH3-64 of the buffers in `parts` taken as one input, "
     "computed without the GIL from 64 KiB; None when the input is 240 bytes or shorter."},
    {"set_scalar", set_scalar, METH_O,
     "set_scalar(flag) -> bool\n\nFor tests: hash with the portable loop (True) or the CPU's best "
     "(False); returns whether the portable loop was in use before."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_xxh3", NULL, -1, methods};

PyMODINIT_FUNC PyInit__xxh3(void) { return PyModule_Create(&module); }
