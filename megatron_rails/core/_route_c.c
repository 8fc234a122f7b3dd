/* The token route of a plan, compiled: quotas -> the CSR route (core/route.py `route_csr`), in one
 * call. Every layer derives it per microbatch before any rank can send, and at Mixtral sizes the
 * numpy version is a few dozen small calls (tens of microseconds); this is a few microseconds.
 *
 * It computes exactly what route.py computes (`split_by_quota`, then `to_csr`): experts served by
 * one replica take every source's whole count; the others are matched in two north-west-corner
 * passes over the same streams (supply by (expert, source rank), demand by (expert, replica rank)):
 * first inside every node up to min(the node's supply, its quota), then the rest across nodes.
 * Entries are sorted by (source, replica), duplicates summed. tests/test_route_kernel.py checks
 * bit-identity against the Python definition on random plans. Errors (quotas that do not match the
 * counts) are left to the Python path, which says what is wrong.
 *
 * route_csr(counts, rep_expert, rep_rank, quota, D, E, R, G, ptr, rep_out, tok_out, send_DD) -> M
 * (and below: rank_tables, one rank's send and receive tables from the route; the small passes
 * every plan makes: count_sums, whether a count is negative and the column sums; rank_sums, every
 * rank's load; replica_table and even_quotas, a placement's replicas from its slot table and every
 * expert's tokens split evenly over them; flow_split, the exact flow's first pass)
 *   counts      int64 [D, E], C-contiguous (read)
 *   rep_expert, rep_rank, quota   int64 [R]: replicas in (expert, rank) order (read)
 *   ptr         int64 [D + 1]          (written)
 *   rep_out, tok_out  int64 [cap]      (written: M entries; cap >= 3 * D * E + 2 * R)
 *   send_DD     int64 [D, D]           (written: tokens source rank i sends to rank j, Plan.send_DD)
 * returns M >= 0, or -1 where the quotas are negative or do not sum to every expert's tokens.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#include "_buffers.h"

typedef struct {
    int64_t key, tok; /* source * R + replica, tokens */
} entry;

static int cmp_entry(const void *pa, const void *pb) {
    const entry *a = pa, *b = pb;
    return (a->key > b->key) - (a->key < b->key);
}

/* North-west corner of supply a[0..na) against demand b[0..nb) (equal totals, both streams of
 * one expert), skipping zeros; appends (source, replica, amount) entries. */
static int64_t nw_corner(const int64_t *a, const int64_t *a_src, int64_t na, const int64_t *b,
                         const int64_t *b_rep, int64_t nb, int64_t R, entry *out, int64_t m) {
    int64_t i = 0, j = 0, ra = na ? a[0] : 0, rb = nb ? b[0] : 0;
    for (;;) {
        while (i < na && ra == 0) ra = ++i < na ? a[i] : 0;
        while (j < nb && rb == 0) rb = ++j < nb ? b[j] : 0;
        if (i >= na || j >= nb) return m;
        int64_t amt = ra < rb ? ra : rb;
        out[m].key = a_src[i] * R + b_rep[j], out[m].tok = amt, m++;
        ra -= amt, rb -= amt;
    }
}

/* The share of x[0..n) (in order, grouped by group[], groups contiguous) that fits under each
 * group's cap: x_loc[i] = clip(cap - (what came before i in its group), 0, x[i]). */
static void local_part(const int64_t *x, const int64_t *group, int64_t n, const int64_t *cap, int64_t *x_loc) {
    int64_t before = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i == 0 || group[i] != group[i - 1]) before = 0;
        int64_t room = cap[group[i]] - before;
        x_loc[i] = room < 0 ? 0 : (room > x[i] ? x[i] : room);
        before += x[i];
    }
}

