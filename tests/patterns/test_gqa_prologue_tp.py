"""The GQA prologue family under tensor parallelism: MiniMax's full-width QK-norm with its mean
of squares all-reduced (model_adapters/reference/minimax_m2.py ``rms_norm_tp``, vLLM's
``MiniMaxText01RMSNormTP.forward_qk``), on CPU with gloo, or with NCCL on two GPUs where the
machine has them (each rank on its own GPU, the op's Triton kernel instead of its reference).
With ``FUSION_TP_ONE_GPU=1`` on a machine of one GPU, both ranks run on it and all-reduce through
gloo (which takes CUDA tensors): the same kernels and graphs, no NCCL.

- A world of 2 processes: each rank compiles a 2-layer stack of its shard of the reference
  prologue (layer 0 a bf16 cache, layer 1 an FP8 one) with the fusion backend, strict on one site
  per layer. Each layer fuses as ``minimax.paged_tp_*``, with the division after the all-reduce
  folded into the op and the two local means before it fused into one op; q and the cache bytes
  equal eager's on the same rank (the tolerances of tests/patterns/test_gqa_prologue.py),
  untouched slots keep their bytes, and the ranks' q, gathered, equal a single-rank reference's.
- A world of 1 (in this process): the guard's near misses (a divisor other than the world size,
  q reading k's all-reduced column, a max all-reduce), each a reported miss with its reason;
  vLLM's other spelling (one all-reduce per norm) fusing with the division folded; the
  "inductor" lowering of the TP variant.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

import fusion_compiler as fc
from fusion_compiler.model_adapters.reference import minimax_m2 as minimax
from fusion_compiler.verify import relative_error
from gqa_fixtures import assert_missed, compile_beside_eager, prologue_inputs

FAMILY = "gqa_prologue"
FP8 = torch.float8_e4m3fn
WORLD = 2
TOKENS = 3
CFG = dataclasses.replace(minimax.TINY, block_size=4)
SCALES = ((1.0, 1.0), (0.05, 0.02))  # layer 0's cache bf16, layer 1's FP8
POSITIONS, SLOTS = [5, 0, 17], [13, 2, 7]


# Both ranks on one GPU (gloo all-reduces CUDA tensors through the host): the kernels and compiled
# graphs of the NCCL run, on a machine that has a single GPU.
ONE_GPU = os.environ.get("FUSION_TP_ONE_GPU") == "1"


def _skip_reason() -> str | None:
    if not dist.is_available() or not dist.is_gloo_available() or minimax.funcol is None:
        return "torch.distributed with gloo is not available in this build"
    if ONE_GPU and not torch.cuda.is_available():
        return "FUSION_TP_ONE_GPU=1 needs a GPU"
    if not ONE_GPU and torch.cuda.device_count() >= WORLD and not dist.is_nccl_available():
        return f"{torch.cuda.device_count()} GPUs but no NCCL in this build"
    try:
        torch.ops._c10d_functional.all_reduce.default  # noqa: B018
    except (AttributeError, RuntimeError) as e:
        return f"functional collectives unavailable: {e}"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


class Stack(torch.nn.Module):
    """Two attention prologues (one rank's shards), each with its own caches; every layer's q."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x, table, positions, slots, caches):
        outs = []
        for layer, (k_cache, v_cache), scales in zip(self.layers, caches, SCALES):
            outs.append(layer.prologue(x, table, positions, slots, k_cache, v_cache, *scales))
            x = x * 0.5  # each layer its own input
        return outs


def _full_layers():
    """The single-rank layers every rank shards (same seed everywhere), norm weights away from 1."""
    torch.manual_seed(0)
    layers = [minimax.Attention(CFG) for _ in range(2)]
    for layer in layers:
        torch.nn.init.normal_(layer.q_norm_weight, 1.0, 0.1)
        torch.nn.init.normal_(layer.k_norm_weight, 1.0, 0.1)
    return [layer.bfloat16() for layer in layers]


def _rank_device(rank: int) -> torch.device:
    """Rank r's GPU when the machine has one per rank (NCCL), GPU 0 for both with ONE_GPU (gloo),
    else the CPU (gloo)."""
    if ONE_GPU:
        return torch.device("cuda:0")
    return torch.device(f"cuda:{rank}") if torch.cuda.device_count() >= WORLD else torch.device("cpu")


def _inputs(device="cpu"):
    torch.manual_seed(1)
    x = torch.randn(TOKENS, CFG.hidden_size, dtype=torch.bfloat16)
    tensors = (x, minimax.rope_cos_sin_cache(CFG), torch.tensor(POSITIONS), torch.tensor(SLOTS))
    return tuple(t.to(device) for t in tensors)


def _caches(kv_heads: int, rank: int, device="cpu"):
    gen = torch.Generator().manual_seed(100 + rank)
    shape = (6, CFG.block_size, kv_heads, CFG.head_dim)
    dtypes = (torch.bfloat16, FP8)
    return [tuple(torch.randn(*shape, generator=gen).to(dtype).to(device) for _ in range(2)) for dtype in dtypes]


def _to_cpu(tree):
    return torch.utils._pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, tree)


