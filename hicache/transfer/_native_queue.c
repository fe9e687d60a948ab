/* hicache.transfer._native.CopyQueue: asynchronous transfers with no Python thread.
 *
 * submit() checks a transfer (as copy_pieces does) with the GIL held and queues it; one
 * thread of the queue's own, started by the first submit, runs the transfers in order (each
 * as run_job: in that thread and on the copy crew's). The
 * thread never takes the GIL, so a busy Python thread cannot delay the start of a copy, and
 * a transfer's end is known from its progress words alone: nothing has to wake Python.
 *
 * Each transfer holds a reference to a `keep` object (the pools and the progress words)
 * until it is done; references of finished transfers are dropped by the next call that holds
 * the GIL (submit, pending, close, or the queue's deallocation). close() lets every queued
 * transfer finish, then stops the thread.
 */
#include "_native.h"

#include <errno.h>
#include <pthread.h>
#include <unistd.h>

typedef struct Queued {
    struct Queued *next;
    Job *job;
    PyObject *keep;
} Queued;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    pthread_cond_t wake;  /* a job queued, or closing */
    Queued *head, *tail;     /* queued, in order */
    Queued *finished;     /* done; their jobs and keep are released with the GIL */
    Py_ssize_t pending;   /* queued or running */
    int closing, running; /* running: the thread is started and not joined */
    int joining, joined;  /* a close() is joining the thread / has joined it (others wait) */
    pid_t owner;          /* the process that started the thread (a forked child has none) */
    pthread_t thread;
} CopyQueue;

static void *serve(void *arg) {
    CopyQueue *q = arg;
    pthread_mutex_lock(&q->lock);
    for (;;) {
        while (q->head == NULL && !q->closing)
            pthread_cond_wait(&q->wake, &q->lock);
        Queued *item = q->head;
        if (item == NULL)
            break; /* closing, and nothing left */
        q->head = item->next;
        if (q->head == NULL)
            q->tail = NULL;
        pthread_mutex_unlock(&q->lock);
        run_job(item->job);
        pthread_mutex_lock(&q->lock);
        item->next = q->finished;
        q->finished = item;
        q->pending--;
    }
    pthread_mutex_unlock(&q->lock);
    return NULL;
}

/* In a forked child, whose copy of the queue has no thread: its lock and condition are in
 * whatever state the parent's thread left them at the fork (maybe held, maybe waited on),
 * so the child must not touch them, nor the jobs, which will never run here. */
static int forked(const CopyQueue *q) { return q->running && q->owner != getpid(); }

/* Drop the finished jobs and their references. Needs the GIL. */
static void reap(CopyQueue *q) {
    if (forked(q))
        return;
    pthread_mutex_lock(&q->lock);
    Queued *item = q->finished;
    q->finished = NULL;
    pthread_mutex_unlock(&q->lock);
    while (item != NULL) {
        Queued *next = item->next;
        free_job(item->job);
        Py_XDECREF(item->keep);
        PyMem_Free(item);
        item = next;
    }
}

/* Let queued jobs finish and join the thread. Needs the GIL (released while it waits). One
 * caller joins; a close() that comes meanwhile waits for that join (joining a thread twice is
 * undefined, and hung). */
static void stop(CopyQueue *q) {
    if (q->running && !forked(q)) {
        int join = !q->joining; /* joining is read and set with the GIL held */
        q->joining = 1;
        pthread_mutex_lock(&q->lock);
        q->closing = 1;
        pthread_cond_broadcast(&q->wake);
        pthread_mutex_unlock(&q->lock);
        Py_BEGIN_ALLOW_THREADS
        if (join) {
            pthread_join(q->thread, NULL);
            pthread_mutex_lock(&q->lock);
            q->joined = 1;
            pthread_cond_broadcast(&q->wake);
            pthread_mutex_unlock(&q->lock);
        } else {
            pthread_mutex_lock(&q->lock);
            while (!q->joined)
                pthread_cond_wait(&q->wake, &q->lock);
            pthread_mutex_unlock(&q->lock);
        }
        Py_END_ALLOW_THREADS
        q->running = 0;
    }
    q->closing = 1;
    reap(q);
}

static PyObject *queue_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, ":CopyQueue", names))
        return NULL;
    CopyQueue *q = (CopyQueue *)type->tp_alloc(type, 0);
    if (q == NULL)
        return NULL;
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->wake, NULL);
    return (PyObject *)q;
}