static int64_t route(const int64_t *counts, const int64_t *rep_e, const int64_t *rep_d, const int64_t *quota,
                     int64_t D, int64_t E, int64_t R, int64_t G, int64_t *ptr, int64_t *rep_out,
                     int64_t *tok_out, int64_t *send_DD, int *oom) {
    int64_t V = D / G, m = 0, M = 0, bad = 0;
    int64_t *iw = malloc(sizeof(int64_t) * (size_t)(3 * E + 1 + 2 * V + 6 * (D + R)));
    entry *ent = malloc(sizeof(entry) * (size_t)(3 * D * E + 2 * R + 1));
    if (!iw || !ent) {
        *oom = 1;
        free(iw), free(ent);
        return -1;
    }
    int64_t *load = iw, *first = load + E, *npos = first + E + 1, *sup = npos + E, *dem = sup + V;
    int64_t *a = dem + V, *a_src = a + D, *a_grp = a_src + D, *a_loc = a_grp + D;
    int64_t *b = a_loc + D, *b_rep = b + R, *b_grp = b_rep + R, *b_loc = b_grp + R;
    int64_t *a_rest = b_loc + R, *b_rest = a_rest + D;
    for (int64_t e = 0; e < E; e++) load[e] = 0, npos[e] = 0;
    for (int64_t d = 0; d < D; d++)
        for (int64_t e = 0; e < E; e++) load[e] += counts[d * E + e];
    for (int64_t e = 0, r = 0; e <= E; e++) { /* replicas of expert e: first[e] .. first[e+1]-1 */
        while (r < R && rep_e[r] < e) r++;
        first[e] = r;
    }
    for (int64_t r = 0; r < R; r++) {
        if (quota[r] < 0 || rep_e[r] < 0 || rep_e[r] >= E) bad = 1;
        else if (quota[r] > 0) npos[rep_e[r]]++, load[rep_e[r]] -= quota[r];
    }
    for (int64_t e = 0; e < E; e++) bad |= load[e] != 0;
    if (bad) {
        free(iw), free(ent);
        return -1;
    }
    for (int64_t e = 0; e < E; e++) {
        if (npos[e] == 0) continue;
        int64_t r0 = first[e], r1 = first[e + 1];
        if (npos[e] == 1) { /* one replica: every source sends its whole count */
            int64_t r = r0;
            while (quota[r] == 0) r++;
            for (int64_t d = 0; d < D; d++)
                if (counts[d * E + e]) ent[m].key = d * R + r, ent[m].tok = counts[d * E + e], m++;
            continue;
        }
        /* the expert's streams: supply by source rank, demand by its positive replicas (rank order) */
        int64_t nb = 0;
        for (int64_t v = 0; v < V; v++) sup[v] = 0, dem[v] = 0;
        for (int64_t d = 0; d < D; d++) {
            a[d] = counts[d * E + e], a_src[d] = d, a_grp[d] = d / G;
            sup[d / G] += a[d];
        }
        for (int64_t r = r0; r < r1; r++) {
            if (quota[r] <= 0) continue;
            b[nb] = quota[r], b_rep[nb] = r, b_grp[nb] = rep_d[r] / G;
            dem[b_grp[nb]] += quota[r];
            nb++;
        }
        for (int64_t v = 0; v < V; v++) sup[v] = sup[v] < dem[v] ? sup[v] : dem[v]; /* the caps */
        local_part(a, a_grp, D, sup, a_loc);
        local_part(b, b_grp, nb, sup, b_loc);
        for (int64_t d = 0; d < D; d++) a_rest[d] = a[d] - a_loc[d];
        for (int64_t j = 0; j < nb; j++) b_rest[j] = b[j] - b_loc[j];
        m = nw_corner(a_loc, a_src, D, b_loc, b_rep, nb, R, ent, m);
        m = nw_corner(a_rest, a_src, D, b_rest, b_rep, nb, R, ent, m);
    }
    qsort(ent, (size_t)m, sizeof(entry), cmp_entry);
    for (int64_t d = 0; d <= D; d++) ptr[d] = 0;
    for (int64_t i = 0; i < m; i++) {
        if (M && ent[i].key == ent[M - 1].key) { /* the same (source, replica) twice: one entry */
            ent[M - 1].tok += ent[i].tok;
            continue;
        }
        ent[M++] = ent[i];
    }
    for (int64_t i = 0; i < D * D; i++) send_DD[i] = 0;
    for (int64_t i = 0; i < M; i++) {
        int64_t src = ent[i].key / R;
        rep_out[i] = ent[i].key % R, tok_out[i] = ent[i].tok;
        ptr[src + 1]++;
        send_DD[src * D + rep_d[rep_out[i]]] += ent[i].tok;
    }
    for (int64_t d = 0; d < D; d++) ptr[d + 1] += ptr[d];
    free(iw), free(ent);
    return M;
}