def _flat(cache):
    return cache.view(-1, *cache.shape[2:])


def _decode_forward(layer, rank: int | None, device="cpu"):
    """Layer 0's whole decode step (eager): 3 sequences in a bf16 paged cache whose kv heads are
    this rank's (all of them for rank None); o_proj's partial sums all-reduced under TP."""
    x, table, _, _ = _inputs(device)
    seq_lens = torch.tensor([6, 3, 8], device=device)
    block_table = torch.tensor([[0, 1], [2, 3], [4, 5]], device=device)
    context, valid = minimax.context_of(block_table, seq_lens, CFG.block_size)
    gen = torch.Generator().manual_seed(7)
    shape = (6, CFG.block_size, CFG.num_kv_heads, CFG.head_dim)
    k_cache, v_cache = (torch.randn(*shape, generator=gen).bfloat16().to(device) for _ in range(2))
    if rank is not None:
        heads = layer.num_kv_heads
        k_cache, v_cache = (c[:, :, rank * heads : (rank + 1) * heads].contiguous() for c in (k_cache, v_cache))
    slots = context[torch.arange(3, device=device), seq_lens - 1]
    with torch.no_grad():
        out = layer(x, table, seq_lens - 1, slots, k_cache, v_cache, 1.0, 1.0, context, valid)
    # An eager functional all-reduce hands back an AsyncCollectiveTensor: wait for its values.
    return out.wait() if isinstance(out, minimax.funcol.AsyncCollectiveTensor) else out


