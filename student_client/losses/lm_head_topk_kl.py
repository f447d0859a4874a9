"""The losses on a distributed student's lm_head: FSDP2, tensor parallel, both (docs/scaling.md).

The losses take local tensors: logits `[..., V_local]` or an lm_head weight `[V_local, H]`,
plus the tensor-parallel group that holds the vocabulary's other shards (`process_group`).
A distributed student's lm_head weight is a `DTensor` instead:

- tensor parallel (`ColwiseParallel` on the lm_head): `Shard(0)` on the TP mesh, always
  materialised. The loss gets `weight.to_local()` `[V / tp, H]` (differentiable: the
  shard's gradient lands in the DTensor parameter) and the mesh's group.
- FSDP2 (`fully_shard(lm_head)`): outside the head's forward the weight is sharded over
  the data-parallel mesh; FSDP all-gathers it in the module's pre-forward hook and
  reduce-scatters its gradient after backward. `lm_head_topk_kl_loss` therefore runs the
  fused loss *inside the head's forward*: it registers a loss method of the head as an
  FSDP forward method (`register_fsdp_forward_method`, FSDP's public API for this), so
  FSDP's own hooks unshard the weight before the loss, all-gather it again before
  backward when it was resharded after forward (the recomputing backward of reduction
  "none" / `grad_in_forward=False` reads it), and reduce-scatter the gradient once the
  hidden states' gradient is through. Chosen over `FSDPModule.unshard()`, which would
  leave the reduce-scatter to FSDP's end-of-backward callback, queued only when another
  FSDP module's backward ran: a student whose only FSDP unit is the head would keep an
  unreduced gradient and a stale shard.
- FSDP2 + tensor parallel (a 2-D mesh): inside the forward the weight is the TP DTensor.

A DTensor handed to the losses directly raises a `ValueError` naming these fixes
(`validation.check_local_tensor`); nothing computes against a shard silently.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch.distributed as dist
from torch import Tensor, nn

from student_client.losses.input_checks import dtensor_type
from student_client.losses.linear_topk_kl import linear_topk_kl_loss
from student_client.losses.options import LossOptions, loss_options
from student_client.losses.teacher import TeacherTargets
from student_client.losses.types import TopKKLStats

__all__ = [
    "HeadCall",
    "LMHead",
    "head_topk_kl_loss",
    "in_fsdp_forward",
    "lm_head_topk_kl_loss",
    "local_vocab_shard",
]

T = TypeVar("T")

_LOSS_METHOD = "_topk_distill_fused_loss"
"""Name of the loss method attached to an FSDP lm_head (registered as a forward method)."""


def _group_ranks(group: Any) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def local_vocab_shard(tensor: Tensor, process_group: Any, *, name: str, dim: int) -> Tensor:
    """The local vocabulary shard of `tensor` for the losses.

    Args:
        tensor: a plain tensor (returned as is: already local) or a DTensor sharded along
            `dim` (the vocabulary dim: 0 for an lm_head weight `[V, H]` / bias `[V]`, -1
            for logits `[..., V]`) on a 1-D mesh whose ranks are `process_group`'s.
        process_group: the tensor-parallel group passed on to the loss.
        name: the argument's name, for errors.
        dim: the vocabulary dim.

    Returns:
        `tensor.to_local()` (`[V / tp, H]`, `[..., V / tp]`), differentiable.

    Raises:
        ValueError: a DTensor without `process_group`, on another mesh, with another
            placement, or with a vocabulary that does not split evenly.
    """
    dtensor = dtensor_type()
    if dtensor is None or not isinstance(tensor, dtensor):
        return tensor
    sharded_tensor: Any = tensor  # a DTensor (mypy cannot narrow to a runtime type)
    mesh = sharded_tensor.device_mesh
    placements = tuple(sharded_tensor.placements)
    where = f"{name}: a DTensor with placements {placements} on a mesh of shape {tuple(mesh.shape)}"
    if process_group is None:
        raise ValueError(
            f"{where} and no process_group: tensor parallel: pass process_group=<the TP "
            f"group> (tp_mesh.get_group()); FSDP2: fully_shard(lm_head) the head module "
            f"itself, so that lm_head_topk_kl_loss runs inside its unshard"
        )
    vocab_dim = dim % tensor.dim()
    sharded = (
        mesh.ndim == 1
        and len(placements) == 1
        and placements[0].is_shard()
        and getattr(placements[0], "dim", None) in (dim, vocab_dim)
    )
    if not sharded:
        raise ValueError(
            f"{where}: only a vocabulary-sharded tensor (ColwiseParallel: Shard({dim}) on a "
            f"1-D tensor-parallel mesh) is supported; a 2-D (FSDP x TP) weight must be "
            f"used inside the FSDP unshard (lm_head_topk_kl_loss on a fully_shard(lm_head))"
        )
    mesh_ranks, group_ranks = _group_ranks(mesh.get_group()), _group_ranks(process_group)
    if mesh_ranks != group_ranks:
        raise ValueError(
            f"{where}: its mesh holds ranks {mesh_ranks}, process_group ranks {group_ranks}; "
            f"pass the lm_head's TP group (an FSDP-sharded weight outside its unshard? "
            f"fully_shard(lm_head) and call lm_head_topk_kl_loss)"
        )
    vocab, world = tensor.shape[vocab_dim], mesh.size()
    if vocab % world:
        raise ValueError(
            f"{where}: vocabulary {vocab} does not split evenly over {world} ranks; the "
            f"losses need equal shards (pad the vocabulary to a multiple of {world})"
        )
    return cast(Tensor, sharded_tensor.to_local())


class HeadCall:
    """The teacher value and options of one loss call, handed through an FSDP forward
    method. A plain class, not a dataclass or a tuple: FSDP's forward hooks look into
    those and cast their float tensors under a mixed-precision policy, and the teacher's
    log-probs must reach the loss as given (`TeacherTargets` is a plain class too)."""

    __slots__ = ("options", "teacher")

    def __init__(self, teacher: TeacherTargets, options: LossOptions) -> None:
        self.teacher = teacher
        self.options = options


def _fused_loss_on(head: nn.Module, hidden: Tensor, call: HeadCall) -> tuple[Tensor, TopKKLStats]:
    """The fused loss on `head`'s (local, unsharded) weight and bias."""
    group = call.options.process_group
    weight = local_vocab_shard(cast(Tensor, head.weight), group, name="weight", dim=0)
    bias = getattr(head, "bias", None)
    if bias is not None:
        bias = local_vocab_shard(bias, group, name="bias", dim=0)
    return linear_topk_kl_loss(hidden, weight, bias, call.teacher, call.options)


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