static PyObject *route_csr(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "route_csr takes 12 arguments");
        return NULL;
    }
    int64_t D = PyLong_AsLongLong(args[4]), E = PyLong_AsLongLong(args[5]);
    int64_t R = PyLong_AsLongLong(args[6]), G = PyLong_AsLongLong(args[7]);
    if (PyErr_Occurred()) return NULL;
    if (D < 1 || E < 1 || R < 1 || G < 1 || D % G) {
        PyErr_SetString(PyExc_ValueError, "route_csr: bad sizes");
        return NULL;
    }
    Py_buffer v[8];
    const char *names[8] = {"counts", "rep_expert", "rep_rank", "quota", "ptr", "rep_out", "tok_out", "send_DD"};
    const int64_t sizes[8] = {D * E, R, R, R, D + 1, 3 * D * E + 2 * R, 3 * D * E + 2 * R, D * D};
    const int slot[8] = {0, 1, 2, 3, 8, 9, 10, 11};
    if (get_buffers(args, slot, sizes, names, 8, 4, v)) return NULL;
    int64_t M = -1;
    int oom = 0;
    Py_BEGIN_ALLOW_THREADS
    M = route(v[0].buf, v[1].buf, v[2].buf, v[3].buf, D, E, R, G, v[4].buf, v[5].buf, v[6].buf, v[7].buf, &oom);
    Py_END_ALLOW_THREADS
    release_buffers(v, 8);
    if (oom) return PyErr_NoMemory();
    return PyLong_FromLongLong(M);
}

/* One rank's tables from the route (the Triton send order's host side, runtime/local.py; the
 * receive order, runtime/receive.py): what `_runs`, the per-plan table of `order_pairs_triton`,
 * `_assemble`'s split sizes and `receive_order_host` compute, bit-identical (tests/test_route_kernel.py).
 *
 * rank_tables(ptr, rep, tok, rep_rank, rep_slot, rep_expert, D, E, S, me,
 *             table, send_runs, send_D, per_slot, recv_size, recv_take) -> (runs_max, n_recv, grouped)
 *   ptr [D+1], rep, tok [Mt]: the route (CSR, by source then replica)      (read)
 *   rep_rank, rep_slot, rep_expert [R]: the placement's replica tables      (read)
 *   table      [E + 1 + 3M]  M = this rank's route entries: first run of every expert, then per run
 *              (in (expert, rank) order) its first and past-last place among its expert's pairs and
 *              its send position minus that first place                   (written)
 *   send_runs  [3M]  destination rank, slot there and pairs of every run, in send order   (written)
 *   send_D     [D]   pairs sent to every rank                              (written)
 *   per_slot   [S]   rows received per slot                                (written)
 *   recv_size, recv_take [Mt]: received runs' rows in arrival order (source-major, slot-minor) and
 *              the arrival run of each run in slot-major order             (written: n_recv each)
 *   grouped: the arrival order is already slot-major. */
