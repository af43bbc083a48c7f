"""nf4's own launch function for the repeat call: one `cuLaunchKernel` with the arguments bound once.

Triton's C launch function takes every kernel argument again on each call (constexprs included),
converts them, and launches through `cuLaunchKernelEx`. Between two calls of a bound launch only
a few pointer slots (named when binding, e.g. the output) and the stream change, so `bind` copies
the other arguments once into a C struct and `launch(bound, stream, *pointers)` stores the
pointers into their slots and calls `cuLaunchKernel`.

The C source is compiled on first use with Triton's own build helper, with the compiler, CUDA
header and libcuda that Triton's launchers use (no new dependency). `layout` reproduces the
parameter list of Triton's launcher for the releases in `nf4.runtime.DIRECT_LAUNCH_VERSIONS`: the
non-constexpr arguments in order, then two scratch pointers. It is checked against the kernel's
PTX entry before a launch is bound; on any mismatch, or where the module cannot be built, the
caller keeps Triton's C launch function.
"""

from __future__ import annotations

import contextlib
import re
import struct

SOURCE = r"""
#include "cuda.h"
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_PARAMS 64
#define MAX_REBIND 8

typedef struct {
  CUfunction function;
  int device;
  unsigned int grid_x, block_x, shared;
  int n_rebind, n_params;
  int rebind[MAX_REBIND];
  unsigned long long values[MAX_PARAMS];  /* one 8-byte slot per parameter (4-byte ones in the low half) */
  void *params[MAX_PARAMS];
} Bound;

static void release(PyObject *capsule) {
  PyMem_Free(PyCapsule_GetPointer(capsule, "nf4.bound"));
}

static int fail(CUresult rc) {
  const char *text = NULL;
  cuGetErrorString(rc, &text);
  PyErr_Format(PyExc_RuntimeError, "nf4 launch: CUDA error %d (%s)", (int)rc, text ? text : "unknown");
  return -1;
}

/* bind(function, device, grid_x, block_x, shared, rebind, values) -> capsule;
   rebind: the slots a launch passes anew, as little-endian int32; values: the parameters as
   little-endian 8-byte slots. */
static PyObject *bind(PyObject *self, PyObject *args) {
  unsigned long long function;
  int device;
  unsigned int grid_x, block_x, shared;
  const char *buf, *slots;
  Py_ssize_t len, n_slots;
  if (!PyArg_ParseTuple(args, "KiIIIy#y#", &function, &device, &grid_x, &block_x, &shared, &slots, &n_slots, &buf,
                        &len))
    return NULL;
  if (len % 8 != 0 || len / 8 > MAX_PARAMS || n_slots % 4 != 0 || n_slots / 4 > MAX_REBIND) {
    PyErr_SetString(PyExc_ValueError, "bind: values must be 1..64 8-byte slots, rebind at most 8 int32 slots");
    return NULL;
  }
  for (Py_ssize_t i = 0; i < n_slots / 4; i++) {
    int32_t slot;
    memcpy(&slot, slots + 4 * i, 4);
    if (slot < 0 || slot >= len / 8) {
      PyErr_SetString(PyExc_ValueError, "bind: a rebind slot is not one of the values");
      return NULL;
    }
  }
  Bound *b = PyMem_Malloc(sizeof(Bound));
  if (b == NULL)
    return PyErr_NoMemory();
  memset(b, 0, sizeof(Bound));
  b->function = (CUfunction)(uintptr_t)function;
  b->device = device;
  b->grid_x = grid_x;
  b->block_x = block_x;
  b->shared = shared;
  b->n_rebind = (int)(n_slots / 4);
  memcpy(b->rebind, slots, (size_t)n_slots);
  b->n_params = (int)(len / 8);
  memcpy(b->values, buf, (size_t)len);
  for (int i = 0; i < b->n_params; i++)
    b->params[i] = &b->values[i];
  PyObject *capsule = PyCapsule_New(b, "nf4.bound", release);
  if (capsule == NULL)
    PyMem_Free(b);
  return capsule;
}

/* launch(bound, stream, *pointers) -> None: one pointer per rebind slot, in bind's order */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs < 2) {
    PyErr_SetString(PyExc_TypeError, "launch(bound, stream, *pointers) takes at least 2 arguments");
    return NULL;
  }
  Bound *b = PyCapsule_GetPointer(args[0], "nf4.bound");
  if (b == NULL)
    return NULL;
  if (nargs != 2 + b->n_rebind) {
    PyErr_Format(PyExc_TypeError, "launch: this bound launch takes %d pointers, got %d", b->n_rebind,
                 (int)(nargs - 2));
    return NULL;
  }
  unsigned long long stream = PyLong_AsUnsignedLongLong(args[1]);
  if (stream == (unsigned long long)-1 && PyErr_Occurred())
    return NULL;
  unsigned long long ptrs[MAX_REBIND];
  for (int i = 0; i < b->n_rebind; i++) {
    ptrs[i] = PyLong_AsUnsignedLongLong(args[2 + i]);
    if (ptrs[i] == (unsigned long long)-1 && PyErr_Occurred())
      return NULL;
  }
  CUcontext ctx = NULL;
  CUresult rc = cuCtxGetCurrent(&ctx);
  if (rc == CUDA_SUCCESS && ctx == NULL) {
    /* a thread that has not used CUDA yet: make the device's primary context current, as torch would */
    CUdevice dev;
    rc = cuDeviceGet(&dev, b->device);
    if (rc == CUDA_SUCCESS)
      rc = cuDevicePrimaryCtxRetain(&ctx, dev);
    if (rc == CUDA_SUCCESS)
      rc = cuCtxSetCurrent(ctx);
  }
  if (rc != CUDA_SUCCESS && fail(rc))
    return NULL;
  for (int i = 0; i < b->n_rebind; i++)
    b->values[b->rebind[i]] = ptrs[i];
  rc = cuLaunchKernel(b->function, b->grid_x, 1, 1, b->block_x, 1, 1, b->shared, (CUstream)(uintptr_t)stream,
                      b->params, NULL);
  if (rc != CUDA_SUCCESS && fail(rc))
    return NULL;
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
  {"bind", bind, METH_VARARGS, "bind the launch of one plan"},
  {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "launch a bound kernel on stream with new pointers"},
  {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "nf4_native_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_nf4_native_launch(void) { return PyModule_Create(&module); }
"""