static void queue_dealloc(CopyQueue *q) {
    stop(q);
    if (!forked(q)) { /* a child's copy would wait forever for the parent's thread to leave */
        pthread_mutex_destroy(&q->lock);
        pthread_cond_destroy(&q->wake);
    }
    Py_TYPE(q)->tp_free((PyObject *)q);
}

/* submit(dst_addr, dst_size, src_addr, src_size, descs, layer_ends, group, streaming, threads,
 *        piece_bytes, progress_addr, keep) */
static PyObject *queue_submit(CopyQueue *q, PyObject *args) {
    uintptr_t dst_addr, src_addr, progress;
    long long dst_size, src_size, piece_bytes;
    PyObject *descs_obj, *ends_obj, *keep;
    Py_ssize_t group, threads;
    int streaming;
    if (!PyArg_ParseTuple(args, "O&LO&LOOnpnLO&O", to_address, &dst_addr, &dst_size, to_address, &src_addr, &src_size,
                          &descs_obj, &ends_obj, &group, &streaming, &threads, &piece_bytes, to_address, &progress,
                          &keep))
        return NULL;
    reap(q);
    if (q->closing)
        return PyErr_Format(PyExc_RuntimeError, "the copy queue is closed");
    if (forked(q)) /* the thread stayed in the parent */
        return PyErr_Format(PyExc_RuntimeError, "the copy queue belongs to process %ld", (long)q->owner);
    Job *job = load_job(dst_addr, dst_size, src_addr, src_size, descs_obj, ends_obj, group, streaming, threads,
                        piece_bytes, progress);
    if (job == NULL)
        return NULL;
    Queued *item = PyMem_Calloc(1, sizeof(Queued));
    if (item == NULL) {
        free_job(job);
        return PyErr_NoMemory();
    }
    item->job = job;
    Py_INCREF(keep);
    item->keep = keep;
    if (!q->running) {
        int err = pthread_create(&q->thread, NULL, serve, q);
        if (err != 0) {
            free_job(job);
            Py_DECREF(keep);
            PyMem_Free(item);
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        q->running = 1;
        q->owner = getpid();
    }
    pthread_mutex_lock(&q->lock);
    if (q->tail != NULL)
        q->tail->next = item;
    else
        q->head = item;
    q->tail = item;
    q->pending++;
    pthread_cond_signal(&q->wake);
    pthread_mutex_unlock(&q->lock);
    Py_RETURN_NONE;
}

static PyObject *queue_pending(CopyQueue *q, PyObject *noargs) {
    (void)noargs;
    if (forked(q))
        return PyErr_Format(PyExc_RuntimeError, "the copy queue belongs to process %ld", (long)q->owner);
    reap(q);
    pthread_mutex_lock(&q->lock);
    Py_ssize_t pending = q->pending;
    pthread_mutex_unlock(&q->lock);
    return PyLong_FromSsize_t(pending);
}

static PyObject *queue_close(CopyQueue *q, PyObject *noargs) {
    (void)noargs;
    stop(q);
    Py_RETURN_NONE;
}

static PyMethodDef queue_methods[] = {
    {"submit", (PyCFunction)queue_submit, METH_VARARGS,
     "submit(dst_addr, dst_size, src_addr, src_size, descs, layer_ends, group, streaming, threads, piece_bytes,\n"
     "       progress_addr, keep) -> None\n\n"
     "Check a transfer as copy_pieces does and queue it (ValueError: nothing queued); it runs\n"
     "after the transfers queued before it, and holds a reference to `keep` until done.\n"
     "RuntimeError once closed."},
    {"pending", (PyCFunction)queue_pending, METH_NOARGS, "pending() -> int\n\nTransfers queued or running."},
    {"close", (PyCFunction)queue_close, METH_NOARGS,
     "close() -> None\n\nWait for every queued transfer, then stop the queue's thread. Idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CopyQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hicache.transfer._native.CopyQueue",
    .tp_basicsize = sizeof(CopyQueue),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "CopyQueue()\n\nTransfers run in order on a thread of the queue's own, without the GIL.",
    .tp_new = queue_new,
    .tp_dealloc = (destructor)queue_dealloc,
    .tp_methods = queue_methods,
};

int add_copy_queue(PyObject *module) {
    if (PyType_Ready(&CopyQueueType) < 0)
        return -1;
    Py_INCREF(&CopyQueueType);
    if (PyModule_AddObject(module, "CopyQueue", (PyObject *)&CopyQueueType) < 0) {
        Py_DECREF(&CopyQueueType);
        return -1;
    }
    return 0;
}
