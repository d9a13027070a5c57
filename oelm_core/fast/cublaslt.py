"""The training step's GEMMs through cuBLASLt: each problem's algorithm chosen by timing, and the
MLP's forward GELU inside its GEMM's epilogue.

Why (measured at 64 x 512 tokens; the gains are in benchmarks/README.md):
- cuBLAS's heuristic takes its first guess. For the MLP's (32,768 x 512) @ (512 x 2,048) product
  another of its own candidates was about 10% faster than that guess on an H200. ``gemm`` times
  every candidate once per problem and keeps the fastest, as PyTorch's TunableOp does on ROCm (on
  CUDA it only chooses between cuBLAS and cuBLASLt's first guesses).
- The MLP's forward GELU is a memory-bound pass per layer (read the pre-activation, write its
  GELU). cuBLASLt computes it in the GEMM's epilogue (GELU_AUX_BIAS), writing the
  pre-activation beside it for the backward pass. Its GELU is the tanh approximation, the model's.

PyTorch ships libcublasLt with every CUDA build but binds only ``addmm``'s epilogues, so this
module calls the library through ctypes; it loads the library on the first GEMM, and is imported
only by the fast paths that use it on CUDA (``oelm_core.fast.linear``, ``oelm_core.fast.ce_kernels``).
All of it is optional: ``available(device, dtype)`` is False wherever the library, the dtype or an
algorithm is missing, and the callers then run torch's ops. Switch: ``train.cublaslt``.

Row-major tensors are column-major transposes: out = op(a) @ op(b) (row-major) is computed by
cuBLASLt as out^T = op(b)^T op(a)^T, with b's memory as its first operand and a's as its second.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
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
# with an older kernel, slower than the product and a separate GELU' and bias-sum pass together,
# and DGELU_BGRAD slower still.

# Hopper's recommended cuBLAS workspace, one per stream the GEMMs run on (as torch keeps one per
# stream for cuBLAS: split-K kernels on two streams must not share one), kept for the process
# (CUDA graphs that captured a GEMM replay into it).
_WORKSPACE_BYTES = 32 * 1024 * 1024
_CANDIDATES = 8      # the heuristic's best guesses timed per problem
_TIMED_CALLS = 3     # calls per candidate, after one untimed
_QUEUE_CYCLES = 20_000_000  # GPU sleep cycles: longer than the host takes to launch every timed candidate
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)  # CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_{A,B,C,D}_BYTES


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves_count", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


_P, _INT, _SIZE = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
_SIGNATURES = {  # argument types, so that 64-bit pointers and sizes are passed whole
    "cublasLtCreate": [_P],
    "cublasLtMatmulDescCreate": [_P, _INT, _INT],
    "cublasLtMatmulDescSetAttribute": [_P, _INT, _P, _SIZE],
    "cublasLtMatrixLayoutCreate": [_P, _INT, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
    "cublasLtMatmulPreferenceCreate": [_P],
    "cublasLtMatmulPreferenceSetAttribute": [_P, _INT, _P, _SIZE],
    "cublasLtMatmulPreferenceDestroy": [_P],
    "cublasLtMatmulAlgoGetHeuristic": [_P] * 7 + [_INT, _P, _P],
    "cublasLtMatmul": [_P] * 14 + [_SIZE, _P],
}


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
            lib = ctypes.CDLL(name)
            for function, argtypes in _SIGNATURES.items():
                getattr(lib, function).argtypes = argtypes
                getattr(lib, function).restype = _INT
            return lib
        except (OSError, AttributeError):
            continue
    return None


def _dense_rows(t: torch.Tensor) -> bool:
    """True for a 2-D tensor cuBLASLt can read as it is: unit column stride, rows apart by at
    least a row (a contiguous tensor, or rows sliced from one)."""
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= max(1, t.size(1))


def _layout_of(t: torch.Tensor) -> tuple[int, int, int]:
    """A ``_dense_rows`` (rows, cols) tensor as cuBLASLt's column-major (rows, cols, leading
    dimension) of the same memory: its transpose."""
    return t.size(1), t.size(0), t.stride(0)


def _alignment(t: Optional[torch.Tensor]) -> int:
    """Bytes the tensor's address is aligned to, up to 256 (what cuBLASLt asks about)."""
    if t is None:
        return 256
    address = t.data_ptr()
    return min(256, address & -address) if address else 256


@dataclass
class _Plan:
    """One problem's descriptor, layouts (A, B, D), the heuristic's candidates and the index of
    the fastest (None until timed)."""
    desc: ctypes.c_void_p
    layouts: tuple
    candidates: list
    chosen: Optional[int] = None


