"""The Triton MoE routing kernel against ``moe_route_reference``.

CPU tier: the launcher runs on CPU tensors under TRITON_INTERPRET=1 (set by tests/conftest.py
before this module imports the kernel).  The op's CPU dispatch runs the reference, so the
kernel is called directly through ``moe_route_fwd``.

Two input families:
  * tie-free: logits are a scaled permutation (all distinct, exact in bf16) plus a random
    bias; examples where the reference's ranked scores come within 1e-4 (relative) of a tie
    are rejected, so ulp-level differences between torch's and Triton's exp cannot reorder;
  * tie-heavy: logits from 4 discrete values (and a discrete bias, constant per group when
    grouped so that mathematically equal group scores are computed by the same expression);
    both sides rank ties by the lower index, so ids must match exactly.
Weights: fp32 within 1e-6 relative, bf16/fp16 within one unit in the last place.
"""

from __future__ import annotations

import pytest
import torch

from kernel_fixtures import DEVICE, INT_VIEW, skip_unless_kernels_can_run
from launch_counter import count_launches

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings, strategies as st  # noqa: E402
from hypothesis_profile import examples  # noqa: E402

skip_unless_kernels_can_run()

from fusion_compiler.kernels import KERNEL_VERSIONS  # noqa: E402
from fusion_compiler.kernels import moe_route as K  # noqa: E402
from fusion_compiler.ops.moe_route import _ARG_NAMES, GROUP_TOP, moe_route_reference  # noqa: E402


FP32_RTOL = 1e-6
TIE_VALUES = (0.0, 0.5, 1.25, 2.0)  # sigmoid / exp pair sums all distinct; exact in bf16
TIE_BIAS = (0.0, 0.25)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def run_kernel(args: tuple, config: K.MoeRouteConfig | None = None):
    """Run the kernel on NaN / -1 poisoned outputs with a guard row on each side (``config``
    None: the shipped launch policy)."""
    named = dict(zip(_ARG_NAMES, args))
    logits, top_k, wdt = named["logits"], named["top_k"], named["weights_dtype"]
    t = logits.shape[0]
    wbuf = torch.full((t + 2, top_k), float("nan"), dtype=wdt, device=logits.device)
    ibuf = torch.full((t + 2, top_k), -1, dtype=torch.int64, device=logits.device)
    K.moe_route_fwd(named, wbuf[1 : t + 1], ibuf[1 : t + 1], config=config)
    # Guard rows untouched.
    assert torch.isnan(wbuf[0]).all() and torch.isnan(wbuf[-1]).all(), "weights written out of bounds"
    assert (ibuf[0] == -1).all() and (ibuf[-1] == -1).all(), "ids written out of bounds"
    return wbuf[1 : t + 1], ibuf[1 : t + 1]


def assert_matches_reference(args: tuple, config: K.MoeRouteConfig | None = None):
    weights, ids = run_kernel(args, config)
    ref_w, ref_ids = moe_route_reference(*args)
    assert torch.isfinite(weights).all(), "a weight was not written (NaN poison left)"
    assert (ids >= 0).all(), "an id was not written (-1 poison left)"
    assert torch.equal(ids.cpu(), ref_ids.cpu()), f"ids differ:\n{ids}\nvs reference\n{ref_ids}"
    assert weights.dtype == ref_w.dtype
    w, rw = weights.cpu(), ref_w.cpu()
    if w.dtype == torch.float32:
        torch.testing.assert_close(w, rw, rtol=FP32_RTOL, atol=1e-30)
    else:
        ulps = (w.view(INT_VIEW[w.dtype]).int() - rw.view(INT_VIEW[rw.dtype]).int()).abs()
        assert (ulps <= 1).all() and (torch.sign(w) == torch.sign(rw)).all(), (
            f"{w.dtype} weights differ by more than 1 ulp:\n{w}\nvs reference\n{rw}"
        )


def ranking_gaps_ok(args: tuple, rel: float = 1e-4) -> bool:
    """True when the reference's ranking decisions are tie-free by ``rel`` (relative): the
    ``topk_group + 1`` best group scores and the ``top_k + 1`` best (group-masked) choices
    are pairwise separated, so ulp differences in exp/sigmoid cannot change the selection."""
    logits, bias, top_k, n_group, topk_group, scoring = args[:6]
    h = logits.float().cpu()
    s = torch.sigmoid(h) if scoring == 0 else torch.softmax(h, dim=-1)
    choice = s + bias.cpu() if bias is not None else s

    def separated(v, n):
        v = torch.sort(v, dim=-1, descending=True).values[:, : n + 1]
        gap = v[:, :-1] - v[:, 1:]  # -inf - -inf = nan: compares False below
        return not (gap <= rel * torch.maximum(v[:, :-1].abs(), v[:, 1:].abs())).any()

    if n_group > 1:
        grouped = choice.view(choice.shape[0], n_group, -1)
        scores = torch.sort(grouped, dim=-1, descending=True).values[..., :GROUP_TOP].sum(-1)
        if not separated(scores, topk_group):
            return False
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter(
            1, torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk_group], True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
    return separated(choice, top_k)


