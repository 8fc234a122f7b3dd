/* The exact min-max flow of planners/flow.py, compiled: Dinkelbach's iteration over max-flows at
 * T = p/q, then the integer flow at ceil(T*), on the network of a placement's flexible experts.
 *
 * It runs exactly what flow.py runs (`_Network.solve` with its greedy first-fit start and rescaled
 * warm starts, `_dinic` with the same adjacency order, BFS and DFS, `cut_ratio`), so the quotas are
 * bit-identical; tests/test_flow_kernel.py checks that on random placements. It builds the network
 * of the flexible experts itself (flow.py's _Shape, which the Python iteration keeps per placement);
 * the first pass (flow_split), the checks and every error stay in Python, which is also the fallback
 * where this is not built. Every product stays below 2^63 when total * num_ranks < 2^62 (the caller
 * checks).
 *
 * flow_solve(load_E, base_D, flex, ptr, n_E, rank_R, quota, load_out, E_all, R_all, num_ranks, E_flex,
 *            total, base_max) -> (status, t_int, p, q, flows)
 *   load_E   int64 [E_all] tokens per expert; base_D int64 [num_ranks] each rank's fixed load (its
 *            single-replica experts', flow_split's); flex int64 [E_flex] the flexible experts (read)
 *   ptr, n_E, rank_R: the placement's expert_ptr [E_all + 1], replicas_per_expert_E [E_all],
 *            replica_rank_R [R_all] (read)
 *   quota    int64 [R_all]: the flexible replicas' quotas at t_int written in (when status is 0)
 *   load_out int64 [num_ranks]: every rank's load at t_int (written when status is 0)
 *   total, base_max: all experts' tokens, the largest base load
 * status: 0 solved, 1 the iteration did not converge (a bug guard, as in flow.py), 2 a cut with no
 * rank (flow.py raises there: the caller runs it to get its error).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../_buffers.h"

typedef struct {
    int64_t E, R, D, n, t;          /* flexible experts, replicas, rank nodes; nodes; the sink */
    const int64_t *load, *base, *kstart, *node;
    int64_t *adj_start, *adj, *to;  /* adjacency (CSR, flow.py's order) and edge heads */
    int64_t *cap, *f, *src, *res, *out, *level, *queue, *it, *path;
    int64_t q;                      /* units of the last solve (0: none yet) */
    int64_t flex_total;
} net_t;

static int64_t gcd64(int64_t a, int64_t b) {
    while (b) {
        int64_t r = a % b;
        a = b, b = r;
    }
    return a < 0 ? -a : a;
}

/* flow.py _Shape.graph: edge 2i and its reverse 2i+1; source->expert k (i = k), expert->host
 * (i = E + m), rank->sink (i = E + R + j). Experts list their hosts, then the edge back to the
 * source; ranks the sink first, then their replicas' reverse edges in replica order. */
static void build_graph(net_t *g) {
    int64_t E = g->E, R = g->R, D = g->D, t = g->t, k = 0, pos = 0;
    int64_t *st = g->adj_start, *adj = g->adj, *to = g->to;
    for (k = 0; k < E; k++) to[2 * k] = 1 + k, to[2 * k + 1] = 0;
    for (k = 0; k < E; k++)
        for (int64_t m = g->kstart[k]; m < g->kstart[k + 1]; m++)
            to[2 * (E + m)] = 1 + E + g->node[m], to[2 * (E + m) + 1] = 1 + k;
    for (int64_t j = 0; j < D; j++) to[2 * (E + R + j)] = t, to[2 * (E + R + j) + 1] = 1 + E + j;
    st[0] = 0; /* the source */
    for (k = 0; k < E; k++) adj[pos++] = 2 * k;
    for (k = 0; k < E; k++) { /* expert k: node 1 + k */
        st[1 + k] = pos;
        for (int64_t m = g->kstart[k]; m < g->kstart[k + 1]; m++) adj[pos++] = 2 * (E + m);
        adj[pos++] = 2 * k + 1;
    }
    /* rank node j (node 1 + E + j): the sink first, then its replicas' reverse edges in replica
     * order (a counting sort; g->it is scratch until the first max-flow) */
    int64_t *at = g->it;
    for (int64_t j = 0; j < D; j++) at[j] = 0;
    for (int64_t m = 0; m < R; m++) at[g->node[m]]++;
    for (int64_t j = 0; j < D; j++) {
        int64_t c = at[j];
        st[1 + E + j] = pos;
        adj[pos++] = 2 * (E + R + j);
        at[j] = pos; /* where node j's replicas go */
        pos += c;
    }
    for (int64_t m = 0; m < R; m++) adj[at[g->node[m]]++] = 2 * (E + m) + 1;
    st[t] = pos; /* the sink */
    for (int64_t j = 0; j < D; j++) adj[pos++] = 2 * (E + R + j) + 1;
    st[t + 1] = pos;
}

