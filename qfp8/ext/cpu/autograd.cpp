// qfp8::scaled_linear_cpu and qfp8::experts_linear get gradients for their
// argument `x` (and `bias`) from Python formulas (qfp8.library.autograd,
// ExpertsLinear), which QLinear and the MoE layer apply themselves. A graph
// torch.export traced calls the ops directly, though, and so can a user. This
// kernel, on the ops' Autograd key, lets a call that needs no gradient go on
// to the op's kernel after one check; a call that needs one (grad mode on, x
// or the bias requiring grad) goes to the Python callable registered for the
// op, which applies the formula. Only those calls pay for entering Python.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <Python.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <string>
#include <unordered_map>
#include <vector>

#include "bindings.h"
#include "python_entry.h"

namespace qfp8 {
namespace {

std::unordered_map<std::string, PyObject*> g_differentiable;  // op name -> callable taking the op's arguments

// A new reference to the Python value of an op argument (the types these ops' schemas use), or nullptr with
// the Python error set.
PyObject* argument_to_python(const c10::IValue& value, const c10::Argument& argument) {
  if (value.isNone()) Py_RETURN_NONE;
  if (value.isTensor()) return THPVariable_Wrap(value.toTensor());
  if (value.isString()) {
    const std::string& text = value.toStringRef();
    return PyUnicode_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size()));
  }
  if (value.isInt() && argument.real_type()->kind() == c10::TypeKind::ScalarTypeType) {
    PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<at::ScalarType>(value.toInt())));
    Py_INCREF(dtype);
    return dtype;
  }
  if (value.isInt()) return PyLong_FromLongLong(value.toInt());
  if (value.isDouble()) return PyFloat_FromDouble(value.toDouble());
  if (value.isBool()) return PyBool_FromLong(value.toBool());
  const bool tensors = value.isTensorList();
  if (!tensors && !value.isIntList()) {
    return PyErr_Format(PyExc_TypeError, "qfp8: the gradient path cannot pass argument '%s' (%s) to Python",
                        argument.name().c_str(), value.tagKind().c_str());
  }
  const size_t size = tensors ? value.toTensorList().size() : value.toIntList().size();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(size));
  for (size_t i = 0; list != nullptr && i < size; ++i) {
    PyObject* item = tensors ? THPVariable_Wrap(value.toTensorList().get(i))
                             : PyLong_FromLongLong(value.toIntList().get(i));
    if (item == nullptr) {
      Py_CLEAR(list);
      break;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

void differentiable_autograd(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t count = schema.arguments().size();
  const size_t first = stack->size() - count;
  // The differentiable arguments: x, and the linear op's bias.
  const c10::IValue& x = (*stack)[first + static_cast<size_t>(schema.argumentIndexWithName("x").value_or(0))];
  const std::optional<int> bias_index = schema.argumentIndexWithName("bias");
  const c10::IValue* bias = bias_index ? &(*stack)[first + static_cast<size_t>(*bias_index)] : nullptr;
  auto requires_grad = [](const c10::IValue* v) {
    return v != nullptr && v->isTensor() && v->toTensor().requires_grad();
  };
  TORCH_CHECK_NOT_IMPLEMENTED(!(x.isTensor() && has_forward_grad(x.toTensor())), schema.name(),
                              ": forward-mode AD (torch.autograd.forward_ad, torch.func.jvp) is not supported by "
                              "qfp8's kernels; the tangent would be dropped");
  if (!(c10::GradMode::is_enabled() && (requires_grad(&x) || requires_grad(bias)))) {
    // The kernels below take a None list themselves (the CPU one in scaled_linear_cpu_boxed, the experts'
    // Python one in experts_linear_impl).
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    op.callBoxed(stack);
    return;
  }
  empty_lists_from_none(schema, stack);  // the Python path reads the lists
  pybind11::gil_scoped_acquire gil;
  const auto found = g_differentiable.find(schema.name());
  TORCH_CHECK(found != g_differentiable.end(), schema.name(), ": no gradient path is registered (import qfp8)");
  std::vector<PyObject*> args(count, nullptr);
  bool complete = true;
  for (size_t i = 0; i < count && complete; ++i) {
    args[i] = argument_to_python((*stack)[first + i], schema.arguments()[i]);
    complete = args[i] != nullptr;
  }
  PyObject* result = complete ? PyObject_Vectorcall(found->second, args.data(), count, nullptr) : nullptr;
  for (PyObject* arg : args) Py_XDECREF(arg);
  if (result == nullptr) throw python_error();
  const bool tensor = THPVariable_Check(result);
  at::Tensor out = tensor ? THPVariable_Unpack(result) : at::Tensor();
  Py_DECREF(result);
  TORCH_CHECK(tensor, schema.name(), ": the gradient path returned no tensor");
  torch::jit::drop(*stack, count);
  stack->emplace_back(std::move(out));
}

}  // namespace

PyObject* set_differentiable(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyUnicode_Check(args[0]) || !PyCallable_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "qfp8._C._set_differentiable(op_name, fn): expected a str and a callable");
    return nullptr;
  }
  const char* name = PyUnicode_AsUTF8(args[0]);
  if (name == nullptr) return nullptr;
  Py_INCREF(args[1]);
  PyObject*& slot = g_differentiable[name];
  Py_XDECREF(slot);
  slot = args[1];
  Py_RETURN_NONE;
}

}  // namespace qfp8

TORCH_LIBRARY_IMPL(qfp8, Autograd, m) {
  for (const char* name : {"scaled_linear_cpu", "experts_linear"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&qfp8::differentiable_autograd>());
  }
}