def _rank(rank: int, port: int, out_dir: str) -> None:
    """One rank: eager and fused decode steps of its shard; results saved for the parent."""
    device = _rank_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" and not ONE_GPU else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=WORLD)  # fmt: skip
    try:
        torch.set_num_threads(1)
        start = time.perf_counter()
        model = Stack([minimax.shard(layer, rank, WORLD) for layer in _full_layers()]).to(device)
        x, table, positions, slots = _inputs(device)
        kv_heads = model.layers[0].num_kv_heads
        eager_caches, fused_caches, pristine = (_caches(kv_heads, rank, device) for _ in range(3))
        expected = {FAMILY: {"layers.0": 1, "layers.1": 1}}
        backend = fc.FusionBackend(fc.FusionConfig(strict=True, expected=expected))
        with torch.no_grad():
            eager = model(x, table, positions, slots, eager_caches)
            fused, code = fc._compat.run_and_get_code(
                lambda: torch.compile(model, backend=backend)(x, table, positions, slots, fused_caches)
            )
        report = backend.report
        torch.save(_to_cpu(dict(
            device=str(device), per_variant=report.per_variant(), misses=[s.reason for s in report.misses(FAMILY)],
            missing=report.missing_expected(), format=report.format(),
            folded_divisions=report.folded_tp_divisions(), fused_variances=report.fused_tp_variances(),
            folded_gathers=report.folded_rope_gathers(), eager=eager, fused=fused, eager_caches=eager_caches,
            fused_caches=fused_caches, pristine=pristine, code="\n".join(code), seconds=time.perf_counter() - start,
            forward=_decode_forward(model.layers[0], rank, device),
        )), os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    start = time.perf_counter()
    torch.multiprocessing.spawn(_rank, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return dict(ranks=ranks, seconds=time.perf_counter() - start)  # about 20 s on 2 CPU cores


# The world of 2 (two processes compiling: 20-60 s on 2 CPU cores) is nightly; the CI tier fuses
# the TP variant in the world of 1 below.
@pytest.mark.nightly
def test_every_rank_fuses_each_layer_with_its_all_reduce_neighbours(tp_run):
    for rank, run in enumerate(tp_run["ranks"]):
        assert run["device"] == str(_rank_device(rank))  # where the kernels ran
        assert run["misses"] == [] and run["missing"] == [], run["format"]
        assert run["per_variant"] == {"minimax.paged_tp_bf16": 1, "minimax.paged_tp_fp8": 1}, run["format"]
        assert run["folded_gathers"] == 2
        assert run["folded_divisions"] == 2 and run["fused_variances"] == 2, run["format"]
        code = run["code"]
        assert code.count("torch.ops.fusion_compiler.gqa_prologue.default(") == 2
        assert code.count("torch.ops.fusion_compiler.gqa_prologue_variance.default(") == 2
        assert code.count("_c10d_functional.all_reduce") >= 2


@pytest.mark.nightly
def test_each_rank_matches_its_eager_step(tp_run):
    for run in tp_run["ranks"]:
        for eager, fused in zip(run["eager"], run["fused"]):
            # One rounding per norm in the op, two in the HF-style norm: bf16 tolerance.
            assert relative_error(fused, eager) < 1e-2
        untouched = torch.ones(_flat(run["pristine"][0][0]).shape[0], dtype=torch.bool)
        untouched[SLOTS] = False
        for layer in range(2):
            for which in range(2):
                eager, fused = _flat(run["eager_caches"][layer][which]), _flat(run["fused_caches"][layer][which])
                pristine = _flat(run["pristine"][layer][which])
                assert torch.equal(fused[untouched].view(torch.uint8), pristine[untouched].view(torch.uint8))
                written = fused[SLOTS].float(), eager[SLOTS].float()
                if fused.dtype == FP8:  # codes one step apart at most (the norm rounds once here)
                    step = written[1].abs().clamp(min=2**-6) * 2**-2
                    assert ((written[0] - written[1]).abs() <= step).float().mean() > 0.97
                else:
                    assert relative_error(*written) < 1e-2


@pytest.mark.nightly
def test_gathered_q_equals_the_single_rank_reference(tp_run):
    """Rank r holds heads [r * H / 2, (r + 1) * H / 2): concatenated over the head dim, the
    fused TP q is the single-rank q, and the bf16 K rows are its K rows."""
    model = Stack(_full_layers())
    x, table, positions, slots = _inputs()
    caches = _caches(CFG.num_kv_heads, 0)
    with torch.no_grad():
        single = model(x, table, positions, slots, caches)
    ranks = tp_run["ranks"]
    for layer in range(2):
        gathered = torch.cat([run["fused"][layer] for run in ranks], dim=1)
        assert relative_error(gathered, single[layer]) < 1e-2
        eager_gathered = torch.cat([run["eager"][layer] for run in ranks], dim=1)
        assert relative_error(eager_gathered, single[layer]) < 1e-3  # the same math, sums in another order
    k_rows = torch.cat([_flat(run["fused_caches"][0][0])[SLOTS].float() for run in ranks], dim=1)
    assert relative_error(k_rows, _flat(caches[0][0])[SLOTS].float()) < 1e-2


@pytest.mark.nightly
def test_tp_reference_forward_equals_the_single_rank_forward(tp_run):
    """The TP reference itself: each rank's attention over its kv heads, o_proj's partial sums
    all-reduced, is the single-rank layer (eager both)."""
    single = _decode_forward(_full_layers()[0], None)
    for run in tp_run["ranks"]:
        assert relative_error(run["forward"].float(), single.float()) < 1e-2


# ------------------------------------------------------------------------------------------
# A world of 1: near misses of the guard, and one all-reduce per norm
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world_of_one():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _norm_tp(spelling: str, group):
    funcol = minimax.funcol

    def norm(q, k, qw, kw, eps):
        q32, k32 = q.float(), k.float()
        q_mean, k_mean = q32.pow(2).mean(-1, keepdim=True), k32.pow(2).mean(-1, keepdim=True)
        if spelling == "per_norm":  # vLLM's MiniMaxText01RMSNormTP._forward: one all-reduce each
            q_var = funcol.all_reduce(q_mean, "sum", group) / 1
            k_var = funcol.all_reduce(k_mean, "sum", group) / 1
        else:
            divisor = 2 if spelling == "divisor_2" else 1
            op = "max" if spelling == "max" else "sum"
            variance = funcol.all_reduce(torch.cat([q_mean, k_mean], dim=-1), op, group) / divisor
            q_var, k_var = variance.chunk(2, dim=-1)
            if spelling == "swapped":
                q_var, k_var = k_var, q_var
        q = qw * (q32 * torch.rsqrt(q_var + eps)).to(q.dtype)
        return q, kw * (k32 * torch.rsqrt(k_var + eps)).to(k.dtype)

    return norm


class TpPrologue(torch.nn.Module):
    """A paged-cache MiniMax prologue of one rank with the TP norm spelled as asked."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, q, k, v, qw, kw, table, positions, k_cache, v_cache, slots):
        d = k_cache.shape[-1]
        q, k = self.norm(q, k, qw, kw, 1e-6)
        q, k = q.view(-1, q.shape[-1] // d, d), k.view(-1, k.shape[-1] // d, d)
        cos, sin = table[positions].chunk(2, dim=-1)
        q, k = minimax.rope_neox_partial(q, cos, sin, 8), minimax.rope_neox_partial(k, cos, sin, 8)
        minimax.write_cache(k_cache, slots, k, 1.0)
        minimax.write_cache(v_cache, slots, v.view(-1, *v_cache.shape[2:]), 1.0)
        return q


def _tp_near_miss(spelling: str, group, lowering: str = "triton"):
    args, caches, slots = prologue_inputs(full_weights=True, table_width=8)
    families = {"add_rms_norm": "off", "mla_prologue": "off", FAMILY: lowering}
    return compile_beside_eager(TpPrologue(_norm_tp(spelling, group)), args, caches, slots, families)




def test_one_all_reduce_per_norm_fuses_with_the_division_folded(world_of_one):
    report = _tp_near_miss("per_norm", world_of_one)
    assert report.per_variant() == {"minimax.paged_tp_bf16": 1}, report.format()
    assert report.folded_tp_divisions() == 1 and report.fused_tp_variances() == 0  # two all-reduces: means stay


def test_inductor_lowering_takes_the_tp_variant_too(world_of_one):
    """Lowering "inductor": the canonical decomposition with the divided variances; the folds,
    which rewrite the Triton op's call, leave it alone."""
    report = _tp_near_miss("forward_qk", world_of_one, lowering="inductor")
    assert report.per_variant() == {"minimax.paged_tp_bf16": 1}, report.format()
    assert report.folded_tp_divisions() == 0 and report.fused_tp_variances() == 0


def test_divisor_other_than_the_world_size_does_not_match(world_of_one):
    assert_missed(_tp_near_miss("divisor_2", world_of_one), "divided by 2", "1 ranks")


def test_q_reading_k_s_all_reduced_column_does_not_match(world_of_one):
    assert_missed(_tp_near_miss("swapped", world_of_one), "not the mean of squares of this q")


def test_max_all_reduce_does_not_match(world_of_one):
    assert_missed(_tp_near_miss("max", world_of_one), "'max', not a sum")
