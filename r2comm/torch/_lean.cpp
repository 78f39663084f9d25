// The torch backend's lean all_reduce probe (r2comm/torch/lean.py builds it against the torch
// that is installed). A synchronous all_reduce of a small CPU tensor costs a few microseconds
// in all; reading its tensor and options from Python (eleven attribute reads, one of them
// copying the ReduceOp) cost about one of them. Here they cost one call.
#include <Python.h>
#include <cstring>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <pybind11/pybind11.h>

namespace {

PyTypeObject* options_type = nullptr;   // torch's AllreduceOptions (init)

// init(AllreduceOptions): the options class probe() reads (exactly that class, no subclass).
PyObject* init(PyObject*, PyObject* cls) {
  if (!PyType_Check(cls)) {
    PyErr_SetString(PyExc_TypeError, "init: torch.distributed.AllreduceOptions expected");
    return nullptr;
  }
  Py_INCREF(cls);
  Py_XDECREF(reinterpret_cast<PyObject*>(options_type));
  options_type = reinterpret_cast<PyTypeObject*>(cls);
  Py_RETURN_NONE;
}

// probe(tensors, opts, scratch_address, scratch_bytes): for a list of one plain tensor (not a
// subclass) on the CPU, strided, contiguous, without autograd, without negative or conjugate
// bit, of 1..scratch_bytes bytes that all lie inside its storage (a storage resized under its
// tensor holds fewer), and options of exactly AllreduceOptions with asyncOp false:
// copies the tensor's bytes to the scratch and returns (address, bytes, scalar type * 256 +
// reduce op). Anything else: None, having done nothing.
PyObject* probe(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "probe takes (tensors, opts, scratch_address, scratch_bytes)");
    return nullptr;
  }
  PyObject* tensors = args[0];
  if (!PyList_CheckExact(tensors) || PyList_GET_SIZE(tensors) != 1 || options_type == nullptr ||
      Py_TYPE(args[1]) != options_type)
    Py_RETURN_NONE;
  PyObject* obj = PyList_GET_ITEM(tensors, 0);
  if (!THPVariable_CheckExact(obj))
    Py_RETURN_NONE;
  auto* inst = reinterpret_cast<pybind11::detail::instance*>(args[1]);
  const auto* opts = static_cast<const c10d::AllreduceOptions*>(
      inst->get_value_and_holder().value_ptr());
  if (opts == nullptr || opts->asyncOp)
    Py_RETURN_NONE;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided || !t.is_contiguous() ||
      t.requires_grad() || t.is_neg() || t.is_conj() || !t.has_storage())
    Py_RETURN_NONE;
  const long long scratch = PyLong_AsLongLong(args[2]);
  const long long room = PyLong_AsLongLong(args[3]);
  if (PyErr_Occurred())
    return nullptr;
  const long long nbytes = static_cast<long long>(t.nbytes());
  const long long offset = static_cast<long long>(t.storage_offset()) *
                           static_cast<long long>(t.element_size());
  const long long held = static_cast<long long>(t.storage().nbytes());
  const void* data = t.data_ptr();
  if (nbytes <= 0 || nbytes > room || scratch == 0 || data == nullptr || offset < 0 ||
      offset > held || nbytes > held - offset)
    Py_RETURN_NONE;
  std::memcpy(reinterpret_cast<void*>(static_cast<intptr_t>(scratch)), data,
              static_cast<size_t>(nbytes));
  const long code = static_cast<long>(t.scalar_type()) * 256 + static_cast<long>(opts->reduceOp.op_);
  PyObject* out = PyTuple_New(3);
  if (out == nullptr)
    return nullptr;
  PyTuple_SET_ITEM(out, 0, PyLong_FromLongLong(reinterpret_cast<intptr_t>(data)));
  PyTuple_SET_ITEM(out, 1, PyLong_FromLongLong(nbytes));
  PyTuple_SET_ITEM(out, 2, PyLong_FromLong(code));
  if (PyTuple_GET_ITEM(out, 0) == nullptr || PyTuple_GET_ITEM(out, 1) == nullptr ||
      PyTuple_GET_ITEM(out, 2) == nullptr) {
    Py_DECREF(out);
    return nullptr;
  }
  return out;
}

PyMethodDef methods[] = {
    {"init", static_cast<PyCFunction>(init), METH_O, "init(AllreduceOptions): the options class"},
    {"probe", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(probe)),
     METH_FASTCALL, "probe(tensors, opts, scratch_address, scratch_bytes): see _lean.cpp"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  if (PyModule_AddFunctions(m.ptr(), methods) < 0)
    throw pybind11::error_already_set();
}
