"""The Triton mla_kv_prologue kernel against the op's plain-torch reference.

CPU tier: the launcher runs on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py sets it
before this module imports the kernel); the op's CPU dispatch runs the reference, so the tests
call ``mla_kv_prologue_fwd`` directly with outputs allocated from ``output_shapes``.  With CUDA
present the same tests run on the GPU; the ``gpu``-marked tests add NaN propagation (the
interpreter's reductions drop NaN) and the real DeepSeek V3.2 sizes.

Tolerances: the kernel does the reference's fp32 math step by step, so outputs are mostly
bit-identical.  The one source of difference is the order of the fp32 sums in the norms
(torch's vectorised reduction vs the kernel's tree): rstd may differ in its last bit, which can
flip the rounding of a bf16 output at a tie, and an FP8 code (or a scale, if that value is the
group's amax) downstream of it.  So a few elements may differ, by one bf16 ulp / one FP8 code.
"""

from __future__ import annotations

import pytest
import torch

from kernel_fixtures import DEVICE, FP8, HAS_CUDA, INT_VIEW, _few, assert_fp8_close, assert_guards_untouched, poisoned, skip_unless_kernels_can_run

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402
from hypothesis_profile import examples  # noqa: E402

skip_unless_kernels_can_run()

from fusion_compiler.kernels import mla_kv_prologue as K  # noqa: E402
from fusion_compiler.ops import mla_kv_prologue as op  # noqa: E402
from fusion_compiler.verify import relative_error  # noqa: E402
from launch_counter import count_launches  # noqa: E402



# ---------------------------------------------------------------------------------------------
# Comparison helpers
# ---------------------------------------------------------------------------------------------


def assert_float_close(out, ref, what):
    assert out.shape == ref.shape and out.dtype == ref.dtype, (what, out.shape, ref.shape)
    if out.dtype == torch.float32:
        # fp32 outputs carry rstd's last-bit difference in every element: a few ulps of the
        # values before a cancellation (LayerNorm's bias, RoPE), hence the row-scale atol.
        scale = float(ref.abs().nan_to_num(0.0, 0.0, 0.0).max()) if ref.numel() else 0.0
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * scale + 1e-30, equal_nan=True,
                                   msg=lambda m: f"{what}: {m}")
        return
    same = out.contiguous().view(INT_VIEW[out.dtype]) == ref.contiguous().view(INT_VIEW[ref.dtype])
    same |= torch.isnan(out) & torch.isnan(ref)
    n_diff = int((~same).sum())
    assert n_diff <= _few(out.numel()), f"{what}: {n_diff} of {out.numel()} elements differ"
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def assert_scales_close(out, ref, what):
    assert_float_close(out, ref, what)




def random_bytes(shape, gen):
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


