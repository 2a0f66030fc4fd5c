"""MoE routing (router GEMM and logits -> top-k weights and expert ids): launch policy and launchers.

Semantics (the reference is ``fusion_compiler.ops.moe_route.moe_route_reference``; the kernels
must match it):

    s      = sigmoid(logits.float())  (scoring 0)   or  softmax(logits.float(), -1)  (scoring 1)
    choice = s + bias                 (optional fp32 [E])
    if n_group > 1: group score = sum of the 2 largest ``choice`` of each group of E / n_group
                    experts; the experts of all but the ``topk_group`` best groups get -inf
    ids    = the ``top_k`` largest ``choice``, descending                   int64 [T, top_k]
    w      = s[ids]; if renormalize: w = w / (w.sum(-1) + renorm_eps)
    w      = (w * scale).to(weights_dtype)

Ties (experts and groups alike) go to the lower index, like the reference's stable sort.

The kernels, by phase: ``moe_route_gemm`` (the router GEMM as fp32 partial sums over splits of the
hidden dim, and the one launch that also routes) and ``moe_route_select`` (the routing: keys,
group ranks, top-k selection, the picked scores). This module holds the launch policy
(``MoeRouteConfig``: the shipped one by default, variants for benches and tests) and the
launchers:

- ``moe_route_fwd``: one program per token, from logits.
- ``moe_router_fwd``: the router GEMM and the routing. Up to ``fused_gemm_max_tokens`` tokens one
  launch, whose last T programs to finish sum the partials and route one token each (an acq_rel
  arrival counter); at one token the program with the last id routes without any counter,
  polling the partial sums until none holds the unwritten bits, then writing those bits back for
  the next launch. Above, the GEMM launch and the routing kernel, which sums the partials.

Math in fp32: sigmoid is ``1 / (1 + exp(-x))`` and softmax ``exp(x - max) / sum`` with
correctly rounded divisions (``div_rn``: plain ``/`` is approximate on the GPU), and the
renormalisation is ``w / (sum + renorm_eps)`` then ``* scale``, in the reference's order.
``exp`` may differ from torch's in the last ulp, so weights match to a few ulp and ids match
exactly wherever scores are not within an ulp of a tie (and exactly on true ties).
NaN logits: ids stay distinct and in [0, E); a NaN score ranks above +inf (torch's sort puts
NaN first too), but with several NaNs or a NaN group score the choice is unspecified.  With
int32 logit keys a NaN logit ranks by its sign bit: above +inf if clear, below -inf if set.

bf16 loads/stores go through ``_device.upcast`` / ``_device.downcast`` (bit-level casts under
the interpreter, native casts on the GPU).  No host syncs in the launchers.

This module imports only torch and triton.  Set ``TRITON_INTERPRET=1`` *before* importing it
to run the kernels on CPU tensors.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from ._device import launch_on_device
from .moe_route_gemm import _router_gemm_kernel
from .moe_route_select import _moe_route_kernel

# Bump whenever the kernel or its launch configuration changes: the compiler hashes it into
# the Inductor cache key.
KERNEL_VERSION = "moe_route-18"

_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GROUP_TOP = 2  # DeepSeek V3 scores a group by the sum of its 2 best experts

# The launch tables (H200, CUDA-graph µs, DeepSeek / MiniMax / Qwen3.5; bench/NOTES.md section 7).
#
# Up to this many tokens the router GEMM and the routing are one launch (the last programs of the
# GEMM route, one token each); above it, two launches. H200, b735b68
# (results/moe_router_split_h200_b735b68.json): one launch 5.28 / 4.17 / 5.62 at 1 token against
# two launches' 5.72 / 4.79 / 6.89; from 2 tokens two launches are faster (2: 7.39 / 6.19 / 7.94
# against 7.66 / 6.22 / 8.86; 64: 7.89 / 5.67 / 8.66 against 9.05 / 6.80 / 9.56; 256: 14.70 /
# 9.41 / 17.39 against 17.68 / 10.97 / 19.79). The several-tile one launch stays available
# through ``MoeRouteConfig.fused_gemm_max_tokens``.
FUSED_GEMM_MAX_TOKENS = 1
# At most this many routers (min(T, programs)) wait for the GEMM's last program: fewer than an
# H200's 132 SMs, so the programs they wait for always find a slot. Past it, two launches.
MAX_ROUTERS = 128
TARGET_PROGRAMS = 128  # about one per SM: enough loads in flight to stream the router weight
MAX_SPLIT = 8  # hidden-dim splits at most (64-column steps; ignored by one span per program)
# The GEMM of the <= 16-token launch: each program reads one span of the hidden dim in one tile,
# so all its loads are in flight at once, with evict_last weight loads. Rotated cold (the router
# weight read from HBM, as in a real step), one token: 7.61 / 5.72 / 8.35 against 9.50 / 6.16 /
# 13.56 in 64-column steps; 16 tokens 8.69 / 6.68 / 9.26 against 11.28 / 7.63 / 14.80.
SPAN_PER_PROGRAM = 0  # ``MoeRouteConfig.block_k`` 0: one span per program
SPAN_WEIGHT_HINTS = ("", "evict_last")  # (cache_modifier, eviction_policy) of the weight loads
# At one token the GEMV body (fp32 multiply-adds, no 16-row tl.dot padding) with 2 experts a
# program and spans up to 2048 columns (8 KB a program): 5.35 / 3.93 / 5.74 against 16 experts and
# spans up to 1024's 5.90 / 4.42 / 6.53. More programs stream the weight faster, and fewer splits
# leave the router fewer partial sums to poll, sum and reset.
GEMV_BLOCK_E = 2
MAX_GEMV_SPAN = 2048  # the GEMV body has no shared-memory operands
# A register cap on the <= 16-token launch. Without it ptxas reuses the partial sums' registers,
# so the last program's SPLIT partial loads return in dependent L2 round trips (offline sm_90
# SASS: DeepSeek ~9, MiniMax 4) instead of one. Rotated cold, one token: 7.66 / 5.74 / 8.43 ->
# 6.21 / 4.87 / 8.21; 2 and 16 tokens within +-0.15. ptxas's load scheduling moves with unrelated
# changes: after a tail change, read the SASS (bench/sass_offline.py router) and re-time
# ``maxnreg=0``.
MAXNREG = 128
_MIN_BLOCK_K = 16  # tl.dot's smallest K
_MAX_SPAN = 1024  # a [16, 1024] bf16 operand pair is 64 KB of shared memory for tl.dot's shuffle
TOPK_SELECT_MAX_EXPERTS = 256  # tl.topk up to this many lanes (``routing_tail``)


@dataclasses.dataclass(frozen=True)
class MoeRouteConfig:
    """The launch policy; the defaults are the shipped one (the tables above). Benches and tests
    pass variants to ``moe_router_fwd`` / ``moe_route_fwd``. The GEMM fields from ``block_k`` on
    shape the <= 16-token launch only: above 16 tokens the GEMM always takes 64-column steps, 16
    experts a program and 4 warps. The routing-tail fields' None picks by shape (``routing_tail``)."""

    fused_gemm_max_tokens: int = FUSED_GEMM_MAX_TOKENS  # one launch up to this many tokens (0: always two)
    target_programs: int = TARGET_PROGRAMS  # the router GEMM's grid: about this many programs
    max_split: int = MAX_SPLIT  # hidden-dim splits at most, in steps of block_k columns
    # Hidden columns a step (a power of two >= 16); 0: one step per program, its whole split in one
    # tile (the span ~hidden * tiles / target_programs rounded down to a power of two, at most 1024
    # for tl.dot or max_gemv_span for the GEMV body; max_split ignored).
    block_k: int = SPAN_PER_PROGRAM
    block_e: int | None = None  # experts a program (>= 16 for tl.dot); None: GEMV_BLOCK_E, or 16 for tl.dot
    gemv: bool = True  # at one token BLOCK_T 1 and fp32 multiply-adds instead of a 16-row tl.dot
    max_gemv_span: int = MAX_GEMV_SPAN
    # The K loop unrolled (tl.static_range): the steps' loads may issue up front, except across the
    # bar.sync that tl.dot's operand shuffle puts between steps.
    unroll: bool = False
    # (cache_modifier, eviction_policy) of the router-weight loads; not ".cg" with a policy (ptxas
    # rejects ".evict_last cannot be combined with .cg").
    w_hints: tuple[str, str] = SPAN_WEIGHT_HINTS
    maxnreg: int = MAXNREG  # the register cap (0: none)
    gemm_warps: int = 4  # the launch's num_warps (the routing tail runs in these warps too)
    gemm_stages: int | None = None  # num_stages (the K loop's software pipelining); None: Triton's default
    select: int | None = None  # the kernels' SELECT (moe_route_select)
    tail_loads: int | None = None  # TAIL_LOADS
    keys: int | None = None  # KEYS
    poll_one_token: bool = True  # False: one token takes the arrival counters instead of polling
    route_warps: int | None = None  # the routing kernel's num_warps; None: launch_config's