static int64_t *rank_runs_order(const int64_t *dest, const int64_t *slot, int64_t M, int64_t S, int64_t *order) {
    /* stable sort of runs by (dest, slot): insertion sort, M is a row of the route (small) */
    for (int64_t i = 0; i < M; i++) {
        int64_t j = i, key = dest[i] * S + slot[i];
        while (j > 0 && dest[order[j - 1]] * S + slot[order[j - 1]] > key) order[j] = order[j - 1], j--;
        order[j] = i;
    }
    return order;
}

static PyObject *rank_tables(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 16) {
        PyErr_SetString(PyExc_TypeError, "rank_tables takes 16 arguments");
        return NULL;
    }
    int64_t D = PyLong_AsLongLong(args[6]), E = PyLong_AsLongLong(args[7]);
    int64_t S = PyLong_AsLongLong(args[8]), me = PyLong_AsLongLong(args[9]);
    if (PyErr_Occurred()) return NULL;
    if (D < 1 || E < 1 || S < 1 || me < 0 || me >= D) {
        PyErr_SetString(PyExc_ValueError, "rank_tables: bad sizes");
        return NULL;
    }
    Py_buffer v[12];
    int got = 0;
    if (get_buffer(args[0], &v[0], D + 1, 0, "ptr")) return NULL;
    got = 1;
    const int64_t *ptr = v[0].buf;
    int64_t Mt = ptr[D], M = ptr[me + 1] - ptr[me], R = 0;
    if (Mt < 0 || M < 0) {
        PyBuffer_Release(&v[0]);
        PyErr_SetString(PyExc_ValueError, "rank_tables: bad route pointers");
        return NULL;
    }
    {
        Py_buffer probe;
        if (PyObject_GetBuffer(args[3], &probe, PyBUF_C_CONTIGUOUS) < 0) goto fail;
        R = probe.len / 8;
        PyBuffer_Release(&probe);
    }
    const char *names[12] = {"ptr", "rep", "tok", "rep_rank", "rep_slot", "rep_expert", "table", "send_runs",
                             "send_D", "per_slot", "recv_size", "recv_take"};
    const int64_t sizes[12] = {D + 1, Mt, Mt, R, R, R, E + 1 + 3 * M, 3 * M, D, S, Mt, Mt};
    const int slot_arg[12] = {0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15};
    for (; got < 12; got++)
        if (get_buffer(args[slot_arg[got]], &v[got], sizes[got], got >= 6, names[got])) goto fail;
    const int64_t *rep = v[1].buf, *tok = v[2].buf, *rank = v[3].buf, *rslot = v[4].buf, *rexp = v[5].buf;
    int64_t *table = v[6].buf, *send_runs = v[7].buf, *send_D = v[8].buf, *per_slot = v[9].buf;
    int64_t *recv_size = v[10].buf, *recv_take = v[11].buf;
    int64_t runs_max = 0, n_recv = 0, grouped = 1, bad = 0;
    int oom = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t *w = malloc(sizeof(int64_t) * (size_t)(5 * M + 2 * Mt + 1));
    if (!w) {
        oom = 1;
    } else {
        int64_t *dest = w, *slot = dest + M, *n = slot + M, *expert = n + M, *order = expert + M;
        int64_t *r_slot = order + M, *r_order = r_slot + Mt;
        for (int64_t i = 0; i < Mt && !bad; i++) bad = rep[i] < 0 || rep[i] >= R;
        for (int64_t m = 0; m < M && !bad; m++) {
            int64_t r = rep[ptr[me] + m];
            dest[m] = rank[r], slot[m] = rslot[r], n[m] = tok[ptr[me] + m], expert[m] = rexp[r];
        }
        if (!bad) {
            /* the per-plan table: runs are in (expert, rank) order (the route row is by replica) */
            int64_t *first = table, *lo = table + E + 1, *hi = lo + M, *base = hi + M;
            for (int64_t e = 0, m = 0; e <= E; e++) {
                while (m < M && expert[m] < e) m++;
                first[e] = m;
            }
            for (int64_t e = 0; e < E; e++) runs_max = first[e + 1] - first[e] > runs_max ? first[e + 1] - first[e] : runs_max;
            int64_t start = 0;
            for (int64_t m = 0; m < M; m++) { /* place among the expert's pairs */
                if (m == 0 || expert[m] != expert[m - 1]) start = 0;
                lo[m] = start, hi[m] = start + n[m];
                start += n[m];
            }
            rank_runs_order(dest, slot, M, S, order);
            for (int64_t d = 0; d < D; d++) send_D[d] = 0;
            int64_t at = 0;
            for (int64_t i = 0; i < M; i++) { /* send positions, by (destination, slot) */
                int64_t m = order[i];
                base[m] = at - lo[m];
                at += n[m];
                send_runs[i] = dest[m], send_runs[M + i] = slot[m], send_runs[2 * M + i] = n[m];
                send_D[dest[m]] += n[m];
            }
            /* received runs: entries into `me`, by source (route order), slot-minor */
            for (int64_t s = 0; s < S; s++) per_slot[s] = 0;
            for (int64_t src = 0; src < D; src++) {
                int64_t first_run = n_recv;
                for (int64_t i = ptr[src]; i < ptr[src + 1]; i++) {
                    int64_t r = rep[i];
                    if (rank[r] != me) continue;
                    int64_t j = n_recv++, key = rslot[r]; /* insertion by slot within the source */
                    while (j > first_run && r_slot[j - 1] > key) r_slot[j] = r_slot[j - 1], recv_size[j] = recv_size[j - 1], j--;
                    r_slot[j] = key, recv_size[j] = tok[i];
                    per_slot[key] += tok[i];
                }
            }
            for (int64_t j = 1; j < n_recv; j++) grouped &= r_slot[j] >= r_slot[j - 1];
            /* slot-major, arrival order kept within a slot: a stable sort of arrival runs by slot */
            for (int64_t i = 0; i < n_recv; i++) {
                int64_t j = i;
                while (j > 0 && r_slot[r_order[j - 1]] > r_slot[i]) r_order[j] = r_order[j - 1], j--;
                r_order[j] = i;
            }
            for (int64_t i = 0; i < n_recv; i++) recv_take[i] = r_order[i];
        }
        free(w);
    }
    Py_END_ALLOW_THREADS
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    if (oom) return PyErr_NoMemory();
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "rank_tables: a route entry names a replica outside the placement");
        return NULL;
    }
    return Py_BuildValue("(LLL)", (long long)runs_max, (long long)n_recv, (long long)grouped);