class _Lt:
    """One cuBLASLt handle per device; per problem (shapes, strides, transposes, alignments,
    dtype, epilogue) a ``_Plan``, or None where cuBLASLt cannot run it."""

    def __init__(self, lib: ctypes.CDLL, device: torch.device):
        self.lib, self.device = lib, device
        self.handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            self._check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self._plans: dict = {}
        self._workspaces: dict = {}

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
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), _CUDA_DTYPE[dtype], rows, cols, ld),
                    "cublasLtMatrixLayoutCreate")
        return layout

    def _new_plan(self, key, bias, aux) -> _Plan:
        dtype, la, trans_a, lb, trans_b, out_dtype, ld, _, epilogue, aux_ld, alignments = key
        desc = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F,
                                                      _CUDA_DTYPE[torch.float32]),
                    "cublasLtMatmulDescCreate")
        self._set(desc, _DESC_TRANSA, ctypes.c_int32(trans_a))
        self._set(desc, _DESC_TRANSB, ctypes.c_int32(trans_b))
        self._set(desc, _DESC_EPILOGUE, ctypes.c_uint32(epilogue))
        if aux_ld:
            self._set(desc, _DESC_AUX_LD, ctypes.c_int64(aux_ld))
        self._set_pointers(desc, bias, aux)  # the heuristic infers their alignment from them
        layouts = (self._layout(dtype, *la), self._layout(dtype, *lb), self._layout(out_dtype, *ld))
        pref = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)),
                    "cublasLtMatmulPreferenceCreate")
        try:
            for attr, value in zip((_PREF_MAX_WORKSPACE_BYTES, *_PREF_MIN_ALIGNMENT),
                                   (_WORKSPACE_BYTES, *alignments)):
                value = ctypes.c_uint64(value) if attr == _PREF_MAX_WORKSPACE_BYTES else ctypes.c_uint32(value)
                self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(
                    pref, attr, ctypes.byref(value), ctypes.sizeof(value)), "cublasLtMatmulPreferenceSetAttribute")
            results, count = (_HeuristicResult * _CANDIDATES)(), ctypes.c_int(0)
            self._check(self.lib.cublasLtMatmulAlgoGetHeuristic(
                self.handle, desc, layouts[0], layouts[1], layouts[2], layouts[2], pref, _CANDIDATES,
                results, ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        finally:
            self.lib.cublasLtMatmulPreferenceDestroy(pref)
        candidates = [results[i] for i in range(count.value) if results[i].state == 0]
        if not candidates:
            raise CublasLtError(f"cuBLASLt has no algorithm for {key}")
        return _Plan(desc, layouts, candidates)

    def _set_pointers(self, desc, bias, aux) -> None:
        for attr, tensor in ((_DESC_BIAS_POINTER, bias), (_DESC_AUX_POINTER, aux)):
            if tensor is not None:
                self._set(desc, attr, ctypes.c_void_p(tensor.data_ptr()))

    def _launch(self, plan: _Plan, algo, stream, a, b, out, bias, aux, accumulate) -> None:
        """One GEMM on ``stream``. The descriptor's pointers are read when the kernel is
        enqueued, so re-pointing a shared descriptor leaves earlier launches (and graphs) alone."""
        self._set_pointers(plan.desc, bias, aux)
        workspace = self._workspaces.get(stream.cuda_stream)
        if workspace is None:
            workspace = self._workspaces[stream.cuda_stream] = torch.empty(
                _WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        one, beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if accumulate else 0.0)
        la, lb, ld = plan.layouts
        self._check(self.lib.cublasLtMatmul(
            self.handle, plan.desc, ctypes.byref(one), b.data_ptr(), la, a.data_ptr(), lb, ctypes.byref(beta),
            out.data_ptr(), ld, out.data_ptr(), ld, ctypes.byref(algo.algo), workspace.data_ptr(),
            _WORKSPACE_BYTES, stream.cuda_stream), "cublasLtMatmul")

    def _fastest(self, plan: _Plan, stream, *args) -> int:
        """Index of the candidate that ran ``args`` fastest. Each runs once untimed (which loads
        its kernel: lazy loading may synchronise), then all timed launches queue behind one long
        sleep kernel, so the events time the GPU's work, not this process's ctypes calls (each as
        long as a small GEMM). If the sleep ended before the last launch was queued,
        the timing is not trusted and the heuristic's first guess stays."""
        usable = []
        for i, algo in enumerate(plan.candidates):
            try:
                self._launch(plan, algo, stream, *args)
                usable.append(i)
            except CublasLtError:
                continue
        if not usable:
            raise CublasLtError("no candidate algorithm ran")
        events = {i: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for i in usable}
        slept = torch.cuda.Event()
        torch.cuda._sleep(_QUEUE_CYCLES)
        slept.record(stream)
        for i, (start, end) in events.items():
            start.record(stream)
            for _ in range(_TIMED_CALLS):
                self._launch(plan, plan.candidates[i], stream, *args)
            end.record(stream)
        timed_behind_the_sleep = not slept.query()
        stream.synchronize()
        if not timed_behind_the_sleep:
            return usable[0]
        return min(usable, key=lambda i: events[i][0].elapsed_time(events[i][1]))

    def matmul(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, trans_a: bool,
               trans_b: bool, epilogue: int = EPILOGUE_DEFAULT, bias: Optional[torch.Tensor] = None,
               aux: Optional[torch.Tensor] = None, accumulate: bool = False) -> bool:
        """out (M, N) = epilogue(op(a) @ op(b)) (+ out, with ``accumulate``) on the current stream
        of this device, op a transpose where asked; False, with nothing written, where cuBLASLt
        cannot run it (the caller then uses torch). a, b, out (and aux): ``_dense_rows``, one dtype,
        except that out may be float32 (sums kept in float32 over several products). bias (N,):
        added (BIAS, GELU_AUX_BIAS). aux like out: the pre-activation written beside GELU
        (GELU_AUX*)."""
        if (min(a.shape + b.shape) == 0 or not all(_dense_rows(t) for t in (a, b, out))
                or (aux is not None and (not _dense_rows(aux) or aux.stride(0) % 8))):
            return False  # (cuBLASLt wants the pre-activation's rows 8-element aligned)
        key = (a.dtype, _layout_of(b), _OP_T if trans_b else _OP_N, _layout_of(a),
               _OP_T if trans_a else _OP_N, out.dtype, _layout_of(out), accumulate, epilogue,
               aux.stride(0) if aux is not None else 0,
               tuple(_alignment(t) for t in (b, a, out, out)) + (_alignment(bias), _alignment(aux)))
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream()
            args = (a, b, out, bias, aux, accumulate)
            try:
                if key not in self._plans:
                    self._plans[key] = self._new_plan(key, bias, aux)
                plan = self._plans[key]
                if plan is None:
                    return False
                if plan.chosen is None:
                    if torch.are_deterministic_algorithms_enabled():
                        plan.chosen = 0  # the same algorithm in every run, not the fastest of this one
                    elif not torch.cuda.is_current_stream_capturing():  # no timing inside a capture
                        # (timed into a buffer of out's layout where each launch would add to out)
                        scratch = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype,
                                                      device=out.device) if accumulate else out
                        plan.chosen = self._fastest(plan, stream, a, b, scratch, bias, aux, accumulate)
                self._launch(plan, plan.candidates[plan.chosen or 0], stream, *args)
            except CublasLtError:
                self._plans[key] = None
                return False
        return True


@functools.lru_cache(maxsize=None)
def _lt(device_index: int) -> Optional[_Lt]:
    lib = _find_library()
    if lib is None:
        return None
    try:
        return _Lt(lib, torch.device("cuda", device_index))
    except CublasLtError:
        return None


def _lt_for(t: torch.Tensor) -> Optional[_Lt]:
    return _lt(t.device.index if t.device.index is not None else torch.cuda.current_device())


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if _dense_rows(t) else t.contiguous()


def _op(t: torch.Tensor, transpose: bool) -> torch.Tensor:
    return t.t() if transpose else t


@torch.library.custom_op("oelm::gemm", mutates_args=(), device_types="cuda")
def gemm(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], trans_a: bool,
         trans_b: bool) -> torch.Tensor:
    """op(a) @ op(b) (+ bias (N,), over rows) -> (M, N), op a transpose where asked: a is (M, K)
    or, transposed, (K, M); b (K, N) or (N, K)."""
    a, b = _dense(a), _dense(b)
    out = a.new_empty(_op(a, trans_a).size(0), _op(b, trans_b).size(1))
    lt = _lt_for(a)
    if lt is None or not lt.matmul(a, b, out, trans_a, trans_b,
                                   EPILOGUE_DEFAULT if bias is None else EPILOGUE_BIAS, bias=bias):
        product = _op(a, trans_a) @ _op(b, trans_b)
        out = product if bias is None else product + bias
    return out


