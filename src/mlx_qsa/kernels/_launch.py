"""Shared helpers of the CUDA launchers: kernel sources, one kernel per key, naming, checks.

A ``.cu`` file holds one or more kernel bodies (MLX generates each signature from the input and
output names); sections start with a line ``//// kernel: <name>``. Device code shared by kernels
(``common.cuh``, ``gemm.cuh``) goes in through ``header=`` as an ``#include`` of the file
(``include``). Kernels are built once per key (``functools.cache``) and named after the key and
a digest of their source and of the files they include, so neither MLX's in-process module cache
(keyed by name) nor a persistent ``MLX_PTX_CACHE_DIR`` can hand back a kernel compiled from
other source.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import device
from .device import DeviceLimits

_DIR = Path(__file__).resolve().parent
_SECTION = re.compile(r"^//// kernel: *([A-Za-z0-9_]+) *$", re.M)


@functools.cache
def _text(filename: str) -> str:
    return (_DIR / filename).read_text()


def compact(text: str) -> str:
    """CUDA text without comments, indentation or blank lines: the same tokens on fewer bytes.

    Kernel bodies go to MLX as text, which it copies on every call and hashes on every
    evaluation (see ``include``), so they go without their comments. Lines are kept (the
    preprocessor is line-based); string and character literals are copied as they are.
    """
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":  # a literal, up to its unescaped closing quote
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise ValueError("unterminated /* comment in CUDA source")
            out.append("\n" * text.count("\n", i, j) or " ")  # keep its line breaks
            i = j + 2
        else:
            j = i
            while j < n and text[j] not in "\"'/":
                j += 1
            if j == i:  # a lone '/' (division)
                j += 1
            out.append(text[i:j])
            i = j
    lines = (line.strip() for line in "".join(out).split("\n"))
    return "".join(line + "\n" for line in lines if line)


@functools.cache
def kernel_sections(filename: str) -> dict[str, str]:
    """The kernel bodies of ``filename`` (a ``.cu`` beside this module), by section name, as
    MLX gets them (``compact``)."""
    text = _text(filename)
    marks = list(_SECTION.finditer(text))
    if not marks:
        raise RuntimeError(f"{filename}: no '//// kernel: <name>' section")
    out = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        out[m.group(1)] = compact(text[m.end() : end])
    return out


def include(filename: str) -> str:
    """An ``#include`` of ``filename`` (a header beside this module) by its absolute path, as
    ``header=`` text.

    MLX 0.32 copies a kernel's whole text (header + generated signature + body) on every
    ``cuda_kernel`` call and hashes it on every evaluation (``mlx/backend/cuda/custom_kernel.cpp``),
    host time that grows with the text (a 35 KB text: ~20 µs a call on a CPU core). NVRTC reads
    the included file when it compiles; the text MLX copies stays one line. Kernel names carry a
    digest of the file's contents (``included_text``), so a changed file is a new kernel.
    """
    path = str(_DIR / filename)
    if any(c in path for c in '"\\\n'):
        raise RuntimeError(f"{path}: an #include line cannot name this path")
    if not (_DIR / filename).is_file():  # NVRTC reads it at compile time, from the file system
        raise RuntimeError(f"{path}: not a file (mlx_qsa must be installed as files, not zipped)")
    return f'#include "{path}"\n'


def header_for(source: str) -> str:
    """The header a kernel body gets: ``common.cuh`` where the body uses it (names ``qsa::``),
    else none; ``gate.cuh`` after it where the body is built with the fused output gate
    (``#define QSA_GATE``: only those kernels parse MLX's device op headers). A body's
    ``#define QSA_IEEE_DIV`` (common.cuh's `div_sqrt128` as plain `__fdiv_rn`, for A/B timing)
    goes before the include, where common.cuh reads it."""
    if "qsa::" not in source:
        return ""
    gated = "#define QSA_GATE\n" in source
    ieee = _IEEE_DIV if _IEEE_DIV in source else ""
    return ieee + include("common.cuh") + (include("gate.cuh") if gated else "")


_IEEE_DIV = "#define QSA_IEEE_DIV\n"


_INCLUDE = re.compile(r'^#include "([^"]+)"$', re.M)


def included_text(header: str) -> str:
    """The contents of the files ``header`` includes through ``include`` (for kernel names)."""
    return "".join(Path(p).read_text() for p in _INCLUDE.findall(header))


_CUDA_TYPES = {  # MLX's dtype_to_cuda_type for the dtypes a template names
    mx.float32: "float",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
}


def constants(template: tuple) -> str:
    """A kernel's template values as the declarations MLX would write at the top of its body
    (``constexpr int``, ``constexpr bool``, ``using`` for a dtype).

    Passed as ``template=``, MLX converts the list and formats it into the kernel's name and
    text on every call; a launcher's plan fixes them, so its kernel declares them itself."""
    lines = []
    for name, value in template:
        if isinstance(value, bool):
            lines.append(f"constexpr bool {name} = {'true' if value else 'false'};\n")
        elif isinstance(value, int):
            lines.append(f"constexpr int {name} = {value};\n")
        elif value in _CUDA_TYPES:
            lines.append(f"using {name} = {_CUDA_TYPES[value]};\n")
        else:
            raise ValueError(f"template value {name}={value!r}: expected int, bool or a dtype")
    return "".join(lines)


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:10]


