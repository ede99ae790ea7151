"""Array arguments of the binding: torch tensors or numpy arrays, checked and passed as addresses.

Two kinds of arrays cross the C ABI, with no copy:

- torch tensors (bfloat16 is skv_bf16): CPU tensors for ref and cpu, CUDA tensors for cuda.
- numpy arrays (host memory: ref and cpu only). A bf16 argument takes an ml_dtypes.bfloat16
  array as it is, a uint16 array as raw bf16 bits, or a float32 array, which is rounded to
  bf16 here exactly as the library rounds (round to nearest even; a NaN stays a quiet NaN
  with its sign: skv_f32_to_bf16 in lib/skv_numerics.h). bf16 results are ml_dtypes.bfloat16
  arrays when ml_dtypes can be imported, else uint16 arrays holding the bf16 bits
  (as_float32 turns either into float32).

A call's results are of the kind of its array arguments. Neither torch nor numpy is imported
until an array is involved.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

BF16, F32, I32 = "bfloat16", "float32", "int32"
KINDS = ("numpy", "torch")

TORCH_EXTRA = "pip install 'shadowkv[torch]'"
HF_EXTRA = "pip install 'shadowkv[hf]'"


def torch_module():
    """torch, or an ImportError that names the extra to install."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"shadowkv: torch tensors need torch, which is not installed: {TORCH_EXTRA} "
                          "(numpy arrays work without it)") from e
    return torch


def numpy_module():
    try:
        import numpy
    except ImportError as e:
        raise ImportError("shadowkv: numpy arrays need numpy: pip install numpy") from e
    return numpy


_UNSET = object()
_bf16_cache: Any = _UNSET


def bf16_dtype():
    """numpy's dtype for bf16 results: ml_dtypes.bfloat16 when importable, else None (uint16 bits)."""
    global _bf16_cache
    if _bf16_cache is _UNSET:
        try:
            import ml_dtypes
            _bf16_cache = numpy_module().dtype(ml_dtypes.bfloat16)
        except ImportError:
            _bf16_cache = None
    return _bf16_cache


def kind_of(x: Any) -> Optional[str]:
    """"torch", "numpy" or None, without importing either module."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return "numpy"
    return None


def default_kind() -> str:
    """The kind of results a call with no array argument gives: torch when the program has imported
    it, else numpy."""
    return "torch" if sys.modules.get("torch") is not None else "numpy"


def check_kind_name(arrays: Optional[str]) -> Optional[str]:
    if arrays is None:
        return None
    if arrays not in KINDS:
        raise ValueError(f"arrays {arrays!r}: expected 'numpy' or 'torch'")
    if arrays == "torch":
        torch_module()
    else:
        numpy_module()
    return arrays


def _bf16_bits(a):
    """float32 numpy array -> uint16 bf16 bits, as skv_f32_to_bf16 rounds."""
    np = numpy_module()
    u = np.asarray(a, dtype=np.float32, order="C").view(np.uint32)
    with np.errstate(over="ignore"):
        r = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        r[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return r


def as_bf16(a: Any):
    """A numpy array as bf16, rounded as the library rounds: float32 (and float64, rounded to float32
    first) are converted; ml_dtypes.bfloat16 and uint16 (bf16 bits) arrays are returned as they are.
    The result is an ml_dtypes.bfloat16 array when ml_dtypes is importable, else uint16 bits."""
    np = numpy_module()
    a = np.asarray(a)
    bf = bf16_dtype()
    if a.dtype == np.uint16 or (bf is not None and a.dtype == bf):
        return a
    if a.dtype.kind != "f":
        raise TypeError(f"as_bf16: dtype {a.dtype}, expected a float array")
    bits = _bf16_bits(a.astype(np.float32, copy=False))
    return bits.view(bf) if bf is not None else bits


def as_float32(a: Any):
    """A numpy bf16 array (ml_dtypes.bfloat16, or uint16 bf16 bits) as float32, exactly;
    other numpy arrays are converted with astype."""
    np = numpy_module()
    a = np.asarray(a)
    bf = bf16_dtype()
    if bf is not None and a.dtype == bf:
        a = a.view(np.uint16)
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return a.astype(np.float32)


class _Addr(int):
    """An address that keeps the array it points into alive (a converted copy, for one call)."""


class Torch:
    """torch tensors: the checks and allocations of the binding's tensor arguments."""
    name = "torch"
    noun = "tensor"

    def __init__(self):
        self.t = torch_module()

    def dtype(self, tag: str):
        return getattr(self.t, tag)

    def device_for(self, backend: str):
        t = self.t
        if backend == "cuda":
            if not t.cuda.is_available():
                return t.device("cuda")
            return t.device("cuda", t.cuda.current_device())
        return t.device("cpu")

    def ndim(self, x: Any, name: str, n: int, dims: str) -> None:
        if not isinstance(x, self.t.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor {dims}, got {type(x).__name__}")
        if x.dim() != n:
            raise ValueError(f"{name}: expected a {n}-d tensor {dims}, got shape {tuple(x.shape)}")

    def check(self, x: Any, name: str, shape: Sequence[int], tag: str, device: Any, allow_none: bool = False,
              dims: str = "", out: bool = False):
        """Type, dtype, device, shape, contiguity; the address (None for None or an empty tensor)."""
        t = self.t
        if x is None:
            if allow_none:
                return None
            raise TypeError(f"{name}: a tensor is required, got None")
        if not isinstance(x, t.Tensor):
            hint = " (this call's other arguments are torch tensors)" if kind_of(x) == "numpy" else ""
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}{hint}")
        dtype = self.dtype(tag)
        if x.dtype != dtype:
            raise TypeError(f"{name}: dtype {x.dtype}, expected {dtype}")
        device = t.device(device)
        if x.device.type != device.type or (device.index is not None and x.device.index != device.index):
            raise ValueError(f"{name}: on {x.device}, but this {'cache' if dims else 'call'} takes tensors on {device}")
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(x.shape)}, expected {tuple(shape)}" + (f" {dims}" if dims else ""))
        if not x.is_contiguous():
            raise ValueError(f"{name}: must be contiguous (stride {tuple(x.stride())}); pass {name}.contiguous()")
        return x.data_ptr() if x.numel() else None

    def empty(self, shape, tag: str, device: Any):
        return self.t.empty(shape, dtype=self.dtype(tag), device=device)

    def addr(self, x: Any):
        return x.data_ptr()

    def numel(self, x: Any) -> int:
        return x.numel()

    def stack(self, xs):
        return self.t.stack(xs)

    def to_device(self, x: Any, device: Any):
        return x.to(device)