/* flow.py _dinic on g->cap, stopping once `need` units are pushed; g->level as it leaves it. */
static int64_t dinic(net_t *g, int64_t need) {
    int64_t n = g->n, s = 0, t = g->t, pushed = 0;
    int64_t *level = g->level, *queue = g->queue, *it = g->it, *path = g->path, *cap = g->cap;
    const int64_t *st = g->adj_start, *adj = g->adj, *to = g->to;
    for (int64_t v = 0; v < n; v++) level[v] = 0;
    while (pushed < need) {
        for (int64_t v = 0; v < n; v++) level[v] = -1;
        level[s] = 0;
        int64_t qn = 0;
        queue[qn++] = s;
        for (int64_t qi = 0; qi < qn; qi++) {
            int64_t v = queue[qi], lv = level[v] + 1;
            if (level[t] >= 0 && lv > level[t]) break;
            for (int64_t a = st[v]; a < st[v + 1]; a++) {
                int64_t e = adj[a];
                if (cap[e] && level[to[e]] < 0) level[to[e]] = lv, queue[qn++] = to[e];
            }
        }
        if (level[t] < 0) break;
        for (int64_t v = 0; v < n; v++) it[v] = 0;
        int64_t np = 0, v = s;
        for (;;) {
            if (v == t) {
                int64_t b = cap[path[0]];
                for (int64_t i = 1; i < np; i++)
                    if (cap[path[i]] < b) b = cap[path[i]];
                for (int64_t i = 0; i < np; i++) cap[path[i]] -= b, cap[path[i] ^ 1] += b;
                pushed += b;
                if (pushed >= need) break;
                int64_t i = 0;
                while (cap[path[i]]) i++;
                np = i;
                v = np ? to[path[np - 1]] : s;
                continue;
            }
            int64_t i = it[v], na = st[v + 1] - st[v], lv = level[v] + 1, e = -1;
            const int64_t *a = adj + st[v];
            while (i < na) {
                e = a[i];
                if (cap[e] && level[to[e]] == lv) break;
                i++;
            }
            it[v] = i;
            if (i < na) {
                path[np++] = e;
                v = to[e];
            } else if (v == s) {
                break;
            } else {
                level[v] = -1;
                np--;
                v = np ? to[path[np - 1]] : s;
                it[v]++;
            }
        }
    }
    return pushed;
}

/* flow.py _Network.solve at T = p/q: 1 if every flexible token fits, else 0. */
static int solve(net_t *g, int64_t p, int64_t q) {
    int64_t E = g->E, R = g->R, D = g->D, q0 = g->q;
    int64_t *src = g->src, *res = g->res, *out = g->out, *f = g->f, *cap = g->cap;
    for (int64_t k = 0; k < E; k++) src[k] = q * g->load[k], out[k] = 0;
    for (int64_t j = 0; j < D; j++) res[j] = p - q * g->base[j];
    if (q0) {
        for (int64_t k = 0; k < E; k++)
            for (int64_t m = g->kstart[k]; m < g->kstart[k + 1]; m++) {
                f[m] = f[m] * q / q0; /* non-negative: C's division floors as Python's // */
                out[k] += f[m];
                res[g->node[m]] -= f[m];
            }
    } else {
        for (int64_t k = 0; k < E; k++) {
            int64_t r = src[k];
            for (int64_t m = g->kstart[k]; m < g->kstart[k + 1]; m++) f[m] = 0;
            for (int64_t m = g->kstart[k]; m < g->kstart[k + 1]; m++) {
                int64_t c = res[g->node[m]];
                if (c > 0) {
                    int64_t a = r < c ? r : c;
                    f[m] = a;
                    res[g->node[m]] = c - a;
                    r -= a;
                    if (!r) break;
                }
            }
            out[k] = src[k] - r;
        }
    }
    g->q = q;
    int64_t need = 0;
    for (int64_t k = 0; k < E; k++) need += src[k] - out[k];
    if (!need) return 1;
    int64_t inf = q * g->flex_total + 1;
    for (int64_t k = 0; k < E; k++) cap[2 * k] = src[k] - out[k], cap[2 * k + 1] = out[k];
    for (int64_t m = 0; m < R; m++) cap[2 * (E + m)] = inf - f[m], cap[2 * (E + m) + 1] = f[m];
    for (int64_t j = 0; j < D; j++)
        cap[2 * (E + R + j)] = res[j], cap[2 * (E + R + j) + 1] = p - q * g->base[j] - res[j];
    int64_t pushed = dinic(g, need);
    for (int64_t m = 0; m < R; m++) f[m] = cap[2 * (E + m) + 1];
    return pushed == need;
}

