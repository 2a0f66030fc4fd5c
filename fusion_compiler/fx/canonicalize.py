"""Rewrite equivalent spellings into the one form the patterns are traced in.

Real graphs say the same thing several ways: `nn.RMSNorm` reduces over `[1]` where HF
code says `[-1]`, and adds eps with `add.Scalar` where HF's `+ eps` traces to
`add.Tensor`; a 0-d constant is `scalar_tensor` in a trace and `full([])` in a graph;
`torch.topk(x, k)` and `torch.topk(x, k, dim=-1, sorted=False)` differ in
their argument lists, and `gather(1, ids)` and `gather(-1, ids)` of a 2-D tensor in a literal
(a reduction's and gather's dims are counted from the end). Without this, a pattern silently
matches one spelling and misses the other. A reshape's ``-1`` is one such spelling: ``view(-1, heads, D)`` and ``view(T, -1, D)``
are the same reshape, so a static one carries its full shape. Pattern traces go through the
same rewrite (patterns/registry.py).

A tensor-parallel norm's upcast ``x32 = x.float()`` feeds both sides of an all-reduce: the
local ``x32.pow(2).mean(-1)`` that is reduced, and ``x32 * rsqrt(variance + eps)`` after it.
A pattern of the tail alone cannot hold a node with a user outside it, so the local side gets
its own upcast (the same value; Inductor fuses each copy into its reader).

A constant negative index counts from the end: HF's sliding-window static cache, once full,
rolls its rows and writes the new token at ``torch.tensor([-1])`` (``full([1], -1)`` here),
which ``index_put`` reads as the last row. A fused write taking that -1 for a padding slot (no
write) would drop the token, so such an index becomes its non-negative equivalent.

A scatter of one index a row into a constant (HF's DeepSeek / GLM group mask with one group
kept: ``zeros_like(s).scatter_(1, idx, 1)``) is a compare with the positions, ``where(idx ==
positions, 1, 0)``. Inductor's joint graph rewrites it so (``scatter_upon_const_tensor``), torch
2.13 casting the int64 result back to the constant's dtype and torch 2.11 not; with that rewrite
turned off the scatter stays. Here a scatter becomes 2.11's compare, and a cast of such a 0/1 mask
that is read only through views by a cast to bool (``~mask.bool()``) is dropped: the three graphs,
and the patterns' traces, meet in one form.

Two spellings depend on layouts and devices, not on the math. A ``zeros_like`` of a transposed
tensor is a permuted ``full`` or a plain one, as the strides of its input fall (HF's GDN output
buffer at batch 1 and at batch 2): a constant's layout is not the model's math, so a permuted
``full`` is the ``full`` of the permuted shape. Inductor unfuses a GEMM's bias add into its
pointwise readers on the GPU only (``should_prefer_unfused_addmm``): on the CPU ``a + dt_bias``
after a Linear stays inside an ``addmm`` (an fp32 GDN gate), so an ``addmm`` read only by
pointwise ops is ``mm`` + ``add`` here too, the graph the GPU hands us.

One rewrite is device-specific: on CUDA, Inductor turns every softmax into its online form
(``prims.prepare_softmax_online`` giving max and sum) before our pass runs; a router's softmax
(one whose probabilities feed a top-k) goes back to the plain amax/exp/sum form the patterns
are traced in. Other softmaxes keep the online form.
"""

from __future__ import annotations

import operator

import torch

from .graph_walk import val_shape

aten = torch.ops.aten
prims = torch.ops.prims

_REDUCTIONS = (aten.mean.dim, aten.sum.dim_IntList, aten.amax.default)
# Ops whose second argument is a dim (a reduction's list of them, gather's one), counted from the
# end here: HF's MiniMax-M2 router gathers at gather(1, ids), Laguna's at gather(-1, ids).
_DIM_OPS = (*_REDUCTIONS, aten.gather.default)


