/* llmdd_shm._shmfast: the shm transport's per-batch hot path in one C call.
 *
 * batch() does, for a batch that fits one chunk, what the Python path does with a few hundred
 * interpreter steps: look every op's regions up in the (immutable, sorted) region snapshots,
 * bounds-check both sides, build the iovec arrays (coalescing ops that continue each other), check
 * the peer's pidfd, take the shared OFD lock on the peer's slot range without waiting, check the
 * peer endpoint is open and every slot is LIVE with the descriptor's generation, memcpy the mapped
 * ops, process_vm_readv / process_vm_writev the user-memory ops (short transfers resumed at the
 * exact byte), and release the lock.  Anything it is not sure about (unknown region, out of
 * bounds, more than one chunk, lock held by the owner) returns ST_FALLBACK / ST_BUSY before a
 * byte moves, and the caller takes the Python path, which produces the contract's error or waits.
 *
 * quick() is the small-transfer path of a planned call shape (issue 21): the plan (built once per
 * shape by llmdd_shm._quick from the same snapshots) holds each tensor pair's local and remote base
 * and size, the peer's slots and generations and the lock range; a call hands it the two block lists
 * and gets the bytes moved, with no ops array and no per-op Python object: block checks, the plan's
 * snapshot versions, bounds, pidfd, lock, generation check, copy, unlock and the channel's counters
 * in one call, the GIL held throughout (so no Python thread changes a table or unmaps a segment
 * while it runs).  Anything else returns a negative status before a byte moves (or, for a failed
 * process_vm_*, after some may have) and the caller takes the ops path, which reports it.
 *
 * copy() moves one chunk of a larger batch (memcpy over an iovec pair array, or CMA with resume)
 * with the GIL released; the caller holds the lock and does the checks between chunks.
 *
 * Addresses come from the Python side, which owns the mappings and pins them for the call, the
 * same trust as ctypes.memmove: this module adds speed, not a new way to reach memory.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef F_OFD_SETLK
#define F_OFD_SETLK 37
#endif

#define SHMFAST_ABI 4

enum {
    ST_OK = 0,          /* every byte moved: (0, bytes, syscalls) */
    ST_FALLBACK = 1,    /* not handled here, nothing done: (1, reason, 0) */
    ST_BUSY = 2,        /* the owner holds a conflicting lock, nothing done */
    ST_CLOSED = 3,      /* the peer endpoint's header is not OPEN, nothing moved */
    ST_STALE = 4,       /* a slot is not LIVE with its generation: (4, region id, 0), nothing moved */
    ST_CMA = 5,         /* process_vm_* failed: (5, errno, bytes moved before) */
    ST_NOPROGRESS = 6,  /* process_vm_* returned 0: (6, bytes left, bytes moved before) */
    ST_DEAD = 7,        /* the peer's pidfd is readable (process exited), nothing done */
    ST_LOCKERR = 8,     /* fcntl failed otherwise: (8, errno, 0) */
};

/* fallback reasons (for tests and statistics) */
enum { FB_REGION = 1, FB_BOUNDS = 2, FB_SIZE = 3, FB_NOMEM = 4 };

#define HDR_STATE 2
#define CTL_OPEN 1
#define SLOTS_OFF 4096
#define SLOT_LIVE 1
#define MAX_SLOTS 16384 /* llmdd_shm.MAX_SLOTS: the control segment holds this many 16-byte slots */
#define KIND_SHM 0

#pragma pack(push, 1)
typedef struct {
    uint32_t local_region;
    uint64_t local_offset;
    uint32_t remote_region;
    uint64_t remote_offset;
    uint64_t length;
} op_t;
#pragma pack(pop)

_Static_assert(sizeof(op_t) == 32, "OP_DTYPE is 32 packed bytes");
_Static_assert(sizeof(struct iovec) == 16, "struct iovec is two 64-bit words");