fail:
    for (int i = 0; i < got; i++) PyBuffer_Release(&v[i]);
    return NULL;
}

/* count_sums(counts, D, E, load_out) -> -1 where an entry of counts (int64 [D, E], read) is
 * negative, -2 where they total more than 2^53 (the most the planners' float64 checks hold exactly),
 * else 0; load_out (int64 [E], written) := its column sums: every planner's first look at the counts
 * (plan.py counts_and_load). Two numpy reductions over a few dozen entries cost more than the
 * arithmetic by far when the host's caches are cold, as between a training step's plans. */
#define MAX_COUNT_TOTAL (((uint64_t)1) << 53)

/* Whether n non-negative counts whose OR is `bits` total more than MAX_COUNT_TOTAL. Every count is at
 * most `bits`, so below MAX_COUNT_TOTAL / n no count is read; else one pass that stops once past it
 * (each count checked before it is added, so the total never wraps). */
static int count_total_over(const int64_t *x, int64_t n, uint64_t bits) {
    if (bits <= MAX_COUNT_TOTAL / (uint64_t)n) return 0;
    uint64_t total = 0;
    for (int64_t i = 0; i < n && total <= MAX_COUNT_TOTAL; i++)
        total = (uint64_t)x[i] > MAX_COUNT_TOTAL ? MAX_COUNT_TOTAL + 1 : total + (uint64_t)x[i];
    return total > MAX_COUNT_TOTAL;
}

