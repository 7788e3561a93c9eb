/* llmdd_tcp._tcpfast: the tcp transport's optional C hot path (issue 21).
 *
 * Two things, each with the GIL released while it waits or moves bytes:
 *
 *  - quick(): a client's one-call small transfer on one plain, pooled stream (the channel's quick
 *    path, llmdd_tcp._quick): the request packed and sent (a push's payload with it, F_EAGER), the
 *    answer polled for (spin_ns) then waited for, its header checked, a pull's bytes received
 *    straight into the caller's memory.  Every wait is a ppoll() bounded by the call's deadline;
 *    no socket option is set.  Anything but the expected OK answer goes back to Python with the
 *    header bytes read, and Python reads and reports the rest as its own path does.
 *
 *  - Table + serve(): the owner's side.  A Table mirrors the endpoint's served regions (registered,
 *    remote accessible: id, address, size) under its own mutex, with a pin count per region, the
 *    streams being served and the endpoint's counters; the endpoint bumps its epoch on every change
 *    of its regions or grants.  serve() serves one stream's requests while they keep coming: a READ
 *    or an eager WRITE of at most FEW ops, every op inside a region of the table and of the stream's
 *    grant, the announced total equal to the op lengths, the epoch unchanged since Python looked at
 *    the grant; the regions pinned while their bytes move, released (and the request counted) before
 *    the answer's last byte leaves (a read's last bytes from a copy).  Whatever it does not serve (a bigger
 *    request, a check that fails, a changed epoch) goes back to Python, read as far as it was, and
 *    Python serves or refuses it with its own messages.  Table.remove() (deregistration) takes the
 *    region out of the table and shuts down the streams serving it; Table.drain() waits for its pins.
 *
 * Wire layouts (little endian) as llmdd_tcp._wire: REQ "LDRQ" kind u8 flags u8 pad u16 count u32
 * total u64 (20 bytes), ops (region u32, offset u64, length u64) (20 bytes each), RSP "LDRS" status u8
 * pad u8 pad u16 length u32 (12 bytes) and its message.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define ABI 1
#define REQ_SIZE 20
#define OP_SIZE 20
#define RSP_SIZE 12
#define FEW 8            /* the owner serves requests of at most this many ops here */
#define COPY_ALL 16384   /* a read of at most this many bytes is answered from one copy (header and bytes) */
#define TAIL 4096        /* a larger read's last bytes (at most this many) leave from a copy */
#define QUICK_ROWS 128   /* the most rows of one quick() call (llmdd_tcp._quick: 8 pairs x 16 blocks) */
#define READ_K 1
#define WRITE_K 2
#define F_PAD 1
#define F_EAGER 2
#define ST_OK 0

/* quick() results */
enum { Q_OK = 0, Q_STALE, Q_TIMEOUT, Q_GONE, Q_ERRNO, Q_ANSWER };
/* serve() results */
enum { S_IDLE = 0, S_EOF, S_HEADER, S_REQUEST, S_ERRNO, S_GONE, S_TIMEOUT };

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void put32(unsigned char *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i)); }
static inline void put64(unsigned char *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i)); }
static inline uint32_t get32(const unsigned char *p) { uint32_t v = 0; for (int i = 3; i >= 0; i--) v = (v << 8) | p[i]; return v; }
static inline uint64_t get64(const unsigned char *p) { uint64_t v = 0; for (int i = 7; i >= 0; i--) v = (v << 8) | p[i]; return v; }

/* Wait until fd is ready for ev or the deadline passes: 0, -ETIMEDOUT, or -errno. */
static int wait_fd(int fd, short ev, uint64_t deadline) {
    for (;;) {
        uint64_t now = now_ns();
        if (now >= deadline) return -ETIMEDOUT;
        uint64_t left = deadline - now;
        struct timespec ts = {(time_t)(left / 1000000000ull), (long)(left % 1000000000ull)};
        struct pollfd p = {fd, ev, 0};
        int r = ppoll(&p, 1, &ts, NULL);
        if (r > 0) return 0;   /* ready, or an error / hang-up the next call reports */
        if (r < 0 && errno != EINTR) return -errno;
    }
}

/* Poll fd without sleeping for up to spin_ns (yielding the core between polls): 1 when a byte, the end
 * of the stream or an error waits, 0 when the time ran out. */
static int spin_readable(int fd, uint64_t spin_ns) {
    uint64_t end = now_ns() + spin_ns;
    char c;
    for (;;) {
        ssize_t r = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        if (r >= 0) return 1;
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return 1;
        if (now_ns() >= end) return 0;
        sched_yield();
    }
}