_SCALARS = {"i32": "<i", "u32": "<I", "i64": "<q", "u64": "<Q"}  # Triton type -> struct format
_module: list = []  # [module] once built, [None] when it cannot be built here
build_error: str | None = None  # why the module could not be built (for the probe and the tests)


def layout(signature: dict, args: tuple,
           rebind: tuple[str, ...] = ("out_ptr",)) -> tuple[bytes, list[int], list[int]] | None:
    """(8-byte slots of the launch parameters, the slot of each `rebind` name in order, each parameter's size).

    signature: the compiled kernel's `src.signature` (name -> '*fp16', 'i32', 'constexpr', ...) in
    parameter order; args: the values passed to the kernel, in the same order (tensors or ints for
    pointers). Two null scratch pointers close the list, as Triton's launcher passes them. None
    when a parameter has a type this launcher does not bind, or a rebind name is not a pointer.
    """
    if len(signature) != len(args):
        return None
    slots, sizes, found = [], [], {}
    for (name, ty), value in zip(signature.items(), args, strict=True):
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            ptr = value if isinstance(value, int) else value.data_ptr()
            slots.append(struct.pack("<Q", ptr))
            sizes.append(8)
            found[name] = len(slots) - 1
        elif ty in _SCALARS and isinstance(value, int) and not isinstance(value, bool):
            slots.append(struct.pack(_SCALARS[ty], value).ljust(8, b"\0"))
            sizes.append(struct.calcsize(_SCALARS[ty]))
        else:
            return None
    if not rebind or any(name not in found for name in rebind):
        return None
    slots += [struct.pack("<Q", 0)] * 2  # global and profile scratch: none (checked by the caller)
    sizes += [8, 8]
    return b"".join(slots), [found[name] for name in rebind], sizes


def ptx_param_sizes(ptx: str, name: str) -> list[int] | None:
    """Byte sizes of the parameters of `.entry name(...)` in PTX text, or None when it is not found."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if m is None:
        return None
    sizes = []
    for decl in m.group(1).split(","):
        decl = decl.strip()
        if not decl:
            continue
        t = re.match(r"\.param\s+\.([usbf])(\d+)\b", decl)
        if t is None:
            return None
        sizes.append(int(t.group(2)) // 8)
    return sizes


@contextlib.contextmanager
def module_override(mod):
    """Test hook: `module()` returns `mod` inside the block (None: as if it could not be built here)."""
    saved = list(_module)
    _module[:] = [mod]
    try:
        yield mod
    finally:
        _module[:] = saved


def module():
    """The compiled launch module, or None (then `build_error` says why)."""
    global build_error
    if not _module:
        try:
            from triton.backends.nvidia import driver as nv
            from triton.runtime.build import compile_module_from_src

            _module.append(compile_module_from_src(src=SOURCE, name="nf4_native_launch", library_dirs=nv.library_dirs(),
                                                   include_dirs=nv.include_dirs, libraries=nv.libraries))
        except Exception as exc:  # no C compiler, no CUDA header or driver: Triton's launcher is used instead
            build_error = f"{type(exc).__name__}: {exc}"[:500]
            _module.append(None)
    return _module[0]


def bind(compiled, args: tuple, grid_x: int, device_index: int, rebind: tuple[str, ...] = ("out_ptr",)):
    """A bound launch for `compiled` with `args` (the `rebind` pointer slots passed anew per call), or
    None when the parameter layout cannot be confirmed against the kernel's PTX or the kernel needs
    launch attributes."""
    md = compiled.metadata
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl",
                                                                                                  False):
        return None
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        return None
    src = getattr(compiled, "src", None)
    found = layout(dict(src.signature), args, tuple(rebind)) if src is not None and hasattr(src, "signature") else None
    if found is None:
        return None
    values, slots, sizes = found
    in_ptx = getattr(compiled, "_nf4_ptx_param_sizes", None)  # parsed once per compiled kernel
    if in_ptx is None:
        name = getattr(md, "name", None) or getattr(getattr(src, "fn", None), "__name__", "")
        in_ptx = ptx_param_sizes(compiled.asm.get("ptx", ""), name) or []
        try:
            compiled._nf4_ptx_param_sizes = in_ptx
        except AttributeError:  # a kernel object that takes no attributes: parse again next time
            pass
    if in_ptx != sizes:
        return None
    mod = module()
    if mod is None:
        return None
    return mod.bind(compiled.function, device_index, grid_x, 32 * md.num_warps, md.shared,
                    struct.pack(f"<{len(slots)}i", *slots), values)