/* flow.py _Network.cut_ratio: w(X) / |X| (reduced) for the ranks X the last BFS reached; 0 if
 * X is empty. */
static int cut_ratio(net_t *g, int64_t *p, int64_t *q) {
    int64_t E = g->E, D = g->D, w = 0, size = 0;
    int64_t *in = g->queue; /* scratch: the rank nodes on the source side */
    for (int64_t j = 0; j < D; j++) {
        in[j] = g->level[E + 1 + j] >= 0;
        if (in[j]) w += g->base[j], size++;
    }
    for (int64_t k = 0; k < E; k++) {
        int64_t inside = 1;
        for (int64_t m = g->kstart[k]; m < g->kstart[k + 1] && inside; m++) inside = (int)in[g->node[m]];
        if (inside) w += g->load[k];
    }
    if (!size) return 0;
    int64_t c = gcd64(w, size);
    *p = w / c, *q = size / c;
    return 1;
}

/* The iteration on g (its arrays set): 0 solved (f at t_int), 1 not converged, 2 an empty cut. */
static int iterate(net_t *g, int64_t ranks, int64_t total, int64_t base_max, int64_t *t_int, int64_t *p,
                   int64_t *q, int64_t *flows) {
    /* T = max(total / ranks, base_max), each reduced as Fraction keeps it */
    int64_t c = gcd64(total, ranks), tp = total / c, tq = ranks / c;
    if (tp < base_max * tq) tp = base_max, tq = 1;
    *p = tp, *q = tq;
    for (int64_t i = 0; i < ranks + 2; i++) {
        ++*flows;
        if (solve(g, *p, *q)) {
            *t_int = (*p + *q - 1) / *q;
            if (*q == 1) return 0;
            ++*flows; /* the integer flow at ceil(T*), from the fractional one floored */
            return solve(g, *t_int, 1) ? 0 : 1; /* t_int >= T* is feasible: a bug guard as in flow.py */
        }
        if (!cut_ratio(g, p, q)) return 2;
    }
    return 1;
}