/* binary search of a sorted table of rows of `stride` uint64 words keyed by word 0 */
static const uint64_t *find_row(const uint64_t *tab, Py_ssize_t rows, int stride, uint64_t id) {
    Py_ssize_t lo = 0, hi = rows;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        uint64_t k = tab[mid * stride];
        if (k == id)
            return tab + mid * stride;
        if (k < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

static int in_bounds(uint64_t off, uint64_t len, uint64_t size) {
    return off <= size && len <= size - off;
}

/* memmove, as ctypes.memmove on the Python path: a same-process test pair may map one segment twice */
static void memcpy_iov(const struct iovec *dst, const struct iovec *src, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        memmove(dst[i].iov_base, src[i].iov_base, src[i].iov_len);
}

/* Move every byte of the paired arrays (element i of both has the same length); the arrays are
 * modified on a short transfer.  Returns 0, or ST_CMA / ST_NOPROGRESS with *err set. */
static int cma_all(int write, pid_t pid, struct iovec *l, struct iovec *r, Py_ssize_t n, uint64_t *moved,
                   uint64_t *calls, int64_t *err) {
    Py_ssize_t k = 0;
    while (k < n) {
        uint64_t want = 0;
        for (Py_ssize_t i = k; i < n; i++)
            want += l[i].iov_len;
        if (want == 0)
            return 0;
        ssize_t got = write ? process_vm_writev(pid, l + k, (unsigned long)(n - k), r + k, (unsigned long)(n - k), 0)
                            : process_vm_readv(pid, l + k, (unsigned long)(n - k), r + k, (unsigned long)(n - k), 0);
        (*calls)++;
        if (got < 0) {
            *err = errno;
            return ST_CMA;
        }
        if (got == 0) {
            *err = (int64_t)want;
            return ST_NOPROGRESS;
        }
        *moved += (uint64_t)got;
        if ((uint64_t)got >= want)
            return 0;
        /* short transfer: continue inside the element the kernel stopped in */
        uint64_t left = (uint64_t)got;
        while (k < n && left >= l[k].iov_len) {
            left -= l[k].iov_len;
            k++;
        }
        if (k < n && left) {
            l[k].iov_base = (char *)l[k].iov_base + left;
            l[k].iov_len -= left;
            r[k].iov_base = (char *)r[k].iov_base + left;
            r[k].iov_len -= left;
        }
    }
    return 0;
}

static int set_lock(int fd, short type, uint64_t start, uint64_t len) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)start;
    fl.l_len = (off_t)len;
    return fcntl(fd, F_OFD_SETLK, &fl);
}

#define SMALL 32

/* batch(write, pid, pidfd, lock_fd, ctl_addr, ops, ltab_addr, lrows, rtab_addr, rrows,
 *       iov_max, chunk_bytes, gil_bytes) -> (status, a, b)
 * ops: a C-contiguous buffer of OP_DTYPE records (a numpy array); its length must be a multiple of 32.
 * ltab rows: (id, addr, size); rtab rows: (id, base, kind, slot, gen, size); both sorted by id. */
