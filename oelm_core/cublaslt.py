"""The training step's GEMMs through cuBLASLt: each problem's algorithm chosen by timing, and the
MLP's forward GELU inside its GEMM's epilogue.

Why, measured on an H200 at 64 x 512 tokens (benchmarks/RESULTS.md):
- cuBLAS's heuristic takes its first guess. For the MLP's (32,768 x 512) @ (512 x 2,048) product
  that guess took 105-108 us, where another of its own candidates took 94. ``gemm`` times every
  candidate once per problem and keeps the fastest, as PyTorch's TunableOp does on ROCm (on CUDA
  it only chooses between cuBLAS and cuBLASLt's first guesses).
- The MLP's forward GELU is a memory-bound pass per layer (read the pre-activation, write its
  GELU). cuBLASLt computes it in the GEMM's epilogue (GELU_AUX_BIAS), writing the
  pre-activation beside it for the backward pass. Its GELU is the tanh approximation, the model's.

PyTorch ships libcublasLt with every CUDA build but binds only ``addmm``'s epilogues, so this
module calls the library through ctypes. All of it is optional: ``available(device, dtype)`` is
False wherever the library, the dtype or an algorithm is missing, and the model runs plain ops.

Row-major tensors are column-major transposes: out = op(a) @ op(b) (row-major) is computed by
cuBLASLt as out^T = op(b)^T op(a)^T, with b's memory as its first operand and a's as its second.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

import torch

# cublasLt.h / library_types.h values (stable across CUDA 11-13)
_CUDA_DTYPE = {torch.bfloat16: 14, torch.float16: 2, torch.float32: 0}
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_AUX_POINTER, _DESC_AUX_LD = 11, 12
_PREF_MAX_WORKSPACE_BYTES = 1
EPILOGUE_DEFAULT = 1
EPILOGUE_BIAS = 4
EPILOGUE_GELU_AUX = 32 | 128
EPILOGUE_GELU_AUX_BIAS = 32 | 128 | 4
# The backward epilogues are not used: on an H200 cuBLASLt runs DGELU (GELU' times the product)
# with an older, slower kernel (180 us against 107 for the product and ~125 for a fused GELU'
# and bias-sum pass at 32,768 x 2,048, 42 against 30 at 4,096), and DGELU_BGRAD took 660-680 us.

# Hopper's recommended cuBLAS workspace; one per device, kept for the process (CUDA graphs that
# captured a GEMM replay into it).
_WORKSPACE_BYTES = 32 * 1024 * 1024
_CANDIDATES = 8      # the heuristic's best guesses timed per problem
_TIMED_CALLS = 3     # calls per candidate, after one untimed
_QUEUE_CYCLES = 20_000_000  # ~10 ms of GPU sleep: covers the host's launches of every candidate


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves_count", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


def _find_library() -> Optional[ctypes.CDLL]:
    """The libcublasLt that torch itself loaded (read from the process's memory map), else the
    usual sonames."""
    names = []
    try:
        with open("/proc/self/maps") as maps:
            names = sorted({line.split()[-1] for line in maps if "libcublasLt.so" in line})
    except OSError:
        pass
    for name in names + ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _layout_of(t: torch.Tensor) -> tuple[int, int, int]:
    """A row-major (rows, cols) tensor with unit column stride as cuBLASLt's column-major
    (rows, cols, leading dimension) of the same memory: its transpose."""
    return t.size(1), t.size(0), t.stride(0)


class _Lt:
    """One cuBLASLt handle and workspace per device; per problem (shapes, strides, transposes,
    dtype, epilogue) a descriptor, its layouts and the fastest of the heuristic's candidates."""

    def __init__(self, lib: ctypes.CDLL, device: torch.device):
        self.lib, self.device = lib, device
        self.handle = ctypes.c_void_p()
        lib.cublasLtMatmul.argtypes = [ctypes.c_void_p] * 14 + [ctypes.c_size_t, ctypes.c_void_p]
        self._check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._plans: dict = {}

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise CublasLtError(f"{what} failed with cuBLAS status {status}")

    def _set(self, desc, attr: int, value) -> None:
        self._check(self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value),
                                                             ctypes.sizeof(value)),
                    f"cublasLtMatmulDescSetAttribute({attr})")

    def _layout(self, dtype: torch.dtype, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatrixLayoutCreate(
            ctypes.byref(layout), _CUDA_DTYPE[dtype], ctypes.c_uint64(rows), ctypes.c_uint64(cols),
            ctypes.c_int64(ld)), "cublasLtMatrixLayoutCreate")
        return layout

    def _new_plan(self, key) -> list:
        """[descriptor, layouts, candidates, chosen index or None (not yet timed)]."""
        dtype, la, trans_a, lb, trans_b, ld, epilogue, aux_ld = key
        desc = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F,
                                                      _CUDA_DTYPE[torch.float32]),
                    "cublasLtMatmulDescCreate")
        self._set(desc, _DESC_TRANSA, ctypes.c_int32(trans_a))
        self._set(desc, _DESC_TRANSB, ctypes.c_int32(trans_b))
        self._set(desc, _DESC_EPILOGUE, ctypes.c_uint32(epilogue))
        if aux_ld:
            self._set(desc, _DESC_AUX_LD, ctypes.c_int64(aux_ld))
        layouts = [self._layout(dtype, *shape) for shape in (la, lb, ld)]
        pref = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)),
                    "cublasLtMatmulPreferenceCreate")
        ws = ctypes.c_uint64(_WORKSPACE_BYTES)
        self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(
            pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), ctypes.sizeof(ws)),
            "cublasLtMatmulPreferenceSetAttribute")
        results, count = (_HeuristicResult * _CANDIDATES)(), ctypes.c_int(0)
        self._check(self.lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], pref, _CANDIDATES,
            results, ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        self.lib.cublasLtMatmulPreferenceDestroy(pref)
        if count.value == 0:
            raise CublasLtError(f"cuBLASLt has no algorithm for {key}")
        return [desc, layouts, [results[i] for i in range(count.value)], None]

    def _launch(self, plan, algo, a, b, out, bias, aux) -> None:
        desc, (la, lb, ld) = plan[0], plan[1]
        for attr, tensor in ((_DESC_BIAS_POINTER, bias), (_DESC_AUX_POINTER, aux)):
            if tensor is not None:
                self._set(desc, attr, ctypes.c_void_p(tensor.data_ptr()))
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._check(self.lib.cublasLtMatmul(
            self.handle, desc, ctypes.byref(one), ctypes.c_void_p(b.data_ptr()), la,
            ctypes.c_void_p(a.data_ptr()), lb, ctypes.byref(zero),
            ctypes.c_void_p(out.data_ptr()), ld, ctypes.c_void_p(out.data_ptr()), ld,
            ctypes.byref(algo.algo), ctypes.c_void_p(self.workspace.data_ptr()),
            ctypes.c_size_t(_WORKSPACE_BYTES),
            ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)), "cublasLtMatmul")

    def _fastest(self, plan, *args) -> int:
        """Index of the candidate that ran ``args`` fastest. All launches queue behind one long
        sleep kernel, so the events time the GPU's work, not this process's ctypes calls
        (~tens of us each, as long as a small GEMM)."""
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in plan[2]]
        torch.cuda._sleep(_QUEUE_CYCLES)
        for algo, (start, end) in zip(plan[2], events):
            self._launch(plan, algo, *args)
            start.record()
            for _ in range(_TIMED_CALLS):
                self._launch(plan, algo, *args)
            end.record()
        torch.cuda.current_stream(self.device).synchronize()
        times = [start.elapsed_time(end) for start, end in events]
        return min(range(len(times)), key=times.__getitem__)

    def matmul(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, trans_a: bool,
               trans_b: bool, epilogue: int = EPILOGUE_DEFAULT, bias: Optional[torch.Tensor] = None,
               aux: Optional[torch.Tensor] = None) -> None:
        """out = epilogue(op(a) @ op(b)) on the current stream; op transposes where asked.

        a, b, out: 2-D with unit column stride, one dtype. bias (N,): added (BIAS, GELU_AUX_BIAS).
        aux, like out: the pre-activation it writes (GELU_AUX*)."""
        key = (a.dtype, _layout_of(b), _OP_T if trans_b else _OP_N, _layout_of(a),
               _OP_T if trans_a else _OP_N, _layout_of(out), epilogue,
               aux.stride(0) if aux is not None else 0)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._new_plan(key)
        if plan[3] is None:
            if torch.cuda.is_current_stream_capturing():  # no timing inside a capture
                return self._launch(plan, plan[2][0], a, b, out, bias, aux)
            plan[3] = self._fastest(plan, a, b, out, bias, aux)
        self._launch(plan, plan[2][plan[3]], a, b, out, bias, aux)


