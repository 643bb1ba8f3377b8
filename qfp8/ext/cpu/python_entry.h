// The functions of the qfp8._C Python module (its method table is in
// python_module.cpp): the eager entry (eager_entry.cpp) and the gradient
// path's registration (autograd.cpp).
#pragma once

#include <Python.h>

namespace qfp8 {

PyObject* scaled_linear_cpu_eager(PyObject* module, PyObject* const* args, Py_ssize_t nargs);
PyObject* set_eager_fallback(PyObject* module, PyObject* const* args, Py_ssize_t nargs);
PyObject* set_differentiable(PyObject* module, PyObject* const* args, Py_ssize_t nargs);

}  // namespace qfp8