static PyObject *shmfast_batch(PyObject *self, PyObject *args) {
    int write, pid, pidfd, lock_fd;
    unsigned long long ctl_addr, ltab_addr, rtab_addr, chunk_bytes, gil_bytes;
    Py_ssize_t lrows, rrows, iov_max;
    PyObject *ops_obj;
    if (!PyArg_ParseTuple(args, "iiiiKOKnKnnKK", &write, &pid, &pidfd, &lock_fd, &ctl_addr, &ops_obj,
                          &ltab_addr, &lrows, &rtab_addr, &rrows, &iov_max, &chunk_bytes, &gil_bytes))
        return NULL;
    if (lrows < 0 || rrows < 0 || iov_max <= 0) {
        PyErr_SetString(PyExc_ValueError, "negative count");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(ops_obj, &view, PyBUF_C_CONTIGUOUS) != 0)
        return NULL;
    if (view.len % (Py_ssize_t)sizeof(op_t) != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "ops buffer is not a whole number of 32-byte OP_DTYPE records");
        return NULL;
    }
    const Py_ssize_t nops = view.len / (Py_ssize_t)sizeof(op_t);
    const op_t *ops = (const op_t *)view.buf;
    const uint64_t *ltab = (const uint64_t *)(uintptr_t)ltab_addr;
    const uint64_t *rtab = (const uint64_t *)(uintptr_t)rtab_addr;

    struct iovec s_ml[SMALL], s_mr[SMALL], s_cl[SMALL], s_cr[SMALL];
    uint64_t s_slot[SMALL * 3];
    struct iovec *ml = s_ml, *mr = s_mr, *cl = s_cl, *cr = s_cr;
    uint64_t *slots = s_slot; /* (slot, gen, rid) triples */
    void *heap = NULL;
    if (nops > SMALL) {
        heap = PyMem_Malloc((size_t)nops * (4 * sizeof(struct iovec) + 3 * sizeof(uint64_t)));
        if (heap == NULL) {
            PyBuffer_Release(&view);
            return Py_BuildValue("(iii)", ST_FALLBACK, FB_NOMEM, 0);
        }
        ml = (struct iovec *)heap;
        mr = ml + nops;
        cl = mr + nops;
        cr = cl + nops;
        slots = (uint64_t *)(cr + nops);
    }
    Py_ssize_t nm = 0, nc = 0, ns = 0;
    uint64_t total = 0, slot_lo = UINT64_MAX, slot_hi = 0;
    int status = ST_OK;
    int64_t a = 0, b = 0;

    for (Py_ssize_t i = 0; i < nops; i++) {
        op_t op;
        memcpy(&op, ops + i, sizeof op);
        const uint64_t *lrow = find_row(ltab, lrows, 3, op.local_region);
        const uint64_t *rrow = find_row(rtab, rrows, 6, op.remote_region);
        if (lrow == NULL || rrow == NULL) {
            status = ST_FALLBACK;
            a = FB_REGION;
            goto out;
        }
        if (!in_bounds(op.local_offset, op.length, lrow[2]) || !in_bounds(op.remote_offset, op.length, rrow[5])) {
            status = ST_FALLBACK;
            a = FB_BOUNDS;
            goto out;
        }
        /* the remote region's slot: every region the batch names is checked, as the Python path */
        uint64_t slot = rrow[3];
        if (slot >= MAX_SLOTS) {
            status = ST_FALLBACK;
            a = FB_REGION;
            goto out;
        }
        Py_ssize_t j;
        for (j = 0; j < ns; j++)
            if (slots[3 * j] == slot)
                break;
        if (j == ns) {
            slots[3 * ns] = slot;
            slots[3 * ns + 1] = rrow[4];
            slots[3 * ns + 2] = rrow[0];
            ns++;
            if (slot < slot_lo)
                slot_lo = slot;
            if (slot + 1 > slot_hi)
                slot_hi = slot + 1;
        }
        if (op.length == 0)
            continue;
        char *la = (char *)(uintptr_t)(lrow[1] + op.local_offset);
        char *ra = (char *)(uintptr_t)(rrow[1] + op.remote_offset);
        struct iovec *L, *R;
        Py_ssize_t *cnt;
        if (rrow[2] == KIND_SHM) {
            L = ml; R = mr; cnt = &nm;
        } else {
            L = cl; R = cr; cnt = &nc;
        }
        Py_ssize_t c = *cnt;
        if (c && (char *)L[c - 1].iov_base + L[c - 1].iov_len == la && (char *)R[c - 1].iov_base + R[c - 1].iov_len == ra) {
            L[c - 1].iov_len += op.length;   /* continues the previous op on both sides */
            R[c - 1].iov_len += op.length;
        } else {
            L[c].iov_base = la; L[c].iov_len = op.length;
            R[c].iov_base = ra; R[c].iov_len = op.length;
            (*cnt)++;
        }
        total += op.length;
        if (nm > iov_max || nc > iov_max || total > chunk_bytes)
            break;  /* more than one chunk already: the rest of a big batch is not looked at */
    }
    if (nm > iov_max || nc > iov_max || total > chunk_bytes) {
        status = ST_FALLBACK;  /* more than one chunk: the Python path checks between chunks */
        a = FB_SIZE;
        goto out;
    }
    if (ns == 0) {  /* no op at all */
        a = 0;
        goto out;
    }
    if (pidfd >= 0) {
        struct pollfd p = {.fd = pidfd, .events = POLLIN, .revents = 0};
        if (poll(&p, 1, 0) > 0) {
            status = ST_DEAD;
            goto out;
        }
    }
    if (set_lock(lock_fd, F_RDLCK, slot_lo, slot_hi - slot_lo) != 0) {
        if (errno == EAGAIN || errno == EACCES) {
            status = ST_BUSY;
        } else {
            status = ST_LOCKERR;
            a = errno;
        }
        goto out;
    }
    {
        const volatile uint64_t *hdr = (const volatile uint64_t *)(uintptr_t)ctl_addr;
        const volatile uint32_t *st = (const volatile uint32_t *)(uintptr_t)(ctl_addr + SLOTS_OFF);
        if (__atomic_load_n(&hdr[HDR_STATE], __ATOMIC_ACQUIRE) != CTL_OPEN) {
            status = ST_CLOSED;
        } else {
            for (Py_ssize_t j = 0; j < ns; j++) {
                uint64_t s = slots[3 * j];
                uint32_t state = __atomic_load_n(&st[4 * s], __ATOMIC_ACQUIRE);
                uint32_t gen = __atomic_load_n(&st[4 * s + 1], __ATOMIC_ACQUIRE);
                if (state != SLOT_LIVE || (uint64_t)gen != slots[3 * j + 1]) {
                    status = ST_STALE;
                    a = (int64_t)slots[3 * j + 2];
                    break;
                }
            }
        }
        if (status == ST_OK) {
            uint64_t moved = 0, calls = 0;
            int64_t err = 0;
            int rc = 0;
            PyThreadState *ts = NULL;
            if (total > gil_bytes)
                ts = PyEval_SaveThread();
            if (nm) {
                moved = 0;
                for (Py_ssize_t j = 0; j < nm; j++)
                    moved += ml[j].iov_len;
                if (write)
                    memcpy_iov(mr, ml, nm);
                else
                    memcpy_iov(ml, mr, nm);
            }
            if (nc)
                rc = cma_all(write, (pid_t)pid, cl, cr, nc, &moved, &calls, &err);
            if (ts != NULL)
                PyEval_RestoreThread(ts);
            if (rc) {
                status = rc;
                a = err;
                b = (int64_t)moved;
            } else {
                a = (int64_t)moved;
                b = (int64_t)calls;
            }
        }
        set_lock(lock_fd, F_UNLCK, slot_lo, slot_hi - slot_lo);
    }
