/* The simulator's distinct-token model (sim/model.py `distinct_ratio_DV`), its loop compiled.
 *
 * The model multiplies one truncated polynomial factor per expert into three polynomials per
 * (source rank s, node b); numpy does it one expert at a time over [D, V] planes, ten small calls
 * per expert, so a DeepSeek-V3-sized layer (256 experts, 64 ranks, 8 nodes, top-8) took ~23 ms and
 * a `simulate run` step ~9 s of its ~17 s. This loop does the same float operations in the same
 * order (built with -ffp-contract=off: no fused multiply-adds), so its results are bit-identical
 * to the numpy loop's (tests/test_sim_dedup_model.py checks that on random layers).
 *
 * distinct_pairs(p_ED, q_ED, pf_EDV, pb_EDV, E, D, V, k, distinct_DV, pairs_DV) -> None
 *   p_ED, q_ED       float64 [E, D]    (read): each used expert's pick probability p and 1 - p
 *   pf_EDV, pb_EDV   float64 [E, D, V] (read): p x the share of its pairs on node b, and p - that
 *   distinct_DV      float64 [D, V]    (written): A[k] - B[k] (in the model's docstring's terms)
 *   pairs_DV         float64 [D, V]    (written): C[k]
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t n, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->itemsize != 8 || !view->format || view->format[0] != 'd' || view->format[1] || view->len < n * 8) {
        PyErr_Format(PyExc_ValueError, "%s: expected at least %zd float64 values", name, n);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* One source rank s: the three polynomials (degree <= k) for every node b after all E factors.
 * B and C are degree-major ([k + 1, V]), so each degree's update runs over the nodes in one
 * contiguous loop the compiler can vectorize (the same operations per element, so the same bits). */
static void one_source(const double *restrict p_ED, const double *restrict q_ED, const double *restrict pf_EDV,
                       const double *restrict pb_EDV, int64_t E, int64_t D, int64_t V, int64_t k, int64_t s,
                       double *restrict A, double *restrict B, double *restrict C, double *restrict distinct_V,
                       double *restrict pairs_V) {
    for (int64_t j = 0; j <= k; j++) A[j] = 0.0;
    A[0] = 1.0;
    for (int64_t b = 0; b < (k + 1) * V; b++) B[b] = 0.0, C[b] = 0.0;
    for (int64_t b = 0; b < V; b++) B[b] = 1.0;
    for (int64_t i = 0; i < E; i++) {
        const double p = p_ED[i * D + s], q = q_ED[i * D + s];
        const double *pf = pf_EDV + (i * D + s) * V, *pb = pb_EDV + (i * D + s) * V;
        /* numpy: tmp = C[:-1] * p; tmp += A[:-1] * pf; C *= q; C[1:] += tmp, and the same for B
         * with pb and without the A term (old values on the right: from the top degree down, degree
         * j - 1 is still the old one when degree j is made) */
        for (int64_t j = k; j >= 1; j--) {
            const double a = A[j - 1];
            double *Cj = C + j * V, *Bj = B + j * V;
            const double *Cl = C + (j - 1) * V, *Bl = B + (j - 1) * V;
            for (int64_t b = 0; b < V; b++) {
                double t = Cl[b] * p;
                double u = a * pf[b];
                t = t + u;
                double c = Cj[b] * q;
                Cj[b] = c + t;
                double w = Bl[b] * pb[b];
                double x = Bj[b] * q;
                Bj[b] = x + w;
            }
        }
        for (int64_t b = 0; b < V; b++) C[b] = C[b] * q, B[b] = B[b] * q;
        /* numpy: tmp_a = A[:-1] * p; A *= q; A[1:] += tmp_a (after B and C took the old A) */
        for (int64_t j = k; j >= 1; j--) {
            double t = A[j - 1] * p;
            double x = A[j] * q;
            A[j] = x + t;
        }
        A[0] = A[0] * q;
    }
    for (int64_t b = 0; b < V; b++) {
        distinct_V[b] = A[k] - B[k * V + b];
        pairs_V[b] = C[k * V + b];
    }
}

static PyObject *distinct_pairs(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "distinct_pairs takes 10 arguments");
        return NULL;
    }
    int64_t E = PyLong_AsLongLong(args[4]), D = PyLong_AsLongLong(args[5]);
    int64_t V = PyLong_AsLongLong(args[6]), k = PyLong_AsLongLong(args[7]);
    if (PyErr_Occurred()) return NULL;
    if (E < 0 || D < 1 || V < 1 || k < 1) {
        PyErr_SetString(PyExc_ValueError, "distinct_pairs: bad sizes");
        return NULL;
    }
    const char *names[6] = {"p_ED", "q_ED", "pf_EDV", "pb_EDV", "distinct_DV", "pairs_DV"};
    const int64_t sizes[6] = {E * D, E * D, E * D * V, E * D * V, D * V, D * V};
    const int slot[6] = {0, 1, 2, 3, 8, 9};
    Py_buffer v[6];
    for (int i = 0; i < 6; i++)
        if (get_buffer(args[slot[i]], &v[i], sizes[i], i >= 4, names[i])) {
            for (int j = 0; j < i; j++) PyBuffer_Release(&v[j]);
            return NULL;
        }
    double *work = malloc(sizeof(double) * (size_t)((k + 1) * (2 * V + 1)));
    if (work) {
        Py_BEGIN_ALLOW_THREADS
        for (int64_t s = 0; s < D; s++)
            one_source(v[0].buf, v[1].buf, v[2].buf, v[3].buf, E, D, V, k, s, work, work + (k + 1),
                       work + (k + 1) * (V + 1), (double *)v[4].buf + s * V, (double *)v[5].buf + s * V);
        Py_END_ALLOW_THREADS
    }
    free(work);
    for (int i = 0; i < 6; i++) PyBuffer_Release(&v[i]);
    if (!work) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"distinct_pairs", (PyCFunction)(void (*)(void))distinct_pairs, METH_FASTCALL,
     "the distinct-token model's polynomials at degree k (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_dedup_c", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__dedup_c(void) { return PyModule_Create(&module); }