def place(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` [T, E] in a layout: contiguous, a column slice of a wider NaN-filled
    tensor (row stride != E), or every other column (column stride 2)."""
    t, e = values.shape
    if layout == "contiguous":
        return values.contiguous()
    if layout == "col_slice":
        wide = torch.full((t, e + 7), float("nan"), dtype=values.dtype, device=values.device)
        wide[:, 3 : 3 + e] = values
        return wide[:, 3 : 3 + e]
    wide = torch.full((t, 2 * e + 1), float("nan"), dtype=values.dtype, device=values.device)
    wide[:, 1::2] = values
    return wide[:, 1::2]


@st.composite
def configs(draw, max_experts_log2: int = 6):
    experts = draw(st.sampled_from([e for e in (8, 16, 32, 64) if e <= 2 ** max_experts_log2]))
    n_group = draw(st.sampled_from([1] + [g for g in (2, 4, 8) if experts // g >= GROUP_TOP]))
    topk_group = draw(st.integers(1, n_group)) if n_group > 1 else 1
    available = topk_group * (experts // n_group) if n_group > 1 else experts
    top_k = draw(st.integers(1, min(available, 16)))
    return dict(
        tokens=draw(st.integers(1, 6)),
        experts=experts,
        n_group=n_group,
        topk_group=topk_group,
        top_k=top_k,
        scoring=draw(st.sampled_from([0, 1])),
        has_bias=draw(st.booleans()),
        renormalize=draw(st.booleans()),
        renorm_eps=draw(st.sampled_from([0.0, 1e-20])),
        scale=draw(st.sampled_from([1.0, 2.5])),
        logits_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        weights_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        layout=draw(st.sampled_from(["contiguous", "col_slice", "col_stride2"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def build_args(c: dict, ties: bool) -> tuple:
    gen = torch.Generator().manual_seed(c["seed"])
    t, e = c["tokens"], c["experts"]
    if ties:
        table = torch.tensor(TIE_VALUES)
        logits = table[torch.randint(0, len(TIE_VALUES), (t, e), generator=gen)]
        bias = None
        if c["has_bias"]:
            # Per expert, or constant within each group when grouped (see the module doc).
            per = 1 if c["n_group"] == 1 else e // c["n_group"]
            pick = torch.randint(0, len(TIE_BIAS), (e // per,), generator=gen)
            bias = torch.tensor(TIE_BIAS)[pick].repeat_interleave(per)
    else:
        # Distinct multiples of 8 / E in [-4, 4): exact in bf16.
        logits = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]).float()
        logits = (logits - e // 2) * (8.0 / e)
        bias = torch.rand(e, generator=gen) * 0.1 if c["has_bias"] else None
    logits = place(logits.to(c["logits_dtype"]).to(DEVICE), c["layout"])
    if bias is not None:
        bias = bias.to(DEVICE)
    return (logits, bias, c["top_k"], c["n_group"], c["topk_group"], c["scoring"],
            c["renormalize"], c["renorm_eps"], c["scale"], c["weights_dtype"])


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


def test_kernel_version_registered():
    assert KERNEL_VERSIONS["moe_routing"] == K.KERNEL_VERSION == "moe_route-18"


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(c=configs())
def test_tie_free_matches_reference(c):
    args = build_args(c, ties=False)
    assume(ranking_gaps_ok(args))
    assert_matches_reference(args)


@settings(max_examples=examples(15), deadline=None)
@given(c=configs())
def test_tie_heavy_matches_reference(c):
    assert_matches_reference(build_args(c, ties=True))


@pytest.mark.parametrize(
    "name, experts, top_k, n_group, topk_group, scoring, bias, renormalize, eps, scale, wdt",
    [
        ("deepseek_v3", 256, 8, 8, 4, 0, True, True, 1e-20, 2.5, torch.float32),
        ("deepseek_v3_bf16w", 256, 8, 8, 4, 0, True, True, 1e-20, 2.5, torch.bfloat16),
        ("minimax_m2", 256, 8, 1, 1, 0, True, True, 0.0, 1.0, torch.float32),
        ("qwen3_moe", 512, 10, 1, 1, 1, False, True, 0.0, 1.0, torch.float32),
        ("qwen3_moe_no_norm", 512, 10, 1, 1, 1, False, False, 0.0, 1.0, torch.float16),
    ],
)
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_model_shapes(name, experts, top_k, n_group, topk_group, scoring, bias, renormalize, eps,
                      scale, wdt, logits_dtype):
    gen = torch.Generator().manual_seed(experts + top_k)
    # Distinct multiples of 8 / E in [-4, 4) (exact in bf16), rows shuffled independently.
    logits = torch.stack([torch.randperm(experts, generator=gen) for _ in range(5)]).float()
    logits = ((logits - experts // 2) * (8.0 / experts)).to(logits_dtype).to(DEVICE)
    b = (torch.rand(experts, generator=gen) * 0.1).to(DEVICE) if bias else None
    args = (logits, b, top_k, n_group, topk_group, scoring, renormalize, eps, scale, wdt)
    assert ranking_gaps_ok(args, rel=1e-5), "test input too close to a tie: change the seed"
    assert_matches_reference(args)


@pytest.mark.parametrize("n_group, topk_group", [(1, 1), (4, 2), (8, 8)])
def test_all_equal_logits_pick_lowest_indices(n_group, topk_group):
    """Every score ties: experts and groups go to the lowest indices, like the reference."""
    logits = torch.zeros(3, 64, device=DEVICE)
    args = (logits, None, 8, n_group, topk_group, 0, True, 0.0, 1.0, torch.float32)
    weights, ids = run_kernel(args)
    assert torch.equal(ids.cpu(), torch.arange(8).expand(3, 8))
    assert torch.equal(weights.cpu(), torch.full((3, 8), 0.125))
    assert_matches_reference(args)


def test_group_score_counts_both_equal_maxima():
    """Group 0 holds two copies of the row max (score 2 * max); group 1 holds the max once
    and high runners-up: group 0 must win."""
    row = torch.full((1, 8), -4.0)
    row[0, [0, 1]] = 3.0  # group 0: 3, 3
    row[0, [4]] = 3.0  # group 1: 3, 2.5
    row[0, [5]] = 2.5
    args = (row.to(DEVICE), None, 2, 2, 1, 0, True, 0.0, 1.0, torch.float32)
    _, ids = run_kernel(args)
    assert ids.cpu().tolist() == [[0, 1]]
    assert_matches_reference(args)


def test_non_power_of_two_experts():
    """Padded lanes (E = 48 in 4 groups of 12, and E = 40 ungrouped) never leak in."""
    gen = torch.Generator().manual_seed(3)
    for experts, n_group, topk_group, top_k in ((48, 4, 2, 7), (40, 1, 1, 40)):
        logits = torch.stack([torch.randperm(experts, generator=gen) for _ in range(4)]).float() / 8
        args = (logits.to(DEVICE), torch.rand(experts, generator=gen).to(DEVICE) * 0.01, top_k,
                n_group, topk_group, 1, True, 1e-20, 2.5, torch.float32)
        assert ranking_gaps_ok(args, rel=1e-6)
        assert_matches_reference(args)


def test_fp16_logits():
    gen = torch.Generator().manual_seed(5)
    logits = ((torch.randperm(64, generator=gen).float() - 32) / 8).to(torch.float16).view(1, 64)
    args = (logits.to(DEVICE), None, 6, 4, 2, 0, True, 0.0, 1.0, torch.float16)
    assert_matches_reference(args)


def test_zero_tokens_launches_nothing():
    """No rows, no launch (the launcher returns before it); one row launches the routing kernel
    once, so the counter does see this launcher's launches."""
    args = (None, 4, 1, 1, 0, True, 0.0, 1.0, torch.float32)
    with count_launches() as launches:
        K.moe_route_fwd(dict(zip(_ARG_NAMES, (torch.randn(1, 16, device=DEVICE),) + args)),
                        torch.empty(1, 4, device=DEVICE), torch.empty(1, 4, dtype=torch.int64, device=DEVICE))
    assert launches.names == ["_moe_route_kernel"]
    with count_launches() as launches:
        K.moe_route_fwd(dict(zip(_ARG_NAMES, (torch.empty(0, 16, device=DEVICE),) + args)),
                        torch.empty(0, 4, device=DEVICE), torch.empty(0, 4, dtype=torch.int64, device=DEVICE))
    assert launches.names == []


def test_rejects_bad_outputs():
    logits = torch.randn(2, 16, device=DEVICE)
    named = dict(zip(_ARG_NAMES, (logits, None, 4, 1, 1, 0, True, 0.0, 1.0, torch.float32)))
    ids64 = torch.empty(2, 4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError):
        K.moe_route_fwd(named, torch.empty(2, 3, device=DEVICE), ids64)
    with pytest.raises(ValueError):
        K.moe_route_fwd(named, torch.empty(2, 4, device=DEVICE), ids64.int())


# ---------------------------------------------------------------------------------------------
# Router GEMM + routing (moe_router_fwd): one launch up to FUSED_GEMM_MAX_TOKENS, two above
# ---------------------------------------------------------------------------------------------
#
# hidden and router weight hold small multiples of 1/8, so every product and partial sum is
# exact in fp32: the logits do not depend on summation order, and the kernel's must equal
# F.linear's bit for bit (rounded to bf16 the same way when the logits are bf16).  Duplicated
# weight rows make exactly tied experts; ties go to the lower index on both sides.

from fusion_compiler.ops.moe_route import _ROUTER_ARG_NAMES, moe_router_reference  # noqa: E402


def router_args(c: dict, hidden_size: int, duplicate_rows: bool, gate: bool = False) -> tuple:
    gen = torch.Generator().manual_seed(c["seed"])
    t, e = c["tokens"], c["experts"]
    hidden = torch.randint(-3, 4, (t, hidden_size), generator=gen).float() / 8
    if duplicate_rows:
        weight = (torch.randint(-3, 4, (4, hidden_size), generator=gen).float() / 8)[torch.randint(0, 4, (e,), generator=gen)]
    else:
        weight = torch.randint(-3, 4, (e, hidden_size), generator=gen).float() / 8
    bias = None
    if c["has_bias"]:
        per = 1 if c["n_group"] == 1 or not duplicate_rows else e // c["n_group"]
        bias = (torch.rand(e // per, generator=gen) * 0.1).repeat_interleave(per)
        if duplicate_rows:
            bias = torch.tensor(TIE_BIAS)[torch.randint(0, len(TIE_BIAS), (e // per,), generator=gen)].repeat_interleave(per)
    in_dtype = torch.bfloat16 if c["logits_dtype"] == torch.float32 else c["logits_dtype"]
    gate_weight = (torch.randint(-3, 4, (1, hidden_size), generator=gen).float() / 8).to(in_dtype).to(DEVICE) if gate else None
    return (hidden.to(in_dtype).to(DEVICE), weight.to(in_dtype).to(DEVICE), None if bias is None else bias.to(DEVICE),
            c["top_k"], c["n_group"], c["topk_group"], c["scoring"], c["renormalize"], c["renorm_eps"], c["scale"],
            c["weights_dtype"], c["logits_dtype"], gate_weight)


def fused_up_to(tokens: int, **fields) -> K.MoeRouteConfig:
    """The shipped launch policy with the GEMM in one launch up to ``tokens`` (the launcher's
    split), and ``fields`` of it changed."""
    return K.MoeRouteConfig(fused_gemm_max_tokens=tokens, **fields)


def run_router_kernel(args: tuple, config: K.MoeRouteConfig | None = None):
    named = dict(zip(_ROUTER_ARG_NAMES, args))
    hidden, weight = named["hidden"], named["router_weight"]
    t, e, k = hidden.shape[0], weight.shape[0], named["top_k"]
    lbuf = torch.full((t + 2, e), float("nan"), dtype=named["logits_dtype"], device=DEVICE)
    wbuf = torch.full((t + 2, k), float("nan"), dtype=named["weights_dtype"], device=DEVICE)
    ibuf = torch.full((t + 2, k), -1, dtype=torch.int64, device=DEVICE)
    gate_weight = named.get("gate_weight")
    gbuf = torch.full((t + 2, 1), float("nan"), dtype=hidden.dtype, device=DEVICE) if gate_weight is not None else None
    K.moe_router_fwd(named, hidden, weight, lbuf[1 : t + 1], wbuf[1 : t + 1], ibuf[1 : t + 1],
                     gate_weight=gate_weight, gate=None if gbuf is None else gbuf[1 : t + 1], config=config)
    for buf in (lbuf, wbuf) + (() if gbuf is None else (gbuf,)):
        assert torch.isnan(buf[0]).all() and torch.isnan(buf[-1]).all(), "written out of bounds"
    assert (ibuf[0] == -1).all() and (ibuf[-1] == -1).all(), "ids written out of bounds"
    gate = None if gbuf is None else gbuf[1 : t + 1]
    return wbuf[1 : t + 1], ibuf[1 : t + 1], lbuf[1 : t + 1], gate


def assert_router_matches_reference(args: tuple, config: K.MoeRouteConfig | None = None):
    weights, ids, logits, gate = run_router_kernel(args, config)
    ref_w, ref_ids, ref_logits, ref_gate = moe_router_reference(*args)
    if gate is not None:  # exact logit; sigmoid's exp may differ from torch's in the last bit
        g, rg = gate.cpu(), ref_gate.cpu()
        assert ((g.view(INT_VIEW[g.dtype]).int() - rg.view(INT_VIEW[rg.dtype]).int()).abs() <= 1).all(), (g, rg)
    assert torch.equal(logits.cpu(), ref_logits.cpu()), "logits differ from F.linear's (exact inputs)"
    assert torch.equal(ids.cpu(), ref_ids.cpu()), f"ids differ:\n{ids}\nvs reference\n{ref_ids}"
    if weights.dtype == torch.float32:
        torch.testing.assert_close(weights.cpu(), ref_w.cpu(), rtol=FP32_RTOL, atol=1e-30)
    else:
        ulps = (weights.cpu().view(INT_VIEW[weights.dtype]).int() - ref_w.cpu().view(INT_VIEW[ref_w.dtype]).int()).abs()
        assert (ulps <= 1).all()


@st.composite
def router_configs(draw):
    c = draw(configs())
    c["fused"] = draw(st.booleans())  # one launch (several token tiles past 16) or GEMM + routing launches
    c["tokens"] = draw(st.integers(1, 40))
    c["hidden_size"] = draw(st.sampled_from([8, 48, 100, 300]))
    return c


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(c=router_configs())
def test_router_gemm_tie_free_matches_reference(c):
    args = router_args(c, c["hidden_size"], duplicate_rows=False)
    ref_logits = moe_router_reference(*args)[2]
    assume(ranking_gaps_ok((ref_logits,) + args[2:8]))
    assert_router_matches_reference(args, fused_up_to(256 if c["fused"] else 0))


@settings(max_examples=examples(8), deadline=None)
@given(c=router_configs())
def test_router_gemm_tie_heavy_matches_reference(c):
    assert_router_matches_reference(router_args(c, c["hidden_size"], duplicate_rows=True),
                                    fused_up_to(256 if c["fused"] else 0))


def test_router_gemm_deepseek_shape_and_counter_reset(monkeypatch):
    """DeepSeek's routing (256 experts, 8 groups, top-4 groups, top-8) on a narrow hidden, on
    a pair of zeroed counters: the last router must leave them at zero for the next launch.
    (The counters are all the state one launch hands the next, so a second launch would start
    exactly as this one did.)"""
    counters = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    monkeypatch.setattr(K, "_counters", lambda device: counters)
    c = dict(tokens=3, experts=256, n_group=8, topk_group=4, top_k=8, scoring=0, has_bias=True, renormalize=True,
             renorm_eps=1e-20, scale=2.5, logits_dtype=torch.float32, weights_dtype=torch.float32, seed=11)
    args = router_args(c, 64, duplicate_rows=False)
    assert ranking_gaps_ok((moe_router_reference(*args)[2],) + args[2:8])
    assert_router_matches_reference(args, fused_up_to(16))
    assert counters.tolist() == [0, 0]
    c.update(tokens=40, seed=20)  # several token tiles (BLOCK_T 32 past 16 tokens), one launch
    args = router_args(c, 128, duplicate_rows=False)
    assert ranking_gaps_ok((moe_router_reference(*args)[2],) + args[2:8])
    assert_router_matches_reference(args, fused_up_to(256))
    assert counters.tolist() == [0, 0]


@pytest.mark.parametrize("gate", [False, True])
def test_router_gemm_one_token_polling_leaves_partials_unwritten(monkeypatch, gate):
    """One token: the router polls the partial sums (no counters) and must put every one back to
    the unwritten bits for the next launch; two launches in a row on one buffer, different inputs,
    both match the reference (a softmax row of 128 experts, the smallest that polls at 4 warps,
    with or without the gate column, over 8 hidden splits)."""
    # 8 (9 with the gate) expert tiles x 8 splits (the shipped GEMV shape gives this row one split)
    config = fused_up_to(16, target_programs=64, block_e=16)
    buffers = {}

    def persistent(device, split, columns):
        if (split, columns) not in buffers:
            buffers[split, columns] = torch.full((split, 1, columns), -1, dtype=torch.int32, device=device).view(torch.float32)
        return buffers[split, columns]

    monkeypatch.setattr(K, "_poll_partials", persistent)
    monkeypatch.setattr(K, "_counters", lambda device: pytest.fail("one token must not use the counters"))
    for seed in (1, 2):
        c = dict(tokens=1, experts=128, n_group=1, topk_group=1, top_k=6, scoring=1, has_bias=False, renormalize=True,
                 renorm_eps=0.0, scale=1.0, logits_dtype=torch.bfloat16, weights_dtype=torch.float32, seed=seed)
        args = router_args(c, 256, duplicate_rows=False, gate=gate)
        assert ranking_gaps_ok((moe_router_reference(*args)[2],) + args[2:8])
        assert_router_matches_reference(args, config)
    (buffer,) = buffers.values()
    assert buffer.shape[0] == 8 and bool((buffer.view(torch.int32) == -1).all()), "partials left written"


def test_router_gemm_narrow_rows_take_the_counters(monkeypatch):
    """Fewer lanes than the launch's threads (64 experts at 4 warps): a lane would be held by two
    threads, where the poll's exit count is not guaranteed to see every copy, so one token takes the
    counters; at more tokens a pollable row still makes its one-token buffer (a warm-up at any
    count prepares a capture at one token), also where the call itself is two launches (the
    shipped policy above one token)."""
    assert not K.poll_rows(64, 4) and K.poll_rows(128, 4) and not K.poll_rows(128, 8)
    made = []
    monkeypatch.setattr(K, "_poll_partials", lambda device, split, columns: made.append((split, columns)) or
                        torch.full((split, 1, columns), -1, dtype=torch.int32, device=device).view(torch.float32))  # fmt: skip
    for experts, tokens, fused_max in ((64, 1, 16), (128, 3, 16), (128, 2, 1)):
        c = dict(tokens=tokens, experts=experts, n_group=1, topk_group=1, top_k=4, scoring=0, has_bias=True,
                 renormalize=True, renorm_eps=0.0, scale=1.0, logits_dtype=torch.bfloat16, weights_dtype=torch.float32,
                 seed=5)  # fmt: skip
        args = router_args(c, 64, duplicate_rows=False)
        assert ranking_gaps_ok((moe_router_reference(*args)[2],) + args[2:8])
        assert_router_matches_reference(args, fused_up_to(fused_max))
    assert made == [(K.gemm_launch_config(1, 128, 64)[4], 128)] * 2, made  # the one-token launch's split


def test_router_gemm_rejects_what_it_cannot_do():
    hidden = torch.zeros(4, 8, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.zeros(16, 8, dtype=torch.bfloat16, device=DEVICE)
    named = dict(zip(_ROUTER_ARG_NAMES, (hidden, weight, None, 4, 1, 1, 0, True, 0.0, 1.0, torch.float32, torch.float32)))
    out = (torch.empty(4, 4, device=DEVICE), torch.empty(4, 4, dtype=torch.int64, device=DEVICE))
    # fp32 operands cannot feed bf16 logits without a rounding the kernel does not do
    with pytest.raises(ValueError, match="widen"):
        K.moe_router_fwd(named, hidden.float(), weight.float(), torch.empty(4, 16, dtype=torch.bfloat16, device=DEVICE), *out)
    with pytest.raises(ValueError, match="shapes disagree"):
        K.moe_router_fwd(named, hidden, weight[:, :4], torch.empty(4, 16, device=DEVICE), *out)


# 5: one token tile; 37: 3 token tiles (the shipped policy: GEMM + routing launches above 1 token),
# nightly (9 s; the CI tier's shared-gate test takes both forms at 21 tokens).
@pytest.mark.parametrize("tokens", [5, pytest.param(37, marks=pytest.mark.nightly)])
def test_router_gemm_hidden_splits(monkeypatch, tokens):
    """Many hidden splits and steps (300 = 5 x 64 - 20: a masked tail in the last split), summed
    in split order; fp32 operands (IEEE dot) for fp32 logits."""
    monkeypatch.setattr(K, "gemm_launch_config", lambda t, e, h, config: (16, 16, 64, 2, 3, 4))
    c = dict(tokens=tokens, experts=32, n_group=4, topk_group=2, top_k=6, scoring=1, has_bias=True, renormalize=True,
             renorm_eps=0.0, scale=1.0, logits_dtype=torch.bfloat16, weights_dtype=torch.bfloat16, seed=3)
    assert_router_matches_reference(router_args(c, 300, duplicate_rows=True))
    c.update(logits_dtype=torch.float32, weights_dtype=torch.float32)
    args = router_args(c, 300, duplicate_rows=True)
    args = (args[0].float(), args[1].float()) + args[2:]
    assert_router_matches_reference(args)


@pytest.mark.parametrize("tokens, fused", [(3, True), (3, False), (21, False), (21, True)])
def test_router_gemm_with_the_shared_expert_gate(tokens, fused):
    """Qwen's shared-expert gate as one more GEMM column: sigmoid(F.linear(hidden, gate_weight))."""
    c = dict(tokens=tokens, experts=64, n_group=1, topk_group=1, top_k=10, scoring=1, has_bias=False, renormalize=True,
             renorm_eps=0.0, scale=1.0, logits_dtype=torch.bfloat16, weights_dtype=torch.bfloat16, seed=5)
    assert_router_matches_reference(router_args(c, 100, duplicate_rows=True, gate=True),
                                    fused_up_to(256 if fused else 0))


@pytest.mark.parametrize("gate", [False, True])
def test_op_device_body_with_and_without_the_gate(gate):
    """The op's CUDA registration (allocation, gate plumbing) run on this tier's tensors: the
    kernel tests above call the launcher directly and would not see a mistake in between."""
    from fusion_compiler.ops.moe_route import _router_cuda

    c = dict(tokens=3, experts=64, n_group=1, topk_group=1, top_k=10, scoring=1, has_bias=False, renormalize=True,
             renorm_eps=0.0, scale=1.0, logits_dtype=torch.bfloat16, weights_dtype=torch.bfloat16, seed=5)
    args = router_args(c, 100, duplicate_rows=False, gate=gate)
    weights, ids, logits, gate_out = _router_cuda(*args)
    ref_w, ref_ids, ref_logits, ref_gate = moe_router_reference(*args)
    assert torch.equal(logits.cpu(), ref_logits.cpu()) and torch.equal(ids.cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights.cpu(), ref_w.cpu(), rtol=1e-2, atol=0)
    assert gate_out.shape == (3, 1 if gate else 0)
    if gate:
        torch.testing.assert_close(gate_out.cpu(), ref_gate.cpu(), rtol=1e-2, atol=0)


# ---------------------------------------------------------------------------------------------
# Routing-tail alternatives (MoeRouteConfig select / tail_loads / keys, timed by
# bench/moe_router_check.py): every test above runs ``routing_tail``'s pick for its shape (int32
# logit keys selected per warp for bf16 rows without a bias and groups, the logit in the int64
# key with a bias, tl.topk up to 256 experts), so these force the rest.
# ---------------------------------------------------------------------------------------------

# (select, tail_loads, keys; None: by shape): int64 score keys with the rounds and either source of
# the picked scores, tl.topk with the reload, then the per-warp selection over either key, and the
# logit in the int64 key.
TAIL_VARIANTS = [(0, 0, 0), (0, 1, 0), (1, 0, 0), (2, 1, 0), (2, None, None), (0, None, None), (1, 2, 0)]
TAIL_VARIANT_CASES = [
    # (fused, tokens, experts, n_group, topk_group, top_k, scoring, bias, duplicate_rows, gate)
    (True, 2, 64, 8, 4, 8, 0, True, False, False),  # DeepSeek's routing, narrow
    (True, 2, 64, 8, 4, 8, 0, True, True, False),  # ... with exact ties (experts and groups)
    (True, 2, 64, 1, 1, 10, 1, False, True, True),  # Qwen's: softmax, no bias, the gate column
    (False, 2, 48, 4, 2, 7, 1, True, False, False),  # padded groups, two launches
    (True, 1, 40, 1, 1, 20, 0, True, True, False),  # padded row, top_k 20 (K_PAD 32)
    # Rows wide enough for the per-warp selection (>= 32 lanes a warp at 4 warps; 8 for 512):
    (True, 1, 512, 1, 1, 10, 1, False, False, True),  # Qwen3.5's row and gate
    (True, 1, 256, 1, 1, 8, 0, True, True, False),  # MiniMax's, with exact ties
    (False, 2, 512, 1, 1, 10, 1, False, True, False),  # two launches: the routing kernel's 8 warps
]


@pytest.mark.nightly  # config variants: the CI tier runs each shape's pick (``routing_tail``) in every test above
@pytest.mark.parametrize("select, tail_loads, keys", TAIL_VARIANTS)
def test_router_tail_variants_match_reference(select, tail_loads, keys):
    tail = dict(select=select, tail_loads=tail_loads, keys=keys)
    for seed, (fused, tokens, experts, n_group, topk_group, top_k, scoring, bias, dup, gate) in enumerate(TAIL_VARIANT_CASES):
        c = dict(tokens=tokens, experts=experts, n_group=n_group, topk_group=topk_group, top_k=top_k, scoring=scoring,
                 has_bias=bias, renormalize=True, renorm_eps=1e-20, scale=2.5, logits_dtype=torch.bfloat16,
                 weights_dtype=torch.float32, seed=seed)
        args = router_args(c, 48, duplicate_rows=dup, gate=gate)
        if not dup:
            assert ranking_gaps_ok((moe_router_reference(*args)[2],) + args[2:8]), "near-tie input: change the seed"
        assert_router_matches_reference(args, fused_up_to(16 if fused else 0, **tail))
    # every score ties: experts and groups to the lowest indices (routing kernel alone)
    logits = torch.zeros(1, 64, dtype=torch.bfloat16, device=DEVICE)
    assert_matches_reference((logits, None, 8, 4, 2, 0, True, 0.0, 1.0, torch.float32), K.MoeRouteConfig(**tail))


@pytest.mark.parametrize("scoring", [0, 1])
def test_logit_keys_tie_semantics(scoring):
    """int32 logit keys (bf16 rows, no bias, no groups): equal logits, -0.0 and +0.0 included, tie
    to the lower index as in the reference; distinct logits whose fp32 scores are equal (softmax's
    exp underflowing to 0; sigmoid saturating to 1) go to the larger logit, where the reference
    takes the lower index: the documented difference. The weights are the same either way."""
    assert K.routing_tail(128, False, 1, torch.bfloat16)[2] == 1
    # Exact ties only: 8 ones, the rest -0.0 and +0.0 mixed; the top 24 reach 16 of the zeros.
    gen = torch.Generator().manual_seed(3)
    logits = torch.tensor([-0.0, 0.0])[torch.randint(0, 2, (2, 128), generator=gen)]
    for row in logits:
        row[torch.randperm(128, generator=gen)[:8]] = 1.0
    assert (logits == 0).sum(-1).min() > 100 and torch.signbit(logits).any(-1).all()
    assert_matches_reference((logits.to(torch.bfloat16).to(DEVICE), None, 24, 1, 1, scoring, True, 1e-20, 1.0, torch.float32))
    # Score ties between distinct logits: 4 clear winners, then 124 logits whose scores are all
    # 0.0 (softmax) or 1.0 (sigmoid, bf16 logits >= 17 give sigmoid == 1.0 in fp32).
    tail = -100.0 - torch.arange(124.0) if scoring == 1 else 20.0 + torch.arange(124.0) / 4
    head = torch.tensor([50.0, 49.0, 48.0, 47.0]) if scoring == 1 else torch.tensor([-1.0, -2.0, -3.0, -4.0])
    row = torch.cat([head, tail])[torch.randperm(128, generator=gen)].to(torch.bfloat16)
    args = (row[None].to(DEVICE), None, 8, 1, 1, scoring, False, 0.0, 1.0, torch.float32)
    weights, ids = run_kernel(args)
    ref_w, ref_ids = moe_route_reference(*args)
    torch.testing.assert_close(weights.cpu().sort(-1).values, ref_w.cpu().sort(-1).values, rtol=FP32_RTOL, atol=0)
    x = row.float()
    if scoring == 1:  # the 4 winners, then the 4 largest logits of the tied rest, in logit order
        assert torch.equal(ids.cpu()[0, :4], ref_ids.cpu()[0, :4])
        assert torch.equal(ids.cpu()[0], torch.argsort(x, descending=True, stable=True)[:8])
    else:  # all 8 picks are tied at 1.0: the 8 largest logits
        assert torch.equal(ids.cpu()[0], torch.argsort(x, descending=True, stable=True)[:8])
    assert not torch.equal(ids.cpu(), ref_ids.cpu()), "the input no longer exercises the documented difference"


# ---------------------------------------------------------------------------------------------
# GEMM-phase alternatives of the one launch (MoeRouteConfig block_k / block_e / gemv / unroll /
# w_hints / gemm_warps / gemm_stages and target_programs / max_split, timed by
# bench/moe_router_check.py --parts gemm): each setting against the reference (exact inputs, so
# bit-equal logits whatever the split or the summation order).
# ---------------------------------------------------------------------------------------------

GEMM_VARIANTS = {
    # many programs: 19 splits of 16 columns (300 = 19 x 16 - 4), more partials in the tail
    "programs_512": {"target_programs": 512, "max_split": 32},
    # wide tiles, 3 steps per split, the loop unrolled, weight-load hints, launch options
    # (.cg with an eviction policy is not PTX: ptxas rejects ".evict_last cannot be combined with .cg")
    "wide_unrolled": {"block_k": 32, "block_e": 32, "target_programs": 8, "unroll": True,
                      "w_hints": (".cg", ""), "gemm_warps": 8, "gemm_stages": 2},
    # one step per program (span 128: 3 splits, the last partly masked)
    "span": {"block_k": 0, "target_programs": 8},
    # the GEMV body at one token (the dot above it), 2 steps of 64
    "gemv": {"gemv": True, "target_programs": 12, "w_hints": ("", "evict_first")},
    "gemv_span": {"gemv": True, "block_k": 0, "target_programs": 16, "unroll": True},
}
GEMM_VARIANT_CASES = [
    # (tokens, experts, n_group, topk_group, top_k, scoring, bias, duplicate_rows, gate, fp32 operands)
    (1, 64, 1, 1, 10, 1, False, True, True, False),  # Qwen's routing + the gate column, exact ties
    (1, 64, 8, 4, 8, 0, True, False, False, True),  # DeepSeek's, fp32 operands (IEEE dot / fp32 GEMV)
    (3, 48, 4, 2, 7, 0, True, False, False, False),  # several tokens: the tl.dot body for every knob
]


@pytest.mark.nightly  # config variants: the CI tier runs the shipped launch shape in every router test above
@pytest.mark.parametrize("variant", list(GEMM_VARIANTS))
def test_router_gemm_variants_match_reference(variant):
    config = fused_up_to(16, **GEMM_VARIANTS[variant])
    for seed, (tokens, experts, n_group, topk_group, top_k, scoring, bias, dup, gate, fp32) in enumerate(GEMM_VARIANT_CASES):
        c = dict(tokens=tokens, experts=experts, n_group=n_group, topk_group=topk_group, top_k=top_k, scoring=scoring,
                 has_bias=bias, renormalize=True, renorm_eps=1e-20, scale=2.5,
                 logits_dtype=torch.float32 if fp32 else torch.bfloat16, weights_dtype=torch.float32, seed=seed + 20)
        args = router_args(c, 300, duplicate_rows=dup, gate=gate)
        if fp32:
            args = (args[0].float(), args[1].float()) + args[2:]
        if not dup:
            assert ranking_gaps_ok((moe_router_reference(*args)[2],) + args[2:8]), "near-tie input: change the seed"
        assert_router_matches_reference(args, config)


def test_router_gemm_variant_shapes():
    """The config's launch shapes at the models' widths (DeepSeek 7168 x 256, Qwen 4096 x 513)."""
    # shipped: one span per program, the GEMV body at one token (2 experts a program, spans up to
    # 2048), evict_last loads
    assert K.gemm_launch_config(1, 256, 7168) == (1, 2, 2048, 1, 4, 4)  # span 7168 -> 2048
    assert K.gemm_launch_config(1, 256, 3072) == (1, 2, 2048, 1, 2, 4)
    assert K.gemm_launch_config(1, 513, 4096) == (1, 2, 2048, 1, 2, 4)
    assert K.gemm_launch_config(2, 256, 7168) == (16, 16, 512, 1, 14, 4)  # the GEMV body is one token's
    assert K.gemm_launch_config(64, 256, 7168)[2:] == (64, 14, 8, 4)  # two launches: 64-column steps
    assert K.gemm_variant_meta(1)[0]["GEMV"] and not K.gemm_variant_meta(16)[0]["GEMV"]
    assert K.gemm_variant_meta(16)[0]["W_EVICT"] == "evict_last" and K.gemm_variant_meta(64)[0]["W_EVICT"] == ""
    # the register cap on the <= 16-token launch only; 0 removes it
    assert K.gemm_variant_meta(1)[1] == K.gemm_variant_meta(16)[1] == {"maxnreg": 128}
    assert K.gemm_variant_meta(64)[1] == {}
    assert K.gemm_variant_meta(1, K.MoeRouteConfig(maxnreg=0))[1] == {}
    # 64-column steps and a 16-row tl.dot at one token too
    steps = K.MoeRouteConfig(maxnreg=0, block_k=64, gemv=False)
    assert K.gemm_launch_config(1, 256, 7168, steps) == (16, 16, 64, 14, 8, 4)
    wide = K.MoeRouteConfig(maxnreg=0, gemv=False, block_k=256, block_e=32, target_programs=256, max_split=32)
    assert K.gemm_launch_config(16, 256, 7168, wide) == (16, 32, 256, 1, 28, 4)