out:
    PyBuffer_Release(&view);
    if (heap != NULL)
        PyMem_Free(heap);
    return Py_BuildValue("(iLL)", status, (long long)a, (long long)b);
}

/* copy(write, pid, kind, liov_addr, riov_addr, n) -> (status, a, b): one chunk of a larger batch,
 * GIL released. kind 0: memcpy (read: remote -> local); kind 1: CMA with resume.  The iovec arrays
 * are not modified (CMA works on a private copy). */
static PyObject *shmfast_copy(PyObject *self, PyObject *args) {
    int write, pid, kind;
    unsigned long long laddr, raddr;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "iiiKKn", &write, &pid, &kind, &laddr, &raddr, &n))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "negative count");
        return NULL;
    }
    struct iovec *l = (struct iovec *)(uintptr_t)laddr, *r = (struct iovec *)(uintptr_t)raddr;
    uint64_t moved = 0, calls = 0;
    int64_t err = 0;
    int rc = 0;
    if (kind == KIND_SHM) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            moved += l[i].iov_len;
        if (write)
            memcpy_iov(r, l, n);
        else
            memcpy_iov(l, r, n);
        Py_END_ALLOW_THREADS
    } else {
        struct iovec *buf = PyMem_Malloc((size_t)(n ? n : 1) * 2 * sizeof(struct iovec));
        if (buf == NULL)
            return PyErr_NoMemory();
        memcpy(buf, l, (size_t)n * sizeof(struct iovec));
        memcpy(buf + n, r, (size_t)n * sizeof(struct iovec));
        Py_BEGIN_ALLOW_THREADS
        rc = cma_all(write, (pid_t)pid, buf, buf + n, n, &moved, &calls, &err);
        Py_END_ALLOW_THREADS
        PyMem_Free(buf);
    }
    if (rc)
        return Py_BuildValue("(iLL)", rc, (long long)err, (long long)moved);
    return Py_BuildValue("(iLL)", ST_OK, (long long)moved, (long long)calls);
}

