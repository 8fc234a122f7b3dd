/* ultraep's hot path, compiled: exact counts -> the owner-layout plan of the cascade at
 * T = ceil(total / D), in one call.
 *
 * It computes exactly what planners/ultraep.py computes on its cascade path (cascade.py `cascade`:
 * the same chain order, ties and integer arithmetic; `UltraEPPlanner._build`: the same slot table and
 * replica table), so the plans are bit-identical; tests/test_ultraep_kernel.py checks that on random
 * inputs. Everything else (stock plans, the threshold search when the cascade gives up, error
 * messages) stays in Python, which is also the fallback when this module is not built.
 *
 * cascade_plan(counts, D, E, ranks_per_node, slots, tol_limit, load_E, slot_DS, table, info) -> code
 *   counts   int64 [D, E], C-contiguous (read)
 *   tol_limit  1 + tolerance, or 0 for no tolerance
 *   load_E   int64 [E]                    (written: tokens per expert)
 *   slot_DS  int64 [D, ceil(E/D) + slots] (written on CASCADE: the slot table)
 *   table    int64 [4, E + D]             (written on CASCADE: columns 0 .. E+X-1 hold the replicas
 *                                          in (expert, rank) order: expert, rank, slot, quota)
 *   info     int64 [4]                    (written: T = ceil(mean), max stock rank load, exports X, total)
 * codes: 0 STOCK (keep the stock layout), 1 CASCADE (slot_DS, table written), 2 GAVE_UP (the cascade
 * cannot split some carry at taker cuts: search thresholds in Python), -1 a negative count (or a total
 * past 2^53).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_within.h"

enum { NEGATIVE = -1, STOCK = 0, CASCADE = 1, GAVE_UP = 2 };
static const int64_t NEVER = (int64_t)1 << 62; /* slack of the taker past the last one */

typedef struct {
    int64_t pos, key, d; /* chain sort key: node position, minus room or minus slack, rank */
} chain_key;

static int cmp_chain(const void *pa, const void *pb) {
    const chain_key *a = pa, *b = pb;
    if (a->pos != b->pos) return a->pos < b->pos ? -1 : 1;
    if (a->key != b->key) return a->key < b->key ? -1 : 1;
    return (a->d > b->d) - (a->d < b->d);
}

typedef struct {
    int64_t key, n; /* node order: sort key, node */
} node_key;

static int cmp_node(const void *pa, const void *pb) {
    const node_key *a = pa, *b = pb;
    if (a->key != b->key) return a->key < b->key ? -1 : 1;
    return (a->n > b->n) - (a->n < b->n);
}

/* cascade.py `node_order`: every node's position in the chain, `first` leading. */
static int node_order(const int64_t *net, int64_t N, int64_t first, int64_t *pos) {
    node_key *plus = malloc(sizeof(node_key) * (size_t)(N + 1));
    node_key *minus = malloc(sizeof(node_key) * (size_t)(N + 1));
    if (!plus || !minus) {
        free(plus);
        free(minus);
        return -1;
    }
    int64_t np_ = 0, nm = 0;
    for (int64_t n = 0; n < N; n++) {
        if (n == first) continue;
        if (net[n] > 0) plus[np_++] = (node_key){-net[n], n};
        else minus[nm++] = (node_key){net[n], n};
    }
    qsort(plus, (size_t)np_, sizeof(node_key), cmp_node);
    qsort(minus, (size_t)nm, sizeof(node_key), cmp_node);
    pos[first] = 0;
    int64_t run = net[first], i = 0, j = 0;
    for (int64_t k = 1; k < N; k++) {
        int64_t n;
        if (j >= nm || (run <= 0 && i < np_)) n = plus[i++].n;
        else n = minus[j++].n;
        pos[n] = k;
        run += net[n];
    }
    free(plus);
    free(minus);
    return 0;
}

typedef struct {
    int64_t load, e;
} owned;

static int cmp_owned(const void *pa, const void *pb) { /* hottest first, lower id on ties */
    const owned *a = pa, *b = pb;
    if (a->load != b->load) return a->load > b->load ? -1 : 1;
    return (a->e > b->e) - (a->e < b->e);
}