DEFAULT_CONFIG = MoeRouteConfig()


def routing_tail(padded_experts: int, has_bias: bool, n_group: int, logits_dtype: torch.dtype,
                 config: MoeRouteConfig = DEFAULT_CONFIG) -> tuple[int, int, int]:  # fmt: skip
    """(SELECT, TAIL_LOADS, KEYS) for a row of ``padded_experts`` lanes (``moe_route_select``).

    H200, one token through the GEMM-fused launch, CUDA-graph µs (bench/NOTES.md section 7;
    DeepSeek / MiniMax / Qwen3.5), all with int64 score keys: rounds + reload 7.14 / 6.02 / 9.88;
    tl.topk 6.71 / 5.05 / 10.12 (its network grows with the 512 lanes of Qwen's row); registers
    7.78 / 6.56 / 9.28 (with a bias, the masked sum costs more than the reload it saves; without
    one it is free). Without a bias and groups, int32 logit keys selected per warp (Qwen3.5, block-
    wide rounds 8.21 -> 7.37); with a bias and 16-bit logits, the logit carried in the key
    (MiniMax, 4.87 -> 4.77)."""
    narrow = logits_dtype.itemsize == 2 and padded_experts <= 1 << 16
    logit_keys = narrow and not has_bias and n_group == 1
    keys = int(logit_keys) if config.keys is None else config.keys
    if keys and not logit_keys:
        raise ValueError("int32 logit keys (KEYS 1) need 16-bit logits, no bias, no groups and <= 65536 experts")
    if keys:
        select, tail_loads = 2, 1
    else:
        select = 1 if padded_experts <= TOPK_SELECT_MAX_EXPERTS else 0
        tail_loads = (2 if narrow else 0) if has_bias else 1
    tail_loads = tail_loads if config.tail_loads is None else config.tail_loads
    if tail_loads == 2 and not narrow:
        raise ValueError("the logit in the key (TAIL_LOADS 2) needs 16-bit logits and <= 65536 experts")
    return (select if config.select is None else config.select), tail_loads, keys


