/* fsep's layout, compiled: expert loads -> the slot table of the plan, in one call.
 *
 * It computes exactly what planners/fsep.py computes (`FsepPlanner.plan` up to the slot table: the
 * tolerance's stock and one-replica layouts, `packing.replica_counts`, `FsepPlanner._place` with
 * `packing.lpt_place` and its round repair, slots in order of arrival), so the plans are
 * bit-identical; tests/test_fsep_kernel.py checks that on random inputs. The placement object, the
 * even quotas and every error stay in Python, which is also the fallback where this is not built.
 *
 * fsep_layout(load_E, D, E, C, tol_limit, slot_DS) -> (code, replicas, unplaced)
 *   load_E   int64 [E] tokens per expert (read; non-negative, checked by the caller)
 *   tol_limit  1 + tolerance, or 0 for no tolerance
 *   slot_DS  int64 [D, C] (written unless code is STOCK: expert per slot, -1 empty)
 * codes: 0 STOCK (the stock layout is within the tolerance), 1 LEAN (one replica per expert), 2 FULL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_within.h"

enum { STOCK = 0, LEAN = 1, FULL = 2 };

typedef struct {
    int64_t load, e, idx; /* replica item: tokens, expert, position before sorting */
} item;

static int cmp_item(const void *pa, const void *pb) { /* heaviest first, then lower expert, stable */
    const item *a = pa, *b = pb;
    if (a->load != b->load) return a->load > b->load ? -1 : 1;
    if (a->e != b->e) return a->e < b->e ? -1 : 1;
    return (a->idx > b->idx) - (a->idx < b->idx);
}

typedef struct {
    double key;
    int64_t e;
} grant;

static int cmp_grant(const void *pa, const void *pb) { /* most tokens per replica first, lower id */
    const grant *a = pa, *b = pb;
    if (a->key != b->key) return a->key > b->key ? -1 : 1;
    return (a->e > b->e) - (a->e < b->e);
}

static int64_t sum_n_at(const int64_t *load, int64_t E, int64_t most, int64_t lam, int64_t *n) {
    int64_t s = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t v = (load[e] + lam - 1) / lam;
        v = v < 1 ? 1 : v;
        v = v > most ? most : v;
        if (n) n[e] = v;
        s += v;
    }
    return s;
}

/* packing.replica_counts(load, budget, ones, most): replicas per expert (n_E written). */
static int replica_counts(const int64_t *load, int64_t E, int64_t budget, int64_t most, int64_t *n, grant *g) {
    int64_t total = 0, b = 0, any = 0;
    for (int64_t e = 0; e < E; e++) total += load[e], b = load[e] > b ? load[e] : b, any |= load[e] != 0;
    int64_t lo = most < 1 ? most : 1;
    if (lo * E >= budget || !any) {
        for (int64_t e = 0; e < E; e++) n[e] = lo;
        return 0;
    }
    if (sum_n_at(load, E, most, 1, n) <= budget) return 0;
    int64_t a = 1, a0 = (total + budget - 1) / budget - 1;
    a0 = a0 < 1 ? 1 : a0;
    if (a0 < b && sum_n_at(load, E, most, a0, NULL) > budget) a = a0;
    while (b - a > 1) {
        int64_t mid = (a + b) / 2;
        if (sum_n_at(load, E, most, mid, NULL) <= budget) b = mid;
        else a = mid;
    }
    int64_t left = budget - sum_n_at(load, E, most, b, n);
    while (left > 0) { /* the remainder: by most tokens per replica, ties to the lower id */
        int64_t m = 0;
        for (int64_t e = 0; e < E; e++)
            if (n[e] < most && load[e] > 0) g[m].key = (double)load[e] / (double)n[e], g[m].e = e, m++;
        if (m == 0) break;
        qsort(g, (size_t)m, sizeof(grant), cmp_grant);
        int64_t take = m < left ? m : left;
        for (int64_t i = 0; i < take; i++) n[g[i].e]++;
        left -= take;
    }
    return 0;
}