/* The walk of cascade.py `cascade` at threshold T. got_e/got_a [D] out; 0 on success, 1 if it gives up. */
static int walk(int64_t T, int64_t D, int64_t G, const int64_t *base, const int64_t *hot, const int64_t *hot_e,
                const int64_t *load_E, const int64_t *first, const int64_t *count, int64_t *got_e, int64_t *got_a,
                int *oom) {
    int rc = 1;
    chain_key *giv = malloc(sizeof(chain_key) * (size_t)D);
    chain_key *tak = malloc(sizeof(chain_key) * (size_t)D);
    int64_t *pos = calloc((size_t)D, sizeof(int64_t));
    int64_t *net = calloc((size_t)D, sizeof(int64_t));
    owned *own = NULL;
    if (!giv || !tak || !pos || !net) goto out_oom;
    int64_t ng = 0, nt = 0, lead = -1;
    for (int64_t d = 0; d < D; d++) {
        int64_t sd = T - base[d];
        net[d / G] -= sd;
        if (sd < 0) {
            giv[ng++] = (chain_key){0, -(hot[d] + sd), d};
            /* lead: the largest (key, rank), i.e. the least room, higher rank on ties */
            if (lead < 0 || giv[ng - 1].key >= giv[lead].key) lead = ng - 1;
        } else if (sd > 0) {
            tak[nt++] = (chain_key){0, -sd, d};
        }
    }
    if (ng == 0 || nt == 0) goto out; /* cannot happen above the mean; give up rather than guess */
    if (G < D) {                     /* nodes in chain order; else every rank shares position 0 */
        if (node_order(net, D / G, giv[lead].d / G, pos)) goto out_oom;
        for (int64_t i = 0; i < ng; i++) giv[i].pos = pos[giv[i].d / G];
        for (int64_t i = 0; i < nt; i++) tak[i].pos = pos[tak[i].d / G];
    }
    chain_key first_giver = giv[lead];
    giv[lead] = giv[ng - 1];
    qsort(giv, (size_t)(ng - 1), sizeof(chain_key), cmp_chain);
    memmove(giv + 1, giv, sizeof(chain_key) * (size_t)(ng - 1));
    giv[0] = first_giver;
    qsort(tak, (size_t)nt, sizeof(chain_key), cmp_chain);

    int64_t most = 0;
    for (int64_t d = 0; d < D; d++) most = count[d] > most ? count[d] : most;
    own = malloc(sizeof(owned) * (size_t)(most + 1));
    if (!own) goto out_oom;
    for (int64_t d = 0; d < D; d++) got_e[d] = -1, got_a[d] = 0;
    int64_t j = 0, c = 0, cur = -1, s_j = -tak[0].key;
#define NEXT_TAKER() (j++, s_j = j < nt ? -tak[j].key : NEVER)
    for (int64_t i = 0; i < ng; i++) {
        int64_t g = giv[i].d;
        while (s_j <= c) { /* the carry fills whole takers */
            int64_t t = tak[j].d;
            got_e[t] = cur, got_a[t] = s_j;
            c -= s_j;
            NEXT_TAKER();
        }
        if (c) got_e[g] = cur, got_a[g] = c; /* g absorbs the tail, passes its own expert on */
        c += base[g] - T;
        if (c <= hot[g]) {
            cur = hot_e[g];
            continue;
        }
        int64_t n = count[g], done = 0; /* several experts, changing only at taker cuts */
        for (int64_t k = 0; k < n; k++) own[k] = (owned){load_E[first[g] + k], first[g] + k};
        qsort(own, (size_t)n, sizeof(owned), cmp_owned);
        for (int64_t k = 0; k < n && !done; k++) {
            int64_t left = own[k].load, e = own[k].e;
            while (s_j <= left && s_j < c) {
                int64_t t = tak[j].d;
                got_e[t] = e, got_a[t] = s_j;
                c -= s_j;
                left -= s_j;
                NEXT_TAKER();
            }
            if (c <= left) cur = e, done = 1;
        }
        if (!done) goto out;
    }
    while (c > 0) { /* the last carry spreads over the next takers */
        if (j >= nt) goto out;
        int64_t t = tak[j].d;
        got_e[t] = cur, got_a[t] = s_j < c ? s_j : c;
        c -= s_j;
        NEXT_TAKER();
    }
#undef NEXT_TAKER
    rc = 0;
    goto out;
out_oom:
    *oom = 1;
out:
    free(giv);
    free(tak);
    free(pos);
    free(net);
    free(own);
    return rc;
}