@functools.lru_cache(maxsize=None)
def _lt(device_index: int) -> Optional[_Lt]:
    lib = _find_library()
    if lib is None:
        return None
    try:
        return _Lt(lib, torch.device("cuda", device_index))
    except (CublasLtError, AttributeError):
        return None


def _lt_for(t: torch.Tensor) -> _Lt:
    lt = _lt(t.device.index if t.device.index is not None else torch.cuda.current_device())
    if lt is None:
        raise CublasLtError("cuBLASLt is not available on this machine")
    return lt


def _out_shape(a, b, trans_a: bool, trans_b: bool) -> tuple[int, int]:
    return a.size(1) if trans_a else a.size(0), b.size(0) if trans_b else b.size(1)


@torch.library.custom_op("oelm::gemm", mutates_args=(), device_types="cuda")
def gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], trans_a: bool,
         trans_b: bool) -> torch.Tensor:
    """op(a) @ op(b) (+ bias, over rows): a, b contiguous 2-D, op = transpose where asked."""
    out = a.new_empty(_out_shape(a, b, trans_a, trans_b))
    _lt_for(a).matmul(a, b, out, trans_a, trans_b,
                      EPILOGUE_DEFAULT if bias is None else EPILOGUE_BIAS, bias=bias)
    return out


@gemm.register_fake
def _(a, b, bias, trans_a, trans_b):
    return a.new_empty(_out_shape(a, b, trans_a, trans_b))