typedef struct {
    int64_t D, E, C;
    item *items;
    int64_t *rank_load, *free, *ranks, *dst, *arrive;
    uint8_t *hosted;
} work;

/* FsepPlanner._place: n_E replicas of every expert, LPT-placed in rounds (packing.lpt_place); the
 * items sorted heaviest first (items[].e, .load), their ranks in dst_all (-1 unplaced); rank loads
 * in w->rank_load. Returns the number of items. */
static int64_t place(work *w, const int64_t *load, const int64_t *n_E, int64_t *rank_all) {
    int64_t D = w->D, E = w->E, C = w->C, n = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t base = load[e] / n_E[e], extra = load[e] % n_E[e];
        for (int64_t k = 0; k < n_E[e]; k++, n++) w->items[n].load = base + (k < extra), w->items[n].e = e, w->items[n].idx = n;
    }
    qsort(w->items, (size_t)n, sizeof(item), cmp_item);
    memset(w->hosted, 0, (size_t)(D * E));
    for (int64_t d = 0; d < D; d++) w->rank_load[d] = 0, w->free[d] = C;
    for (int64_t i = 0; i < n; i++) rank_all[i] = -1;
    int64_t pos = 0;
    while (pos < n) {
        int64_t nr = 0;
        for (int64_t d = 0; d < D; d++) { /* ranks with a free slot, least loaded first (stable) */
            if (w->free[d] <= 0) continue;
            int64_t j = nr++;
            while (j > 0 && w->rank_load[w->ranks[j - 1]] > w->rank_load[d]) w->ranks[j] = w->ranks[j - 1], j--;
            w->ranks[j] = d;
        }
        if (nr == 0) break;
        int64_t m = nr < n - pos ? nr : n - pos, n_spare = nr - m;
        int64_t *dst = w->dst, *spare = w->ranks + m;
        const item *it = w->items + pos;
        for (int64_t i = 0; i < m; i++) dst[i] = w->ranks[i];
        int64_t n_bad = 0;
        for (int64_t i = 0; i < m; i++) /* conflicts as the round starts (the repair reads hosted as is) */
            if (w->hosted[dst[i] * E + it[i].e]) w->arrive[n_bad++] = i;
        for (int64_t b = 0; b < n_bad; b++) {
            int64_t i = w->arrive[b], e = it[i].e;
            if (!w->hosted[dst[i] * E + e]) continue; /* fixed by an earlier swap */
            int64_t j = 0;
            for (; j < m; j++)
                if (j != i && dst[j] >= 0 && it[j].e != e && !w->hosted[dst[j] * E + e] && !w->hosted[dst[i] * E + it[j].e])
                    break;
            if (j < m) {
                int64_t t = dst[i];
                dst[i] = dst[j], dst[j] = t;
                continue;
            }
            int64_t k = 0;
            for (; k < n_spare; k++)
                if (!w->hosted[spare[k] * E + e]) break;
            if (k < n_spare) {
                dst[i] = spare[k];
                memmove(spare + k, spare + k + 1, sizeof(int64_t) * (size_t)(n_spare - k - 1));
                n_spare--;
            } else {
                dst[i] = -1;
            }
        }
        for (int64_t i = 0; i < m; i++) {
            rank_all[pos + i] = dst[i];
            if (dst[i] < 0) continue;
            w->rank_load[dst[i]] += it[i].load;
            w->hosted[dst[i] * E + it[i].e] = 1;
            w->free[dst[i]]--;
        }
        pos += m;
    }
    return n;
}

/* The slot table from placed items (slot = order of arrival on the rank); returns replicas placed. */
static int64_t slot_table(work *w, int64_t n, const int64_t *rank_all, int64_t *se, int64_t *unplaced) {
    int64_t D = w->D, C = w->C, placed = 0;
    for (int64_t i = 0; i < D * C; i++) se[i] = -1;
    for (int64_t d = 0; d < D; d++) w->free[d] = 0; /* reused: next slot per rank */
    *unplaced = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rank_all[i];
        if (r < 0) {
            (*unplaced)++;
            continue;
        }
        se[r * C + w->free[r]++] = w->items[i].e;
        placed++;
    }
    return placed;
}