def guarded_cache(lead, row_bytes, dtype, gen):
    """A contiguous cache of random bytes, a view into a buffer with one guard row on each side
    (a store at slot -1 would land in the first one); ``cache.guarded_buffer`` is the buffer."""
    rows = 1
    for n in lead:
        rows *= n
    buf = random_bytes((rows + 2, row_bytes), gen).to(DEVICE)
    cache = buf[1:-1].view(dtype).view(lead + (row_bytes // dtype.itemsize,))
    cache.guarded_buffer = buf
    return cache


# ---------------------------------------------------------------------------------------------
# One case: build inputs, run kernel and reference, compare everything
# ---------------------------------------------------------------------------------------------


def build_args(cfg, gen):
    """Op arguments for a config dict (CPU tensors moved to DEVICE at the end)."""
    T, dt = cfg["tokens"], cfg["dtype"]
    qr, kr, rot, d = cfg["q_width"], cfg["kv_width"], cfg["rot"], cfg["index_dim"]

    def randn(*shape, dtype=dt, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    w_dt = cfg["weight_dtype"] or dt
    # q_c / kv_c / k_pe: column slices of one GEMM output (row stride > width).
    gemm = randn(T, qr + kr + rot + 5)
    args = dict(zip(op._ARG_NAMES, op.mla_kv_prologue_reference.__defaults__))
    if cfg["q"]:
        args.update(q_c=gemm[:, :qr], q_weight=randn(qr, dtype=w_dt) + 1.0,
                    q_eps=1e-6, q_quant_group=cfg["q_group"], q_ue8m0=cfg["q_ue8m0"])
    if cfg["kv"]:
        args.update(kv_c=gemm[:, qr:qr + kr], k_pe=gemm[:, qr + kr:qr + kr + rot],
                    kv_weight=randn(kr, dtype=w_dt) + 1.0, kv_eps=1e-5,
                    deinterleave_rope=cfg["deinterleave"], return_kv=cfg["return_kv"])
    if cfg["index_k"]:
        index_k = randn(T, d + 3, scale=2.0)[:, :d] + 0.5
        args.update(index_k=index_k, index_k_weight=randn(d, dtype=w_dt) + 1.0,
                    index_k_bias=randn(d, dtype=w_dt, scale=0.1) if cfg["bias"] else None,
                    index_k_eps=1e-6, return_index_k=cfg["return_index_k"])
    if cfg["kv"] or cfg["index_k"]:
        cs_dt = cfg["cos_dtype"] or dt
        rows = 13 if cfg["positions"] else T
        # Tables with a row stride wider than rot/2.
        args["cos"] = randn(rows, rot // 2 + 2, dtype=cs_dt)[:, : rot // 2]
        args["sin"] = randn(rows, rot // 2 + 2, dtype=cs_dt)[:, : rot // 2]
        if cfg["positions"]:
            args["positions"] = torch.randint(0, rows, (T,), generator=gen).to(cfg["positions"])
    num_slots = 2 * T + 3
    latent = cfg["kv"] and cfg["latent"]
    index_cache = cfg["index_k"] and cfg["index_cache"]
    if latent or index_cache:
        perm = torch.randperm(num_slots, generator=gen)[:T]
        pad = torch.rand(T, generator=gen) < 0.3
        args["slots"] = torch.where(pad, -1, perm).to(cfg["slots_dtype"])
        lead = (num_slots,) if cfg["flat_cache"] else (num_slots // 3 + 1, 3)
        if latent == "fp8":
            width = op.latent_cache_width(kr, rot, torch.uint8)
            args["latent_cache"] = guarded_cache(lead, width, torch.uint8, gen)
        elif latent == "same":
            width = op.latent_cache_width(kr, rot, dt)
            args["latent_cache"] = guarded_cache(lead, width * dt.itemsize, dt, gen)
        if index_cache:
            args["index_cache"] = guarded_cache(lead, d + 4, torch.uint8, gen)
        args["cache_ue8m0"] = cfg["cache_ue8m0"]
    args["round_before_quant"] = cfg.get("round_before_quant", True)
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def clone_args(args):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def run_and_compare(args):
    ref_args = clone_args(args)
    before = clone_args(args)
    caches = [args[n] for n in ("latent_cache", "index_cache") if args[n] is not None]
    bufs_before = [c.guarded_buffer.clone() for c in caches]
    ref = op.mla_kv_prologue_reference(**ref_args)

    bufs, outs = zip(*(poisoned(shape, dtype) for shape, dtype in op.output_shapes(args)))
    K.mla_kv_prologue_fwd(args, *outs)

    names = ("q_out", "q_scale", "kv_out", "k_pe_out", "index_k_out")
    for name, buf, out, r in zip(names, bufs, outs, ref):
        assert_guards_untouched(buf)
        if out.numel() == 0:
            assert r.numel() == 0, name
        elif out.dtype == FP8:
            assert_fp8_close(out, r, name)
        else:
            assert_float_close(out, r, name)
    # Inputs unchanged (outputs never alias them).
    for name in ("q_c", "kv_c", "k_pe", "index_k", "cos", "sin", "positions", "slots"):
        if args[name] is not None:
            assert torch.equal(args[name], before[name]), name

    for cache, buf_before in zip(caches, bufs_before):  # the guard rows around each cache
        buf = cache.guarded_buffer
        assert torch.equal(buf[0], buf_before[0]) and torch.equal(buf[-1], buf_before[-1]), \
            "wrote outside the cache"
    slots = args["slots"]
    written = slots[slots >= 0].long() if slots is not None else None
    if args["latent_cache"] is not None:
        check_cache(args["latent_cache"], ref_args["latent_cache"], before["latent_cache"], written,
                    latent_fields(args))
    if args["index_cache"] is not None:
        d = args["index_k"].shape[-1]
        check_cache(args["index_cache"], ref_args["index_cache"], before["index_cache"], written,
                    [("index fp8", 0, d, FP8), ("index scale", d, d + 4, torch.float32)])


def latent_fields(args):
    kr, rot = args["kv_c"].shape[-1], args["k_pe"].shape[-1]
    cache = args["latent_cache"]
    if cache.dtype == torch.uint8:
        ng = kr // op.LATENT_GROUP
        return [("latent fp8", 0, kr, FP8), ("latent scales", kr, kr + 4 * ng, torch.float32),
                ("latent k_pe", kr + 4 * ng, kr + 4 * ng + 2 * rot, torch.bfloat16)]
    size = cache.dtype.itemsize
    return [("latent kv", 0, kr * size, cache.dtype),
            ("latent k_pe", kr * size, (kr + rot) * size, cache.dtype)]


def check_cache(cache, ref_cache, before, written, fields):
    """Rows outside ``written`` keep their random bytes; written rows match field by field."""
    rows = cache.view(-1, cache.shape[-1]).view(torch.uint8)
    ref_rows = ref_cache.view(-1, ref_cache.shape[-1]).view(torch.uint8)
    before_rows = before.view(-1, before.shape[-1]).view(torch.uint8)
    untouched = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    untouched[written] = False
    assert torch.equal(rows[untouched], before_rows[untouched]), "bytes outside the slots changed"
    got, exp = rows[written], ref_rows[written]
    covered = 0
    for name, lo, hi, dtype in fields:
        a = got[:, lo:hi].contiguous().view(dtype)
        b = exp[:, lo:hi].contiguous().view(dtype)
        if dtype == FP8:
            assert_fp8_close(a, b, name)
        else:
            assert_float_close(a, b, name)
        covered += hi - lo
    assert covered == rows.shape[1], "fields must cover the whole row"


# ---------------------------------------------------------------------------------------------
# CPU tier
# ---------------------------------------------------------------------------------------------


BASE = dict(
    tokens=3, dtype=torch.bfloat16, weight_dtype=None, cos_dtype=None,
    q=True, q_width=256, q_group=128, q_ue8m0=False,
    kv=True, kv_width=128, rot=32, deinterleave=False, return_kv=True, latent="fp8",
    index_k=True, index_dim=64, bias=True, return_index_k=True, index_cache=True,
    cache_ue8m0=False, positions=torch.int64, slots_dtype=torch.int64, flat_cache=False,
)


@st.composite
def configs(draw):
    cfg = dict(BASE)
    cfg["tokens"] = draw(st.integers(1, 9))
    all_roles = ("q", "kv", "index_k")
    roles = draw(st.sampled_from([("q",), ("kv",), ("index_k",), ("q", "kv"), ("kv", "index_k"),
                                  ("q", "index_k"), all_roles, all_roles]))
    cfg["q"], cfg["kv"], cfg["index_k"] = ("q" in roles, "kv" in roles, "index_k" in roles)
    cfg["dtype"] = draw(st.sampled_from([torch.bfloat16] * 2 + [torch.float16, torch.float32]))
    cfg["weight_dtype"] = draw(st.sampled_from([None, torch.float32]))
    cfg["cos_dtype"] = draw(st.sampled_from([None, torch.float32]))
    cfg["q_width"] = draw(st.sampled_from([256, 192]))
    cfg["q_group"] = draw(st.sampled_from([0, 64, 128] if cfg["q_width"] == 256 else [0, 64, 96]))
    cfg["q_ue8m0"] = draw(st.booleans())
    latents = ["fp8", "same", None] if cfg["dtype"] == torch.bfloat16 else ["same", None]
    cfg["latent"] = draw(st.sampled_from(latents))
    # The fp8_ds_mla layout quantises the latent in groups of 128; the other paths take any width.
    cfg["kv_width"] = draw(st.sampled_from([128, 256] if cfg["latent"] == "fp8" else [64, 96, 128, 192, 256]))
    cfg["rot"] = draw(st.sampled_from([32, 24]))
    cfg["deinterleave"] = draw(st.booleans())
    cfg["return_kv"] = draw(st.booleans())
    cfg["index_dim"] = draw(st.sampled_from([64, 48]))
    cfg["bias"] = draw(st.booleans())
    cfg["return_index_k"] = draw(st.booleans())
    cfg["index_cache"] = draw(st.booleans())
    cfg["cache_ue8m0"] = draw(st.booleans())
    cfg["round_before_quant"] = draw(st.booleans())  # False: torch 2.11's graph (see _compat)
    cfg["positions"] = draw(st.sampled_from([None, torch.int32, torch.int64]))
    cfg["slots_dtype"] = draw(st.sampled_from([torch.int32, torch.int64]))
    cfg["flat_cache"] = draw(st.booleans())
    return cfg


@settings(max_examples=examples(20), deadline=None)
@given(cfg=configs(), seed=st.integers(0, 2**16))
def test_kernel_matches_reference(cfg, seed):
    gen = torch.Generator().manual_seed(seed)
    run_and_compare(build_args(cfg, gen))


@pytest.mark.parametrize("ue8m0", [False, True])
def test_fp8_extreme_groups(ue8m0):
    """Groups whose amax is under the 1e-4 floor (subnormal / zero codes) or huge.

    With amax scaling no value is clamped except by the rounding of x / scale at the group's
    amax (x / (amax / 448) may round above 448); the floor and ue8m0 only shrink the codes.
    """
    gen = torch.Generator().manual_seed(7)
    cfg = dict(BASE, tokens=4, q_ue8m0=ue8m0, cache_ue8m0=ue8m0, q_width=256, q_group=64)
    args = build_args(cfg, gen)
    w = torch.ones(256, dtype=torch.float32)
    w[:64] = 3e-9         # q group 0: |normed| ~ 1e-8, far under the amax floor
    w[64:128] = 1e-5      # group 1: just under the floor
    w[128:192] = 3e30     # group 2: huge values
    args["q_weight"] = w.to(torch.bfloat16).to(DEVICE)
    kvw = torch.ones(128, dtype=torch.float32)
    kvw[:64] = 2e-6
    kvw[64:] = 1e30
    args["kv_weight"] = kvw.to(torch.bfloat16).to(DEVICE)
    args["index_k_weight"] = torch.full((64,), 1e-6, dtype=torch.bfloat16, device=DEVICE)
    args["index_k_bias"] = None
    args["slots"] = torch.tensor([5, -1, 0, 2], dtype=torch.int64, device=DEVICE)
    run_and_compare(args)
    _, outs = zip(*(poisoned(s, d) for s, d in op.output_shapes(args)))
    K.mla_kv_prologue_fwd(args, *outs)
    codes = outs[0].view(torch.uint8) & 0x7F
    # Far under the floor: |x / scale| < 2**-3 (codes below 0x20), many in the subnormal range.
    assert bool((codes[:, :64] < 0x20).all()) and bool((codes[:, :64] < 0x08).any())
    if not ue8m0:  # without ue8m0 the amax maps to the top code, 448 (0x7E)
        assert bool((codes[:, 128:192].amax(dim=-1) == 0x7E).all())


def test_absent_roles_and_unused_outputs():
    gen = torch.Generator().manual_seed(3)
    # kv role with neither return_kv nor a latent cache does nothing: not launched.
    cfg = dict(BASE, q=False, kv=True, return_kv=False, latent=None, index_k=True,
               return_index_k=False, index_cache=True)
    run_and_compare(build_args(cfg, gen))
    cfg = dict(BASE, q=True, kv=False, index_k=False, q_group=0)
    run_and_compare(build_args(cfg, gen))


def test_zero_tokens_launches_nothing():
    gen = torch.Generator().manual_seed(4)
    args = build_args(dict(BASE, tokens=1), gen)
    outs = [torch.empty(s, dtype=d, device=DEVICE) for s, d in op.output_shapes(args)]
    with count_launches() as launches:
        K.mla_kv_prologue_fwd(args, *outs)
    assert launches.names == ["_mla_kv_prologue_kernel"]  # the counter sees this launcher's kernel
    for name in ("q_c", "kv_c", "k_pe", "index_k", "cos", "sin", "positions", "slots"):
        args[name] = args[name][:0]
    caches = [args[n].clone() for n in ("latent_cache", "index_cache")]
    outs = [torch.empty(s, dtype=d, device=DEVICE) for s, d in op.output_shapes(args)]
    with count_launches() as launches:
        K.mla_kv_prologue_fwd(args, *outs)
    assert launches.names == []
    assert all(torch.equal(args[n], c) for n, c in zip(("latent_cache", "index_cache"), caches))


def _float64_kv(args):
    """The kv role's math on float64 copies of its inputs: RMSNorm of kv_c, interleaved RoPE of
    k_pe (pairs in place; HF's de-interleaved order with ``deinterleave_rope``)."""
    kv_c, k_pe, w = (args[n].cpu().double() for n in ("kv_c", "k_pe", "kv_weight"))
    kv = kv_c * torch.rsqrt((kv_c * kv_c).mean(-1, keepdim=True) + args["kv_eps"]) * w
    cos, sin = (args[n].cpu().double() for n in ("cos", "sin"))
    if args["positions"] is not None:
        cos, sin = cos[args["positions"].cpu()], sin[args["positions"].cpu()]
    even, odd = k_pe[:, 0::2], k_pe[:, 1::2]
    first, second = even * cos - odd * sin, odd * cos + even * sin
    in_place = torch.stack([first, second], dim=-1).flatten(-2)
    return kv, in_place, torch.cat([first, second], dim=-1) if args["deinterleave_rope"] else in_place


@pytest.mark.parametrize(
    "kv_width, dtype",
    [(64, torch.bfloat16), (96, torch.bfloat16), (192, torch.bfloat16), (192, torch.float32)],
)
def test_latent_of_any_width_matches_the_reference_and_float64(kv_width, dtype):
    """The bf16 (same-dtype) latent path at kv_lora_rank widths that are no multiple of 128
    (DeepSeek V3's HF code at 64): outputs poisoned, the latent cache random outside the written
    slots (padding slots included), every role in the launch; kernel = reference (a few ulps),
    and kv_out, k_pe_out and the written rows within bf16 (fp32: 2e-6) of the float64 math."""
    gen = torch.Generator().manual_seed(kv_width)
    cfg = dict(BASE, tokens=5, dtype=dtype, q_group=0 if dtype != torch.bfloat16 else 128, kv_width=kv_width,
               rot=24, latent="same", deinterleave=True, index_cache=dtype == torch.bfloat16)  # fmt: skip
    args = build_args(cfg, gen)
    args["slots"][1] = -1
    run_and_compare(args)  # kernel vs reference: outputs, guards, bytes outside the slots
    outs = [poisoned(s, d)[1] for s, d in op.output_shapes(args)]
    K.mla_kv_prologue_fwd(args, *outs)
    kv64, in_place64, pe64 = _float64_kv(args)
    tolerance = 2e-6 if dtype == torch.float32 else 1e-2
    assert relative_error(outs[2].cpu().double(), kv64) < tolerance
    assert relative_error(outs[3].cpu().double(), pe64) < tolerance
    slots = args["slots"].cpu()
    rows = args["latent_cache"].view(-1, kv_width + 24)[slots[slots >= 0]].cpu().double()
    assert relative_error(rows, torch.cat([kv64, in_place64], -1)[slots >= 0]) < tolerance


@pytest.mark.parametrize("kv_width", [64, 192])
def test_fp8_ds_mla_latent_of_another_width_is_refused_by_the_launcher(kv_width):
    """The op declines it first (tests/ops/test_mla_kv_prologue.py); the launcher never writes
    the FP8 layout's 128-wide groups over a latent that has none."""
    gen = torch.Generator().manual_seed(1)
    args = build_args(dict(BASE, q=False, index_k=False, kv_width=128), gen)
    args["kv_c"] = torch.randn(3, kv_width, dtype=torch.bfloat16, device=DEVICE)
    args["kv_weight"] = torch.ones(kv_width, dtype=torch.bfloat16, device=DEVICE)
    outs = [torch.empty(s, dtype=d, device=DEVICE) for s, d in op.output_shapes(args)]
    with pytest.raises(ValueError, match="fp8_ds_mla latent cache quantises kv_c in 128-wide groups"):
        K.mla_kv_prologue_fwd(args, *outs)


def test_launch_config_real_sizes():
    cfg = K.launch_config(1536, 128, 512, 64, 128)
    assert cfg["Q_GROUPS_BLOCK"] == 16 and cfg["Q_GROUP_BLOCK"] == 128
    assert cfg["KV_GROUPS_BLOCK"] == 4 and cfg["ROT_BLOCK"] == 64 and cfg["IK_BLOCK"] == 128
    assert cfg["num_warps"] == 4
    cfg = K.launch_config(1536, 0, 512, 64, 128)
    assert cfg["Q_GROUPS_BLOCK"] == 1 and cfg["Q_GROUP_BLOCK"] == 2048
    assert cfg["KV_GROUP_BLOCK"] == 128  # the fp8_ds_mla groups: DeepSeek's 512 unchanged


@pytest.mark.parametrize("kv_width, groups, group", [(64, 1, 64), (96, 1, 128), (192, 2, 128), (320, 4, 128), (48, 1, 64)])
def test_launch_config_tiles_any_latent_width(kv_width, groups, group):
    cfg = K.launch_config(0, 0, kv_width, 64, 0)
    assert (cfg["KV_GROUPS_BLOCK"], cfg["KV_GROUP_BLOCK"]) == (groups, group)
    assert groups * group >= kv_width
    assert isinstance(K.KERNEL_VERSION, str) and K.KERNEL_VERSION


# ---------------------------------------------------------------------------------------------
# GPU tier
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("ue8m0", [False, True])
def test_gpu_nan_poisons_only_its_group(ue8m0):
    gen = torch.Generator().manual_seed(11)
    cfg = dict(BASE, tokens=4, q_width=256, q_group=64, q_ue8m0=ue8m0, cache_ue8m0=ue8m0,
               bias=False, positions=None)
    args = build_args(cfg, gen)
    args["slots"] = torch.tensor([0, 1, 2, 3], dtype=torch.int64, device=DEVICE)
    # q: the weight's NaN poisons group 1 of every token.  kv: a NaN weight in group 0.
    # index_k: a NaN in token 2's row (LayerNorm spreads it over the row = its one group).
    args["q_weight"][70] = float("nan")
    args["kv_weight"][5] = float("nan")
    args["index_k"][2, 7] = float("nan")
    outs = [torch.empty(s, dtype=d, device=DEVICE) for s, d in op.output_shapes(args)]
    K.mla_kv_prologue_fwd(args, *outs)
    q_out, q_scale = outs[0].float(), outs[1]
    assert torch.isnan(q_scale[:, 1]).all() and torch.isnan(q_out[:, 64:128]).all()
    others = torch.cat([q_scale[:, :1], q_scale[:, 2:]], 1)
    assert torch.isfinite(others).all() and torch.isfinite(q_out[:, :64]).all()
    assert torch.isfinite(q_out[:, 128:]).all()

    kr = args["kv_c"].shape[-1]
    rows = args["latent_cache"].view(-1, args["latent_cache"].shape[-1])[:4]
    codes = rows[:, :kr].contiguous().view(FP8).float()
    scales = rows[:, kr:kr + 4].contiguous().view(torch.float32)
    assert torch.isnan(scales[:, 0]).all() and torch.isnan(codes[:, :128]).all()

    d = args["index_k"].shape[-1]
    irows = args["index_cache"].view(-1, d + 4)[:4]
    iscale = irows[:, d:].contiguous().view(torch.float32)[:, 0]
    icodes = irows[:, :d].contiguous().view(FP8).float()
    assert torch.isnan(iscale[2]) and torch.isnan(icodes[2]).all()
    keep = torch.tensor([0, 1, 3], device=DEVICE)
    assert torch.isfinite(iscale[keep]).all() and torch.isfinite(icodes[keep]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 16, 256, 4096])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_gpu_real_sizes(tokens, ue8m0):
    gen = torch.Generator().manual_seed(tokens)
    cfg = dict(BASE, tokens=tokens, q_width=1536, q_group=128, q_ue8m0=ue8m0, kv_width=512,
               rot=64, index_dim=128, cache_ue8m0=ue8m0, deinterleave=True)
    run_and_compare(build_args(cfg, gen))


@pytest.mark.parametrize("tokens", [2, 5])  # with 1 token both layouts are the same tensor
def test_q_scales_column_major_as_deepgemm_reads_them(tokens):
    """q_scale_column_major: same values, stored with strides (1, T); the op returns that layout."""
    gen = torch.Generator().manual_seed(tokens)
    q_c = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    args = dict(zip(op._ARG_NAMES, op.mla_kv_prologue_reference.__defaults__))
    args.update(q_c=q_c, q_weight=torch.ones(256, dtype=torch.bfloat16, device=DEVICE), q_quant_group=128,
                q_ue8m0=True, q_scale_column_major=True)  # fmt: skip
    ref = op.mla_kv_prologue_reference(**args)
    assert ref[1].stride() == (1, tokens)
    outs = op._allocate(args, lambda shape, dtype: torch.full(shape, float("nan"), device=DEVICE).to(dtype))
    K.mla_kv_prologue_fwd(args, *outs)
    assert outs[1].stride() == (1, tokens)
    assert torch.equal(outs[1], ref[1]) and torch.equal(outs[0].view(torch.uint8), ref[0].view(torch.uint8))
    fake = op.mla_kv_prologue(**{k: v for k, v in args.items()})
    assert fake[1].stride() == (1, tokens)