def canonicalize(graph: torch.fx.Graph) -> int:
    """Returns the number of nodes rewritten."""
    changed = _one_placeholder_per_symbol(graph)
    wrapped: dict = {}
    online = _online_softmax_op()
    online_softmaxes = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if online is not None and node.target is online:
            online_softmaxes.append(node)
        elif node.target is aten.add.Scalar and len(node.args) == 2 and not node.kwargs:
            node.target = aten.add.Tensor
            changed += 1
        elif node.target in _DIM_OPS and len(node.args) > 1:
            changed += _negative_dims(node)
        elif node.target is aten.topk.default:
            changed += _full_topk(node)
        elif node.target in (aten.reshape.default, aten.view.default) and len(node.args) == 2:
            changed += _static_shape(node)
        elif node.target is aten.index_put.default and len(node.args) >= 3:
            changed += _unsqueezed_put_values(node) + _wrapped_constant_indices(graph, node, wrapped)
        elif node.target is prims.convert_element_type.default and len(node.users) > 1:
            changed += _own_upcast_before_collective(node)
        elif node.target is prims.convert_element_type.default and _is_where_of_0_1(node.args[0]):
            changed += _cast_of_a_mask_read_as_bool(node)
        elif node.target is aten.permute.default and getattr(node.args[0], "target", None) is aten.full.default:
            changed += _permuted_full(node)
        elif node.target is aten.addmm.default and not node.kwargs:
            changed += _unfused_bias(node)
        elif node.target in (aten.scatter.value, aten.scatter_.value) and len(node.args) == 4 and not node.kwargs:
            changed += _scatter_upon_constant(node)
        elif node.target is aten.scalar_tensor.default and len(node.args) == 1:
            # What masked_fill(x, m, float) decomposes to in a pattern trace; real graphs
            # already carry it as a 0-d full (Inductor's own rewrite).
            node.target = aten.full.default
            node.args = ([], node.args[0])
            node.kwargs = {**node.kwargs, "pin_memory": False}
            changed += 1
    for node in online_softmaxes:
        changed += _plain_router_softmax(node)
    return changed


def _one_placeholder_per_symbol(graph: torch.fx.Graph) -> int:
    """Every use of a size symbol names its first placeholder. Dynamo can pass one symbol (the
    batch, s16) in through several SymInt placeholders; a pattern's re-trace with the site's
    shapes has one per symbol, so a `full([arg0_1, 4])` beside an `expand(x, [arg13_1, ...])`
    of the same s16 was "a repeated pattern that differs" and every site was refused at every
    batch after the first (dynamic shapes). The same symbol is the same value at run time."""
    first: dict[object, torch.fx.Node] = {}
    changed = 0
    for node in graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.SymInt) or not node.users:
            continue
        expr = val.node.expr
        if expr in first:
            node.replace_all_uses_with(first[expr])
            changed += 1
        else:
            first[expr] = node
    return changed


def _unsqueezed_put_values(node: torch.fx.Node) -> int:
    """``index_put(x, [i], v.reshape(shape))`` where the reshape only drops leading size-1 dims:
    ``v`` broadcasts to the same rows. A one-row write (decode at batch 1) is traced with that
    reshape; the same write at batch 2 is not."""
    values = node.args[2]
    if getattr(values, "target", None) not in (aten.reshape.default, aten.view.default):
        return 0
    source = values.args[0]
    before, after, target = (val_shape(n) for n in (source, values, node.args[0]))
    if None in (before, after, target) or len(before) <= len(after) or len(before) > len(target):
        return 0
    extra = len(before) - len(after)
    if tuple(before[extra:]) != tuple(after) or any(size != 1 for size in before[:extra]):
        return 0
    node.args = (node.args[0], node.args[1], source, *node.args[3:])
    return 1


def _wrapped_constant_indices(graph: torch.fx.Graph, node: torch.fx.Node, wrapped: dict) -> int:
    """``index_put(x, [..., full(shape, c), ...], v)`` with an integer ``c < 0``: the same write at
    ``c + size`` (``size`` the indexed dim's, when static and ``-size <= c``). The new ``full``
    is shared by every write that shared the old one at that size (``wrapped``: (old node,
    size) -> new node), as HF's K and V writes share theirs: a pattern of both binds one index."""
    target, indices = val_shape(node.args[0]), list(node.args[1])
    changed = 0
    for dim, index in enumerate(indices):
        if getattr(index, "target", None) is not aten.full.default or target is None or dim >= len(target):
            continue
        fill, size = index.args[1], target[dim]
        if not (isinstance(fill, int) and not isinstance(fill, bool) and isinstance(size, int) and -size <= fill < 0):
            continue
        if (index, size) not in wrapped:
            with graph.inserting_after(index):
                new = graph.call_function(aten.full.default, (index.args[0], fill + size), dict(index.kwargs))
            new.meta = {**index.meta}
            if "val" in index.meta:
                new.meta["val"] = torch.full_like(index.meta["val"], fill + size)
            wrapped[index, size] = new
        indices[dim] = wrapped[index, size]
        changed += 1
    if changed:
        node.args = (node.args[0], indices, *node.args[2:])
    return changed