def kernel_name(base: str, key: tuple) -> str:
    """A C identifier naming the kernel after its key (the template values are appended by MLX)."""
    tag = "_".join(re.sub(r"[^A-Za-z0-9]", "", str(k)) for k in key)
    return f"qsa_{base}_{tag}" if tag else f"qsa_{base}"


@functools.cache
def build(
    filename: str,
    section: str,
    inputs: tuple[str, ...],
    outputs: tuple[str, ...],
    key: tuple,
    shared_memory: int = 0,
    ensure_row_contiguous: bool = False,
    prefix: str = "",
    template: tuple = (),
):
    """One ``mx.fast.cuda_kernel`` per (source section, key, shared memory, template values);
    ``section`` may join sections with ``+`` (a kernel made of a preamble and a shared
    fragment).

    The body declares the ``template`` values (``constants``), then ``prefix`` (e.g.
    ``#define`` lines); a call passes no ``template=``.
    """
    shared_memory = device.dynamic_smem_request(shared_memory)
    sections = kernel_sections(filename)
    source = constants(template) + prefix + "".join(sections[part] for part in section.split("+"))
    header = header_for(source)
    base = section.replace("+", "_")
    digest = _digest(header, included_text(header), source)
    name = kernel_name(f"{base}_{digest}", key + (shared_memory,))
    return mx.fast.cuda_kernel(
        name=name,
        input_names=list(inputs),
        output_names=list(outputs),
        source=source,
        header=header,
        ensure_row_contiguous=ensure_row_contiguous,
        shared_memory=shared_memory,
    )


ATTN_THREADS = 256  # threads of the split-K attention CTAs (common.cuh partial_attention)
MERGERS_MAX = 64  # CTAs that merge in a one-launch split-K kernel (common.cuh merge_when_done)


def one_launch_default(rows: int, d: int) -> bool:
    """Whether split-K attention over `rows` (query heads x query rows) of width `d` merges in
    its own launch unless told: only when at most ``MERGERS_MAX`` CTAs hold one output element
    per thread (the merge tiles of ``merge_cols`` columns are lighter than that). H200,
    2026-12-04, benchmarks/split_k_ab.py: one row at 128K queued 55 us against 58 us; 8 rows, a
    3x longer merge on 64 CTAs, 67 against 60 us.
    ``MLX_QSA_ONE_LAUNCH=0`` keeps the separate merge kernel (same bits), for side-by-side
    timing."""
    if one_launch_env() is False:
        return False
    return rows * d <= MERGERS_MAX * ATTN_THREADS


@functools.cache
def env_switch(name: str) -> str | None:
    """An environment switch (the ``MLX_QSA_*`` A/B switches, ``MLX_DISABLE_COMPILE``,
    ``MLX_USE_CUDA_GRAPHS`` for the GEMM's cluster families), read
    once per process, as MLX reads its own variables: a decode step reads them about five
    times, and each ``os.environ`` read costs ~1 µs of host time per layer and step. A test
    that sets one calls ``env_switch.cache_clear()`` (tests/conftest.py clears it after every
    test)."""
    return os.environ.get(name)


def one_launch_env() -> bool | None:
    """False when ``MLX_QSA_ONE_LAUNCH=0`` keeps the separate merge kernel, else None (each
    launcher's own default); part of a launch plan's signature."""
    return False if env_switch("MLX_QSA_ONE_LAUNCH") == "0" else None


_COUNTER_SLOTS = 1024
_counters: dict = {"slots": None, "next": 0}


