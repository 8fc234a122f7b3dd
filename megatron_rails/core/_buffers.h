/* Taking the int64 arrays the compiled helpers read and write (core/_route_c.c,
 * core/planners/_flow_c.c): C-contiguous buffers of at least the size a call needs, released on
 * every path. */
#ifndef MEGATRON_RAILS_BUFFERS_H
#define MEGATRON_RAILS_BUFFERS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static inline int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t n, int writable, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (view->itemsize != 8 || view->len < n * 8) {
        PyErr_Format(PyExc_ValueError, "%s: expected at least %zd int64 values, got %zd bytes", name, n, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static inline void release_buffers(Py_buffer *v, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&v[i]);
}

/* args[slot[i]] for i < n as int64 C-contiguous buffers of at least sizes[i] values into v[i],
 * writable from index first_out on: 0, or -1 with the error set and every buffer taken released. */
static inline int get_buffers(PyObject *const *args, const int *slot, const int64_t *sizes,
                              const char *const *names, int n, int first_out, Py_buffer *v) {
    for (int i = 0; i < n; i++)
        if (get_buffer(args[slot[i]], &v[i], sizes[i], i >= first_out, names[i])) {
            release_buffers(v, i);
            return -1;
        }
    return 0;
}

#endif