def _scatter_upon_constant(node: torch.fx.Node) -> int:
    """``scatter(full(shape, b), dim, idx, v)`` with ``idx`` of size 1 at ``dim`` and the full
    size elsewhere, ``b`` and ``v`` numbers: ``where(idx.expand(shape) == positions, v, b)``, the
    nodes Inductor's joint-graph rewrite leaves, cast to the constant's dtype unless that cast
    only feeds a ``.bool()``."""
    full, dim, index, value = node.args
    if getattr(full, "target", None) is not aten.full.default or len(full.args) != 2 or len(full.users) != 1:
        return 0
    shape, background = full.args
    index_val, out_val = index.meta.get("val") if isinstance(index, torch.fx.Node) else None, node.meta.get("val")
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (background, value))
    if not (numbers and isinstance(index_val, torch.Tensor) and isinstance(out_val, torch.Tensor)
            and isinstance(shape, (list, tuple)) and index_val.dim() == len(shape)):  # fmt: skip
        return 0
    dim = dim + len(shape) if dim < 0 else dim
    if index_val.shape[dim] != 1 or any(index_val.shape[d] != out_val.shape[d] for d in range(len(shape)) if d != dim):
        return 0
    device = full.kwargs.get("device", out_val.device)
    scalar_dtype = torch.int64 if all(isinstance(x, int) for x in (background, value)) else torch.get_default_dtype()
    positions = [shape[dim] if d == dim else 1 for d in range(len(shape))]  # the graph's own size at dim
    graph = node.graph

    def add(target, args, kwargs, val):
        with graph.inserting_before(node):
            new = graph.call_function(target, args, kwargs)
        new.meta = {"val": val, **{k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}}
        return new

    expand = add(aten.expand.default, (index, list(shape)), {}, index_val.expand(out_val.shape))
    length = out_val.shape[dim]
    iota = add(prims.iota.default, (shape[dim],),
               {"start": 0, "step": 1, "dtype": torch.int64, "device": device, "requires_grad": False},
               index_val.new_empty((length,), dtype=torch.int64))  # fmt: skip
    view = add(aten.reshape.default, (iota, positions), {},
               iota.meta["val"].view([length if d == dim else 1 for d in range(len(shape))]))  # fmt: skip
    hit = add(aten.eq.Tensor, (expand, view), {}, out_val.new_empty(out_val.shape, dtype=torch.bool))
    scalar = {"dtype": scalar_dtype, "layout": torch.strided, "device": device, "pin_memory": False}
    one = add(aten.full.default, ([], value), scalar, out_val.new_empty((), dtype=scalar_dtype))
    zero = add(aten.full.default, ([], background), scalar, out_val.new_empty((), dtype=scalar_dtype))
    where = add(aten.where.self, (hit, one, zero), {}, out_val.new_empty(out_val.shape, dtype=scalar_dtype))
    result = where
    if out_val.dtype != scalar_dtype:
        result = add(prims.convert_element_type.default, (where, out_val.dtype), {}, out_val)
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    graph.erase_node(full)
    if result is not where:
        _cast_of_a_mask_read_as_bool(result)
    return 1


# What a mask passes through between its cast and its ``.bool()``: reshapes and copies of it.
_MASK_VIEWS = (aten.unsqueeze.default, aten.expand.default, aten.reshape.default, aten.view.default,
               aten.clone.default, aten._unsafe_view.default, aten.permute.default)  # fmt: skip


