"""A stand-in accelerator for tests on a CPU-only machine: PyTorch's PrivateUse1 backend renamed
(to "neuron" by default), whose tensors are wrapper subclasses holding a real CPU tensor. Every
op on them runs on CPU, but an op that mixes one of them with a CPU tensor of one or more
dimensions raises "Expected all tensors to be on the same device", as CUDA does (a 0-dim CPU
tensor is a scalar and allowed, and so are CPU index tensors in indexing, as CUDA allows). So a
model loaded with `device_map="neuron"` runs here, and an input left on the CPU fails the way it
would on the device.

Renaming PrivateUse1 can be done once per process and never undone, and a renamed "neuron" makes
`torch.neuron` look available: install it only in a child process, never in pytest's own:

    python tests/fake_device.py -m studio_core.serve.chat_worker     # that module, on the fake device
    python tests/fake_device.py path/to/script.py               # that script, on the fake device

A child the studio starts itself (the chat process, the evaluation process) gets it through
`sitecustomize_dir()`: a folder to put in front of PYTHONPATH whose sitecustomize.py installs
the device when FAKE_DEVICE names it. Every "wrong device" error is also written as a line to
the file FAKE_DEVICE_LOG names, so a test sees it even where the studio catches the error.

The pattern is PyTorch's own test (test/test_privateuseone_python_backend.py:
`_setup_privateuseone_for_python_backend`, kernels registered for the PrivateUse1 key) with
albanD's subclass_zoo new_device.py (a wrapper subclass holding the data). Factory ops (empty,
empty_strided) with the device get a PrivateUse1 kernel, which is global: a dispatch mode would be
thread-local and miss the thread that Generator.generate runs the model in.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten, tree_map

NAME_ENV, LOG_ENV = "FAKE_DEVICE", "FAKE_DEVICE_LOG"
aten = torch.ops.aten
# Ops that move data between devices, or take CPU index tensors on a device tensor (as CUDA does).
CROSSING = {aten.copy_.default, aten._to_copy.default, aten._copy_from.default, aten._copy_from_and_resize.default}
CPU_INDICES = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
_state: dict = {}


class OnDevice(torch.Tensor):
    """A tensor on the fake device: its metadata says so, its data is `elem`, a CPU tensor."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        # An inference tensor exactly when its data is one: a view taken under inference_mode of
        # a tensor made outside it is a normal tensor, as on a real device.
        with torch.inference_mode(elem.is_inference()):
            wrapper = torch.Tensor._make_wrapper_subclass(
                cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
                layout=elem.layout, device=_state["device"], requires_grad=elem.requires_grad)
        wrapper.elem = elem
        return wrapper

    def __repr__(self):
        return f"OnDevice({self.elem!r}, device='{_state['device']}')"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _on_device(value) -> bool:
    return isinstance(value, (torch.device, str)) and torch.device(value).type == _state["name"]


def _mismatch(func, args, kwargs) -> None:
    """Raise as CUDA does when a CPU tensor (not a 0-dim scalar) meets a device tensor."""
    if func in CROSSING:
        return
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if func in CPU_INDICES:
        tensors = [t for t in tree_flatten((args[:1], args[2:], kwargs))[0] if isinstance(t, torch.Tensor)]
    if any(isinstance(t, OnDevice) for t in tensors):
        cpu = [t for t in tensors if not isinstance(t, OnDevice) and t.device.type == "cpu" and t.dim() > 0]
        if cpu:
            message = (f"Expected all tensors to be on the same device, but found at least two devices, "
                       f"{_state['device']} and cpu! (in {func}: a CPU tensor of shape {tuple(cpu[0].shape)})")
            _log(message)
            raise RuntimeError(message)


def _log(message: str) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        where = "".join(traceback.format_stack(limit=12)[:-2])
        with open(path, "a") as f:
            f.write(message + "\n" + where + "\n")


def _cpu_for_fake(value):
    return torch.device("cpu") if isinstance(value, torch.device) and _on_device(value) else value


def _unwrap(value):
    return value.elem if isinstance(value, OnDevice) else value


def _wrap(value):
    return OnDevice(value) if isinstance(value, torch.Tensor) and not isinstance(value, OnDevice) else value