static PyObject *flow_solve(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 14) {
        PyErr_SetString(PyExc_TypeError, "flow_solve takes 14 arguments");
        return NULL;
    }
    int64_t EA = PyLong_AsLongLong(args[8]), RA = PyLong_AsLongLong(args[9]), ranks = PyLong_AsLongLong(args[10]);
    int64_t E = PyLong_AsLongLong(args[11]), total = PyLong_AsLongLong(args[12]), base_max = PyLong_AsLongLong(args[13]);
    if (PyErr_Occurred()) return NULL;
    if (EA < 1 || RA < 0 || ranks < 1 || E < 1 || E > EA || total < 0 || base_max < 0) {
        PyErr_SetString(PyExc_ValueError, "flow_solve: bad sizes");
        return NULL;
    }
    Py_buffer v[8];
    const char *names[8] = {"load_E", "base_D", "flex", "ptr", "n_E", "rank_R", "quota", "load_out"};
    const int64_t sizes[8] = {EA, ranks, E, EA + 1, EA, RA, RA, ranks};
    const int slot[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    if (get_buffers(args, slot, sizes, names, 8, 6, v)) return NULL;
    const int64_t *load_all = v[0].buf, *base_all = v[1].buf, *flex = v[2].buf, *ptr = v[3].buf, *n_all = v[4].buf;
    const int64_t *rank_all = v[5].buf;
    int64_t *quota = v[6].buf, *load_out = v[7].buf;
    int64_t R = 0, bad = 0;
    for (int64_t k = 0; k < E; k++) {
        int64_t e = flex[k];
        if (e < 0 || e >= EA || n_all[e] < 2 || ptr[e] < 0 || ptr[e] + n_all[e] > RA) bad = 1;
        else R += n_all[e];
    }
    if (bad) {
        release_buffers(v, 8);
        PyErr_SetString(PyExc_ValueError, "flow_solve: a flexible expert out of range or with fewer than 2 replicas");
        return NULL;
    }
    /* the network of the flexible experts (flow.py _Shape): their replicas in expert order, the
     * ranks hosting one numbered in ascending rank order */
    int64_t D = 0, n = E + ranks + 2, edges = 2 * (E + R + ranks);
    size_t words = (size_t)(4 * E + 1 + 3 * R + 3 * ranks + (n + 1) + 3 * edges + 4 * n + R);
    int64_t *mem = malloc(sizeof(int64_t) * words);
    if (!mem) {
        release_buffers(v, 8);
        return PyErr_NoMemory();
    }
    int64_t *load = mem, *kstart = load + E, *src = kstart + E + 1, *out = src + E, *rep = out + E;
    int64_t *node = rep + R, *f = node + R, *node_of = f + R, *base = node_of + ranks, *res = base + ranks;
    int64_t *adj_start = res + ranks, *adj = adj_start + n + 1, *to = adj + edges, *cap = to + edges;
    int64_t *level = cap + edges, *queue = level + n, *it = queue + n, *path = it + n;
    kstart[0] = 0;
    for (int64_t k = 0; k < E; k++) {
        int64_t e = flex[k];
        load[k] = load_all[e];
        kstart[k + 1] = kstart[k] + n_all[e];
        for (int64_t m = kstart[k]; m < kstart[k + 1]; m++) rep[m] = ptr[e] + (m - kstart[k]);
    }
    for (int64_t d = 0; d < ranks; d++) node_of[d] = -1;
    for (int64_t m = 0; m < R && !bad; m++) {
        int64_t d = rank_all[rep[m]];
        if (d < 0 || d >= ranks) bad = 1;
        else node_of[d] = 0;
    }
    for (int64_t d = 0; d < ranks && !bad; d++)
        if (node_of[d] >= 0) base[D] = base_all[d], node_of[d] = D++;
    for (int64_t m = 0; m < R && !bad; m++) node[m] = node_of[rank_all[rep[m]]];
    int64_t t_int = 0, p = 0, q = 1, flows = 0;
    int status = 2;
    if (!bad) {
        net_t g = {.E = E, .R = R, .D = D, .n = E + D + 2, .t = E + D + 1, .load = load, .base = base,
                   .kstart = kstart, .node = node, .adj_start = adj_start, .adj = adj, .to = to, .cap = cap,
                   .f = f, .src = src, .res = res, .out = out, .level = level, .queue = queue, .it = it,
                   .path = path, .q = 0, .flex_total = 0};
        for (int64_t k = 0; k < E; k++) g.flex_total += load[k];
        build_graph(&g);
        status = iterate(&g, ranks, total, base_max, &t_int, &p, &q, &flows);
    }
    if (status == 0) {
        for (int64_t d = 0; d < ranks; d++) load_out[d] = base_all[d];
        for (int64_t m = 0; m < R; m++) quota[rep[m]] = f[m], load_out[rank_all[rep[m]]] += f[m];
    }
    free(mem);
    release_buffers(v, 8);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "flow_solve: a replica's rank out of range");
        return NULL;
    }
    return Py_BuildValue("(iLLLL)", status, (long long)t_int, (long long)p, (long long)q, (long long)flows);
}

static PyMethodDef methods[] = {
    {"flow_solve", (PyCFunction)(void (*)(void))flow_solve, METH_FASTCALL,
     "flow_solve(load_E, base_D, flex, ptr, n_E, rank_R, quota, load_out, E_all, R_all, num_ranks, E_flex, total, "
     "base_max) -> (status, t_int, p, q, flows)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_flow_c", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__flow_c(void) { return PyModule_Create(&module); }