def _is_where_of_0_1(node) -> bool:
    """``where(c, 1, 0)`` (either order) of integer 0-d constants: a 0/1 mask."""
    if getattr(node, "target", None) is not aten.where.self or len(node.args) != 3:
        return False
    values = []
    for branch in node.args[1:]:
        if getattr(branch, "target", None) is not aten.full.default or list(branch.args[0]) != []:
            return False
        values.append(branch.args[1])
    return sorted(values) == [0, 1] and all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _cast_of_a_mask_read_as_bool(node: torch.fx.Node) -> int:
    """``convert_element_type(where(c, 1, 0), D)`` whose every reader, through ``_MASK_VIEWS``,
    is a cast to bool: the same booleans without it. The views keep their shapes and take the
    mask's dtype."""
    mask = node.args[0]
    views, frontier, to_bool = [], [node], 0
    while frontier:
        for user in frontier.pop().users:
            if user.target is prims.convert_element_type.default and user.args[1] is torch.bool:
                to_bool += 1
            elif user.target in _MASK_VIEWS and user.args[0] in (node, *views):
                views.append(user)
                frontier.append(user)
            else:
                return 0
    if not to_bool:
        return 0
    dtype = getattr(mask.meta.get("val"), "dtype", None)
    for view in views:
        val = view.meta.get("val")
        if isinstance(val, torch.Tensor) and dtype is not None:
            view.meta["val"] = val.to(dtype)
            view.meta.pop("tensor_meta", None)
    node.replace_all_uses_with(mask)
    node.graph.erase_node(node)
    return 1


def reshape_sizes(shape) -> list | None:
    """A reshape's sizes for an output of ``shape`` that name no symbol: the shape itself when
    static, -1 at its one symbolic dim, None with two or more (a pass building a reshape then
    needs the graph's own size nodes)."""
    symbolic = [i for i, size in enumerate(shape) if not isinstance(size, int)]
    if len(symbolic) > 1:
        return None
    return [-1 if i in symbolic else size for i, size in enumerate(shape)]


def _static_shape(node: torch.fx.Node) -> int:
    shape, val = node.args[1], node.meta.get("val")
    if not isinstance(shape, (list, tuple)) or not isinstance(val, torch.Tensor):
        return 0
    if all(isinstance(size, int) for size in val.shape):
        if -1 not in shape:
            return 0
        node.args = (node.args[0], list(val.shape))
        return 1
    # Dynamic, one symbolic dim: the output's shape with -1 there. Dynamo hands the same symbol
    # in through several placeholders (HF's `view(-1, E)` became `reshape(x, [arg13_1, E])`
    # while the `zeros_like` beside it sized itself by `arg0_1`, both s16), and Inductor's
    # re-trace of a match binds one name per symbol: it refused DeepSeek's router and Qwen3.5's
    # GDN core at every batch after the first. -1 names no placeholder.
    canonical = reshape_sizes(val.shape)
    if canonical is None or len(shape) != val.dim() or list(shape) == canonical:
        return 0
    node.args = (node.args[0], canonical)
    return 1


def _all_reduce_op():
    try:
        return torch.ops._c10d_functional.all_reduce.default
    except (AttributeError, RuntimeError):  # torch built without distributed
        return None


def _reaches_all_reduce(node: torch.fx.Node, hops: int) -> bool:
    """Whether an all-reduce reads node within ``hops`` users (pow -> mean [-> cat] -> all_reduce)."""
    target, frontier = _all_reduce_op(), [node]
    for _ in range(hops):
        if target is None or not frontier:
            return False
        if any(n.target is target for n in frontier):
            return True
        frontier = [u for n in frontier for u in n.users]
    return any(n.target is target for n in frontier)


def _own_upcast_before_collective(node: torch.fx.Node) -> int:
    """Readers of a shared upcast that lead into an all-reduce get a copy of their own, when
    other readers (the normalised tail) remain on the original."""
    before = [u for u in node.users if _reaches_all_reduce(u, 3)]
    if not before or len(before) == len(node.users):
        return 0
    graph = node.graph
    with graph.inserting_after(node):
        copy = graph.call_function(node.target, node.args, dict(node.kwargs))
    copy.meta = dict(node.meta)
    for user in before:
        user.replace_input_with(node, copy)
    return 1


