// qfp8._C.scaled_linear_cpu_eager(x, packed_weight, weight_scale, bias,
// input_scale, out_features, in_features, block_size, activation,
// activation_dtype) computes what torch.ops.qfp8.scaled_linear_cpu computes,
// for QLinear's eager fast path. A call through torch.ops boxes its ten
// arguments into IValues and back, which at M = 1 costs as much as the
// kernel of a small layer; this entry parses them itself and calls the
// kernel directly. Whenever the dispatcher has work to do, it hands the
// call, unchanged, to the registered fallback (the op's OpOverload): a
// tensor subclass, a __torch_function__ or dispatch mode, functorch or any
// other dispatch key included in TLS, autograd (grad mode on and an input
// requiring grad), a profiler or other RecordFunction callback, or a tensor
// that is not a plain strided CPU tensor.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <Python.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "bindings.h"
#include "python_entry.h"

namespace qfp8 {
namespace {

PyObject* g_eager_fallback = nullptr;
PyObject* g_parameter_type = nullptr;  // torch.nn.Parameter, whose __torch_function__ is disabled

// A plain CPU tensor: exactly torch.Tensor (or torch.nn.Parameter for the
// bias), so no __torch_function__ override, and its dispatch keys are the
// CPU backend's alone, besides autograd's (absent in inference tensors) and
// autocast's (which the op falls through).
bool plain_cpu_tensor(PyObject* obj, bool may_be_parameter) {
  if (!(THPVariable_CheckExact(obj) ||
        (may_be_parameter && reinterpret_cast<PyObject*>(Py_TYPE(obj)) == g_parameter_type)))
    return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  const c10::DispatchKeySet keys =
      t.key_set() - c10::autograd_dispatch_keyset_with_ADInplaceOrView - c10::autocast_dispatch_keyset;
  return keys == c10::DispatchKeySet(c10::DispatchKey::CPU) && t.layout() == at::kStrided;
}

bool parse_int(PyObject* obj, int64_t& value) {
  if (!PyLong_Check(obj)) return false;
  value = PyLong_AsLongLong(obj);
  return !(value == -1 && PyErr_Occurred());
}

}  // namespace

// Whether x carries a forward-mode tangent (a dual tensor) at one of the first levels; forward AD and
// torch.func.jvp open levels from 0 and rarely nest deeply.
bool has_forward_grad(const at::Tensor& x) {
  for (uint64_t level = 0; level < 4; ++level) {
    if (x._fw_grad(level).defined()) return true;
  }
  return false;
}

PyObject* scaled_linear_cpu_eager(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (g_eager_fallback == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "qfp8._C.scaled_linear_cpu_eager: no fallback set");
    return nullptr;
  }
  auto fallback = [&]() { return PyObject_Vectorcall(g_eager_fallback, args, static_cast<size_t>(nargs), nullptr); };
  if (nargs != 10) return fallback();
  PyObject *x = args[0], *packed = args[1], *scale = args[2], *bias = args[3], *input_scale = args[4];
  if (!plain_cpu_tensor(x, false) || !plain_cpu_tensor(packed, false) || !plain_cpu_tensor(scale, false) ||
      (bias != Py_None && !plain_cpu_tensor(bias, true)) ||
      (input_scale != Py_None && !plain_cpu_tensor(input_scale, false)))
    return fallback();
  if (at::impl::torch_function_mode_enabled() || c10::impl::dispatch_mode_enabled() ||
      !(c10::impl::tls_local_dispatch_key_set().included_ - c10::default_included_set).empty() || at::hasCallbacks())
    return fallback();
  const at::Tensor& xt = THPVariable_Unpack(x);
  std::optional<at::Tensor> bias_t, input_scale_t;
  if (bias != Py_None) bias_t = THPVariable_Unpack(bias);
  if (input_scale != Py_None) input_scale_t = THPVariable_Unpack(input_scale);
  if (c10::GradMode::is_enabled() && (xt.requires_grad() || (bias_t && bias_t->requires_grad()))) return fallback();
  if (has_forward_grad(xt)) return fallback();  // the op's Autograd kernel refuses forward-mode AD
  int64_t n = 0, k = 0;
  PyObject* block = args[7];
  if (!parse_int(args[5], n) || !parse_int(args[6], k) || !(PyList_Check(block) || PyTuple_Check(block)) ||
      !PyUnicode_Check(args[8]) || !THPDtype_Check(args[9])) {
    PyErr_Clear();
    return fallback();
  }
  std::vector<int64_t> block_size(static_cast<size_t>(PySequence_Fast_GET_SIZE(block)));
  for (size_t i = 0; i < block_size.size(); ++i) {
    if (!parse_int(PySequence_Fast_GET_ITEM(block, i), block_size[i])) {
      PyErr_Clear();
      return fallback();
    }
  }
  Py_ssize_t activation_len = 0;
  const char* activation = PyUnicode_AsUTF8AndSize(args[8], &activation_len);
  if (activation == nullptr) return nullptr;
  const at::ScalarType activation_dtype = reinterpret_cast<THPDtype*>(args[9])->scalar_type;
  at::Tensor out;
  {
    pybind11::gil_scoped_release no_gil;
    out = scaled_linear_cpu(xt, THPVariable_Unpack(packed), THPVariable_Unpack(scale), bias_t, input_scale_t, n, k,
                            block_size, c10::string_view(activation, static_cast<size_t>(activation_len)),
                            activation_dtype);
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

PyObject* set_eager_fallback(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyCallable_Check(args[0]) || !PyType_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError,
                    "qfp8._C._set_eager_fallback(fallback, parameter_type): expected a callable and a type");
    return nullptr;
  }
  Py_INCREF(args[0]);
  Py_INCREF(args[1]);
  Py_XDECREF(g_eager_fallback);
  Py_XDECREF(g_parameter_type);
  g_eager_fallback = args[0];
  g_parameter_type = args[1];
  Py_RETURN_NONE;
}

}  // namespace qfp8