static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t n, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (view->itemsize != 8 || view->len != n * 8) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd int64 values, got %zd bytes", name, n, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *fsep_layout(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "fsep_layout takes 6 arguments");
        return NULL;
    }
    int64_t D = PyLong_AsLongLong(args[1]), E = PyLong_AsLongLong(args[2]), C = PyLong_AsLongLong(args[3]);
    double tol_limit = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (D < 1 || E < 1 || C < 1 || D * C < E) {
        PyErr_SetString(PyExc_ValueError, "fsep_layout: bad sizes");
        return NULL;
    }
    Py_buffer vl, vs;
    if (get_buffer(args[0], &vl, E, 0, "load_E")) return NULL;
    if (get_buffer(args[5], &vs, D * C, 1, "slot_DS")) {
        PyBuffer_Release(&vl);
        return NULL;
    }
    const int64_t *load = vl.buf;
    int64_t *se = vs.buf;
    int64_t code = FULL, replicas = 0, unplaced = 0, N = D * C;
    int oom = 0;
    Py_BEGIN_ALLOW_THREADS
    work w = {D, E, C, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    w.items = malloc(sizeof(item) * (size_t)N);
    int64_t *buf = malloc(sizeof(int64_t) * (size_t)(6 * D + N + E));
    grant *g = malloc(sizeof(grant) * (size_t)E);
    w.hosted = malloc((size_t)(D * E));
    if (!w.items || !buf || !g || !w.hosted) {
        oom = 1;
    } else {
        w.rank_load = buf, w.free = buf + D, w.ranks = buf + 2 * D, w.dst = buf + 3 * D, w.arrive = buf + 4 * D;
        int64_t *rank_all = buf + 5 * D, *n_E = rank_all + N, *stock_D = n_E + E;
        int64_t total = 0, hi = 0;
        for (int64_t e = 0; e < E; e++) total += load[e], hi = load[e] > hi ? load[e] : hi;
        int placed_lean = 0;
        if (tol_limit > 0 && within_limit(hi, D, tol_limit * (double)total)) {
            int64_t stock_hi = 0; /* the stock layout: rank floor(e * D / E) owns e */
            for (int64_t d = 0; d < D; d++) stock_D[d] = 0;
            for (int64_t e = 0; e < E; e++) stock_D[e * D / E] += load[e];
            for (int64_t d = 0; d < D; d++) stock_hi = stock_D[d] > stock_hi ? stock_D[d] : stock_hi;
            if (within_limit(stock_hi, D, tol_limit * (double)total)) {
                code = STOCK;
            } else {
                for (int64_t e = 0; e < E; e++) n_E[e] = 1;
                int64_t n = place(&w, load, n_E, rank_all), lean_hi = 0;
                for (int64_t d = 0; d < D; d++) lean_hi = w.rank_load[d] > lean_hi ? w.rank_load[d] : lean_hi;
                if (within_limit(lean_hi, D, tol_limit * (double)total)) {
                    code = LEAN;
                    replicas = slot_table(&w, n, rank_all, se, &unplaced);
                    placed_lean = 1;
                }
            }
        }
        if (code == FULL && !placed_lean) {
            replica_counts(load, E, N, D, n_E, g);
            int64_t n = place(&w, load, n_E, rank_all);
            replicas = slot_table(&w, n, rank_all, se, &unplaced);
        }
    }
    free(w.items), free(buf), free(g), free(w.hosted);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&vs);
    PyBuffer_Release(&vl);
    if (oom) return PyErr_NoMemory();
    return Py_BuildValue("(LLL)", (long long)code, (long long)replicas, (long long)unplaced);
}

static PyMethodDef methods[] = {
    {"fsep_layout", (PyCFunction)(void (*)(void))fsep_layout, METH_FASTCALL,
     "fsep's slot table from the expert loads (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_fsep_c", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__fsep_c(void) { return PyModule_Create(&module); }