static void advance(struct iovec **iov, int *n, size_t k) {
    while (k && *n) {
        if (k >= (*iov)->iov_len) {
            k -= (*iov)->iov_len;
            (*iov)++;
            (*n)--;
        } else {
            (*iov)->iov_base = (char *)(*iov)->iov_base + k;
            (*iov)->iov_len -= k;
            k = 0;
        }
    }
    while (*n && (*iov)->iov_len == 0) { (*iov)++; (*n)--; }
}

/* Send every byte of iov: 0 or -errno.  With a deadline, non-blocking sends polled until it passes
 * (-ETIMEDOUT); with deadline 0, blocking sends (the stream's SO_SNDTIMEO bounds each: -EAGAIN). */
static int send_all(int fd, struct iovec *iov, int n, uint64_t deadline) {
    int flags = MSG_NOSIGNAL | (deadline ? MSG_DONTWAIT : 0);
    advance(&iov, &n, 0);
    while (n) {
        struct msghdr m = {0};
        m.msg_iov = iov;
        m.msg_iovlen = (size_t)n;
        ssize_t k = sendmsg(fd, &m, flags);
        if (k < 0) {
            if (errno == EINTR) continue;
            if (!deadline || (errno != EAGAIN && errno != EWOULDBLOCK)) return -errno;
            int w = wait_fd(fd, POLLOUT, deadline);
            if (w) return w;
            continue;
        }
        advance(&iov, &n, (size_t)k);
    }
    return 0;
}

/* Receive exactly the bytes of iov: 0, 1 when the stream ended before its first byte, 2 when it ended
 * after some, or -errno.  With a deadline, non-blocking receives polled until it passes (-ETIMEDOUT);
 * with deadline 0, blocking MSG_WAITALL receives (the stream's SO_RCVTIMEO bounds each: -EAGAIN). */
static int recv_all(int fd, struct iovec *iov, int n, uint64_t deadline) {
    int flags = deadline ? MSG_DONTWAIT : MSG_WAITALL;
    size_t got = 0;
    advance(&iov, &n, 0);
    while (n) {
        struct msghdr m = {0};
        m.msg_iov = iov;
        m.msg_iovlen = (size_t)n;
        ssize_t k = recvmsg(fd, &m, flags);
        if (k == 0) return got ? 2 : 1;
        if (k < 0) {
            if (errno == EINTR) continue;
            if (!deadline || (errno != EAGAIN && errno != EWOULDBLOCK)) return -errno;
            int w = wait_fd(fd, POLLIN, deadline);
            if (w) return w;
            continue;
        }
        got += (size_t)k;
        advance(&iov, &n, (size_t)k);
    }
    return 0;
}

static int recv_exact(int fd, unsigned char *buf, size_t len) {   /* (blocking) */
    struct iovec v = {buf, len};
    return recv_all(fd, &v, 1, 0);
}

/* ---------------------------------------------------------------------------------------- client */

/* quick(fd, kind, flags, pad, rows, total, head_len, timeout_ns, spin_ns)
 *   rows: a list of ints, four per row: remote region, remote offset, local address, length.
 *   Sends REQ + the rows' ops (+ pad zeros) (+ a push's payload, eager), waits for the answer header
 *   (head_len bytes: 16 for a padded answer), and for a pull with an OK answer receives the payload
 *   into the local addresses.  Returns (result, value, head bytes or None, spun):
 *   Q_OK, Q_STALE (the stream ended before the answer's first byte: nothing was received),
 *   Q_TIMEOUT, Q_GONE (ended, or failed, after the answer came; value: the errno, 0 for an end of stream),
 *   Q_ERRNO (failed before any answer; value = errno), Q_ANSWER (an answer that is not
 *   the expected OK: its head_len bytes; Python reads its message and reports it). */