def in_fsdp_forward(module: nn.Module, name: str, fn: Callable[..., T]) -> Callable[..., T]:
    """`fn(module, ...)` as a callable; when `module` is an FSDP2 unit (`fully_shard`), run
    as its forward method `name` (registered once, `register_fsdp_forward_method`): FSDP's
    hooks unshard its parameters before `fn` and reduce-scatter their gradients after
    backward, as around `module.forward`. Arguments FSDP must not touch (cast, move) go in
    a :class:`HeadCall`."""
    fsdp_module = _fsdp_module_type()
    if fsdp_module is None or not isinstance(module, fsdp_module):
        return functools.partial(fn, module)
    method = module.__dict__.get(name)
    if method is None:
        from torch.distributed.fsdp import register_fsdp_forward_method

        object.__setattr__(module, name, types.MethodType(fn, module))
        register_fsdp_forward_method(module, name)
        method = module.__dict__[name]
    return cast(Callable[..., T], method)


def head_topk_kl_loss(
    head: nn.Module, hidden: Tensor, call: HeadCall
) -> tuple[Tensor, TopKKLStats]:
    """`lm_head_topk_kl_loss` with its arguments in a :class:`HeadCall`: inside the head's
    forward when the head is an FSDP2 unit, else on its weight as it is."""
    return in_fsdp_forward(head, _LOSS_METHOD, _fused_loss_on)(hidden, call)


LMHead = nn.Module | Tensor | tuple[Tensor, Tensor | None]
"""The lm_head path's head: a linear module (plain, FSDP2, TP), its `[V_local, H]` weight,
or `(weight, bias)`."""