def counter_slot() -> mx.array:
    """Two zeroed int32 of a persistent pool, for one launch of a kernel that hands off between
    its CTAs (``qsa::merge_when_done``); the kernel leaves them zeroed again.

    An evaluated view of the pool, made once: neither a fresh ``mx.zeros`` nor a slice per call
    (each is one more primitive, and host time, per step). Slots rotate, so launches MLX may run
    concurrently (no data dependency between them, in one CUDA graph) get distinct counters
    unless over ``_COUNTER_SLOTS`` are in flight.
    """
    slots = _counters["slots"]
    if slots is None:
        pool = mx.zeros((2 * _COUNTER_SLOTS,), dtype=mx.int32)
        slots = [pool[2 * i : 2 * i + 2] for i in range(_COUNTER_SLOTS)]
        mx.eval(slots)
        _counters["slots"] = slots
    i = _counters["next"]
    _counters["next"] = (i + 1) % _COUNTER_SLOTS
    return slots[i]


# ---- plan / run -------------------------------------------------------------------------------
# A launcher checks its arguments, sizes its grid and template and finds its kernels once per
# signature (the arrays' shapes and dtypes and the call's options): the plan. Later calls with
# the same signature only run it (FlashInfer's plan/run split): a decode step re-checks
# nothing, since each check and each attribute read is host time on every layer and step.

Run = Callable[..., Any]  # a planned launch: called with the call's arrays
_PLAN_MAX = 512


class Plans:
    """Planned launches of one launcher by signature (bounded; the oldest plan goes first)."""

    def __init__(self) -> None:
        self._runs: dict[tuple, Run] = {}

    def get(self, sig: tuple, make: Callable[[], Run]) -> Run:
        run = self._runs.get(sig)
        if run is None:
            run = make()  # raises on bad input: nothing is stored
            if len(self._runs) >= _PLAN_MAX:
                self._runs.pop(next(iter(self._runs)))
            self._runs[sig] = run
        return run


def single_output(kernel, shape: tuple, dtype, n_cta: int, threads: int) -> Run:
    """The run of a kernel with one output of `shape` and `dtype` over `n_cta` CTAs of
    `threads`: called with the kernel's input arrays."""
    grid, block = (n_cta * threads, 1, 1), (threads, 1, 1)

    def run(*arrays: mx.array) -> mx.array:
        return kernel(
            inputs=list(arrays),
            grid=grid,
            threadgroup=block,
            output_shapes=[shape],
            output_dtypes=[dtype],
        )[0]

    return run


def signature(arrays: tuple, *options) -> tuple:
    """What a plan depends on: each array's shape and dtype, and the options."""
    return tuple((a.shape, a.dtype) for a in arrays) + options