/* load_E[e] = sum over d of counts[d, e]; returns the OR of all counts (negative iff one is), or -1
 * where they total more than 2^53 (then plan.py's check_counts names the problem, as for a negative
 * count). Sums wrap (unsigned) rather than overflow where the total is refused anyway. */
#define MAX_COUNT_TOTAL (((uint64_t)1) << 53)
static int64_t sum_columns(const int64_t *restrict counts, int64_t D, int64_t E, int64_t *restrict load_E) {
    int64_t sign = 0;
    for (int64_t e = 0; e < E; e++) load_E[e] = 0;
    for (int64_t d = 0; d < D; d++) {
        const int64_t *restrict row = counts + d * E;
        for (int64_t e = 0; e < E; e++) {
            load_E[e] = (int64_t)((uint64_t)load_E[e] + (uint64_t)row[e]);
            sign |= row[e];
        }
    }
    if (sign < 0 || (uint64_t)sign <= MAX_COUNT_TOTAL / (uint64_t)(D * E)) return sign; /* every count <= sign */
    uint64_t total = 0; /* each count checked before it is added: the total never wraps */
    for (int64_t i = 0; i < D * E && total <= MAX_COUNT_TOTAL; i++)
        total = (uint64_t)counts[i] > MAX_COUNT_TOTAL ? MAX_COUNT_TOTAL + 1 : total + (uint64_t)counts[i];
    return total > MAX_COUNT_TOTAL ? -1 : sign;
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

static PyObject *cascade_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "cascade_plan takes 10 arguments");
        return NULL;
    }
    int64_t D = PyLong_AsLongLong(args[1]), E = PyLong_AsLongLong(args[2]);
    int64_t rpn = PyLong_AsLongLong(args[3]), S = PyLong_AsLongLong(args[4]);
    double tol_limit = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (D < 1 || E < 1 || rpn < 1 || S < 0) {
        PyErr_SetString(PyExc_ValueError, "cascade_plan: bad sizes");
        return NULL;
    }
    int64_t L = (E + D - 1) / D, W = L + S;
    Py_buffer vc, vl, vs, vt, vi;
    if (get_buffer(args[0], &vc, D * E, 0, "counts")) return NULL;
    if (get_buffer(args[6], &vl, E, 1, "load_E")) goto fail_c;
    if (get_buffer(args[7], &vs, D * W, 1, "slot_DS")) goto fail_l;
    if (get_buffer(args[8], &vt, 4 * (E + D), 1, "table")) goto fail_s;
    if (get_buffer(args[9], &vi, 4, 1, "info")) goto fail_t;

    const int64_t *counts = vc.buf;
    int64_t *load_E = vl.buf, *se = vs.buf, *table = vt.buf, *info = vi.buf;
    long code = STOCK;
    int oom = 0;
    int64_t *scratch = NULL;
    Py_BEGIN_ALLOW_THREADS
    /* tokens per expert, and whether any count is negative */
    int64_t sign = sum_columns(counts, D, E, load_E);
    scratch = malloc(sizeof(int64_t) * (size_t)(7 * D + 3 * E));
    if (sign < 0) {
        code = NEGATIVE;
    } else if (!scratch) {
        oom = 1;
    } else {
        /* the owner layout: rank d owns experts first[d] .. first[d] + count[d] - 1 (floor(e*D/E) == d) */
        int64_t *first = scratch, *count = first + D, *base = count + D, *hot = base + D, *hot_e = hot + D;
        int64_t *got_e = hot_e + D, *got_a = got_e + D;
        int64_t *cur_E = got_a + D, *owner_col_E = cur_E + E, *exported_E = owner_col_E + E;
        int64_t total = 0, hi = 0;
        for (int64_t d = 0; d < D; d++) first[d] = 0, count[d] = 0, base[d] = 0, hot[d] = 0, hot_e[d] = E;
        for (int64_t e = 0; e < E; e++) {
            int64_t o = e * D / E, l = load_E[e];
            if (count[o]++ == 0) first[o] = e;
            base[o] += l;
            if (hot_e[o] == E || l > hot[o]) hot[o] = l, hot_e[o] = e; /* lower id on ties */
            total += l;
        }
        for (int64_t d = 0; d < D; d++) hi = base[d] > hi ? base[d] : hi;
        int64_t T = (total + D - 1) / D;
        info[0] = T, info[1] = hi, info[2] = 0, info[3] = total;
        int tolerated = tol_limit > 0 && within_limit(hi, D, tol_limit * (double)total);
        if (hi > T && S > 0 && !tolerated) {
            /* nodes order the chain only where every rank owns at most one expert */
            int64_t G = (E <= D && rpn < D) ? rpn : D;
            if (walk(T, D, G, base, hot, hot_e, load_E, first, count, got_e, got_a, &oom)) {
                code = GAVE_UP;
            } else {
                code = CASCADE;
                /* slot table: owners, the export (if any) in the first redundant slot */
                for (int64_t d = 0; d < D; d++) {
                    int64_t *row = se + d * W;
                    for (int64_t s = 0; s < L; s++) row[s] = s < count[d] ? first[d] + s : -1;
                    row[L] = got_e[d];
                    for (int64_t s = L + 1; s < W; s++) row[s] = -1;
                }
                /* replicas in (expert, rank) order: per expert, its exports in rank order with the
                 * owner at its place among them; the owner keeps what it did not export */
                int64_t X = 0, n = E + D, at = 0;
                for (int64_t e = 0; e < E; e++) cur_E[e] = 0, owner_col_E[e] = -1, exported_E[e] = 0;
                for (int64_t d = 0; d < D; d++)
                    if (got_e[d] >= 0) cur_E[got_e[d]]++, X++;
                for (int64_t e = 0; e < E; e++) { /* cur_E: exports of e -> next free column of e */
                    int64_t k = cur_E[e];
                    cur_E[e] = at;
                    at += k + 1;
                }
                int64_t *ex = table, *rk = table + n, *sl = table + 2 * n, *qu = table + 3 * n;
                for (int64_t d = 0; d < D; d++) {
                    int64_t e = got_e[d];
                    if (e < 0) continue;
                    if (owner_col_E[e] < 0 && e * D / E < d) owner_col_E[e] = cur_E[e]++;
                    int64_t col = cur_E[e]++;
                    ex[col] = e, rk[col] = d, sl[col] = L, qu[col] = got_a[d];
                    exported_E[e] += got_a[d];
                }
                for (int64_t e = 0; e < E; e++) {
                    int64_t col = owner_col_E[e] < 0 ? cur_E[e] : owner_col_E[e], o = e * D / E;
                    ex[col] = e, rk[col] = o, sl[col] = e - first[o], qu[col] = load_E[e] - exported_E[e];
                }
                info[2] = X;
            }
        }
    }
    Py_END_ALLOW_THREADS
    free(scratch);
    PyBuffer_Release(&vi);
    PyBuffer_Release(&vt);
    PyBuffer_Release(&vs);
    PyBuffer_Release(&vl);
    PyBuffer_Release(&vc);
    if (oom) return PyErr_NoMemory();
    return PyLong_FromLong(code);
fail_t:
    PyBuffer_Release(&vt);
fail_s:
    PyBuffer_Release(&vs);
fail_l:
    PyBuffer_Release(&vl);
fail_c:
    PyBuffer_Release(&vc);
    return NULL;
}

static PyMethodDef methods[] = {
    {"cascade_plan", (PyCFunction)(void (*)(void))cascade_plan, METH_FASTCALL,
     "ultraep's cascade plan at T = ceil(mean) (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_ultraep_c", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__ultraep_c(void) { return PyModule_Create(&module); }