def lm_head_topk_kl_loss(
    head: LMHead,
    hidden: Tensor,
    teacher: TeacherTargets,
    options: LossOptions | None = None,
) -> tuple[Tensor, TopKKLStats]:
    """`topk_kl_loss(hidden @ weight.T + bias, teacher, options)` without ever forming the
    logits: the same math, options, validation, statistics and return value, with the
    logits computed chunk by chunk and multiplied straight into the gradients of
    `hidden`, `weight` and `bias` (`kernels/fused.py`).

    Args:
        head: the lm_head: a linear layer (`weight` `[V, H]`, optional `bias` `[V]`),
            plain, `fully_shard`-ed itself (FSDP2: the loss runs inside its forward, see
            the module docstring), `ColwiseParallel`-ed (TP), or both; or its weight
            `[V_local, H]` as a tensor, or `(weight, bias)` (`bias` `[V_local]` or None).
            Under `process_group` a tensor weight is this rank's vocabulary shard (rank
            `r`: rows for ids `[r * V_local, (r + 1) * V_local)`).
        hidden: last hidden states `[..., H]`: float32, bfloat16, float16 (float64 for
            checks), same dtype and device as the weight; the same on every rank of
            `process_group`.
        teacher: a `TeacherTargets`, as in `topk_kl_loss` (top-k or sampled).
        options: a `LossOptions`, as in `topk_kl_loss`. Here `chunk_size` is the rows of
            one `[chunk, V_local]` logits block in the weight's dtype (None: the rows in
            six equal chunks, each block within 64 MiB - 1 GiB, `sizing.fused_chunks`;
            the loss math runs on fp32 sub-blocks of 16 MiB on CPU); `grad_in_forward`
            (default True) computes the gradients during forward for "mean" / "sum"
            (three matmuls per chunk); False recomputes the chunk logits in backward
            (four); "none" always recomputes. `grad_weight_accumulation` says how a bf16
            / fp16 `grad_weight` is summed over the row chunks. `process_group`: the
            tensor-parallel group over which the head's vocabulary is sharded
            (`tp_mesh.get_group()`); None without tensor parallelism.

    Returns:
        `(loss, stats)` as `topk_kl_loss`; `loss` is differentiable w.r.t. `hidden`,
        `weight` and `bias`. `hidden`'s gradient is complete on every TP rank (do not
        all-reduce it again); the weight's goes to the head's parameter (its TP shard;
        under FSDP2, reduce-scattered by FSDP as for any module). With gradients computed
        in forward, backward scales them by the upstream gradient in place, so the graph
        cannot be backpropagated twice.

    Raises:
        ValueError: naming the argument, for any invalid input; a sharded weight this
            cannot use (no TP group; FSDP on an ancestor module only, so the head's
            forward does not unshard it), naming the fix.

    Example:
        >>> import torch
        >>> from student_client.losses import TeacherTargets, lm_head_topk_kl_loss
        >>> head = torch.nn.Linear(4, 10, bias=False)  # hidden size 4, vocabulary 10
        >>> _ = torch.nn.init.zeros_(head.weight)  # logits 0: q uniform
        >>> hidden = torch.randn(2, 3, 4, requires_grad=True)  # [B, T, H]
        >>> teacher = TeacherTargets(  # the teacher's top-2 at each of 2 x 3 positions
        ...     ids=torch.tensor([0, 1]).repeat(2, 3, 1),
        ...     logprobs=torch.tensor([0.5, 0.25]).log().repeat(2, 3, 1),
        ... )
        >>> loss, stats = lm_head_topk_kl_loss(head, hidden, teacher)
        >>> round(loss.item(), 4)  # as topk_kl_loss on the logits it never formed
        0.743
        >>> loss.backward()
        >>> head.weight.grad.shape, hidden.grad.shape
        (torch.Size([10, 4]), torch.Size([2, 3, 4]))
    """
    opts = loss_options(options)
    if isinstance(head, nn.Module):
        return head_topk_kl_loss(head, hidden, HeadCall(teacher, opts))
    weight, bias = (head, None) if isinstance(head, Tensor) else head
    return linear_topk_kl_loss(hidden, weight, bias, teacher, opts)