/* ---------------------------------------------------------------- quick(): planned small transfers */

#define QUICK_MAGIC 0x4b43495551444d4cULL /* "LMDQUICK" */
#define QUICK_MAX_BLOCKS 16
#define QUICK_MAX_PAIRS 64
#define QUICK_MAX_IOV (QUICK_MAX_BLOCKS * QUICK_MAX_PAIRS)

/* counters shared with Python (a numpy uint64 array each): word 0 is the snapshot version */
enum { QC_VERSION = 0, QC_BATCHES = 1, QC_BYTES_READ = 2, QC_BYTES_WRITTEN = 3, QC_OPS_READ = 4,
       QC_OPS_WRITTEN = 5, QC_CMA_CALLS = 6, QC_WORDS = 8 };

typedef struct {
    uint64_t magic;
    uint64_t ep_ctr, ep_ver;   /* the local endpoint's counters and the version the plan was built at */
    uint64_t ch_ctr, ch_ver;   /* the channel's */
    uint64_t ctl_addr;         /* the peer's control segment, mapped */
    int64_t write, pid, pidfd, lock_fd;
    uint64_t bs, su, du;       /* block bytes; blocks in the source and in the destination cache */
    uint64_t npairs, nslots, iov_max, max_bytes, slot_lo, slot_hi;
} qhdr_t;

typedef struct {
    uint64_t laddr, lsize, raddr, rsize, kind;
} qpair_t;

typedef struct {
    uint64_t slot, gen;
} qslot_t;

/* the blocks of one list as uint64 (exact ints in [0, limit) and at most maxv, so that block * bs + bs
 * does not wrap); 0, or -1 when not (nothing raised) */
static int quick_blocks(PyObject *seq, Py_ssize_t n, uint64_t limit, uint64_t maxv, uint64_t *out) {
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = items[i];
        if (!PyLong_CheckExact(o))
            return -1;
        unsigned long long v = PyLong_AsUnsignedLongLong(o);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
        if (v >= limit || v > maxv)
            return -1;
        out[i] = v;
    }
    return 0;
}

static PyObject *quick_status(int st) { return PyLong_FromLong(-(long)st); }