def plan_split_k(
    filename: str,
    inputs: tuple[str, ...],
    template: tuple,
    *,
    n_cta: int,
    rows: int,
    out_shape: tuple[int, ...],
    nsplit: int,
    shared_memory: int,
    out_dtype,
    one_launch: bool,
    gate: bool = False,
    section: str = "partial",
    threads: int = ATTN_THREADS,
    key: tuple = (),
    prefix: str = "",
) -> Run:
    """The run of a split-K attention file's ``partial`` section over ``n_cta`` CTAs of
    ``ATTN_THREADS``, merging its ``rows`` x ``nsplit`` partials into ``out_shape``: in the
    same launch (``one_launch``: ``QSA_FUSED``, a counter slot as the last input) or with the
    merge kernel every split-K file shares (``split_k_merge.cu``). The run takes the call's
    arrays and optionally ``ctr``, the counter slot (default: the next of `counter_slot`;
    inside ``mx.compile`` an input of the compiled function, so replays never share one).

    ``gate``: the run's last array is the output gate ``[1, S, H, d]`` and the merge writes
    ``o * sigmoid(gate)`` in that layout (``QSA_GATE``, gate.cuh); ``out_shape`` is then
    ``[1, S, H, d]``.

    ``section``, ``threads``, ``key`` and ``prefix`` name the partial kernel's section, its
    CTAs' threads, and what its build adds to its key and text (the split-K form of
    ``sdpa.cu``'s kernel; the merge kernel is the same)."""
    d = out_shape[-1]
    part_shapes = [(rows, nsplit, d), (rows, nsplit, 2)]
    f32 = [mx.float32, mx.float32]
    grid = (n_cta * threads, 1, 1)
    block = (threads, 1, 1)
    gate_in = ("gate",) if gate else ()
    gate_def = "#define QSA_GATE\n" if gate else ""
    if one_launch:
        fused = build(
            filename,
            section,
            inputs + gate_in + ("ctr",),
            ("part_o", "part_ml", "out"),
            key + ("fused",) + gate_in,
            shared_memory=shared_memory,
            prefix=prefix + "#define QSA_FUSED\n" + gate_def,
            template=template,
        )
        shapes = part_shapes + [out_shape]
        dtypes = f32 + [out_dtype]

        def run_fused(arrays: list, ctr: mx.array | None = None) -> mx.array:
            return fused(
                inputs=arrays + [ctr if ctr is not None else counter_slot()],
                grid=grid,
                threadgroup=block,
                output_shapes=shapes,
                output_dtypes=dtypes,
            )[2]

        return run_fused
    partial = build(
        filename, section, inputs, ("part_o", "part_ml"), key, shared_memory, prefix=prefix,
        template=template,
    )  # fmt: skip
    merge_template = (("D", d), ("NSPLIT", nsplit), ("NT", ATTN_THREADS))
    merge = build(
        "split_k_merge.cu",
        "merge",
        ("part_o", "part_ml") + gate_in,
        ("out",),
        gate_in,
        prefix=gate_def,
        template=merge_template,
    )
    merge_grid = (rows * (d // merge_cols(d)) * ATTN_THREADS, 1, 1)
    n_in = len(inputs)

    def run_two(arrays: list, ctr: mx.array | None = None) -> mx.array:  # ctr: no hand-off here
        part_o, part_ml = partial(
            inputs=arrays[:n_in],
            grid=grid,
            threadgroup=block,
            output_shapes=part_shapes,
            output_dtypes=f32,
        )
        return merge(
            inputs=[part_o, part_ml] + arrays[n_in:],
            grid=merge_grid,
            threadgroup=(ATTN_THREADS, 1, 1),  # the merge kernel's own NT
            output_shapes=[out_shape],
            output_dtypes=[out_dtype],
        )[0]

    return run_two


def require_cuda(fn: str) -> None:
    if not mx.cuda.is_available():
        raise RuntimeError(f"{fn}: needs MLX with its CUDA backend on an NVIDIA GPU")


def check_dtype(fn: str, arg: str, a: mx.array, dtypes: tuple) -> None:
    if a.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{fn}: {arg} must have dtype {names}, got {a.dtype}")


def check_ndim(fn: str, arg: str, a: mx.array, ndim: int, what: str) -> None:
    if a.ndim != ndim:
        raise ValueError(f"{fn}: {arg} must be {what}, got shape {list(a.shape)}")


def check_row_lists(fn: str, rows: int, names: tuple[str, str], lists, mask, what: str) -> None:
    """A per-row int32 list `[S, W]` (ids or slots) and its bool validity mask of the same shape."""
    ln, mn = names
    check_ndim(fn, ln, lists, 2, what)
    if lists.shape[0] != rows:
        raise ValueError(f"{fn}: {ln} must have {rows} rows (q's S), got {list(lists.shape)}")
    check_dtype(fn, ln, lists, (mx.int32,))
    if mask.shape != lists.shape:
        raise ValueError(f"{fn}: {mn} must have shape {list(lists.shape)}, got {list(mask.shape)}")
    check_dtype(fn, mn, mask, (mx.bool_,))


def check_positions(fn: str, positions, rows: int) -> None:
    """The rows' positions: int32 ``[S]``."""
    if positions.shape != (rows,) or positions.dtype != mx.int32:
        raise ValueError(
            f"{fn}: positions must be int32 [{rows}], got {list(positions.shape)} {positions.dtype}"
        )


def check_gate(fn: str, gate, q) -> None:
    """The output gate's logits for a fused gate: ``[1, S, H, d]`` in q's dtype (q is
    ``[1, H, S, d]``); any strides (the layer's gate is a view of q_proj's output)."""
    if gate is None:
        return
    _, n_heads, rows, d = q.shape
    want = (1, rows, n_heads, d)
    if tuple(gate.shape) != want:
        raise ValueError(f"{fn}: gate must be [1, S, H, d] = {list(want)}, got {list(gate.shape)}")
    if gate.dtype != q.dtype:
        raise ValueError(f"{fn}: gate must have q's dtype {q.dtype}, got {gate.dtype}")


def compile_decode_env() -> bool:
    """Whether the decode consumers' CUDA launches run as `mx.compile`d functions (the default,
    `consumers.decode_launch`); ``MLX_QSA_COMPILE_DECODE=0`` calls the launchers directly."""
    return env_switch("MLX_QSA_COMPILE_DECODE") != "0"


def fuse_gate_env() -> bool:
    """Whether the CUDA decode consumers fuse the output gate into their merge (the default);
    ``MLX_QSA_FUSE_GATE=0`` leaves it to MLX's ``sigmoid`` and ``multiply`` (the same bits), for
    side-by-side timing."""
    return env_switch("MLX_QSA_FUSE_GATE") != "0"


def float_bits(x: float) -> int:
    """The float32 bit pattern of ``x`` as a signed int32 (a template value)."""
    import struct

    return struct.unpack("<i", struct.pack("<f", float(x)))[0]


def merge_cols(d: int) -> int:
    """Columns of one split-K merge tile (common.cuh ``qsa::merge_cols``)."""
    return min(d, 128)


ATTN_MAX_TOKENS = 64  # the largest token tile a launcher passes to partial_attention


def attn_smem_bytes(d: int, g: int, tok: int, nt: int = ATTN_THREADS) -> int:
    """Dynamic shared memory of ``qsa::partial_attention<d, g, tok, nt>`` (``qsa::Attn::BYTES``)."""
    tg = nt // d
    k_bytes = tok * (d + 8) * 2
    v_bytes = tok * d * 2
    q_bytes = g * d * 4
    s_bytes = g * tok * 4
    r_bytes = tg * g * d * 4 if tg > 1 else 0
    return k_bytes + v_bytes + q_bytes + s_bytes + r_bytes


def check_attention(fn: str, q, keys, values) -> tuple[int, int, int, int]:
    """Validates q [1, H, S, d] and the K/V backings [1, Hkv, cap, d]; returns (H, S, Hkv, d)."""
    check_ndim(fn, "q", q, 4, "[1, H, S, d]")
    check_ndim(fn, "keys", keys, 4, "[1, Hkv, cap, d]")
    if values.shape != keys.shape:
        raise ValueError(
            f"{fn}: values must have the shape of keys {list(keys.shape)}, got {list(values.shape)}"
        )
    _, n_heads, rows, d = q.shape
    _, n_kv, _, dk = keys.shape
    if q.shape[0] != 1 or keys.shape[0] != 1:
        raise ValueError(f"{fn}: batch must be 1, got q {list(q.shape)}, keys {list(keys.shape)}")
    if dk != d:
        raise ValueError(f"{fn}: keys head_dim must equal q's ({d}), got {dk}")
    if n_kv < 1 or n_heads % n_kv != 0:
        raise ValueError(f"{fn}: H ({n_heads}) must be a multiple of Hkv ({n_kv})")
    if q.dtype != keys.dtype or values.dtype != keys.dtype:
        raise ValueError(
            f"{fn}: q, keys, values must share a dtype, got {q.dtype}, {keys.dtype}, {values.dtype}"
        )
    return n_heads, rows, n_kv, d


def attention_unsupported(
    dtype, n_heads: int, n_kv: int, d: int, limits: DeviceLimits | None = None
) -> str | None:
    """Why the split-K attention kernels cannot take these shapes on this GPU (`limits`, by
    default MLX's; unchecked without one), or None if they can."""
    if dtype != mx.bfloat16:
        return f"only bfloat16 inputs, got {dtype}"
    if d not in (64, 128, 256):
        return f"head_dim must be 64, 128 or 256, got {d}"
    if n_kv < 1 or n_heads % n_kv != 0:
        return f"H ({n_heads}) must be a multiple of Hkv ({n_kv})"
    if n_heads // n_kv > 32:
        return f"at most 32 query heads per KV head, got {n_heads // n_kv}"
    limits = device.resolve(limits)
    if limits is not None:
        # The widest token tile the launchers use (rows_gather: 64 tokens for 5-8 rows).
        nbytes = attn_smem_bytes(d, n_heads // n_kv, ATTN_MAX_TOKENS)
        return device.shared_memory_unsupported(limits, nbytes, "split-K attention")
    return None


def check_cuda_attention(fn: str, q, n_heads: int, n_kv: int, d: int, scale: float) -> None:
    why = attention_unsupported(q.dtype, n_heads, n_kv, d)
    if why is not None:
        raise NotImplementedError(f"{fn}: {why}")
    if not scale > 0:
        raise ValueError(f"{fn}: scale must be a positive float, got {scale}")
