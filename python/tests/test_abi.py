"""The ctypes declarations (shadowkv/_ffi.py) against include/shadowkv.h (and the
include/shadowkv_ops.h and include/shadowkv_serve.h it includes).

A tiny C program compiled against the header prints sizeof and offsetof of every struct
and field; the ctypes mirrors must agree exactly. Every SKV_API function of the headers
must be bound with the header's number of parameters.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest

from conftest import REPO

import shadowkv
from shadowkv import _ffi

HEADER = os.path.join(REPO, "include", "shadowkv.h")
# the headers shadowkv.h includes: their functions are part of the ABI the binding mirrors
HEADERS = [HEADER] + [os.path.join(REPO, "include", h) for h in ("shadowkv_ops.h", "shadowkv_serve.h")]

STRUCTS = {
    "skv_rope_config": _ffi.RopeConfig,
    "skv_config": _ffi.Config,
    "skv_memory_info": _ffi.MemoryInfo,
    "skv_seq_info": _ffi.SeqInfo,
    "skv_stats": _ffi.Stats,
    "skv_kv_span": _ffi.KvSpan,
    "skv_layer_stats": _ffi.LayerStats,
    "skv_usage": _ffi.Usage,
}


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler to read the header's layout")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "shadowkv.h"', "int main(void) {"]
    for cname, cls in STRUCTS.items():
        lines.append(f'printf("{cname} sizeof %zu\\n", sizeof({cname}));')
        lines.append(f'printf("{cname} alignof %zu\\n", _Alignof({cname}));')
        for field, _ in cls._fields_:
            lines.append(f'printf("{cname} {field} %zu %zu\\n", offsetof({cname}, {field}), '
                         f'sizeof((({cname} *)0)->{field}));')
    for e in ("skv_status", "skv_backend", "skv_factorize_route", "skv_select_mode", "skv_value_dtype", "skv_bf16"):
        lines.append(f'printf("{e} sizeof %zu\\n", sizeof({e}));')
    lines.append('printf("SKV_VERSION_NUMBER %d\\n", SKV_VERSION_NUMBER);')
    lines.append('printf("SKV_MAX_SPANS %d\\n", SKV_MAX_SPANS);')
    lines.append('printf("SKV_STATUS_COUNT %d\\n", SKV_STATUS_COUNT);')
    lines.append('printf("SKV_VALUES_ALL_DEVICE %lld\\n", (long long)SKV_VALUES_ALL_DEVICE);')
    lines.append('printf("SKV_BUDGET_ALL %d\\n", (int)SKV_BUDGET_ALL);')
    lines.append('printf("SKV_SELECT_FIXED %d\\n", (int)SKV_SELECT_FIXED);')
    lines.append('printf("SKV_SELECT_MASS %d\\n", (int)SKV_SELECT_MASS);')
    lines.append('printf("SKV_VALUE_BF16 %d\\n", (int)SKV_VALUE_BF16);')
    lines.append('printf("SKV_VALUE_FP8 %d\\n", (int)SKV_VALUE_FP8);')
    lines.append("return 0; }")
    d = tmp_path_factory.mktemp("abi")
    src, exe = d / "layout.c", d / "layout"
    src.write_text("\n".join(lines) + "\n")
    subprocess.run([cc, "-std=c11", "-I", os.path.join(REPO, "include"), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    table = {}
    for line in out.splitlines():
        parts = line.split()
        nkey = 2 if len(parts) == 4 else len(parts) - 1  # "struct field offset size" or "name [what] value"
        table[tuple(parts[:nkey])] = tuple(int(x) for x in parts[nkey:])
    return table


@pytest.mark.parametrize("cname", list(STRUCTS))
def test_struct_layout(c_layout, cname):
    cls = STRUCTS[cname]
    assert ctypes.sizeof(cls) == c_layout[(cname, "sizeof")][0], f"sizeof({cname})"
    assert ctypes.alignment(cls) == c_layout[(cname, "alignof")][0], f"alignof({cname})"
    for field, ftype in cls._fields_:
        off, size = c_layout[(cname, field)]
        assert getattr(cls, field).offset == off, f"offsetof({cname}, {field})"
        assert ctypes.sizeof(ftype) == size, f"sizeof({cname}.{field})"


def test_enums_and_constants(c_layout):
    for e in ("skv_status", "skv_backend", "skv_factorize_route", "skv_select_mode", "skv_value_dtype"):
        assert c_layout[(e, "sizeof")][0] == ctypes.sizeof(ctypes.c_int), e
    assert c_layout[("skv_bf16", "sizeof")][0] == 2
    assert c_layout[("SKV_VERSION_NUMBER",)][0] == _ffi.HEADER_VERSION
    assert c_layout[("SKV_MAX_SPANS",)][0] == _ffi.MAX_SPANS
    assert c_layout[("SKV_STATUS_COUNT",)][0] == len(_ffi.STATUS_NAMES)
    assert c_layout[("SKV_VALUES_ALL_DEVICE",)][0] == _ffi.VALUES_ALL_DEVICE
    assert c_layout[("SKV_BUDGET_ALL",)][0] == _ffi.BUDGET_ALL
    assert c_layout[("SKV_SELECT_FIXED",)][0] == _ffi.SELECT_MODES["fixed"]
    assert c_layout[("SKV_SELECT_MASS",)][0] == _ffi.SELECT_MODES["mass"]
    assert c_layout[("SKV_VALUE_BF16",)][0] == _ffi.VALUE_DTYPES["bf16"]
    assert c_layout[("SKV_VALUE_FP8",)][0] == _ffi.VALUE_DTYPES["fp8"]


def _header_functions():
    """(name, n_params, returns_void) of every SKV_API declaration of the public headers."""
    text = "\n".join(open(h).read() for h in HEADERS if os.path.exists(h))
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    out = []
    for m in re.finditer(r"SKV_API\s+([^;{]*?)\b(skv_\w+)\s*\(([^)]*)\)\s*;", text):
        ret, name, params = m.group(1).strip(), m.group(2), m.group(3).strip()
        n = 0 if params in ("", "void") else len(params.split(","))
        out.append((name, n, ret == "void"))
    return out


def test_every_function_bound():
    funcs = _header_functions()
    assert len(funcs) > 40, "the header parse found too few functions"
    signatures = {**_ffi._SIGNATURES, **_ffi._OPTIONAL_SIGNATURES}
    for name, n, is_void in funcs:
        assert name in signatures, f"{name} is not declared in _ffi._SIGNATURES (or _OPTIONAL_SIGNATURES)"
        res, args = signatures[name]
        assert len(args) == n, f"{name}: {len(args)} ctypes arguments, the header has {n}"
        assert (res is None) == is_void, f"{name}: return type"
    # and nothing is bound that the header does not declare
    names = {f[0] for f in funcs}
    assert set(signatures) <= names


def test_version_and_names():
    L = shadowkv.lib()
    v = _ffi.HEADER_VERSION
    assert shadowkv.version() == f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    assert L.skv_version_number() == _ffi.HEADER_VERSION
    for code, name in _ffi.STATUS_NAMES.items():
        assert L.skv_status_string(code).decode().startswith(name), code
    for name, code in _ffi.BACKENDS.items():
        assert L.skv_backend_name(code).decode() == name
        out = ctypes.c_int(-1)
        assert L.skv_backend_parse(name.encode(), ctypes.byref(out)) == 0 and out.value == code
    assert os.path.exists(shadowkv.library_path())


def _bf16_probe_values():
    """float32 values that exercise the rounding: random magnitudes, ties to even both ways, the
    largest finite values (rounding up to inf), subnormals, signed zeros, infinities and NaNs with
    payloads and both signs (as float32 bit patterns)."""
    import numpy as np
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(2000) * 10.0 ** rng.integers(-30, 30, 2000)).astype(np.float32)
    special = np.array([0.0, -0.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, float("inf"), -float("inf"), 3.0e38, 3.4e38,
                        -3.4e38, 1e-39, -1e-40, 1e-45], dtype=np.float32)
    nan_bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFF8000, 0x7F808000,
                         0xFFFFFFFF], dtype=np.uint32)
    tie_bits = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF, 0x7F7F8000, 0x00008000, 0x80018000],
                        dtype=np.uint32)
    rnd_bits = rng.integers(0, 2 ** 32, 4000, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([x, special, nan_bits.view(np.float32), tie_bits.view(np.float32),
                           rnd_bits.view(np.float32)])


def test_bf16_numpy_rounding_matches_the_library():
    """shadowkv.as_bf16 (what a float32 numpy argument goes through) gives skv_bf16_from_float's bits
    for every value, NaNs included; as_float32 is skv_bf16_to_float."""
    np = pytest.importorskip("numpy")
    L = shadowkv.lib()
    x = _bf16_probe_values()
    got = shadowkv.as_bf16(x)
    got_bits = got.view(np.uint16)
    want = np.array([L.skv_bf16_from_float(float(v)) for v in x], dtype=np.uint16)
    # ctypes passes a float32 NaN through a double: the payload survives (quiet bit set), as in C
    bad = np.nonzero(got_bits != want)[0]
    assert bad.size == 0, [(hex(int(x.view(np.uint32)[i])), hex(int(got_bits[i])), hex(int(want[i]))) for i in bad[:8]]
    back = shadowkv.as_float32(got)
    want_f = np.array([L.skv_bf16_to_float(int(b)) for b in want], dtype=np.float32)
    assert np.array_equal(back.view(np.uint32), want_f.view(np.uint32))
    # a uint16 array is taken as bf16 bits, in both directions
    assert shadowkv.as_bf16(got_bits) is got_bits
    assert np.array_equal(shadowkv.as_float32(got_bits).view(np.uint32), want_f.view(np.uint32))


def test_bf16_matches_torch():
    """torch.bfloat16 is skv_bf16: the same bits for the same float (round to nearest even)."""
    torch = pytest.importorskip("torch")
    L = shadowkv.lib()
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.randn(2000, generator=g) * 10.0 ** torch.randint(-30, 30, (2000,), generator=g),
                   torch.tensor([0.0, -0.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, float("inf"), -float("inf"), 3.0e38])])
    bits = x.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    for xi, bi in zip(x.tolist(), bits.tolist()):
        assert L.skv_bf16_from_float(xi) == bi, xi
        assert L.skv_bf16_to_float(bi) == torch.tensor([bi], dtype=torch.int32).to(torch.int16).view(
            torch.bfloat16).float().item()
