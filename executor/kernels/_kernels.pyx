# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Cython layer of the CPU kernels: tensor checks, threading and per-ISA dispatch.

The C kernels (csrc/) are single-threaded over a range of rows; this module runs them on OpenMP
threads with `prange(..., schedule='static', nogil=True, num_threads=n)`, `n` always passed in by
the caller. Each GEMV thread owns an equal share of the weight rows; one that finishes early
takes tiles from the end of the others' shares (helm_claim in csrc/helm_kernels.h), so a call
does not wait on its slowest thread. A `KernelSet` binds one ISA's table of kernels; which one is
the default is decided once, in `executor/kernels/__init__.py`.
"""
from cython.parallel cimport prange
from libc.stdint cimport int64_t, uint16_t, uint64_t, uintptr_t

import torch

cdef extern from "helm_kernels.h" nogil:
    ctypedef struct helm_claim:
        int64_t word
    ctypedef void (*helm_gemv_fn)(float *out, long ldo, const float *x, const void *w,
                                  const float *bias, int accum, int B, int N, int K, int t, int nt,
                                  helm_claim *claims) noexcept nogil
    ctypedef void (*helm_rms_norm_fn)(float *out, const float *x, const void *w, float eps, int H,
                                      long b0, long b1) noexcept nogil
    ctypedef void (*helm_silu_mul_fn)(float *out, long ldo, const float *gate, long ldg,
                                      const float *up, long ldu, long n, long b0,
                                      long b1) noexcept nogil
    ctypedef uint64_t (*helm_read_fn)(const void *p, size_t nbytes) noexcept nogil
    ctypedef void (*helm_to_bf16_fn)(uint16_t *dst, const float *src, long i0, long i1) noexcept nogil
    ctypedef void (*helm_from_bf16_fn)(float *dst, const uint16_t *src, long i0, long i1) noexcept nogil
    ctypedef void (*helm_from_f16_fn)(float *dst, const uint16_t *src, long i0, long i1) noexcept nogil
    ctypedef void (*helm_gemm_fn)(float *out, long ldo, const float *x, const void *w, const float *bias,
                                  int accum, int M, int N, int K, int t, int nt) noexcept nogil
    ctypedef struct helm_kv_pages:
        const void *const *pages
        long layer_off
        long head_stride
        long v_off
        int Hkv
        int P
        int D
    ctypedef void (*helm_rope_qk_fn)(float *qkv, long ld, int Hq, int Hkv, int D, const float *qn,
                                     const float *kn, float eps, const float *cos, const float *sin,
                                     long t0, long t1) noexcept nogil
    ctypedef void (*helm_kv_write_fn)(const helm_kv_pages *kv, const float *qkv, long ld, int Hq,
                                      long start, long t0, long t1) noexcept nogil
    ctypedef struct helm_att_split:
        int segs
        float *partial
        int *done
    ctypedef void (*helm_attention_fn)(float *out, long ldo, const float *qkv, long ld, int Hq,
                                       const helm_kv_pages *kv, long start, long T, float scale,
                                       long item, const helm_att_split *split) noexcept nogil
    int helm_att_segments(long keys, long pairs) noexcept nogil

    ctypedef struct helm_kernel_table:
        const char *isa
        helm_gemv_fn gemv[3]
        helm_rms_norm_fn rms_norm[3]
        helm_silu_mul_fn silu_mul
        helm_read_fn read
        helm_rope_qk_fn rope_qk
        helm_kv_write_fn kv_write[3]
        helm_attention_fn attention[3]
        helm_to_bf16_fn to_bf16
        helm_from_bf16_fn from_bf16
        helm_from_f16_fn from_f16
        helm_gemm_fn gemm[3]
        float (*fma_peak)(long iters) noexcept nogil

    const helm_kernel_table helm_table_avx512bf16
    const helm_kernel_table helm_table_avx512
    const helm_kernel_table helm_table_avx2
    const helm_kernel_table helm_table_portable
    int helm_cpu_supports(const char *isa)
    long helm_prefetch_bytes[3]
    enum: HELM_MAX_TILE_B
    enum: HELM_ATT_BLOCK
    void helm_claims_init(helm_claim *claims, int n) noexcept nogil

cdef object _F32 = torch.float32  # looked up once: `linear` checks it on every call

# Weight dtype → index into a table's `gemv` / `rms_norm` arrays (HELM_F32, HELM_BF16, HELM_F16).
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

cdef enum:
    ROWS_PER_THREAD_MIN = 16  # below this many weight rows per thread, use fewer threads
    MAX_THREADS = 256  # claims are kept on the stack

#: Largest batch served by the GEMV register tiles in one pass over the weights.
MAX_TILE_B = HELM_MAX_TILE_B

#: How `linear` multiplies more than MAX_TILE_B rows of x (prompt chunks, large decode batches)
#: by a weight, one choice per weight dtype, made by measurement on the machine that runs
#: (executor/probe.py; the machine profile records it, the plan carries it):
#:   "gemv":       our GEMV tiles, MAX_TILE_B rows at a time over L2-sized blocks of the weights;
#:   "gemm":       our packed, register-blocked GEMM (csrc/gemm_core.h), weights widened to fp32
#:                 while packing; fp32 arithmetic like the GEMV;
#:   "torch":      PyTorch's GEMM on the weight's own dtype (MKL fp32; oneDNN bf16/fp16, which
#:                 rounds x and the result to that dtype, as a bf16/fp16 model in PyTorch does);
#:   "torch_fp32": the weight widened to fp32 by our kernels a tile of rows at a time (a bounded
#:                 temporary), then PyTorch's fp32 GEMM (MKL) per tile.
PROMPT_PATHS = ("gemv", "gemm", "torch", "torch_fp32")
cdef enum:
    PATH_GEMV = 0
    PATH_GEMM = 1
    PATH_TORCH = 2
    PATH_TORCH_FP32 = 3
    WIDEN_TILE_BYTES = 1 << 20  # fp32 bytes of one widened weight tile ("torch_fp32")


def cpu_supports(str isa) -> bool:
    """Whether this CPU and OS can run the named kernel variant (and it was compiled in)."""
    return helm_cpu_supports(isa.encode()) != 0


def prefetch_bytes(dtype) -> int:
    """Software-prefetch distance along each weight-row stream for this weight dtype, in bytes."""
    return helm_prefetch_bytes[_DTYPE_CODE[dtype]]


cdef const helm_kernel_table *_table(str isa) except NULL:
    cdef const helm_kernel_table *t
    if isa == "avx512bf16":
        t = &helm_table_avx512bf16
    elif isa == "avx512":
        t = &helm_table_avx512
    elif isa == "avx2":
        t = &helm_table_avx2
    elif isa == "portable":
        t = &helm_table_portable
    else:
        raise ValueError(f"unknown kernel ISA {isa!r}")
    if t.isa == NULL:
        raise RuntimeError(f"kernel ISA {isa!r} was not compiled into this build")
    return t


cdef tuple _linear_args(object x, PreparedLinear w, object out, bint accumulate):
    """x and out of a `linear` call checked (out allocated when None)."""
    xs = x.shape
    if x.dtype is not _F32 or len(xs) != 2 or not x.is_contiguous() or not x.is_cpu:
        raise ValueError(f"x must be a contiguous 2-D fp32 CPU tensor, got {x.dtype} "
                         f"shape {tuple(xs)} on {x.device}")
    cdef int B = xs[0]
    cdef int K = xs[1]
    cdef int N = w.out_features
    if K != w.in_features:
        raise ValueError(f"x has K={K} columns, weight expects {w.in_features}")
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out (the tensor to add to)")
        out = torch.empty((B, N), dtype=_F32)
    else:
        os_ = out.shape
        if (out.dtype is not _F32 or len(os_) != 2 or os_[0] != B or os_[1] != N
                or not out.is_contiguous() or not out.is_cpu):
            raise ValueError(f"out must be a contiguous fp32 CPU tensor of shape ({B}, {N})")
        if _overlap(x, out):
            raise ValueError("out overlaps x: the product is written while x is still being read")
    return x, out


cdef bint _overlap(object a, object b):
    """Whether two contiguous tensors share any byte."""
    cdef size_t a0 = a.data_ptr(), b0 = b.data_ptr()
    cdef size_t a1 = a0 + <size_t> a.numel() * a.element_size(), b1 = b0 + <size_t> b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


cdef inline void _check_cpu_tensor(object t, str name) except *:
    if not t.is_cpu:
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")


cdef class PreparedLinear:
    """A linear layer's weight ready for the kernels: W [N, K] row-major contiguous in its own
    dtype (bf16, fp16 or fp32), bias [N] as fp32. The layout is the checkpoint's own, so the
    same tensor also serves PyTorch (`F.linear(x, w.weight)`); no second copy is kept."""

    cdef readonly object weight  # [N, K] bf16 | fp16 | fp32, contiguous
    cdef readonly object bias  # [N] fp32 or None
    cdef readonly int out_features  # N
    cdef readonly int in_features  # K
    cdef int dtype_code
    cdef uintptr_t w_ptr
    cdef uintptr_t b_ptr

    def __init__(self, weight, bias=None):
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
        if weight.dtype not in _DTYPE_CODE:
            raise TypeError(f"weight dtype {weight.dtype} is not supported (bf16, fp16, fp32)")
        _check_cpu_tensor(weight, "weight")
        n, k = weight.shape
        if n < 1 or k < 1 or n >= 2 ** 31 or k >= 2 ** 31:
            raise ValueError(f"weight shape {tuple(weight.shape)} out of range")
        self.weight = weight.contiguous()
        self.out_features = n
        self.in_features = k
        self.dtype_code = _DTYPE_CODE[weight.dtype]
        self.w_ptr = self.weight.data_ptr()
        if bias is not None:
            _check_cpu_tensor(bias, "bias")
            if tuple(bias.shape) != (n,):
                raise ValueError(f"bias shape {tuple(bias.shape)} does not match N={n}")
            self.bias = bias.to(torch.float32).contiguous()
            self.b_ptr = self.bias.data_ptr()
        else:
            self.bias = None
            self.b_ptr = 0

    @property
    def dtype(self):
        return self.weight.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of weight streamed per call (bias excluded)."""
        return self.weight.numel() * self.weight.element_size()

    def __repr__(self):
        return (f"PreparedLinear(N={self.out_features}, K={self.in_features}, "
                f"dtype={self.weight.dtype}, bias={self.bias is not None})")