class Numpy:
    """numpy arrays (host memory): the checks and allocations of the binding's array arguments."""
    name = "numpy"
    noun = "array"

    def __init__(self):
        self.np = numpy_module()

    def device_for(self, backend: str):
        return "cpu"

    def ndim(self, x: Any, name: str, n: int, dims: str) -> None:
        if not isinstance(x, self.np.ndarray):
            raise TypeError(f"{name}: expected a numpy.ndarray {dims}, got {type(x).__name__}")
        if x.ndim != n:
            raise ValueError(f"{name}: expected a {n}-d array {dims}, got shape {tuple(x.shape)}")

    def check(self, x: Any, name: str, shape: Sequence[int], tag: str, device: Any = None, allow_none: bool = False,
              dims: str = "", out: bool = False):
        """Type, dtype, shape, layout (C-contiguous, aligned; writable for outputs); the address
        (None for None or an empty array). A float32 array given for a bf16 input is rounded to
        bf16 here: the address is then that of the rounded copy, which it keeps alive."""
        np = self.np
        if x is None:
            if allow_none:
                return None
            raise TypeError(f"{name}: an array is required, got None")
        if not isinstance(x, np.ndarray):
            hint = " (this call's other arguments are numpy arrays)" if kind_of(x) == "torch" else ""
            raise TypeError(f"{name}: expected a numpy.ndarray, got {type(x).__name__}{hint}")
        convert = False
        if tag == BF16:
            bf = bf16_dtype()
            if x.dtype == np.float32 and not out:
                convert = True
            elif not (x.dtype == np.uint16 or (bf is not None and x.dtype == bf)):
                raise TypeError(f"{name}: dtype {x.dtype}, expected bfloat16 (an ml_dtypes.bfloat16 array, uint16 "
                                f"bf16 bits{'' if out else ', or float32 to be rounded to bf16'})")
        elif x.dtype != np.dtype(tag):
            raise TypeError(f"{name}: dtype {x.dtype}, expected {tag}")
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(x.shape)}, expected {tuple(shape)}" + (f" {dims}" if dims else ""))
        if not x.flags.c_contiguous:
            raise ValueError(f"{name}: must be C-contiguous (strides {x.strides}); pass "
                             f"numpy.ascontiguousarray({name})")
        if not x.flags.aligned:
            raise ValueError(f"{name}: must be aligned to its element size; pass a copy ({name}.copy())")
        if out and not x.flags.writeable:
            raise ValueError(f"{name}: the array is read-only")
        if x.size == 0:
            return None
        if convert:
            x = _bf16_bits(x)
        a = _Addr(x.ctypes.data)
        a.array = x
        return a

    def empty(self, shape, tag: str, device: Any = None):
        np = self.np
        if tag == BF16:
            bf = bf16_dtype()
            return np.empty(shape, dtype=bf if bf is not None else np.uint16)
        return np.empty(shape, dtype=np.dtype(tag))

    def addr(self, x: Any):
        return x.ctypes.data

    def numel(self, x: Any) -> int:
        return x.size

    def stack(self, xs):
        return self.np.stack(xs)

    def to_device(self, x: Any, device: Any):
        return x


def by_name(name: str):
    return Torch() if name == "torch" else Numpy()


def of(x: Any, name: str, dims: str = ""):
    """The kind of x (the first array argument of a call), or a TypeError naming the argument."""
    k = kind_of(x)
    if k is None:
        raise TypeError(f"{name}: expected a numpy.ndarray or torch.Tensor{' ' + dims if dims else ''}, "
                        f"got {type(x).__name__}")
    return by_name(k)