static PyObject *count_sums(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "count_sums takes 4 arguments");
        return NULL;
    }
    int64_t D = PyLong_AsLongLong(args[1]), E = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    if (D < 1 || E < 1) {
        PyErr_SetString(PyExc_ValueError, "count_sums: bad sizes");
        return NULL;
    }
    Py_buffer c, out;
    if (get_buffer(args[0], &c, D * E, 0, "counts")) return NULL;
    if (get_buffer(args[3], &out, E, 1, "load_out")) {
        PyBuffer_Release(&c);
        return NULL;
    }
    const int64_t *x = c.buf;
    int64_t *load = out.buf, bits = 0; /* the OR of every count: negative iff one is */
    for (int64_t e = 0; e < E; e++) load[e] = 0;
    for (int64_t d = 0; d < D; d++) {
        const int64_t *row = x + d * E;
        /* unsigned adds wrap where signed ones would overflow (undefined); such totals are refused below */
        for (int64_t e = 0; e < E; e++)
            load[e] = (int64_t)((uint64_t)load[e] + (uint64_t)row[e]), bits |= row[e]; /* vectorizes */
    }
    int64_t code = bits < 0 ? -1 : count_total_over(x, D * E, (uint64_t)bits) ? -2 : 0;
    PyBuffer_Release(&c);
    PyBuffer_Release(&out);
    return PyLong_FromLongLong(code);
}

/* rank_sums(rank_R, quota_R, R, D, load_out) -> (max, sum) of load_out (int64 [D], written) :=
 * the quotas of every rank's replicas summed (Plan.load_D: numpy's bincount with weights). */
static PyObject *rank_sums(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "rank_sums takes 5 arguments");
        return NULL;
    }
    int64_t R = PyLong_AsLongLong(args[2]), D = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (R < 0 || D < 1) {
        PyErr_SetString(PyExc_ValueError, "rank_sums: bad sizes");
        return NULL;
    }
    Py_buffer v[3];
    const char *names[3] = {"rank_R", "quota_R", "load_out"};
    const int64_t sizes[3] = {R, R, D};
    const int slot[3] = {0, 1, 4};
    if (get_buffers(args, slot, sizes, names, 3, 2, v)) return NULL;
    const int64_t *rank = v[0].buf, *quota = v[1].buf;
    int64_t *load = v[2].buf, most, total = 0;
    int bad = 0;
    for (int64_t d = 0; d < D; d++) load[d] = 0;
    for (int64_t r = 0; r < R; r++) {
        if (rank[r] < 0 || rank[r] >= D) {
            bad = 1;
            break;
        }
        load[rank[r]] += quota[r];
    }
    most = load[0];
    for (int64_t d = 0; d < D; d++) {
        if (load[d] > most) most = load[d];
        total += load[d];
    }
    release_buffers(v, 3);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "rank_sums: a replica rank outside [0, D)");
        return NULL;
    }
    return Py_BuildValue("(LL)", (long long)most, (long long)total);
}

/* replica_table(slot_DS, D, S, E, expert_R, rank_R, slot_R, ptr) -> R, or -1
 *   slot_DS  int64 [D, S] (read): expert per slot, -1 empty
 *   expert_R, rank_R, slot_R  int64 [>= D * S] (written: R entries): the filled slots as replicas
 *            in (expert, rank) order, what plan.py's _replica_table makes by a stable sort
 *   ptr      int64 [E + 1] (written): replicas of expert e are ptr[e]:ptr[e+1] (Placement.expert_ptr)
 * -1 where a slot holds an id outside [-1, E) or a rank hosts an expert twice: the Python
 * definition then says which. A counting sort over the slots in (rank, slot) order. */