def launch_config(experts: int, n_group: int, top_k: int) -> tuple[int, int, int, int]:
    """(G_PAD, GS_PAD, K_PAD, num_warps) for a row of ``experts`` in ``n_group`` groups."""
    if n_group > 1:
        g_pad = triton.next_power_of_2(n_group)
        gs_pad = triton.next_power_of_2(experts // n_group)
    else:
        g_pad, gs_pad = 1, triton.next_power_of_2(experts)
    num_warps = 8 if experts >= 512 else 4  # not tuned
    return g_pad, gs_pad, triton.next_power_of_2(top_k), num_warps


def gemm_launch_config(tokens: int, experts: int, hidden: int,
                       config: MoeRouteConfig = DEFAULT_CONFIG) -> tuple[int, int, int, int, int, int]:  # fmt: skip
    """(BLOCK_T, BLOCK_E, BLOCK_K, K_STEPS, SPLIT, num_warps) of the router GEMM launch.

    Up to 16 tokens (shipped): each program reads one span of the hidden dim in one tile, so all
    its weight loads are in flight at once; at one token the GEMV body (BLOCK_T 1: fp32
    multiply-adds, no 16-row padding for tl.dot; ``GEMV_BLOCK_E`` experts a program, spans up to
    ``max_gemv_span``), else tokens padded to tl.dot's 16 and 16 experts a program. Above 16
    tokens, 64-column steps with the hidden dim split until there are about ``target_programs``
    programs, each reading its weight tile once."""
    small = tokens <= 16  # the one-launch regime the config's GEMM fields shape
    gemv = small and tokens == 1 and bool(config.gemv)
    block_t = 1 if gemv else (16 if tokens <= 16 else (32 if tokens <= 32 else 64))
    block_e = config.block_e if small and config.block_e is not None else (GEMV_BLOCK_E if gemv else 16)
    block_k = config.block_k if small else 64
    num_warps = config.gemm_warps if small else 4
    tiles = triton.cdiv(tokens, block_t) * triton.cdiv(experts, block_e)
    if block_k == 0:  # one step per program: the split's whole span in one tile
        span = triton.cdiv(hidden, max(1, config.target_programs // tiles))
        cap = config.max_gemv_span if gemv else _MAX_SPAN
        block_k = min(cap, max(_MIN_BLOCK_K, triton.next_power_of_2(span + 1) // 2))  # rounded down
        return block_t, block_e, block_k, 1, triton.cdiv(hidden, block_k), num_warps
    k_blocks = triton.cdiv(hidden, block_k)
    split = max(1, min(config.max_split, k_blocks, config.target_programs // tiles))
    k_steps = triton.cdiv(k_blocks, split)
    split = triton.cdiv(k_blocks, k_steps)  # no empty splits
    return block_t, block_e, block_k, k_steps, split, num_warps


def gemm_variant_meta(block_t: int, config: MoeRouteConfig = DEFAULT_CONFIG) -> tuple[dict, dict]:
    """(the GEMM body's constexprs, extra launch options) from ``config`` for a launch whose
    BLOCK_T is ``block_t`` (1: the GEMV body)."""
    small = block_t <= 16
    cache, evict = config.w_hints if small else ("", "")
    meta = dict(GEMV=block_t == 1, UNROLL=bool(small and config.unroll), W_CACHE=cache, W_EVICT=evict)
    options = {"num_stages": config.gemm_stages} if small and config.gemm_stages is not None else {}
    if small and config.maxnreg:
        options["maxnreg"] = config.maxnreg
    return meta, options


def _routing_meta(named: dict, experts: int, logits_dtype: torch.dtype, config: MoeRouteConfig) -> tuple[dict, int]:
    """Checked routing scalars -> (the kernels' routing constexprs, the routing kernel's
    num_warps)."""
    top_k, n_group, topk_group = int(named["top_k"]), int(named["n_group"]), int(named["topk_group"])
    scoring = int(named["scoring"])
    bias = named["bias"]
    if bias is not None and (bias.dtype not in _LOGIT_DTYPES or tuple(bias.shape) != (experts,)):
        raise ValueError(f"bias must be float [{experts}], got {tuple(bias.shape)} {bias.dtype}")
    if scoring not in (0, 1):
        raise ValueError(f"scoring must be 0 (sigmoid) or 1 (softmax), got {scoring}")
    if n_group < 1 or experts % n_group:
        raise ValueError(f"n_group {n_group} must divide the {experts} experts")
    if n_group > 1:
        if experts // n_group < _GROUP_TOP or not 1 <= topk_group <= n_group:
            raise ValueError(f"bad grouping: {experts} experts, n_group {n_group}, topk_group {topk_group}")
        available = topk_group * (experts // n_group)
    else:
        topk_group = 1
        available = experts
    if not 1 <= top_k <= available:
        raise ValueError(f"top_k {top_k} must be in [1, {available}]")
    g_pad, gs_pad, k_pad, num_warps = launch_config(experts, n_group, top_k)
    num_warps = num_warps if config.route_warps is None else config.route_warps
    meta = dict(
        GROUP_SIZE=experts // n_group, N_GROUP=n_group, TOPK_GROUP=topk_group, TOP_K=top_k,
        G_PAD=g_pad, GS_PAD=gs_pad, K_PAD=k_pad, SCORING=scoring, HAS_BIAS=bias is not None,
        RENORMALIZE=bool(named["renormalize"]),
    )
    meta["SELECT"], meta["TAIL_LOADS"], meta["KEYS"] = routing_tail(g_pad * gs_pad, bias is not None, n_group, logits_dtype,
                                                                  config)
    return meta, num_warps


def _check_outputs(weights: torch.Tensor, ids: torch.Tensor, tokens: int, top_k: int) -> None:
    if tuple(weights.shape) != (tokens, top_k) or weights.dtype not in _WEIGHT_DTYPES:
        raise ValueError(
            f"weights must be [{tokens}, {top_k}] fp32/bf16/fp16, got {tuple(weights.shape)} {weights.dtype}"
        )
    if tuple(ids.shape) != (tokens, top_k) or ids.dtype != torch.int64:
        raise ValueError(f"ids must be int64 [{tokens}, {top_k}], got {tuple(ids.shape)} {ids.dtype}")


def moe_route_fwd(named: dict, weights: torch.Tensor, ids: torch.Tensor, config: MoeRouteConfig | None = None) -> None:
    """Launch the routing kernel; fills ``weights`` [T, top_k] and ``ids`` [T, top_k] in place.

    ``named`` maps the op's argument names (logits, bias, top_k, n_group, topk_group,
    scoring, renormalize, renorm_eps, scale, weights_dtype) to their values.  ``logits`` is
    [T, E] fp32/bf16/fp16 with any strides; ``bias`` None or float [E]; ``weights`` has
    ``weights_dtype`` and ``ids`` int64 (any strides, must not overlap the inputs).
    ``config`` None: the shipped launch policy.  No host syncs: only shapes, strides, dtypes and
    Python scalars are read.
    """
    config = DEFAULT_CONFIG if config is None else config
    logits, bias = named["logits"], named["bias"]
    if logits.dim() != 2 or logits.dtype not in _LOGIT_DTYPES:
        raise ValueError(f"logits must be [T, E] fp32/bf16/fp16, got {tuple(logits.shape)} {logits.dtype}")
    tokens, experts = logits.shape
    meta, num_warps = _routing_meta(named, experts, logits.dtype, config)
    _check_outputs(weights, ids, tokens, meta["TOP_K"])
    tensors = [logits, weights, ids] + ([bias] if bias is not None else [])
    if any(t.device != logits.device for t in tensors):
        raise ValueError(f"all tensors must be on {logits.device}")
    if tokens == 0:
        return
    bias_arg = bias if bias is not None else logits  # dummy, never read without HAS_BIAS

    def _launch():
        _moe_route_kernel[(tokens,)](
            logits, bias_arg, weights, ids, logits, logits,
            logits.stride(0), logits.stride(1), bias.stride(0) if bias is not None else 0,
            weights.stride(0), weights.stride(1), ids.stride(0), ids.stride(1), 0, 0, 0,
            float(named["renorm_eps"]), float(named["scale"]),
            num_warps=num_warps, WARPS=num_warps, SPLIT=0, HAS_GATE=False, **meta,
        )

    launch_on_device(logits, _launch)


# One pair of counters per device (arrivals, routers done). The GEMM-fused launch's last router
# resets them to zero, so they are allocated (zeroed) once, outside any CUDA-graph capture, and
# every later launch, in a graph or not and on whichever stream, finds them at zero. Launches on
# one device must not overlap in time (two streams routing concurrently would share them).
_COUNTERS: dict[tuple[int], torch.Tensor] = {}


def _handed_on(cache: dict, device: torch.device, shape: tuple, make, what: str) -> torch.Tensor:
    """A buffer one launch hands the next on ``device`` (``make()`` builds it in its initial state):
    made on the first call for ``shape``, which must be outside CUDA-graph capture, and kept (a
    captured graph points at it). Off CUDA (the interpreter), a fresh one each call."""
    if device.type != "cuda":
        return make()
    key = (device.index if device.index is not None else torch.cuda.current_device(), *shape)
    buffer = cache.get(key)
    if buffer is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"fusion_compiler.moe_router: its first {what} on this device is inside CUDA-graph capture; "
                "run it once before capturing (the buffer must be initialised outside the graph)"
            )
        buffer = cache[key] = make()
    return buffer


def _counters(device: torch.device) -> torch.Tensor:
    return _handed_on(_COUNTERS, device, (), lambda: torch.zeros(2, dtype=torch.int32, device=device),
                      "call (its completion counters)")


# One-token partial-sum buffers per (device, split, columns), for the launch whose router polls
# them (``POLL``): filled with _UNWRITTEN once, outside any CUDA-graph capture, and put back to it
# by every launch's router, so every later launch (in a graph or not) finds them that way. Launches
# on one device must not overlap in time (as with the counters).
_POLLED: dict[tuple[int, int, int], torch.Tensor] = {}


def poll_rows(padded_experts: int, num_warps: int, config: MoeRouteConfig = DEFAULT_CONFIG) -> bool:
    """Whether one token's router polls (else it takes the counters): ``config`` allows it and
    the row has a lane for each of the launch's threads at least (``moe_route_select._sum_partials``:
    its exit count assumes no lane is held by two threads)."""
    return config.poll_one_token and padded_experts >= 32 * num_warps


def _poll_partials(device: torch.device, split: int, columns: int) -> torch.Tensor:
    def unwritten():
        return torch.full((split, 1, columns), -1, dtype=torch.int32, device=device).view(torch.float32)

    return _handed_on(_POLLED, device, (split, columns), unwritten, "one-token call for this shape (its partial sums)")


def moe_router_fwd(named: dict, hidden: torch.Tensor, router_weight: torch.Tensor,
                   logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   gate_weight: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                   config: MoeRouteConfig | None = None) -> None:
    """Router GEMM + routing: one launch up to ``config.fused_gemm_max_tokens`` tokens, else the
    GEMM launch (partial sums) and the routing kernel.

    ``hidden`` [T, H] and ``router_weight`` [E, H] (unit stride along H) are multiplied with
    fp32 accumulation (a bf16 x bf16 tensor-core dot when both are bf16, or both fp16; else both
    upcast, IEEE fp32); the logits are rounded to ``logits.dtype`` ([T, E], unit stride along E,
    written) before routing, as an ``F.linear`` in that dtype would round them.  So each input's
    dtype must be the logits dtype or a narrower float (an exact widening).  ``named`` holds the
    routing arguments as in :func:`moe_route_fwd`.  With ``gate_weight`` [1, H] (hidden's dtype,
    unit stride), ``gate`` [T, 1] receives ``sigmoid(F.linear(hidden, gate_weight))`` in its dtype,
    computed as one more GEMM column.  ``config`` None: the shipped launch policy.
    """
    config = DEFAULT_CONFIG if config is None else config
    tokens, hid = hidden.shape
    experts = router_weight.shape[0]
    if tuple(router_weight.shape) != (experts, hid) or tuple(logits.shape) != (tokens, experts):
        raise ValueError(
            f"shapes disagree: hidden {tuple(hidden.shape)}, router_weight {tuple(router_weight.shape)}, "
            f"logits {tuple(logits.shape)}"
        )
    for name, t in (("hidden", hidden), ("router_weight", router_weight)):
        if t.dtype not in _LOGIT_DTYPES or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a float tensor with unit stride on its last dim, got {t.dtype} {t.stride()}")
        if t.element_size() > logits.element_size() or (t.element_size() == logits.element_size() and t.dtype != logits.dtype):
            raise ValueError(f"{name} {t.dtype} does not widen exactly to the {logits.dtype} logits")
    if logits.stride(-1) != 1:
        raise ValueError(f"logits must have unit stride on the expert dim, got {logits.stride()}")
    meta, route_warps = _routing_meta(named, experts, logits.dtype, config)
    _check_outputs(weights, ids, tokens, meta["TOP_K"])
    bias = named["bias"]
    tensors = [hidden, router_weight, logits, weights, ids] + ([bias] if bias is not None else [])
    if any(t.device != hidden.device for t in tensors):
        raise ValueError(f"all tensors must be on {hidden.device}")
    has_gate = gate_weight is not None
    if has_gate != (gate is not None):
        raise ValueError("gate_weight and gate must be given together")
    if has_gate:
        if (tuple(gate_weight.shape) != (1, hid) or gate_weight.dtype != hidden.dtype
                or gate_weight.dtype != router_weight.dtype or gate_weight.stride(-1) != 1):
            raise ValueError(f"gate_weight must be [1, {hid}], hidden's and router_weight's dtype, unit stride, got "
                             f"{tuple(gate_weight.shape)} {gate_weight.dtype} {gate_weight.stride()}")
        if tuple(gate.shape) != (tokens, 1) or gate.dtype not in _LOGIT_DTYPES or gate.device != hidden.device:
            raise ValueError(f"gate must be float [{tokens}, 1] on {hidden.device}, got {tuple(gate.shape)} {gate.dtype}")
    if tokens == 0:
        return

    columns = experts + has_gate
    block_t, block_e, block_k, k_steps, split, num_warps = gemm_launch_config(tokens, columns, hid, config)
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(columns, block_e), split)
    fused = tokens <= config.fused_gemm_max_tokens and min(tokens, grid[0] * grid[1] * grid[2]) <= MAX_ROUTERS
    one_split, one_warps = (split, num_warps) if tokens == 1 else gemm_launch_config(1, columns, hid, config)[4:]
    one_token_polls = config.fused_gemm_max_tokens >= 1 and poll_rows(meta["G_PAD"] * meta["GS_PAD"], one_warps, config)
    # Any call outside capture makes the one-token launch's buffer (for that launch's split and
    # warps, which its GEMV shape sets apart), so a warm-up at any token count lets a later capture
    # at one token find it; a call at other counts never reads it, so inside capture it skips it.
    outside_capture = hidden.device.type != "cuda" or not torch.cuda.is_current_stream_capturing()
    prepare = one_token_polls and (tokens == 1 or outside_capture)
    polled = _poll_partials(hidden.device, one_split, columns) if prepare else None
    poll = fused and tokens == 1 and one_token_polls
    partials = polled if poll else torch.empty((split, tokens, columns), dtype=torch.float32, device=hidden.device)
    gate_w_arg = gate_weight if has_gate else router_weight  # dummies, never read without HAS_GATE
    gate_arg = gate if has_gate else logits
    stride_g = gate.stride(0) if has_gate else 0
    counters = _counters(hidden.device) if fused and not poll else partials  # dummy when unused
    bias_arg = bias if bias is not None else logits
    stride_b = bias.stride(0) if bias is not None else 0
    fp32_dot = not (hidden.dtype == router_weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16))
    gemm_meta, gemm_options = gemm_variant_meta(block_t, config)

    def _launch():
        _router_gemm_kernel[grid](
            hidden, router_weight, gate_w_arg, partials, logits, bias_arg, weights, ids, gate_arg, counters,
            tokens, hid, experts,
            hidden.stride(0), router_weight.stride(0), partials.stride(0), partials.stride(1),
            logits.stride(0), stride_b,
            weights.stride(0), weights.stride(1), ids.stride(0), ids.stride(1), stride_g,
            float(named["renorm_eps"]), float(named["scale"]),
            BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, K_STEPS=k_steps, SPLIT=split,
            FP32_DOT=fp32_dot, ROUTE=fused,
            HAS_GATE=has_gate, num_warps=num_warps, WARPS=num_warps, POLL=poll, COLS_PAD=triton.next_power_of_2(columns),
            **meta, **gemm_meta, **gemm_options,
        )
        if not fused:
            _moe_route_kernel[(tokens,)](
                logits, bias_arg, weights, ids, partials, gate_arg,
                logits.stride(0), 1, stride_b,
                weights.stride(0), weights.stride(1), ids.stride(0), ids.stride(1),
                partials.stride(0), partials.stride(1), stride_g,
                float(named["renorm_eps"]), float(named["scale"]),
                num_warps=route_warps, WARPS=route_warps, SPLIT=split,
                HAS_GATE=has_gate, **meta,
            )

    launch_on_device(hidden, _launch)
