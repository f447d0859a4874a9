"""The sampled loss vocab-parallel on a real gloo process group (2 CPU processes, spawned):
each rank keeps its vocab shard of the logits (and, fused, of the lm_head weight) and must
get the single-process loss and its gradient shard, with padding columns and drawn ids on
both sides of the shard border."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from student_client.losses import LossOptions, TeacherTargets, lm_head_topk_kl_loss, topk_kl_loss
from topk_protocol.sampling import sample_rows

WORLD, LOCAL_VOCAB, POSITIONS, HIDDEN = 2, 23, (3, 7), 5


def _problem():
    g = torch.Generator().manual_seed(0)
    vocab = LOCAL_VOCAB * WORLD
    teacher = torch.log_softmax(torch.randn(*POSITIONS, vocab, generator=g) * 2, -1)
    flat = teacher.reshape(-1, vocab)
    rows = sample_rows(flat, 12, 5, 77, torch.arange(flat.shape[0]), 1.4)
    assert rows.log_normalizer is not None
    shape = (*POSITIONS, 12)
    hidden = torch.randn(*POSITIONS, HIDDEN, generator=g)
    weight = torch.randn(vocab, HIDDEN, generator=g)
    mask = torch.rand(POSITIONS, generator=g) > 0.2
    drawn = TeacherTargets(
        rows.ids.reshape(shape),
        rows.logprobs.reshape(shape),
        mask=mask,
        sample_counts=rows.counts.reshape(shape),
        proposal_log_normalizer=rows.log_normalizer.reshape(POSITIONS),
        proposal_temperature=1.4,
    )
    return drawn, hidden, weight


def _grads(fn, *tensors):
    leaves = [t.detach().clone().contiguous().requires_grad_(True) for t in tensors]
    loss, _ = fn(*leaves)
    loss.backward()
    return loss.detach(), [t.grad for t in leaves]


def _check(rank: int, chunk: int | None) -> int:
    """The logits and the fused paths at one chunk size on this rank; returns 2."""
    drawn, hidden, weight = _problem()
    cols = slice(rank * LOCAL_VOCAB, (rank + 1) * LOCAL_VOCAB)
    common = LossOptions(chunk_size=chunk)
    sharded = LossOptions(chunk_size=chunk, process_group=dist.group.WORLD)
    want, (want_grad,) = _grads(lambda z: topk_kl_loss(z, drawn, common), hidden @ weight.T)
    got, (grad,) = _grads(lambda z: topk_kl_loss(z, drawn, sharded), (hidden @ weight.T)[..., cols])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, want_grad[..., cols], rtol=1e-5, atol=1e-7)
    want, (want_h, want_w) = _grads(
        lambda h, w: lm_head_topk_kl_loss(w, h, drawn, common), hidden, weight
    )
    got, (got_h, got_w) = _grads(
        lambda h, w: lm_head_topk_kl_loss(w, h, drawn, sharded), hidden, weight[cols]
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_w, want_w[cols], rtol=1e-5, atol=1e-6)
    return 2


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        passed = _check(rank, None) + _check(rank, 4)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"passed": passed}))


def test_sampled_loss_vocab_parallel_matches_single_process(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=WORLD, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert reports == [{"passed": 4}] * WORLD