@torch.library.custom_op("oelm::gemm_gelu", mutates_args=(), device_types="cuda")
def gemm_gelu(x: torch.Tensor, weight: torch.Tensor,
              bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(GELU(x W^T + b), x W^T + b): x (M, K), weight (N, K), bias (N,) or None -> two (M, N)."""
    out = x.new_empty(x.size(0), weight.size(0))
    pre = torch.empty_like(out)
    _lt_for(x).matmul(x, weight, out, False, True,
                      EPILOGUE_GELU_AUX if bias is None else EPILOGUE_GELU_AUX_BIAS, bias=bias, aux=pre)
    return out, pre


@gemm_gelu.register_fake
def _(x, weight, bias):
    out = x.new_empty(x.size(0), weight.size(0))
    return out, torch.empty_like(out)


def matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b, written into ``out`` (e.g. a slice of a larger tensor); eager use only."""
    _lt_for(a).matmul(a, b, out, False, False)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """True where these GEMMs can run for ``dtype`` on ``device``: checked once against torch on
    small problems of each kind. ``OELM_CUBLASLT=0`` turns them off (to compare)."""
    if (device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16)
            or os.environ.get("OELM_CUBLASLT", "1") == "0"):
        return False
    return _probe(device.index if device.index is not None else torch.cuda.current_device(), dtype)


@functools.lru_cache(maxsize=None)
def _probe(device_index: int, dtype: torch.dtype) -> bool:
    if _lt(device_index) is None:
        return False
    # Asked from inside a training step too: check in plain float32.
    with torch.autocast("cuda", enabled=False):
        return _agrees_with_torch(torch.device("cuda", device_index), dtype)


def _agrees_with_torch(device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator(device).manual_seed(0)
    x, w, b, g, w2 = (torch.randn(shape, device=device, generator=gen).to(dtype)
                      for shape in ((64, 32), (48, 32), (48,), (64, 16), (16, 48)))
    try:
        got = [gemm(x, w, b, False, True), gemm(g, x, None, True, False), gemm(g, w2, None, False, False),
               *gemm_gelu(x, w, b)]
    except CublasLtError:
        return False
    pre = x.float() @ w.float().t() + b.float()
    want = [pre, g.float().t() @ x.float(), g.float() @ w2.float(),
            torch.nn.functional.gelu(pre, approximate="tanh"), pre]
    return all(torch.allclose(a.float(), e, atol=0.1, rtol=0.02) for a, e in zip(got, want))