/* quick(plan: bytes, src_blocks, dst_blocks) -> bytes moved (>= 0), or -status (see the file comment) */
static PyObject *shmfast_quick(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyBytes_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "quick(plan: bytes, src_blocks, dst_blocks)");
        return NULL;
    }
    const char *raw = PyBytes_AS_STRING(args[0]);
    Py_ssize_t rawlen = PyBytes_GET_SIZE(args[0]);
    if (rawlen < (Py_ssize_t)sizeof(qhdr_t)) {
        PyErr_SetString(PyExc_ValueError, "quick plan too short");
        return NULL;
    }
    qhdr_t h;
    memcpy(&h, raw, sizeof h);
    if (h.magic != QUICK_MAGIC || h.npairs == 0 || h.npairs > QUICK_MAX_PAIRS || h.nslots == 0
        || h.nslots > h.npairs || h.bs == 0
        || rawlen != (Py_ssize_t)(sizeof(qhdr_t) + h.npairs * sizeof(qpair_t) + h.nslots * sizeof(qslot_t))) {
        PyErr_SetString(PyExc_ValueError, "not a quick plan");
        return NULL;
    }
    const qpair_t *pairs = (const qpair_t *)(raw + sizeof(qhdr_t));
    const qslot_t *slots = (const qslot_t *)(raw + sizeof(qhdr_t) + h.npairs * sizeof(qpair_t));
    for (uint64_t j = 0; j < h.nslots; j++) { /* the slot array of the mapped control segment */
        if (slots[j].slot >= MAX_SLOTS || slots[j].slot < h.slot_lo || slots[j].slot >= h.slot_hi) {
            PyErr_SetString(PyExc_ValueError, "quick plan names a slot outside its range");
            return NULL;
        }
    }
    PyObject *src = args[1], *dst = args[2];
    if (!(PyList_CheckExact(src) || PyTuple_CheckExact(src)) || !(PyList_CheckExact(dst) || PyTuple_CheckExact(dst)))
        return quick_status(ST_FALLBACK);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(dst);
    if (n == 0 || n > QUICK_MAX_BLOCKS || PySequence_Fast_GET_SIZE(src) != n)
        return quick_status(ST_FALLBACK);
    uint64_t sb[QUICK_MAX_BLOCKS], db[QUICK_MAX_BLOCKS];
    const uint64_t maxv = (UINT64_MAX - h.bs) / h.bs;
    if (quick_blocks(src, n, h.su, maxv, sb) || quick_blocks(dst, n, h.du, maxv, db))
        return quick_status(ST_FALLBACK);
    for (Py_ssize_t i = 1; i < n; i++) /* a destination listed twice: the planner decides which wins */
        for (Py_ssize_t j = 0; j < i; j++)
            if (db[i] == db[j])
                return quick_status(ST_FALLBACK);
    volatile uint64_t *ep_ctr = (volatile uint64_t *)(uintptr_t)h.ep_ctr;
    volatile uint64_t *ch_ctr = (volatile uint64_t *)(uintptr_t)h.ch_ctr;
    /* a table changed, a region went, the channel or endpoint closed since the plan was built */
    if (ep_ctr[QC_VERSION] != h.ep_ver || ch_ctr[QC_VERSION] != h.ch_ver)
        return quick_status(ST_FALLBACK);
    const int write = h.write != 0;
    struct iovec ml[QUICK_MAX_IOV], mr[QUICK_MAX_IOV], cl[QUICK_MAX_IOV], cr[QUICK_MAX_IOV];
    Py_ssize_t nm = 0, nc = 0;
    uint64_t total = 0, rows = 0;
    for (uint64_t p = 0; p < h.npairs; p++) {
        const qpair_t *pr = pairs + p;
        struct iovec *L, *R;
        Py_ssize_t *cnt;
        if (pr->kind == KIND_SHM) {
            L = ml; R = mr; cnt = &nm;
        } else {
            L = cl; R = cr; cnt = &nc;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t loff = (write ? sb[i] : db[i]) * h.bs, roff = (write ? db[i] : sb[i]) * h.bs;
            if (!in_bounds(loff, h.bs, pr->lsize) || !in_bounds(roff, h.bs, pr->rsize))
                return quick_status(ST_FALLBACK);
            char *la = (char *)(uintptr_t)(pr->laddr + loff), *ra = (char *)(uintptr_t)(pr->raddr + roff);
            Py_ssize_t c = *cnt;
            if (i > 0 && c && (char *)L[c - 1].iov_base + L[c - 1].iov_len == la
                && (char *)R[c - 1].iov_base + R[c - 1].iov_len == ra) {
                L[c - 1].iov_len += h.bs; /* the next block on both sides: one op, as the planner's runs */
                R[c - 1].iov_len += h.bs;
            } else {
                L[c].iov_base = la; L[c].iov_len = h.bs;
                R[c].iov_base = ra; R[c].iov_len = h.bs;
                (*cnt)++;
                rows++;
            }
            total += h.bs;
        }
    }
    if ((uint64_t)nm > h.iov_max || (uint64_t)nc > h.iov_max || total > h.max_bytes)
        return quick_status(ST_FALLBACK);
    if (h.pidfd >= 0) {
        struct pollfd pf = {.fd = (int)h.pidfd, .events = POLLIN, .revents = 0};
        if (poll(&pf, 1, 0) > 0)
            return quick_status(ST_DEAD);
    }
    if (set_lock((int)h.lock_fd, F_RDLCK, h.slot_lo, h.slot_hi - h.slot_lo) != 0)
        return quick_status((errno == EAGAIN || errno == EACCES) ? ST_BUSY : ST_LOCKERR);
    int status = ST_OK;
    uint64_t moved = 0, calls = 0;
    const volatile uint64_t *hdr = (const volatile uint64_t *)(uintptr_t)h.ctl_addr;
    const volatile uint32_t *st = (const volatile uint32_t *)(uintptr_t)(h.ctl_addr + SLOTS_OFF);
    if (__atomic_load_n(&hdr[HDR_STATE], __ATOMIC_ACQUIRE) != CTL_OPEN) {
        status = ST_CLOSED;
    } else {
        for (uint64_t j = 0; j < h.nslots; j++) {
            uint64_t s = slots[j].slot;
            uint32_t state = __atomic_load_n(&st[4 * s], __ATOMIC_ACQUIRE);
            uint32_t gen = __atomic_load_n(&st[4 * s + 1], __ATOMIC_ACQUIRE);
            if (state != SLOT_LIVE || (uint64_t)gen != slots[j].gen) {
                status = ST_STALE;
                break;
            }
        }
    }
    if (status == ST_OK) {
        if (nm) {
            for (Py_ssize_t j = 0; j < nm; j++)
                moved += ml[j].iov_len;
            if (write)
                memcpy_iov(mr, ml, nm);
            else
                memcpy_iov(ml, mr, nm);
        }
        if (nc) {
            int64_t err = 0;
            status = cma_all(write, (pid_t)h.pid, cl, cr, nc, &moved, &calls, &err);
        }
    }
    set_lock((int)h.lock_fd, F_UNLCK, h.slot_lo, h.slot_hi - h.slot_lo);
    if (status != ST_OK)
        return quick_status(status);
    ep_ctr[QC_BATCHES] += 1;
    ch_ctr[QC_BATCHES] += 1;
    ch_ctr[write ? QC_BYTES_WRITTEN : QC_BYTES_READ] += moved;
    ch_ctr[write ? QC_OPS_WRITTEN : QC_OPS_READ] += rows;
    ch_ctr[QC_CMA_CALLS] += calls;
    return PyLong_FromUnsignedLongLong(moved);
}