static PyObject *quick(PyObject *self, PyObject *args) {
    int fd, kind, flags, pad;
    PyObject *rows;
    unsigned long long total, timeout_ns, spin_ns;
    Py_ssize_t head_len;
    if (!PyArg_ParseTuple(args, "iiiiO!KnKK", &fd, &kind, &flags, &pad, &PyList_Type, &rows, &total, &head_len,
                          &timeout_ns, &spin_ns))
        return NULL;
    if (timeout_ns > (1ull << 62)) timeout_ns = 1ull << 62;   /* (now + timeout never wraps) */
    if (spin_ns > timeout_ns) spin_ns = timeout_ns;
    Py_ssize_t nv = PyList_GET_SIZE(rows);
    if (nv % 4 || nv / 4 < 1 || nv / 4 > QUICK_ROWS || pad < 0 || pad > 15 || head_len < RSP_SIZE || head_len > 64 ||
        (kind != READ_K && kind != WRITE_K)) {
        PyErr_SetString(PyExc_ValueError, "quick: bad arguments");
        return NULL;
    }
    int n = (int)(nv / 4);
    unsigned char req[REQ_SIZE + OP_SIZE * QUICK_ROWS + 16];
    struct iovec local[QUICK_ROWS + 1];
    memset(req, 0, sizeof req);
    memcpy(req, "LDRQ", 4);
    req[4] = (unsigned char)kind;
    req[5] = (unsigned char)flags;
    put32(req + 8, (uint32_t)n);
    put64(req + 12, total);
    uint64_t sum = 0;
    for (int i = 0; i < n; i++) {
        unsigned long long v[4];
        for (int j = 0; j < 4; j++) {
            v[j] = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(rows, 4 * i + j));
            if (v[j] == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
        }
        if (v[0] > 0xffffffffull) {
            PyErr_SetString(PyExc_ValueError, "quick: region id out of range");
            return NULL;
        }
        unsigned char *op = req + REQ_SIZE + OP_SIZE * i;
        put32(op, (uint32_t)v[0]);
        put64(op + 4, v[1]);
        put64(op + 12, v[3]);
        local[i + 1].iov_base = (void *)(uintptr_t)v[2];
        local[i + 1].iov_len = (size_t)v[3];
        sum += v[3];
    }
    if (sum != total) {
        PyErr_SetString(PyExc_ValueError, "quick: total is not the sum of the rows");
        return NULL;
    }
    size_t req_len = REQ_SIZE + (size_t)OP_SIZE * n + (size_t)pad;
    unsigned char head[64];
    int res = Q_OK, value = 0, spun = 0, r;
    Py_BEGIN_ALLOW_THREADS
    uint64_t deadline = now_ns() + timeout_ns;
    local[0].iov_base = req;
    local[0].iov_len = req_len;
    /* a pull sends the request only; an eager push the request and its payload in one sendmsg */
    r = send_all(fd, local, kind == WRITE_K ? n + 1 : 1, deadline);
    if (r == 0) {
        if (spin_ns) spun = spin_readable(fd, spin_ns);
        struct iovec h = {head, (size_t)head_len};
        r = recv_all(fd, &h, 1, deadline);
        if (r == 0) {
            uint32_t mlen = get32(head + 8);
            if (memcmp(head, "LDRS", 4) != 0 || head[4] != ST_OK || mlen != (uint32_t)(head_len - RSP_SIZE)) {
                res = Q_ANSWER;
            } else if (kind == READ_K) {
                r = recv_all(fd, local + 1, n, deadline);
                if (r == 1) r = 2;   /* the answer came: an end now is in the middle */
                if (r < 0 && r != -ETIMEDOUT) {   /* so is any error: never a stale stream */
                    value = -r;
                    r = 2;
                }
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (res == Q_OK && r) {
        if (r == 1) res = Q_STALE;
        else if (r == 2) res = Q_GONE;
        else if (r == -ETIMEDOUT) res = Q_TIMEOUT;
        else { res = Q_ERRNO; value = -r; }
    }
    if (res == Q_ANSWER)
        return Py_BuildValue("iiy#i", res, value, (const char *)head, head_len, spun);
    return Py_BuildValue("iiOi", res, value, Py_None, spun);
}

/* ---------------------------------------------------------------------------------------- owner */

typedef struct reg {
    uint32_t id;
    uint64_t addr, size;
    long pins;
    int gone;
    struct reg *next_gone;
} reg_t;

typedef struct active {   /* a request being served: its stream and the regions it pinned */
    int fd, n;
    reg_t *regs[FEW];
    uint32_t ids[FEW];   /* their ids (a region may be freed once unpinned) */
    struct active *prev, *next;
} active_t;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t epoch;
    int closed;
    reg_t **regs;          /* live regions, sorted by id */
    Py_ssize_t n, cap;
    reg_t *gone;           /* removed regions still pinned, until drained */
    active_t *active;
    unsigned long long bytes, ops, requests, spun;
    int ready;             /* initialised (a second __init__ is refused) */
} Table;

#define NEED_READY(t)                                                   \
    do {                                                                \
        if (!(t)->ready) {                                              \
            PyErr_SetString(PyExc_RuntimeError, "Table not initialised"); \
            return NULL;                                                \
        }                                                               \
    } while (0)

static Py_ssize_t find(Table *t, uint32_t id, int *found) {
    Py_ssize_t lo = 0, hi = t->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (t->regs[mid]->id < id) lo = mid + 1;
        else hi = mid;
    }
    *found = lo < t->n && t->regs[lo]->id == id;
    return lo;
}

static int Table_init(Table *t, PyObject *args, PyObject *kw) {
    if (!PyArg_ParseTuple(args, "")) return -1;
    if (t->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Table is initialised once");
        return -1;
    }
    t->ready = 1;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    t->regs = NULL;
    t->n = t->cap = 0;
    t->gone = NULL;
    t->active = NULL;
    t->epoch = 1;
    t->closed = 0;
    t->bytes = t->ops = t->requests = t->spun = 0;
    return 0;
}

static void Table_dealloc(Table *t) {
    if (!t->ready) {
        Py_TYPE(t)->tp_free((PyObject *)t);
        return;
    }
    for (Py_ssize_t i = 0; i < t->n; i++) free(t->regs[i]);
    free(t->regs);
    while (t->gone) {
        reg_t *g = t->gone;
        t->gone = g->next_gone;
        free(g);
    }
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* add(id, addr, size): a served region (ValueError when the id is in the table) */
static PyObject *Table_add(Table *t, PyObject *args) {
    NEED_READY(t);
    unsigned int id;
    unsigned long long addr, size;
    if (!PyArg_ParseTuple(args, "IKK", &id, &addr, &size)) return NULL;
    reg_t *r = calloc(1, sizeof *r);
    if (!r) return PyErr_NoMemory();
    r->id = id;
    r->addr = addr;
    r->size = size;
    pthread_mutex_lock(&t->mu);
    int found;
    Py_ssize_t at = find(t, id, &found);
    if (found || t->closed) {
        pthread_mutex_unlock(&t->mu);
        free(r);
        PyErr_SetString(PyExc_ValueError, found ? "region id already in the table" : "table closed");
        return NULL;
    }
    if (t->n == t->cap) {
        Py_ssize_t cap = t->cap ? 2 * t->cap : 16;
        reg_t **g = realloc(t->regs, (size_t)cap * sizeof *g);
        if (!g) {
            pthread_mutex_unlock(&t->mu);
            free(r);
            return PyErr_NoMemory();
        }
        t->regs = g;
        t->cap = cap;
    }
    memmove(t->regs + at + 1, t->regs + at, (size_t)(t->n - at) * sizeof *t->regs);
    t->regs[at] = r;
    t->n++;
    t->epoch++;
    pthread_mutex_unlock(&t->mu);
    Py_RETURN_NONE;
}

static void shutdown_serving(Table *t, uint32_t id, int all) {   /* under the mutex */
    for (active_t *a = t->active; a; a = a->next)
        for (int i = 0; i < a->n; i++)
            if (all || a->ids[i] == id) {
                shutdown(a->fd, SHUT_RDWR);
                break;
            }
}

/* a served request lets go of its regions: unpinned, off the list of streams being served, and a
 * drain() waiting on a removed region woken */
static void release_locked(Table *t, active_t *me, int moved, uint64_t total, int count) {   /* under the mutex */
    if (moved) {   /* its bytes moved: counted as served (before its answer's last byte leaves) */
        t->bytes += total;
        t->ops += (unsigned long long)count;
        t->requests++;
    }
    for (int j = 0; j < me->n; j++) me->regs[j]->pins--;
    if (me->prev) me->prev->next = me->next;
    else t->active = me->next;
    if (me->next) me->next->prev = me->prev;
    if (t->gone) pthread_cond_broadcast(&t->cv);
}

/* a request whose bytes moved lets go of its regions (counted), then its answer's last bytes leave */
static int release_and_send(Table *t, active_t *me, uint64_t total, int count, int fd, const void *buf,
                            size_t len) {
    pthread_mutex_lock(&t->mu);
    release_locked(t, me, 1, total, count);
    pthread_mutex_unlock(&t->mu);
    struct iovec a = {(void *)buf, len};
    return send_all(fd, &a, 1, 0);
}

/* remove(id): out of the table (no request pins it from now on); the streams serving it are shut down.
 * True when it was there. */
static PyObject *Table_remove(Table *t, PyObject *args) {
    NEED_READY(t);
    unsigned int id;
    if (!PyArg_ParseTuple(args, "I", &id)) return NULL;
    pthread_mutex_lock(&t->mu);
    int found;
    Py_ssize_t at = find(t, id, &found);
    if (found) {
        reg_t *r = t->regs[at];
        memmove(t->regs + at, t->regs + at + 1, (size_t)(t->n - at - 1) * sizeof *t->regs);
        t->n--;
        r->gone = 1;
        if (r->pins) {
            r->next_gone = t->gone;
            t->gone = r;
            shutdown_serving(t, id, 0);
        } else {
            free(r);
        }
    }
    t->epoch++;
    pthread_mutex_unlock(&t->mu);
    return PyBool_FromLong(found);
}

static int pinned_gone(Table *t, uint32_t id, int all) {
    for (reg_t *g = t->gone; g; g = g->next_gone)
        if ((all || g->id == id) && g->pins) return 1;
    return 0;
}

static void free_drained(Table *t) {   /* under the mutex */
    reg_t **p = &t->gone;
    while (*p) {
        if ((*p)->pins == 0) {
            reg_t *g = *p;
            *p = g->next_gone;
            free(g);
        } else {
            p = &(*p)->next_gone;
        }
    }
}

/* drain(id): wait (GIL released) until no request pins a removed region of this id */
static PyObject *Table_drain(Table *t, PyObject *args) {
    NEED_READY(t);
    unsigned int id;
    if (!PyArg_ParseTuple(args, "I", &id)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&t->mu);
    while (pinned_gone(t, id, 0)) pthread_cond_wait(&t->cv, &t->mu);
    free_drained(t);
    pthread_mutex_unlock(&t->mu);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* close(): every region out, every stream being served shut down, then drained */
static PyObject *Table_close(Table *t, PyObject *unused) {
    NEED_READY(t);
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&t->mu);
    t->closed = 1;
    t->epoch++;
    for (Py_ssize_t i = 0; i < t->n; i++) {
        reg_t *r = t->regs[i];
        r->gone = 1;
        r->next_gone = t->gone;
        t->gone = r;
    }
    t->n = 0;
    shutdown_serving(t, 0, 1);
    while (pinned_gone(t, 0, 1)) pthread_cond_wait(&t->cv, &t->mu);
    free_drained(t);
    pthread_mutex_unlock(&t->mu);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Table_bump(Table *t, PyObject *unused) {
    NEED_READY(t);
    pthread_mutex_lock(&t->mu);
    uint64_t e = ++t->epoch;
    pthread_mutex_unlock(&t->mu);
    return PyLong_FromUnsignedLongLong(e);
}

static PyObject *Table_epoch(Table *t, PyObject *unused) {
    NEED_READY(t);
    pthread_mutex_lock(&t->mu);
    uint64_t e = t->epoch;
    pthread_mutex_unlock(&t->mu);
    return PyLong_FromUnsignedLongLong(e);
}

/* counters(): (bytes served, ops served, requests, requests spun) by serve() */
static PyObject *Table_counters(Table *t, PyObject *unused) {
    NEED_READY(t);
    pthread_mutex_lock(&t->mu);
    unsigned long long b = t->bytes, o = t->ops, q = t->requests, s = t->spun;
    Py_ssize_t n = t->n;
    pthread_mutex_unlock(&t->mu);
    return Py_BuildValue("KKKKn", b, o, q, s, n);
}

static int in_grant(const uint32_t *grant, Py_ssize_t ng, uint32_t id) {
    Py_ssize_t lo = 0, hi = ng;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (grant[mid] < id) lo = mid + 1;
        else hi = mid;
    }
    return lo < ng && grant[lo] == id;
}

static const unsigned char OK_HEAD[16] = {'L', 'D', 'R', 'S', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
static const unsigned char OK_PADDED[16] = {'L', 'D', 'R', 'S', 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0};

/* Table.serve(fd, grant, epoch, wait_first, spin_ns, skip, penalty, skip_max, linger_ns)
 *   grant: a sorted list of the region ids the stream's grant allows, or None (every region);
 *   epoch: the table's epoch when Python looked at the grant; wait_first: wait for the next request
 *   before reading one (0: one is known to be waiting); spin_ns / skip / penalty / skip_max: the
 *   stream's spinner (llmdd_tcp._sock.Spinner) and its state; linger_ns: how long an idle stream is
 *   kept.  The stream is blocking, with the endpoint's send timeout as SO_RCVTIMEO / SO_SNDTIMEO.
 *   Returns (result, value, skip, penalty, hits, misses):
 *     S_IDLE (no request within the linger), S_EOF (the stream ended between requests),
 *     S_HEADER (value: a request header this code does not take: Python reads on from it),
 *     S_REQUEST (value: (kind, flags, (region, offset, length, ...), total), read in full and not
 *       served here: Python serves or refuses it), S_ERRNO (value: (errno, regions a WRITE was
 *       landing in, or None)), S_GONE (the same, the stream ended in the middle), S_TIMEOUT (the same). */
static PyObject *Table_serve(Table *t, PyObject *args) {
    NEED_READY(t);
    int fd, wait_first, skip, penalty, skip_max;
    PyObject *grant_obj;
    unsigned long long epoch, spin_ns, linger_ns;
    if (!PyArg_ParseTuple(args, "iOKpKiiiK", &fd, &grant_obj, &epoch, &wait_first, &spin_ns, &skip, &penalty,
                          &skip_max, &linger_ns))
        return NULL;
    if (linger_ns > (1ull << 62)) linger_ns = 1ull << 62;
    if (spin_ns > linger_ns) spin_ns = linger_ns;
    if (skip < 0 || penalty < 0 || skip_max < 0) {
        PyErr_SetString(PyExc_ValueError, "serve: negative spinner state");
        return NULL;
    }
    uint32_t *grant = NULL;
    Py_ssize_t ng = -1;   /* -1: every region */
    if (grant_obj != Py_None) {
        if (!PyList_Check(grant_obj)) {
            PyErr_SetString(PyExc_TypeError, "serve: grant is a sorted list of region ids or None");
            return NULL;
        }
        ng = PyList_GET_SIZE(grant_obj);
        grant = PyMem_Malloc((size_t)(ng ? ng : 1) * sizeof *grant);
        if (!grant) return PyErr_NoMemory();
        for (Py_ssize_t i = 0; i < ng; i++) {
            unsigned long v = PyLong_AsUnsignedLong(PyList_GET_ITEM(grant_obj, i));
            if (v == (unsigned long)-1 && PyErr_Occurred()) {
                PyMem_Free(grant);
                return NULL;
            }
            grant[i] = (uint32_t)v;
            if (v > 0xfffffffful || (i && grant[i] <= grant[i - 1])) {
                PyMem_Free(grant);
                PyErr_SetString(PyExc_ValueError, "serve: grant ids must be sorted u32s");
                return NULL;
            }
        }
    }
    /* a descriptor of its own for the stream: the endpoint may close its socket (and the number be reused
     * by another) while this runs; a shutdown of either still ends both */
    fd = dup(fd);
    if (fd < 0) {
        if (grant) PyMem_Free(grant);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    unsigned char *copy = malloc(COPY_ALL + 16);   /* a read's copied bytes (and header) */
    if (!copy) {
        close(fd);
        if (grant) PyMem_Free(grant);
        return PyErr_NoMemory();
    }
    unsigned char req[REQ_SIZE + OP_SIZE * FEW + 16];
    int res = S_IDLE, err = 0, count = 0, kind = 0, rflags = 0, writing = 0, hits = 0, misses = 0;
    uint64_t total = 0;
    active_t me;
    me.fd = fd;
    me.n = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        if (wait_first) {
            /* the next request: polled for first (the spinner's budget, unless its misses say sleep),
             * then waited for until the linger ends */
            int ready = 0;
            if (spin_ns && linger_ns) {
                if (skip) {
                    skip--;
                } else if (spin_readable(fd, spin_ns < linger_ns ? spin_ns : linger_ns)) {
                    ready = 1;
                    penalty = 0;
                    hits++;
                    pthread_mutex_lock(&t->mu);
                    t->spun++;
                    pthread_mutex_unlock(&t->mu);
                } else {
                    penalty = penalty ? 2 * penalty : 1;
                    if (penalty > skip_max) penalty = skip_max;
                    skip = penalty;
                    misses++;
                }
            }
            if (!ready) {
                int w = linger_ns ? wait_fd(fd, POLLIN, now_ns() + linger_ns) : -ETIMEDOUT;
                if (w == -ETIMEDOUT) { res = S_IDLE; break; }
                /* another error: the read below reports it */
            }
        }
        wait_first = 1;
        int r = recv_exact(fd, req, REQ_SIZE);
        if (r) {
            if (r == 1) res = S_EOF;
            else if (r == 2) res = S_GONE;
            else if (r == -EAGAIN || r == -EWOULDBLOCK) res = S_TIMEOUT;
            else { res = S_ERRNO; err = -r; }
            break;
        }
        kind = req[4];
        rflags = req[5];
        uint32_t count32 = get32(req + 8);   /* the peer's number: bounded before it sizes anything */
        total = get64(req + 12);
        int eager = kind == WRITE_K && (rflags & F_EAGER);
        if (memcmp(req, "LDRQ", 4) != 0 || count32 > FEW || (kind != READ_K && !eager) ||
            (rflags & ~(F_PAD | F_EAGER))) {
            count = 0;
            res = S_HEADER;   /* Python reads the rest (or refuses a bad header) */
            break;
        }
        count = (int)count32;
        size_t pad = kind == WRITE_K && (rflags & F_PAD) ? (size_t)((16 - (REQ_SIZE + OP_SIZE * count) % 16) % 16) : 0;
        r = recv_exact(fd, req + REQ_SIZE, (size_t)OP_SIZE * count + pad);
        if (r) {
            if (r == 1 || r == 2) res = S_GONE;
            else if (r == -EAGAIN || r == -EWOULDBLOCK) res = S_TIMEOUT;
            else { res = S_ERRNO; err = -r; }
            break;
        }
        /* checks and pins, all under the mutex; any doubt goes to Python */
        struct iovec iov[FEW + 1];
        uint64_t sum = 0;
        int ok = count > 0;
        pthread_mutex_lock(&t->mu);
        if (t->epoch != epoch || t->closed) ok = 0;
        me.n = 0;
        for (int i = 0; ok && i < count; i++) {
            const unsigned char *op = req + REQ_SIZE + OP_SIZE * i;
            uint32_t id = get32(op);
            uint64_t off = get64(op + 4), len = get64(op + 12);
            int found;
            Py_ssize_t at = find(t, id, &found);
            if (!found || (ng >= 0 && !in_grant(grant, ng, id))) { ok = 0; break; }
            reg_t *reg = t->regs[at];
            if (off > reg->size || len > reg->size - off || len > (uint64_t)1 << 62) { ok = 0; break; }
            sum += len;
            iov[i + 1].iov_base = (void *)(uintptr_t)(reg->addr + off);
            iov[i + 1].iov_len = (size_t)len;
            int seen = 0;
            for (int j = 0; j < me.n; j++) seen |= me.regs[j] == reg;
            if (!seen) {
                me.ids[me.n] = id;
                me.regs[me.n++] = reg;
            }
        }
        if (ok && sum != total) ok = 0;   /* Python says Corrupt */
        if (!ok) {
            pthread_mutex_unlock(&t->mu);
            res = S_REQUEST;
            break;
        }
        for (int j = 0; j < me.n; j++) me.regs[j]->pins++;
        me.prev = NULL;
        me.next = t->active;
        if (t->active) t->active->prev = &me;
        t->active = &me;
        pthread_mutex_unlock(&t->mu);
        /* the answer's last bytes leave after the request let go of its regions (a read's from a copy
         * taken while pinned): a client holding its answer never finds its stream among those a
         * deregistration shuts down */
        int released = 0;
        const void *head = (rflags & F_PAD) ? OK_PADDED : OK_HEAD;
        size_t head_len = (rflags & F_PAD) ? 16 : RSP_SIZE;
        if (kind == READ_K) {
            iov[0].iov_base = (void *)head;
            iov[0].iov_len = head_len;
            if (total <= COPY_ALL) {   /* the header and a copy of the bytes in one send */
                size_t at = 0;
                for (int i = 0; i <= count; i++) {
                    memcpy(copy + at, iov[i].iov_base, iov[i].iov_len);
                    at += iov[i].iov_len;
                }
                r = release_and_send(t, &me, total, count, fd, copy, at);
                released = 1;
            } else {   /* all but the last (at most TAIL) bytes of the last non-empty op, then those */
                int j = count;
                while (j > 0 && iov[j].iov_len == 0) j--;
                size_t k = iov[j].iov_len < TAIL ? iov[j].iov_len : TAIL;
                const unsigned char *src = (const unsigned char *)iov[j].iov_base + iov[j].iov_len - k;
                iov[j].iov_len -= k;
                r = send_all(fd, iov, j + 1, 0);
                if (r == 0) {
                    memcpy(copy, src, k);
                    r = release_and_send(t, &me, total, count, fd, copy, k);
                    released = 1;
                }
            }
        } else {
            writing = 1;
            r = recv_all(fd, iov + 1, count, 0);
            if (r == 0) {
                writing = 0;
                r = release_and_send(t, &me, total, count, fd, head, head_len);
                released = 1;
            }
        }
        if (!released) {
            pthread_mutex_lock(&t->mu);
            release_locked(t, &me, 0, 0, 0);
            pthread_mutex_unlock(&t->mu);
        }
        if (r) {
            if (r == 1 || r == 2) res = S_GONE;
            else if (r == -EAGAIN || r == -EWOULDBLOCK) res = S_TIMEOUT;
            else { res = S_ERRNO; err = -r; }
            break;
        }
        writing = 0;
    }
    close(fd);
    free(copy);
    Py_END_ALLOW_THREADS
    if (grant) PyMem_Free(grant);
    PyObject *value;
    if (res == S_HEADER) {
        value = PyBytes_FromStringAndSize((const char *)req, REQ_SIZE);
    } else if (res == S_REQUEST) {
        PyObject *flat = PyTuple_New(3 * count);
        if (!flat) return NULL;
        for (int i = 0; i < count; i++) {
            const unsigned char *op = req + REQ_SIZE + OP_SIZE * i;
            PyObject *v[3] = {PyLong_FromUnsignedLong(get32(op)), PyLong_FromUnsignedLongLong(get64(op + 4)),
                              PyLong_FromUnsignedLongLong(get64(op + 12))};
            for (int j = 0; j < 3; j++) {
                if (!v[j]) {
                    for (int k = j; k < 3; k++) Py_XDECREF(v[k]);
                    Py_DECREF(flat);
                    return NULL;
                }
                PyTuple_SET_ITEM(flat, 3 * i + j, v[j]);
            }
        }
        value = Py_BuildValue("iiNK", kind, rflags, flat, (unsigned long long)total);
    } else if (res == S_ERRNO || res == S_GONE || res == S_TIMEOUT) {
        PyObject *regs = Py_None;
        Py_INCREF(regs);
        if (writing) {
            Py_DECREF(regs);
            regs = PyTuple_New(me.n);
            if (!regs) return NULL;
            for (int j = 0; j < me.n; j++) {
                PyObject *id = PyLong_FromUnsignedLong(me.ids[j]);
                if (!id) {
                    Py_DECREF(regs);
                    return NULL;
                }
                PyTuple_SET_ITEM(regs, j, id);
            }
        }
        value = Py_BuildValue("iN", err, regs);
    } else {
        value = Py_None;
        Py_INCREF(value);
    }
    if (!value) return NULL;
    return Py_BuildValue("iNiiii", res, value, skip, penalty, hits, misses);
}

static PyMethodDef Table_methods[] = {
    {"add", (PyCFunction)Table_add, METH_VARARGS, "add(id, addr, size): a served region"},
    {"remove", (PyCFunction)Table_remove, METH_VARARGS, "remove(id): out of the table, its streams shut down"},
    {"drain", (PyCFunction)Table_drain, METH_VARARGS, "drain(id): wait until no request pins the removed region"},
    {"close", (PyCFunction)Table_close, METH_NOARGS, "close(): every region out, streams shut down, drained"},
    {"bump", (PyCFunction)Table_bump, METH_NOARGS, "bump(): a new epoch (grants changed)"},
    {"epoch", (PyCFunction)Table_epoch, METH_NOARGS, "epoch(): the current epoch"},
    {"counters", (PyCFunction)Table_counters, METH_NOARGS, "counters(): (bytes, ops, requests, spun, regions)"},
    {"serve", (PyCFunction)Table_serve, METH_VARARGS, "serve(...): serve one stream's small requests"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "llmdd_tcp._tcpfast.Table",
    .tp_basicsize = sizeof(Table),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The owner's served regions, pins and counters for serve()",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Table_init,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = Table_methods,
};

static PyMethodDef methods[] = {
    {"quick", quick, METH_VARARGS, "quick(fd, kind, flags, pad, rows, total, head_len, timeout_ns, spin_ns)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_tcpfast", "llmdd tcp C hot path", -1, methods};

PyMODINIT_FUNC PyInit__tcpfast(void) {
    if (PyType_Ready(&TableType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    Py_INCREF(&TableType);
    if (PyModule_AddObject(m, "Table", (PyObject *)&TableType) < 0) {
        Py_DECREF(&TableType);
        Py_DECREF(m);
        return NULL;
    }
    const char *names[] = {"ABI", "REQ_SIZE", "OP_SIZE", "RSP_SIZE", "FEW", "QUICK_ROWS"};
    const int values[] = {ABI, REQ_SIZE, OP_SIZE, RSP_SIZE, FEW, QUICK_ROWS};
    const char *qn[] = {"Q_OK", "Q_STALE", "Q_TIMEOUT", "Q_GONE", "Q_ERRNO", "Q_ANSWER"};
    const char *sn[] = {"S_IDLE", "S_EOF", "S_HEADER", "S_REQUEST", "S_ERRNO", "S_GONE", "S_TIMEOUT"};
    int bad = 0;
    for (int i = 0; i < 6; i++) bad |= PyModule_AddIntConstant(m, names[i], values[i]) < 0;
    for (int i = 0; i < 6; i++) bad |= PyModule_AddIntConstant(m, qn[i], i) < 0;
    for (int i = 0; i < 7; i++) bad |= PyModule_AddIntConstant(m, sn[i], i) < 0;
    if (bad) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