@gemm.register_fake
def _(a, b, bias, trans_a, trans_b):
    return a.new_empty(_op(a, trans_a).size(0), _op(b, trans_b).size(1))


@torch.library.custom_op("oelm::gemm_gelu", mutates_args=(), device_types="cuda")
def gemm_gelu(x: torch.Tensor, weight: torch.Tensor,
              bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(GELU(x W^T + b), x W^T + b): x (M, K), weight (N, K), bias (N,) or None -> two (M, N)."""
    x, weight = _dense(x), _dense(weight)
    out = x.new_empty(x.size(0), weight.size(0))
    pre = torch.empty_like(out)
    lt = _lt_for(x)
    if lt is None or not lt.matmul(x, weight, out, False, True,
                                   EPILOGUE_GELU_AUX if bias is None else EPILOGUE_GELU_AUX_BIAS,
                                   bias=bias, aux=pre):
        pre = torch.nn.functional.linear(x, weight, bias)
        out = torch.nn.functional.gelu(pre, approximate="tanh")
    return out, pre


@gemm_gelu.register_fake
def _(x, weight, bias):
    out = x.new_empty(x.size(0), weight.size(0))
    return out, torch.empty_like(out)


def matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, trans_a: bool = False,
                accumulate: bool = False) -> None:
    """out (M, N) = op(a) @ b, or out += op(a) @ b with ``accumulate``: a (M, K) or, transposed,
    (K, M); b (K, N); out of a's dtype or float32 (a sum over several products), e.g. rows of a
    larger tensor. Eager use only."""
    a, b = _dense(a), _dense(b)
    lt = _lt_for(a)
    if (lt is not None and (out.dtype == a.dtype or _float32_out_agrees(lt, a.dtype))
            and lt.matmul(a, b, out, trans_a, False, accumulate=accumulate)):
        return
    product = _op(a, trans_a).to(out.dtype) @ b.to(out.dtype)  # a float32 out: float32 products
    if accumulate:
        out += product
    else:
        out.copy_(product)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """True where these GEMMs can run for ``dtype`` on ``device``: checked once against torch on
    small problems of each kind. (Whether they are used is the callers' switch, ``train.cublaslt``.)"""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    return _probe(device.index if device.index is not None else torch.cuda.current_device(), dtype)


@functools.lru_cache(maxsize=None)
def _probe(device_index: int, dtype: torch.dtype) -> bool:
    lt = _lt(device_index)
    if lt is None:
        return False
    device = torch.device("cuda", device_index)
    # Asked from inside a training step too: check in plain float32.
    with torch.cuda.device(device), torch.autocast("cuda", enabled=False):
        return _agrees_with_torch(lt, device, dtype)


def _agrees_with_torch(lt: _Lt, device: torch.device, dtype: torch.dtype) -> bool:
    """Each kind of call the model makes, through cuBLASLt itself (no fallback), against float32."""
    gen = torch.Generator(device).manual_seed(0)
    x, w, b, g = (torch.randn(shape, device=device, generator=gen).to(dtype)
                  for shape in ((64, 32), (48, 32), (48,), (64, 48)))
    out = {name: torch.empty(shape, device=device, dtype=dtype)
           for name, shape in (("bias", (64, 48)), ("wgrad", (48, 32)), ("dgrad", (64, 32)),
                               ("gelu", (64, 48)), ("pre", (64, 48)))}
    ran = [lt.matmul(x, w, out["bias"], False, True, EPILOGUE_BIAS, bias=b),
           lt.matmul(g, x, out["wgrad"], True, False),
           lt.matmul(g, w, out["dgrad"], False, False),
           lt.matmul(x, w, out["gelu"], False, True, EPILOGUE_GELU_AUX_BIAS, bias=b, aux=out["pre"])]
    if not all(ran):
        return False
    pre = x.float() @ w.float().t() + b.float()
    want = {"bias": pre, "wgrad": g.float().t() @ x.float(), "dgrad": g.float() @ w.float(),
            "gelu": torch.nn.functional.gelu(pre, approximate="tanh"), "pre": pre}
    return all(torch.allclose(out[k].float(), want[k], atol=0.1, rtol=0.02) for k in want)


@functools.lru_cache(maxsize=None)
def _float32_out_agrees(lt: _Lt, dtype: torch.dtype) -> bool:
    """Whether low-precision products written or summed into a float32 out (``matmul_into``)
    agree with torch: checked once, apart from ``available``'s kinds, so that a library without
    them keeps the others."""
    device = lt.device
    with torch.cuda.device(device), torch.autocast("cuda", enabled=False):
        gen = torch.Generator(device).manual_seed(1)
        g, x = (torch.randn(shape, device=device, generator=gen).to(dtype) for shape in ((64, 48), (64, 32)))
        out = torch.randn((48, 32), device=device, generator=gen)
        want = out + g.float().t() @ x.float()
        return (lt.matmul(g, x, out, True, False, accumulate=True)
                and torch.allclose(out, want, atol=1e-3, rtol=1e-4))