def prepare_linear(weight, bias=None) -> PreparedLinear:
    """Called once per weight at load time. weight: [N, K] bf16|fp16|fp32, bias: [N] or None."""
    return PreparedLinear(weight, bias)


cdef class KernelSet:
    """The kernels of one instruction set. `executor.kernels` binds its module-level functions to
    the KernelSet of KERNEL_ISA; tests and benchmarks build one per ISA to compare variants."""

    cdef const helm_kernel_table *t
    cdef readonly str isa
    cdef readonly dict routes  # weight dtype -> (path, min_rows), as given
    cdef int route_path[3]  # per dtype code: PATH_* for batches of at least route_min rows
    cdef int route_min[3]

    def __cinit__(self, str isa, routes=None):
        """routes: {weight dtype: (path, min_rows)}, path one of PROMPT_PATHS, taken for batches
        of at least min_rows (> MAX_TILE_B) rows of x; dtypes not given stay on "gemv"."""
        self.t = _table(isa)
        if not helm_cpu_supports(isa.encode()):
            raise RuntimeError(f"this CPU cannot run the {isa!r} kernels")
        self.isa = isa
        self.routes = {}
        for code in range(3):
            self.route_path[code] = PATH_GEMV
            self.route_min[code] = 0
        for dtype, route in (routes or {}).items():
            if dtype not in _DTYPE_CODE:
                raise TypeError(f"route for unsupported weight dtype {dtype}")
            path, min_rows = route
            if path not in PROMPT_PATHS:
                raise ValueError(f"unknown GEMM path {path!r}: expected one of {', '.join(PROMPT_PATHS)}")
            if int(min_rows) <= HELM_MAX_TILE_B:
                raise ValueError(f"min_rows must exceed MAX_TILE_B={HELM_MAX_TILE_B}, got {min_rows}")
            if path == "torch" and dtype is torch.float16:
                raise ValueError("the torch path for fp16 weights multiplies in fp16, whose result can overflow: "
                                 "use gemm, gemv or torch_fp32")
            self.route_path[_DTYPE_CODE[dtype]] = PROMPT_PATHS.index(path)
            self.route_min[_DTYPE_CODE[dtype]] = int(min_rows)
            self.routes[dtype] = (path, int(min_rows))

    def __repr__(self):
        return f"KernelSet({self.isa!r}, routes={self.routes!r})"

    @property
    def vector_floats(self) -> int:
        """fp32 lanes per vector register of this ISA."""
        return {"avx512bf16": 16, "avx512": 16, "avx2": 8, "portable": 4}[self.isa]

    def fma_peak_gflops(self, int num_threads, double seconds=0.2) -> float:
        """The fp32 FMA peak of num_threads cores in GFLOP/s: each thread runs independent chains
        of this ISA's vector FMAs from registers (nothing else) for about `seconds`."""
        cdef long iters = 1 << 16
        cdef int t
        cdef float sink = 0
        import time
        while True:
            t0 = time.perf_counter()
            for t in prange(num_threads, schedule='static', nogil=True, num_threads=num_threads):
                sink += self.t.fma_peak(iters)
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds / 4:
                break
            iters *= 4
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            for t in prange(num_threads, schedule='static', nogil=True, num_threads=num_threads):
                sink += self.t.fma_peak(iters)
            best = max(best, 2.0 * 12 * self.vector_floats * iters * num_threads / (time.perf_counter() - t0) / 1e9)
        return best

    def path(self, dtype, int batch) -> str:
        """The path `linear` takes for a weight of this dtype and this many rows of x."""
        cdef int code = _DTYPE_CODE[dtype]
        if batch <= HELM_MAX_TILE_B or batch < self.route_min[code]:
            return "gemv"
        return PROMPT_PATHS[self.route_path[code]]

    def gemm(self, x, PreparedLinear w not None, out=None, *, int num_threads, bint accumulate=False):
        """`linear` through the packed GEMM whatever the batch (benchmarks, the probe, tests)."""
        x, out = _linear_args(x, w, out, accumulate)
        if x.shape[0]:
            self._gemm(x, w, out, num_threads, accumulate)
        return out

    def linear(self, x, PreparedLinear w not None, out=None, *, int num_threads, bint accumulate=False):
        """out[B, N] = x[B, K] @ w.weight.T + w.bias, fp32 in and out, fp32 accumulation; with
        accumulate, out[B, N] += that instead (the residual add fused into the projection: out is
        then required).

        Up to MAX_TILE_B rows of x share one pass over the weights (decode: DRAM-bound GEMV).
        Larger batches take this set's route for the weight's dtype (PROMPT_PATHS; PyTorch's run on
        torch.get_num_threads() threads: keep that equal to num_threads)."""
        x, out = _linear_args(x, w, out, accumulate)
        cdef int B = x.shape[0]
        cdef int K = w.in_features
        cdef int N = w.out_features
        if B == 0:
            return out
        cdef int path = self.route_path[w.dtype_code]
        if B > HELM_MAX_TILE_B and path != PATH_GEMV and B >= self.route_min[w.dtype_code]:
            if path == PATH_GEMM:
                self._gemm(x, w, out, num_threads, accumulate)
                return out
            if accumulate:
                return out.add_(self._torch_linear(x, w, torch.empty((B, N), dtype=_F32), num_threads, path))
            return self._torch_linear(x, w, out, num_threads, path)
        cdef helm_gemv_fn fn = self.t.gemv[w.dtype_code]
        cdef float *o = <float *> <uintptr_t> out.data_ptr()
        cdef const float *xp = <const float *> <uintptr_t> x.data_ptr()
        cdef const void *wp = <const void *> w.w_ptr
        cdef const float *bp = <const float *> w.b_ptr
        cdef int nt = _threads_for(min(num_threads, MAX_THREADS), N // ROWS_PER_THREAD_MIN)
        cdef helm_claim claims[MAX_THREADS]
        cdef helm_claim *cp = claims
        cdef int acc = accumulate
        cdef int t
        if nt == 1:
            with nogil:
                fn(o, N, xp, wp, bp, acc, B, N, K, 0, 1, NULL)
            return out
        helm_claims_init(cp, nt)
        for t in prange(nt, schedule='static', nogil=True, num_threads=nt):
            fn(o, N, xp, wp, bp, acc, B, N, K, t, nt, cp)
        return out

    def rms_norm(self, x, weight, double eps, out=None, *, int num_threads):
        """out[..., H] = x * rsqrt(mean(x², -1) + eps) * weight; x fp32 contiguous [..., H],
        weight [H] fp32|bf16|fp16. `out` may be x (in place)."""
        if x.dtype is not torch.float32 or not x.is_contiguous() or x.dim() < 1:
            raise ValueError("x must be a contiguous fp32 tensor [..., H]")
        _check_cpu_tensor(x, "x")
        _check_cpu_tensor(weight, "weight")
        cdef int H = x.shape[x.dim() - 1]
        if weight.dim() != 1 or weight.shape[0] != H or not weight.is_contiguous():
            raise ValueError(f"weight must be a contiguous [H={H}] tensor")
        if weight.dtype not in _DTYPE_CODE:
            raise TypeError(f"weight dtype {weight.dtype} is not supported (bf16, fp16, fp32)")
        if out is None:
            out = torch.empty_like(x)
        elif (out.dtype is not torch.float32 or not out.is_contiguous()
              or out.shape != x.shape or not out.is_cpu):
            raise ValueError("out must be a contiguous fp32 CPU tensor shaped like x")
        cdef long rows = x.numel() // H if H > 0 else 0
        if rows == 0:
            return out
        cdef helm_rms_norm_fn fn = self.t.rms_norm[_DTYPE_CODE[weight.dtype]]
        cdef float *o = <float *> <uintptr_t> out.data_ptr()
        cdef const float *xp = <const float *> <uintptr_t> x.data_ptr()
        cdef const void *wp = <const void *> <uintptr_t> weight.data_ptr()
        cdef float feps = eps
        cdef int nt = _threads_for(num_threads, rows)
        cdef long chunk = (rows + nt - 1) // nt
        cdef int t
        if nt == 1:
            with nogil:
                fn(o, xp, wp, feps, H, 0, rows)
            return out
        for t in prange(nt, schedule='static', nogil=True, num_threads=nt):
            fn(o, xp, wp, feps, H, t * chunk, min(rows, (t + 1) * chunk))
        return out

    def silu_mul(self, gate, up, out=None, *, int num_threads=1):
        """out = silu(gate) * up, fp32 [n] or [B, n]; rows may be strided views (e.g. the two
        halves of a fused gate_up output), the last dimension must be contiguous."""
        cdef long rows, n, ldg, ldu, ldo
        rows, n, ldg = _rows_view(gate, "gate")
        r2, n2, ldu = _rows_view(up, "up")
        if r2 != rows or n2 != n or gate.shape != up.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
        if out is None:
            out = torch.empty(gate.shape, dtype=torch.float32)
        elif out.shape != gate.shape:
            raise ValueError("out must be shaped like gate")
        r3, n3, ldo = _rows_view(out, "out", True)
        if rows == 0 or n == 0:
            return out
        cdef helm_silu_mul_fn fn = self.t.silu_mul
        cdef float *o = <float *> <uintptr_t> out.data_ptr()
        cdef const float *g = <const float *> <uintptr_t> gate.data_ptr()
        cdef const float *u = <const float *> <uintptr_t> up.data_ptr()
        cdef int nt = _threads_for(num_threads, rows)
        cdef long chunk = (rows + nt - 1) // nt
        cdef int t
        if nt == 1:
            with nogil:
                fn(o, ldo, g, ldg, u, ldu, n, 0, rows)
            return out
        for t in prange(nt, schedule='static', nogil=True, num_threads=nt):
            fn(o, ldo, g, ldg, u, ldu, n, t * chunk, min(rows, (t + 1) * chunk))
        return out

    cdef void _gemm(self, object x, PreparedLinear w, object out, int num_threads, bint accumulate):
        cdef helm_gemm_fn fn = self.t.gemm[w.dtype_code]
        cdef float *o = <float *> <uintptr_t> out.data_ptr()
        cdef const float *xp = <const float *> <uintptr_t> x.data_ptr()
        cdef const void *wp = <const void *> w.w_ptr
        cdef const float *bp = <const float *> w.b_ptr
        cdef int M = x.shape[0]
        cdef int N = w.out_features
        cdef int K = w.in_features
        cdef int acc = accumulate
        cdef int nt = _threads_for(min(num_threads, MAX_THREADS), N // 32)
        cdef int t
        if nt == 1:
            with nogil:
                fn(o, N, xp, wp, bp, acc, M, N, K, 0, 1)
            return
        for t in prange(nt, schedule='static', nogil=True, num_threads=nt):
            fn(o, N, xp, wp, bp, acc, M, N, K, t, nt)

    cdef object _torch_linear(self, object x, PreparedLinear w, object out, int num_threads, int path):
        """The PyTorch paths of `linear` ("torch", "torch_fp32"); bf16 activations are converted by
        our kernels, several times faster than PyTorch's own fp32 <-> bf16 copies."""
        weight = w.weight
        if weight.dtype is _F32:
            if w.bias is not None:
                torch.addmm(w.bias, x, weight.t(), out=out)
            else:
                torch.mm(x, weight.t(), out=out)
            return out
        if path == PATH_TORCH_FP32:
            self._widened_mm(x, w, out, num_threads)
        elif weight.dtype is torch.bfloat16:
            y = torch.mm(self._convert(x, torch.empty(x.shape, dtype=torch.bfloat16), num_threads), weight.t())
            self._convert(y, out, num_threads)
        else:
            out.copy_(torch.mm(x.to(weight.dtype), weight.t()))
        if w.bias is not None:
            out.add_(w.bias)
        return out

    cdef void _widened_mm(self, object x, PreparedLinear w, object out, int num_threads):
        """out = x @ W.T with W widened to fp32 a tile of rows at a time into one scratch tile."""
        cdef int N = w.out_features
        cdef int K = w.in_features
        cdef int rows = max(16, WIDEN_TILE_BYTES // (4 * K))
        tile = torch.empty((min(rows, N), K), dtype=_F32)
        cdef float *tp = <float *> <uintptr_t> tile.data_ptr()
        cdef const uint16_t *wp = <const uint16_t *> w.w_ptr
        cdef bint bf16 = w.dtype_code == _DTYPE_CODE[torch.bfloat16]
        cdef long n, chunk, base
        cdef int nt, t, n0
        for n0 in range(0, N, rows):
            n = min(rows, N - n0) * <long> K
            base = n0 * <long> K
            nt = _threads_for(num_threads, n // 16384)
            chunk = ((n + nt - 1) // nt + 15) // 16 * 16
            for t in prange(nt, schedule='static', nogil=True, num_threads=nt):
                if bf16:
                    self.t.from_bf16(tp, wp + base, min(n, t * chunk), min(n, (t + 1) * chunk))
                else:
                    self.t.from_f16(tp, wp + base, min(n, t * chunk), min(n, (t + 1) * chunk))
            torch.mm(x, tile[:min(rows, N - n0)].t(), out=out[:, n0:n0 + min(rows, N - n0)])

    cdef object _convert(self, object src, object dst, int num_threads):
        """dst = src converted fp32 <-> bf16, both contiguous and the same shape."""
        cdef long n = src.numel()
        cdef void *d = <void *> <uintptr_t> dst.data_ptr()
        cdef const void *sp = <const void *> <uintptr_t> src.data_ptr()
        cdef bint to_half = src.dtype is _F32
        cdef int nt = _threads_for(num_threads, n // 16384)
        cdef long chunk = ((n + nt - 1) // nt + 15) // 16 * 16
        cdef int t
        for t in prange(nt, schedule='static', nogil=True, num_threads=nt):
            if to_half:
                self.t.to_bf16(<uint16_t *> d, <const float *> sp, min(n, t * chunk), min(n, (t + 1) * chunk))
            else:
                self.t.from_bf16(<float *> d, <const uint16_t *> sp, min(n, t * chunk), min(n, (t + 1) * chunk))
        return dst

    def rope_qk_(self, qkv, int num_heads, int num_kv_heads, cos, sin, q_norm=None, k_norm=None,
                 double eps=1e-6, *, int num_threads=1):
        """In place on the q and k heads of qkv [T, >= (Hq + Hkv)·D] fp32 (rows may be strided,
        each row contiguous): RMSNorm of each q head by q_norm and each k head by k_norm ([D] fp32,
        both or neither), then the rotary rotation by cos, sin [T, D/2] fp32. Returns qkv."""
        cdef long T, width, ld
        T, width, ld = _rows_view(qkv, "qkv", True)
        if qkv.dim() != 2:
            raise ValueError("qkv must be 2-D [T, columns]")
        _check_table(cos, "cos", T)
        _check_table(sin, "sin", T)
        if sin.shape != cos.shape:
            raise ValueError(f"sin {tuple(sin.shape)} and cos {tuple(cos.shape)} differ in shape")
        cdef int D = 2 * cos.shape[1]
        # in long: (heads) x D in int can wrap and pass for a narrow qkv, which the loop then overruns
        if num_heads < 1 or num_kv_heads < 1 or D < 2 or width < (<long> num_heads + <long> num_kv_heads) * D:
            raise ValueError(f"qkv has {width} columns, fewer than ({num_heads} + {num_kv_heads}) heads x {D}")
        if (q_norm is None) != (k_norm is None):
            raise ValueError("give both q_norm and k_norm, or neither")
        cdef const float *qn = NULL
        cdef const float *kn = NULL
        if q_norm is not None:
            qn = _norm_weight(q_norm, "q_norm", D)
            kn = _norm_weight(k_norm, "k_norm", D)
        if T == 0:
            return qkv
        cdef float *p = <float *> <uintptr_t> qkv.data_ptr()
        cdef const float *c = <const float *> <uintptr_t> cos.data_ptr()
        cdef const float *sn = <const float *> <uintptr_t> sin.data_ptr()
        cdef helm_rope_qk_fn fn = self.t.rope_qk
        cdef float feps = eps
        cdef int nt = _threads_for(num_threads, T // 4)
        cdef long chunk = (T + nt - 1) // nt
        cdef int t
        if nt == 1:
            with nogil:
                fn(p, ld, num_heads, num_kv_heads, D, qn, kn, feps, c, sn, 0, T)
            return qkv
        for t in prange(nt, schedule='static', nogil=True, num_threads=nt):
            fn(p, ld, num_heads, num_kv_heads, D, qn, kn, feps, c, sn, t * chunk, min(T, (t + 1) * chunk))
        return qkv

    def kv_write(self, qkv, PagedKV kv not None, pages, int layer, long start, int num_heads):
        """Stores the K and V heads of qkv's T rows (after the Hq q heads) as the KV of positions
        start .. start+T-1 of `layer`, rounded to the cache dtype. pages: int64 [n] page addresses
        (KVCache.page_table) covering those positions."""
        cdef helm_kv_pages desc
        cdef long T, ld
        T, ld = kv.check(qkv, pages, layer, start, num_heads, &desc)
        if T == 0:
            return
        cdef helm_kv_write_fn fn = self.t.kv_write[kv.dtype_code]
        cdef const float *q = <const float *> <uintptr_t> qkv.data_ptr()
        with nogil:
            fn(&desc, q, ld, num_heads, start, 0, T)

    def paged_attention(self, qkv, out, PagedKV kv not None, pages, int layer, long start,
                        int num_heads, double scale, *, int num_threads):
        """Causal attention of the q heads of qkv's T rows (row t at position start + t) over the
        cached keys at positions <= start + t of `layer` (written before, see kv_write), into
        out [T, Hq·D] fp32. GQA: q head i reads KV head i // (Hq / Hkv). Returns out."""
        cdef helm_kv_pages desc
        cdef long T, ld
        T, ld = kv.check(qkv, pages, layer, start, num_heads, &desc)
        cdef long ot, ow, ldo
        ot, ow, ldo = _rows_view(out, "out", True)
        if out.dim() != 2 or ot != T or ow != <long> num_heads * kv.head_dim:
            raise ValueError(f"out must be [{T}, {num_heads * kv.head_dim}], got {tuple(out.shape)}")
        if T == 0:
            return out
        cdef helm_attention_fn fn = self.t.attention[kv.dtype_code]
        cdef const float *q = <const float *> <uintptr_t> qkv.data_ptr()
        cdef float *o = <float *> <uintptr_t> out.data_ptr()
        cdef float fscale = scale
        # Long sequences: several key segments per (KV head, query row), merged by the last to finish.
        cdef helm_att_split split
        cdef helm_att_split *sp = NULL
        split.segs = helm_att_segments(start + T, T * kv.num_kv_heads)
        if split.segs > 1:
            partial = torch.empty(T * kv.num_kv_heads * split.segs * (num_heads // kv.num_kv_heads)
                                  * (kv.head_dim + 2), dtype=_F32)
            done = torch.zeros(T * kv.num_kv_heads, dtype=torch.int32)
            split.partial = <float *> <uintptr_t> partial.data_ptr()
            split.done = <int *> <uintptr_t> done.data_ptr()
            sp = &split
        cdef long items = T * kv.num_kv_heads * split.segs
        cdef int nt = _threads_for(num_threads, items)
        cdef long i
        if nt == 1:
            with nogil:
                for i in range(items):
                    fn(o, ldo, q, ld, num_heads, &desc, start, T, fscale, i, sp)
            return out
        for i in prange(items, schedule='dynamic', nogil=True, num_threads=nt):
            fn(o, ldo, q, ld, num_heads, &desc, start, T, fscale, i, sp)
        return out

    def read_pass(self, buf, *, int num_threads) -> int:
        """Stream once over `buf` (contiguous CPU tensor) with num_threads threads, each reading
        its own contiguous part: the DRAM read-bandwidth probe. Returns a checksum."""
        if not buf.is_contiguous():
            raise ValueError("buf must be contiguous")
        _check_cpu_tensor(buf, "buf")
        cdef size_t nbytes = (buf.numel() * buf.element_size()) // 64 * 64
        cdef const char *p = <const char *> <uintptr_t> buf.data_ptr()
        cdef helm_read_fn fn = self.t.read
        cdef int nt = _threads_for(num_threads, nbytes // 65536)
        cdef size_t chunk = (nbytes // nt) // 64 * 64
        cdef uint64_t total = 0
        cdef int t
        cdef size_t lo, hi
        for t in prange(nt, schedule='static', nogil=True, num_threads=nt):
            lo = t * chunk
            hi = nbytes if t == nt - 1 else lo + chunk
            total += fn(p + lo, hi - lo)
        return total


cdef class PagedKV:
    """The geometry of a paged KV cache (executor/kv_cache.py) for the attention kernels: each page
    one buffer [num_layers, 2 (K, V), num_kv_heads, page_size, head_dim] of `dtype`."""

    cdef readonly int num_layers, num_kv_heads, page_size, head_dim
    cdef readonly object dtype
    cdef int dtype_code

    def __init__(self, int num_layers, int num_kv_heads, int page_size, int head_dim, dtype):
        if min(num_layers, num_kv_heads, page_size, head_dim) < 1:
            raise ValueError("num_layers, num_kv_heads, page_size and head_dim must be >= 1")
        if dtype not in _DTYPE_CODE:
            raise TypeError(f"KV dtype {dtype} is not supported (bf16, fp16, fp32)")
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.page_size, self.head_dim = page_size, head_dim
        self.dtype = dtype
        self.dtype_code = _DTYPE_CODE[dtype]

    def __repr__(self):
        return (f"PagedKV(layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
                f"page_size={self.page_size}, head_dim={self.head_dim}, dtype={self.dtype})")

    cdef tuple check(self, object qkv, object pages, int layer, long start, int num_heads,
                     helm_kv_pages *desc):
        """Validates a kernel call's arguments, fills desc; returns (T, row stride of qkv)."""
        cdef long T, width, ld
        T, width, ld = _rows_view(qkv, "qkv")
        if qkv.dim() != 2:
            raise ValueError("qkv must be 2-D [T, columns]")
        cdef int H = self.num_kv_heads, D = self.head_dim
        if num_heads < H or num_heads % H:
            raise ValueError(f"{num_heads} query heads are not a multiple of {H} KV heads")
        if num_heads // H * (D + HELM_ATT_BLOCK) > 8192:
            raise ValueError(f"{num_heads // H} query heads per KV head is more than the kernels support")
        if width < (<long> num_heads + 2 * <long> H) * D:
            raise ValueError(f"qkv has {width} columns, expected (Hq {num_heads} + 2 x {H}) x {D}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.num_layers})")
        if start < 0:
            raise ValueError(f"start position {start} < 0")
        if pages.dtype is not torch.int64 or pages.dim() != 1 or not pages.is_contiguous() or not pages.is_cpu:
            raise ValueError("pages must be a contiguous 1-D int64 CPU tensor of page addresses")
        if start > pages.shape[0] * <long> self.page_size - T:  # not start + T: it can wrap past a long
            raise ValueError(f"{pages.shape[0]} pages of {self.page_size} do not cover {T} positions from {start}")
        desc.pages = <const void *const *> <uintptr_t> pages.data_ptr()
        desc.head_stride = <long> self.page_size * D
        desc.v_off = desc.head_stride * H
        desc.layer_off = 2 * desc.v_off * layer
        desc.Hkv, desc.P, desc.D = H, self.page_size, D
        return T, ld


cdef void _check_table(object t, str name, long rows) except *:
    if t.dtype is not torch.float32 or t.dim() != 2 or not t.is_contiguous() or not t.is_cpu:
        raise ValueError(f"{name} must be a contiguous 2-D fp32 CPU tensor")
    if t.shape[0] != rows:
        raise ValueError(f"{name} has {t.shape[0]} rows, qkv has {rows}")


cdef const float *_norm_weight(object w, str name, int D) except NULL:
    if w.dtype is not torch.float32 or tuple(w.shape) != (D,) or not w.is_contiguous() or not w.is_cpu:
        raise ValueError(f"{name} must be a contiguous fp32 CPU tensor of shape ({D},)")
    return <const float *> <uintptr_t> w.data_ptr()


cdef inline int _threads_for(int num_threads, long work_units) noexcept:
    """Threads to use: as asked, but never more than there are units of work (and at least 1)."""
    cdef long n = num_threads
    if n > work_units:
        n = work_units
    return <int> n if n >= 1 else 1


cdef tuple _rows_view(object t, str name, bint written=False):
    """(rows, n, row stride) of a fp32 CPU tensor [n] or [rows, n] with a contiguous last dim;
    `written`: one the kernel writes, whose rows must not overlap (an expanded tensor's do)."""
    if t.dtype is not torch.float32:
        raise ValueError(f"{name} must be fp32, got {t.dtype}")
    _check_cpu_tensor(t, name)
    if t.dim() == 1:
        if t.stride(0) != 1 and t.shape[0] > 1:
            raise ValueError(f"{name} must be contiguous")
        return 1, t.shape[0], t.shape[0]
    if t.dim() == 2:
        if t.stride(1) != 1 and t.shape[1] > 1:
            raise ValueError(f"{name}'s last dimension must be contiguous")
        if written and t.shape[0] > 1 and t.stride(0) < t.shape[1]:
            raise ValueError(f"{name}'s rows overlap (row stride {t.stride(0)} < width {t.shape[1]}): "
                             "it is written in place")
        return t.shape[0], t.shape[1], t.stride(0)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous when it has more than 2 dimensions")
    n = t.shape[t.dim() - 1]
    return (t.numel() // n if n else 0), n, n


# ---- the fused decode step of a CPU stage (csrc/decode_blocks.c) ----

from libc.stdlib cimport calloc, free

cdef extern from "decode_blocks.h" nogil:
    ctypedef struct helm_linear_desc:
        const void *w
        const float *bias
        int N, K, dtype
    ctypedef struct helm_block_desc:
        const float *input_norm
        const float *post_norm
        const float *q_norm
        const float *k_norm
        helm_linear_desc qkv, o, gate_up, down
    ctypedef struct helm_stack_desc:
        int H, Hq, Hkv, D, I, P, kv_dtype
        float eps, scale
    ctypedef struct helm_seq_desc:
        long offset, count, start
        const void *const *pages
    ctypedef struct helm_step_buffers:
        float *x
        float *h
        float *qkv
        float *attn
        float *gu
        float *act
        float *att_partial
        int *att_done
    long helm_decode_attention_floats(const helm_stack_desc *m, const helm_seq_desc *seqs, int nseq)
    void helm_decode_blocks(const helm_kernel_table *tab, const helm_stack_desc *m,
                            const helm_block_desc *blocks, int nblocks, const helm_seq_desc *seqs,
                            int nseq, int T, const float *cos, const float *sin,
                            const helm_step_buffers *buf, int num_threads, helm_claim *claims,
                            long *counters)


cdef helm_linear_desc _linear_desc(PreparedLinear w, int n, int k, str name) except *:
    if w.out_features != n or w.in_features != k:
        raise ValueError(f"{name} weight is [{w.out_features}, {w.in_features}], expected [{n}, {k}]")
    cdef helm_linear_desc d
    d.w = <const void *> w.w_ptr
    d.bias = <const float *> w.b_ptr
    d.N, d.K, d.dtype = n, k, w.dtype_code
    return d


MAX_STACK_ROWS = 4096  # rows of one BlockStack step (the engine's decode steps: FusedBlocks.MAX_ROWS)


cdef class BlockStack:
    """The decoder blocks of one CPU stage run as one call per step (csrc/decode_blocks.c): the same
    kernels as the op-by-op path, bit-identical results, no Python between them.

    blocks: one tuple per block, (input_norm, qkv, q_norm, k_norm, o, post_norm, gate_up, down), the
    norms [H] / [D] fp32 tensors (q_norm, k_norm None where the model has none), the projections
    PreparedLinear. kv: the stage's KV cache geometry; block i uses its layer i."""

    cdef const helm_kernel_table *t
    cdef helm_block_desc *blocks
    cdef int nblocks
    cdef helm_stack_desc m
    cdef readonly int num_threads
    cdef readonly PagedKV kv
    cdef helm_claim *claims
    cdef long *counters
    cdef object keep  # the tensors and weights the descriptors point into
    cdef bint busy  # a call under way: its claims and counters are per instance

    def __cinit__(self):
        self.blocks = NULL
        self.claims = NULL
        self.counters = NULL

    def __init__(self, KernelSet kernels not None, list blocks, PagedKV kv not None, int num_heads,
                 int hidden_size, int intermediate_size, double eps, double scale, *, int num_threads):
        if not blocks:
            raise ValueError("a BlockStack needs at least one block")
        if len(blocks) > kv.num_layers:
            raise ValueError(f"{len(blocks)} blocks but the KV cache has {kv.num_layers} layers")
        if not 1 <= num_threads <= MAX_THREADS:
            raise ValueError(f"num_threads must be in [1, {MAX_THREADS}]")
        cdef int Hkv = kv.num_kv_heads, D = kv.head_dim
        if num_heads % Hkv or num_heads // Hkv * (D + HELM_ATT_BLOCK) > 8192:
            raise ValueError(f"{num_heads} query heads do not fit {Hkv} KV heads")
        self.t = kernels.t
        self.kv = kv
        self.num_threads = num_threads
        self.m.H, self.m.Hq, self.m.Hkv, self.m.D = hidden_size, num_heads, Hkv, D
        self.m.I, self.m.P, self.m.kv_dtype = intermediate_size, kv.page_size, kv.dtype_code
        self.m.eps, self.m.scale = eps, scale
        self.nblocks = len(blocks)
        self.blocks = <helm_block_desc *> calloc(self.nblocks, sizeof(helm_block_desc))
        self.claims = <helm_claim *> calloc(self.nblocks * 4 * num_threads, sizeof(helm_claim))
        self.counters = <long *> calloc(self.nblocks, sizeof(long))
        if self.blocks == NULL or self.claims == NULL or self.counters == NULL:
            raise MemoryError()
        cdef int H = hidden_size, I = intermediate_size, qd = num_heads * D
        cdef helm_block_desc *b
        for i, (inorm, qkv, qn, kn, o, pnorm, gate_up, down) in enumerate(blocks):
            b = &self.blocks[i]
            b.input_norm = _norm_weight(inorm, f"block {i} input_norm", H)
            b.post_norm = _norm_weight(pnorm, f"block {i} post_norm", H)
            if (qn is None) != (kn is None):
                raise ValueError(f"block {i}: q_norm and k_norm must both be given or both be None")
            b.q_norm = _norm_weight(qn, f"block {i} q_norm", D) if qn is not None else NULL
            b.k_norm = _norm_weight(kn, f"block {i} k_norm", D) if kn is not None else NULL
            b.qkv = _linear_desc(qkv, qd + 2 * Hkv * D, H, f"block {i} qkv")
            b.o = _linear_desc(o, H, qd, f"block {i} o")
            b.gate_up = _linear_desc(gate_up, 2 * I, H, f"block {i} gate_up")
            b.down = _linear_desc(down, H, I, f"block {i} down")
        self.keep = [tuple(block) for block in blocks]  # the tensors themselves: the caller may change its list

    def __dealloc__(self):
        free(self.blocks)
        free(self.claims)
        free(self.counters)

    def __repr__(self):
        return f"BlockStack({self.nblocks} blocks, {self.kv!r}, threads={self.num_threads})"

    def __call__(self, x, cos, sin, list seqs):
        """x [T, H] fp32 contiguous, updated in place and returned: the stack's blocks applied to
        the step's T tokens. seqs: (row offset, count, start position, page table) per sequence,
        covering the rows in order; the K/V of each token is written to its pages."""
        if x.dtype is not _F32 or x.dim() != 2 or not x.is_contiguous() or not x.is_cpu:
            raise ValueError("x must be a contiguous 2-D fp32 CPU tensor")
        cdef int T = x.shape[0]
        if x.shape[1] != self.m.H:
            raise ValueError(f"x has {x.shape[1]} columns, the blocks expect {self.m.H}")
        _check_table(cos, "cos", T)
        _check_table(sin, "sin", T)
        if sin.shape != cos.shape or cos.shape[1] * 2 != self.m.D:
            raise ValueError(f"cos and sin must be [{T}, {self.m.D // 2}]")
        cdef int nseq = len(seqs)
        if T == 0 or nseq == 0:
            return x
        if T > MAX_STACK_ROWS:  # a decode step's rows; helm_decode_blocks keeps per-sequence arrays on the stack
            raise ValueError(f"{T} rows is more than a BlockStack step takes ({MAX_STACK_ROWS})")
        if self.busy:
            raise RuntimeError("this BlockStack is already running a step on another thread (one per thread)")
        cdef helm_seq_desc *sd = <helm_seq_desc *> calloc(nseq, sizeof(helm_seq_desc))
        if sd == NULL:
            raise MemoryError()
        cdef long row = 0
        cdef int i
        self.busy = True
        try:
            for i, (offset, count, start, pages) in enumerate(seqs):
                if offset != row or count < 1 or start < 0:
                    raise ValueError(f"sequence {i}: rows {offset}+{count} at position {start} do not "
                                     f"continue from row {row}")
                if (pages.dtype is not torch.int64 or pages.dim() != 1 or not pages.is_contiguous()
                        or not pages.is_cpu):
                    raise ValueError("page tables must be contiguous 1-D int64 CPU tensors")
                if pages.shape[0] * <long> self.m.P < start + count:
                    raise ValueError(f"sequence {i}: {pages.shape[0]} pages do not cover positions < {start + count}")
                sd[i].offset, sd[i].count, sd[i].start = offset, count, start
                sd[i].pages = <const void *const *> <uintptr_t> pages.data_ptr()
                row += count
            if row != T:
                raise ValueError(f"the sequences cover {row} rows, x has {T}")
            h = torch.empty((T, self.m.H), dtype=_F32)
            qkv = torch.empty((T, (self.m.Hq + 2 * self.m.Hkv) * self.m.D), dtype=_F32)
            attn = torch.empty((T, self.m.Hq * self.m.D), dtype=_F32)
            gu = torch.empty((T, 2 * self.m.I), dtype=_F32)
            act = torch.empty((T, self.m.I), dtype=_F32)
            partial = torch.empty(helm_decode_attention_floats(&self.m, sd, nseq), dtype=_F32)
            done = torch.zeros(self.nblocks * T * self.m.Hkv, dtype=torch.int32)
            self._run(x, h, qkv, attn, gu, act, partial, done, cos, sin, sd, nseq, T)
        finally:
            self.busy = False
            free(sd)
        return x

    cdef void _run(self, x, h, qkv, attn, gu, act, partial, done, cos, sin, helm_seq_desc *sd, int nseq,
                   int T):
        cdef helm_step_buffers buf
        buf.att_partial = <float *> <uintptr_t> partial.data_ptr() if partial.numel() else NULL
        buf.att_done = <int *> <uintptr_t> done.data_ptr()
        buf.x = <float *> <uintptr_t> x.data_ptr()
        buf.h = <float *> <uintptr_t> h.data_ptr()
        buf.qkv = <float *> <uintptr_t> qkv.data_ptr()
        buf.attn = <float *> <uintptr_t> attn.data_ptr()
        buf.gu = <float *> <uintptr_t> gu.data_ptr()
        buf.act = <float *> <uintptr_t> act.data_ptr()
        cdef const float *c = <const float *> <uintptr_t> cos.data_ptr()
        cdef const float *s = <const float *> <uintptr_t> sin.data_ptr()
        helm_claims_init(self.claims, self.nblocks * 4 * self.num_threads)
        cdef int i
        for i in range(self.nblocks):
            self.counters[i] = 0
        with nogil:
            helm_decode_blocks(self.t, &self.m, self.blocks, self.nblocks, sd, nseq, T, c, s, &buf,
                               self.num_threads, self.claims, self.counters)
