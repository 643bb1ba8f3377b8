// The qfp8._C Python module. Loading it runs the torch.library registrations
// of every translation unit (the ops' CPU and Autograd kernels, the private
// helpers); its own functions are the eager entry and two setters.
#include <Python.h>

#include "python_entry.h"

namespace {

PyMethodDef kMethods[] = {
    {"scaled_linear_cpu_eager",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(qfp8::scaled_linear_cpu_eager)), METH_FASTCALL,
     "torch.ops.qfp8.scaled_linear_cpu without the dispatcher's argument boxing, for plain CPU tensors in eager "
     "mode; any other call goes to the fallback set by _set_eager_fallback."},
    {"_set_eager_fallback", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(qfp8::set_eager_fallback)),
     METH_FASTCALL, "Sets the callable that takes every call the eager entry does not, and torch.nn.Parameter."},
    {"_set_differentiable", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(qfp8::set_differentiable)),
     METH_FASTCALL, "Sets the callable that takes the calls of an op (by name) that need a gradient."},
    {nullptr, nullptr, 0, nullptr}};

struct PyModuleDef qfp8_module = {PyModuleDef_HEAD_INIT, "_C", "qfp8 CPU kernels, registered as torch.ops.qfp8.*", -1,
                                  kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&qfp8_module); }