static PyObject *replica_table(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "replica_table takes 8 arguments");
        return NULL;
    }
    int64_t D = PyLong_AsLongLong(args[1]), S = PyLong_AsLongLong(args[2]), E = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (D < 1 || S < 0 || E < 1) {
        PyErr_SetString(PyExc_ValueError, "replica_table: bad sizes");
        return NULL;
    }
    Py_buffer v[5];
    const char *names[5] = {"slot_DS", "expert_R", "rank_R", "slot_R", "ptr"};
    const int64_t sizes[5] = {D * S, D * S, D * S, D * S, E + 1};
    const int slot[5] = {0, 4, 5, 6, 7};
    if (get_buffers(args, slot, sizes, names, 5, 1, v)) return NULL;
    const int64_t *se = v[0].buf;
    int64_t *er = v[1].buf, *rr = v[2].buf, *sr = v[3].buf, *ptr = v[4].buf, R = 0;
    int64_t *last = malloc((size_t)E * sizeof(int64_t)); /* the last rank seen hosting each expert */
    if (last == NULL) {
        release_buffers(v, 5);
        return PyErr_NoMemory();
    }
    for (int64_t e = 0; e <= E; e++) ptr[e] = 0;
    for (int64_t e = 0; e < E; e++) last[e] = -1;
    for (int64_t d = 0; d < D && R >= 0; d++)
        for (int64_t s = 0; s < S; s++) {
            int64_t e = se[d * S + s];
            if (e == -1) continue;
            if (e < -1 || e >= E || last[e] == d) { /* out of range, or hosted twice on rank d */
                R = -1;
                break;
            }
            last[e] = d, ptr[e + 1]++, R++;
        }
    if (R >= 0) {
        for (int64_t e = 0; e < E; e++) ptr[e + 1] += ptr[e];
        for (int64_t e = 0; e < E; e++) last[e] = ptr[e]; /* now: the next free place of each expert */
        for (int64_t d = 0; d < D; d++)
            for (int64_t s = 0; s < S; s++) {
                int64_t e = se[d * S + s];
                if (e < 0) continue;
                int64_t r = last[e]++;
                er[r] = e, rr[r] = d, sr[r] = s;
            }
    }
    free(last);
    release_buffers(v, 5);
    return PyLong_FromLongLong(R);
}

/* even_quotas(load_E, ptr, E, quota_R): every expert's tokens split evenly over its replicas,
 * the first load % n of its n replicas taking one more (planners/base.py even_quotas).
 *   load_E int64 [E] (read, non-negative), ptr int64 [E + 1] (read), quota_R int64 [ptr[E]] (written) */
static PyObject *even_quotas(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "even_quotas takes 4 arguments");
        return NULL;
    }
    int64_t E = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    if (E < 1) {
        PyErr_SetString(PyExc_ValueError, "even_quotas: bad sizes");
        return NULL;
    }
    Py_buffer load, ptr, quota;
    if (get_buffer(args[0], &load, E, 0, "load_E")) return NULL;
    if (get_buffer(args[1], &ptr, E + 1, 0, "ptr")) {
        PyBuffer_Release(&load);
        return NULL;
    }
    const int64_t *p = ptr.buf, *x = load.buf;
    if (get_buffer(args[3], &quota, p[E], 1, "quota_R")) {
        PyBuffer_Release(&load);
        PyBuffer_Release(&ptr);
        return NULL;
    }
    int64_t *q = quota.buf;
    for (int64_t e = 0; e < E; e++) {
        int64_t n = p[e + 1] - p[e];
        if (n < 1) continue;
        int64_t base = x[e] / n, extra = x[e] % n;
        for (int64_t k = 0; k < n; k++) q[p[e] + k] = base + (k < extra);
    }
    PyBuffer_Release(&load);
    PyBuffer_Release(&ptr);
    PyBuffer_Release(&quota);
    Py_RETURN_NONE;
}