def _run(func, args, kwargs):
    _mismatch(func, args, kwargs)
    if func is aten.copy_.default:  # into a device tensor: into its data; out of one: its data
        destination, source = args[0], _unwrap(args[1])
        _unwrap(destination).copy_(source, *args[2:], **kwargs)
        return destination
    # A device named in the op (to.device's is positional, _to_copy's a keyword): the fake one
    # runs on CPU and wraps the result; another (cpu) returns a plain tensor there.
    named = [v for v in tree_flatten((args, kwargs))[0] if isinstance(v, torch.device)]
    to_device = _on_device(named[0]) if named else None
    args, kwargs = tree_map(_cpu_for_fake, args), tree_map(_cpu_for_fake, kwargs)
    inputs = {id(t.elem): t for t in tree_flatten((args, kwargs))[0] if isinstance(t, OnDevice)}
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if to_device is False:  # an explicit other device (to("cpu")): a plain tensor there
        return out

    def back(value):  # an in-place op returns its input: the same wrapper, not a new one
        if isinstance(value, torch.Tensor) and id(value) in inputs:
            return inputs[id(value)]
        return _wrap(value)

    return tree_map(back, out)


def _factory(op):
    """A PrivateUse1 kernel for a factory op: the tensor made on CPU, wrapped."""
    def kernel(*args, **kwargs):
        return OnDevice(op(*args, **{**kwargs, "device": torch.device("cpu")}))
    return kernel


class _Module:
    """`torch.<name>`: PyTorch's dummy backend module (backend_registration._DummyBackendModule),
    with what torch.autocast asks of a device's module (lm-eval enters it, disabled)."""

    def __init__(self):
        from torch.utils.backend_registration import _DummyBackendModule

        self._dummy = _DummyBackendModule()

    def __getattr__(self, name):
        return getattr(self._dummy, name)

    @staticmethod
    def get_amp_supported_dtype():
        return [torch.bfloat16, torch.float16]

    @staticmethod
    def is_autocast_enabled():
        return False

    @staticmethod
    def get_autocast_dtype():
        return torch.bfloat16


def _copy_from(source, destination, non_blocking=False):
    """copy_ between CPU and the device where Python's dispatch is off (torch.tensor(data, device=...)
    copies its CPU tensor into a device one so)."""
    _unwrap(destination).copy_(_unwrap(source))
    return destination


def install(name: str = "neuron") -> None:
    """Make `name` a device whose tensors live on CPU and refuse to meet CPU tensors (see above)."""
    if _state:
        return
    # Transformers compiles generate's forward with a backend named after the device (a static
    # cache on Neuron: PreTrainedModel._default_compile_config), which torch-neuronx registers.
    # Dynamo is off in a process with the device, and in the processes it starts (the variable),
    # and the backend is registered to run eagerly: placement is what this checks, not a compiler.
    # Set here, not when the module is imported: the test process imports it, and its other
    # tests' runs must compile.
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    import torch._dynamo

    torch._dynamo.config.disable = True
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(name, backend_module=_Module())
    _state.update(name=name, device=torch.device(name, 0), library=torch.library.Library("aten", "IMPL"))
    for op, kernel in (("empty.memory_format", _factory(aten.empty.memory_format)),
                       ("empty_strided", _factory(aten.empty_strided.default)), ("_copy_from", _copy_from)):
        _state["library"].impl(op, kernel, "PrivateUse1")
    import torch._dynamo as dynamo

    dynamo.register_backend(name=name)(lambda graph, example_inputs: graph.forward)


SITECUSTOMIZE = f"""\
import os, sys
if os.environ.get({NAME_ENV!r}):
    sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
    import fake_device
    fake_device.install(os.environ[{NAME_ENV!r}])
"""


def sitecustomize_dir(folder: Path) -> Path:
    """A folder holding a sitecustomize.py that installs the device in every Python started with
    the folder on PYTHONPATH and FAKE_DEVICE set (the device's name)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return folder


def main(argv: list[str]) -> None:
    install(os.environ.get(NAME_ENV) or "neuron")
    if argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":  # run as the module `fake_device`, so a script importing it finds this one
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fake_device

    fake_device.main(sys.argv[1:])