static PyMethodDef methods[] = {
    {"batch", shmfast_batch, METH_VARARGS, "lock, check, copy and unlock one small shm batch"},
    {"copy", shmfast_copy, METH_VARARGS, "copy one chunk of iovec pairs (memcpy or CMA), GIL released"},
    {"quick", (PyCFunction)(void (*)(void))shmfast_quick, METH_FASTCALL,
     "one planned small transfer: block checks, lock, generation check, copy, unlock; bytes or -status"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_shmfast", "llmdd shm transport hot path", -1, methods};

PyMODINIT_FUNC PyInit__shmfast(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "ABI", SHMFAST_ABI) < 0 || PyModule_AddIntConstant(m, "MAX_SLOTS", MAX_SLOTS) < 0
        || PyModule_AddIntConstant(m, "SLOTS_OFF", SLOTS_OFF) < 0 || PyModule_AddIntConstant(m, "CTL_OPEN", CTL_OPEN) < 0
        || PyModule_AddIntConstant(m, "SLOT_LIVE", SLOT_LIVE) < 0 || PyModule_AddIntConstant(m, "OP_SIZE", sizeof(op_t)) < 0
        || PyModule_AddIntConstant(m, "QUICK_MAGIC_LO", (long)(QUICK_MAGIC & 0xffffffffu)) < 0
        || PyModule_AddIntConstant(m, "QUICK_HDR_WORDS", sizeof(qhdr_t) / 8) < 0
        || PyModule_AddIntConstant(m, "QUICK_MAX_BLOCKS", QUICK_MAX_BLOCKS) < 0
        || PyModule_AddIntConstant(m, "QUICK_MAX_PAIRS", QUICK_MAX_PAIRS) < 0
        || PyModule_AddIntConstant(m, "QC_WORDS", QC_WORDS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