/* flow_split(load_E, n_E, ptr, rank_R, E, R, D, quota_out, base_out, flex_out)
 *     -> (flexible experts, total load, largest base load, first unhosted loaded expert or -1)
 * planners/flow.py min_max_quotas' first pass: experts with one replica take their whole load
 * (quota_out int64 [R], written, zero elsewhere) onto their rank's base load (base_out int64 [D],
 * written); loaded experts with two or more replicas are listed (flex_out int64 [E], written,
 * ascending). load_E (non-negative), n_E int64 [E], ptr int64 [E + 1], rank_R int64 [R] (read). */
static PyObject *flow_split(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "flow_split takes 10 arguments");
        return NULL;
    }
    int64_t E = PyLong_AsLongLong(args[4]), R = PyLong_AsLongLong(args[5]), D = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (E < 1 || R < 0 || D < 1) {
        PyErr_SetString(PyExc_ValueError, "flow_split: bad sizes");
        return NULL;
    }
    Py_buffer v[7];
    const char *names[7] = {"load_E", "n_E", "ptr", "rank_R", "quota_out", "base_out", "flex_out"};
    const int64_t sizes[7] = {E, E, E + 1, R, R, D, E};
    const int slot[7] = {0, 1, 2, 3, 7, 8, 9};
    if (get_buffers(args, slot, sizes, names, 7, 4, v)) return NULL;
    const int64_t *load = v[0].buf, *n = v[1].buf, *ptr = v[2].buf, *rank = v[3].buf;
    int64_t *quota = v[4].buf, *base = v[5].buf, *flex = v[6].buf;
    int64_t nflex = 0, total = 0, orphan = -1, most = 0, bad = 0;
    for (int64_t r = 0; r < R; r++) quota[r] = 0;
    for (int64_t d = 0; d < D; d++) base[d] = 0;
    for (int64_t e = 0; e < E && orphan < 0 && !bad; e++) {
        int64_t x = load[e];
        if (x <= 0) continue;
        total += x;
        if (n[e] == 0) {
            orphan = e;
        } else if (n[e] == 1) {
            int64_t r = ptr[e], d = r >= 0 && r < R ? rank[r] : -1;
            if (d < 0 || d >= D) {
                bad = 1;
                break;
            }
            quota[r] = x;
            base[d] += x;
        } else {
            flex[nflex++] = e;
        }
    }
    for (int64_t d = 0; d < D; d++)
        if (base[d] > most) most = base[d];
    release_buffers(v, 7);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "flow_split: a replica outside the placement");
        return NULL;
    }
    return Py_BuildValue("(LLLL)", (long long)nflex, (long long)total, (long long)most, (long long)orphan);
}

static PyMethodDef methods[] = {
    {"flow_split", (PyCFunction)(void (*)(void))flow_split, METH_FASTCALL,
     "the exact flow's first pass over the experts (see the module source)."},
    {"replica_table", (PyCFunction)(void (*)(void))replica_table, METH_FASTCALL,
     "a placement's replicas in (expert, rank) order from its slot table (see the module source)."},
    {"even_quotas", (PyCFunction)(void (*)(void))even_quotas, METH_FASTCALL,
     "every expert's tokens split evenly over its replicas (see the module source)."},
    {"count_sums", (PyCFunction)(void (*)(void))count_sums, METH_FASTCALL,
     "whether a count is negative, and every expert's column sum (see the module source)."},
    {"rank_sums", (PyCFunction)(void (*)(void))rank_sums, METH_FASTCALL,
     "every rank's replica quotas summed, and their max and sum (see the module source)."},
    {"rank_tables", (PyCFunction)(void (*)(void))rank_tables, METH_FASTCALL,
     "one rank's send and receive tables from a plan's route (see the module source)."},
    {"route_csr", (PyCFunction)(void (*)(void))route_csr, METH_FASTCALL,
     "a plan's CSR token route from its quotas (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_route_c", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__route_c(void) { return PyModule_Create(&module); }