def _online_softmax_op():
    prims = torch.ops.prims
    return prims.prepare_softmax_online.default if hasattr(prims, "prepare_softmax_online") else None


def _plain_router_softmax(node: torch.fx.Node) -> int:
    """(max, sum) = prepare_softmax_online(x, dim); exp(x - max) / sum -> topk  becomes
    amax(x, [dim], True); e = exp(x - amax); e / sum(e, [dim], True) -> topk."""
    x, dim = node.args[:2]
    items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    if len(items) != len(node.users) or set(items) != {0, 1}:
        return 0
    top, total = items[0], items[1]
    sub = next((u for u in top.users if u.target is aten.sub.Tensor and u.args == (x, top)), None)
    exp = next((u for u in sub.users if u.target is aten.exp.default), None) if sub is not None else None
    probs = [u for u in total.users if u.target is aten.div.Tensor and u.args == (exp, total)]
    if exp is None or not any(v.target is aten.topk.default for p in probs for v in p.users):
        return 0
    graph = node.graph
    with graph.inserting_before(sub):
        amax = graph.call_function(aten.amax.default, (x, [dim], True))
    with graph.inserting_after(exp):
        summed = graph.call_function(aten.sum.dim_IntList, (exp, [dim], True))
    amax.meta, summed.meta = dict(top.meta), dict(total.meta)
    top.replace_all_uses_with(amax)
    total.replace_all_uses_with(summed)
    for dead in (top, total, node):
        graph.erase_node(dead)
    _negative_dims(amax)
    _negative_dims(summed)
    return 1


def _permuted_full(node: torch.fx.Node) -> int:
    """permute(full(sizes, v), dims) -> full(sizes permuted, v): the same values."""
    full, dims = node.args[0], node.args[1]
    sizes = full.args[0]
    if len(full.args) != 2 or not isinstance(sizes, (list, tuple)) or len(dims) != len(sizes):
        return 0
    node.target = aten.full.default
    node.args = ([sizes[d] for d in dims], full.args[1])
    node.kwargs = dict(full.kwargs)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        node.meta["val"] = val.contiguous()
    if not full.users:
        node.graph.erase_node(full)
    return 1


def _unfused_bias(node: torch.fx.Node) -> int:
    """addmm(bias, x, w) read only by pointwise ops -> add(mm(x, w), bias), as Inductor leaves it
    on the GPU (where the add fuses into its readers)."""
    readers = list(node.users)
    pointwise = all(isinstance(u.target, torch._ops.OpOverload) and torch.Tag.pointwise in u.target.tags
                    for u in readers)  # fmt: skip
    if len(node.args) != 3 or not readers or not pointwise:
        return 0
    bias, x, w = node.args
    graph = node.graph
    with graph.inserting_before(node):
        mm = graph.call_function(aten.mm.default, (x, w))
    mm.meta = dict(node.meta)
    node.target, node.args = aten.add.Tensor, (mm, bias)
    return 1


def _full_topk(node: torch.fx.Node) -> int:
    """topk(x, k, dim, largest, sorted) with every argument given, dim negative, and
    sorted=True: "unsorted" allows any order, so sorted is one valid result of it."""
    names = ("self", "k", "dim", "largest", "sorted")
    defaults = {"dim": -1, "largest": True, "sorted": True}
    values = dict(zip(names, node.args))
    values.update(node.kwargs)
    source = values["self"]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    dim = values.get("dim", -1)
    if value is not None and dim >= 0:
        dim -= value.dim()
    full = (source, values["k"], dim, values.get("largest", defaults["largest"]), True)
    if full == tuple(node.args) and not node.kwargs:
        return 0
    node.args, node.kwargs = full, {}
    return 1


def _negative_dims(node: torch.fx.Node) -> int:
    """The dim argument (a list of dims, or one) counted from the end of the input's rank."""
    source = node.args[0]
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    dims = node.args[1]
    if value is None or not isinstance(dims, (int, list, tuple)):
        return 0
    single = isinstance(dims, int)
    given = [dims] if single else list(dims)
    negative = [d - value.dim() if d >= 0 else d for d in given]
    if negative == given:
        return 0
    node.args = (source, negative[0] if single else negative, *node.args[2:])
    return 1
