"""The exploration behind the "What moves the gap" table of docs/multi_teacher.md.

A scratch script, kept as it was run so that the table's rows can be reproduced (each
row's flags are in that table); not a tool, not tested. It trains like
:mod:`examples.mopd` (same corpora, batches, students, loss and schedule) but computes the
teachers' top-k in process instead of serving them, and can build the teachers in other
ways: from scratch per domain (``--base-steps 0 --ft-steps N``), or as fine-tunes of one
base pretrained on both corpora (``--base-steps B --ft-steps N``, optionally held to the
base on the other domain: ``--anchor W``). The student starts fresh (``--student fresh
--sh W --sl L``, optionally pretrained on both corpora first: ``--spre N``) or as that
base (``--student base``). ``--split-loss first|second`` trains on one half of each batch
only (the ``X half`` baselines). Teachers and pretrained students are cached under
``--cache``.

    python -m examples.mopd_explore --base-steps 0 --ft-steps 3000 --ft-lr 3e-3 \
        --teacher-bs 16 --student fresh --sseed 1 --steps 1200 --lr 3e-3 --eval-every 300
"""

import argparse
import copy
import math
import os
import time
from types import SimpleNamespace

import torch
from transformers import Qwen2ForCausalLM

from examples.data import WindowSampler, fixed_windows
from examples.distill import DistillConfig, evaluate, student_model
from examples.mopd import DOMAINS, _corpora, mixture_kl
from examples.teacher_pretrain import PretrainConfig, teacher_model_config
from student_client.losses import TeacherTargets, topk_kl_loss

ap = argparse.ArgumentParser()
ap.add_argument("--base-steps", type=int, default=300)
ap.add_argument("--ft-steps", type=int, default=200)
ap.add_argument("--steps", type=int, default=300)
ap.add_argument("--lr", type=float, default=1e-3)
ap.add_argument("--ft-lr", type=float, default=1e-3)
ap.add_argument("--bs", type=int, default=8)
ap.add_argument("--T", type=int, default=128)
ap.add_argument("--student", default="base")  # base | fresh64 | small-pre
ap.add_argument("--eval-every", type=int, default=0)
ap.add_argument("--domain-token", action="store_true")
ap.add_argument("--only", default="")
ap.add_argument("--split-loss", default="")
ap.add_argument("--anchor", type=float, default=0.0)
ap.add_argument("--teacher-bs", type=int, default=8)
ap.add_argument("--sh", type=int, default=64)
ap.add_argument("--sl", type=int, default=1)
ap.add_argument("--sseed", type=int, default=0)
ap.add_argument("--spre", type=int, default=0)
ap.add_argument("--cache", default=".cache/topk-distill/mopd-explore")
a = ap.parse_args()
torch.set_num_threads(int(os.environ.get("NT", "2")))
corp = _corpora()
held = {d: fixed_windows(corp[d].heldout, length=a.T, count=16) for d in DOMAINS}


def samplers(bs, seed, length):
    return [
        WindowSampler(corp[d].train, batch_size=bs, length=length, seed=seed + i)
        for i, d in enumerate(DOMAINS)
    ]


def ce_train(model, steps, lr, sampler_fn, anchor_fn=None):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    sch = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    for _ in range(steps):
        b = sampler_fn()
        lg = model(input_ids=b[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            lg.reshape(-1, lg.shape[-1]).float(), b[:, 1:].reshape(-1)
        )
        if anchor_fn is not None:
            o = anchor_fn()[:, :-1]
            with torch.no_grad():
                lb = torch.log_softmax(base(input_ids=o).logits.float(), -1)
            lt = torch.log_softmax(model(input_ids=o).logits.float(), -1)
            loss = loss + a.anchor * (lb.exp() * (lb - lt)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sch.step()
    model.eval()
    return loss.item()


t0 = time.time()
cfg = PretrainConfig(max_steps=1, train_seconds=0)
torch.manual_seed(0)
base = Qwen2ForCausalLM(teacher_model_config(cfg))
half = a.bs // 2
ss = samplers(half, 100, a.T + 1)
last = (
    0
    if a.base_steps == 0
    else ce_train(base, a.base_steps, 3e-3, lambda: torch.cat([s.sample() for s in ss]))
)
print(f"base {a.base_steps} steps loss {last:.3f} {time.time() - t0:.0f}s", flush=True)
teachers = {}
for i, d in enumerate(DOMAINS):
    key = (
        f"{a.cache}/t-{d}-{a.base_steps}-{a.ft_steps}-{a.ft_lr}-{a.teacher_bs}-{a.T}-{a.anchor}.pt"
    )
    t = copy.deepcopy(base)
    if os.path.exists(key):
        t.load_state_dict(torch.load(key))
        t.eval()
        teachers[d] = t
        print("cached", key)
        continue
    s1 = WindowSampler(corp[d].train, batch_size=a.teacher_bs, length=a.T + 1, seed=200 + i)
    other = WindowSampler(corp[DOMAINS[1 - i]].train, batch_size=a.bs, length=a.T + 1, seed=300 + i)
    last = ce_train(t, a.ft_steps, a.ft_lr, s1.sample, other.sample if a.anchor else None)
    teachers[d] = t
    os.makedirs(a.cache, exist_ok=True)
    torch.save(t.state_dict(), key)
    print(f"teacher {d} ft loss {last:.3f} {time.time() - t0:.0f}s", flush=True)
for d in DOMAINS:
    print(
        d,
        "mixture floor",
        round(mixture_kl(teachers, d, held[d]), 4),
        "base KL",
        {dd: round(evaluate(base, teachers[dd], held[dd]).kl_teacher_student, 4) for dd in [d]},
        "other teacher KL",
        round(
            evaluate(
                teachers[next(x for x in DOMAINS if x != d)], teachers[d], held[d]
            ).kl_teacher_student,
            4,
        ),
        "teacher CE",
        round(evaluate(base, teachers[d], held[d]).teacher_ce, 3),
        flush=True,
    )

ss2 = samplers(half, 0, a.T)
batches = [torch.cat([s.sample() for s in ss2]) for _ in range(a.steps)]


def make_student():
    if a.student == "base":
        return copy.deepcopy(base)
    sm = student_model(
        320, DistillConfig(seq_len=a.T, hidden_size=a.sh, num_layers=a.sl, seed=a.sseed)
    )
    if a.spre:
        key = f"{a.cache}/s-{a.sh}x{a.sl}-{a.sseed}-{a.spre}-{a.T}.pt"
        if os.path.exists(key):
            sm.load_state_dict(torch.load(key))
        else:
            sp = samplers(half, 500, a.T + 1)
            last = ce_train(sm, a.spre, 3e-3, lambda: torch.cat([s.sample() for s in sp]))
            os.makedirs(a.cache, exist_ok=True)
            torch.save(sm.state_dict(), key)
            print("student pretrain loss", last, flush=True)
    return sm


res = {}


def kl(p, q):
    return float((p.exp() * (p - q)).sum(-1).mean())


class Tok(torch.nn.Module):
    def __init__(self, m, d):
        super().__init__()
        self.m = m
        self.d = d

    def forward(self, input_ids):
        tok = torch.full((input_ids.shape[0], 1), 260 + DOMAINS.index(self.d))

        return SimpleNamespace(
            logits=self.m(input_ids=torch.cat([tok, input_ids], 1)).logits[:, 1:]
        )


def ev(m, d):
    mm = Tok(m, d) if a.domain_token else m
    return evaluate(mm, teachers[d], held[d]).kl_teacher_student


for student in a.only.split(",") if a.only else ("routed", "code only", "docs only"):
    m = make_student()
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=a.lr, weight_decay=0.0)
    sch = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.steps, pct_start=0.1)
    who = (
        [DOMAINS[0]] * half + [DOMAINS[1]] * half
        if student == "routed"
        else [student.split()[0]] * a.bs
    )
    for step, x in enumerate(batches, 1):
        with torch.no_grad():
            lps = []
            if who[0] != who[-1]:
                lps = [
                    torch.log_softmax(teachers[who[0]](input_ids=x[:half]).logits.float(), -1),
                    torch.log_softmax(teachers[who[-1]](input_ids=x[half:]).logits.float(), -1),
                ]
            else:
                lps = [torch.log_softmax(teachers[who[0]](input_ids=x).logits.float(), -1)]
            lp = torch.cat(lps)
            lps_full = lps
            tl, ti = lp.topk(16, -1)
        if a.domain_token:
            tok = torch.tensor(
                [[260 + DOMAINS.index(d)] for d in [DOMAINS[0]] * half + [DOMAINS[1]] * half]
            )
            logits = m(input_ids=torch.cat([tok, x], 1)).logits[:, 1:]
        else:
            logits = m(input_ids=x).logits
        if a.split_loss == "halves":
            loss = (
                topk_kl_loss(logits[:half], TeacherTargets(ti[:half], tl[:half]))[0]
                + topk_kl_loss(logits[half:], TeacherTargets(ti[half:], tl[half:]))[0]
            ) / 2
        elif a.split_loss == "second":
            loss = topk_kl_loss(logits[half:], TeacherTargets(ti[half:], tl[half:]))[0]
        elif a.split_loss == "first":
            loss = topk_kl_loss(logits[:half], TeacherTargets(ti[:half], tl[:half]))[0]
        elif a.split_loss == "full":
            loss = (
                tl.new_zeros(())
                + (
                    torch.log_softmax(torch.cat(lps_full), -1).exp()
                    * (
                        torch.log_softmax(torch.cat(lps_full), -1)
                        - torch.log_softmax(logits.float(), -1)
                    )
                )
                .sum(-1)
                .mean()
            )
        else:
            loss, _ = topk_kl_loss(logits, TeacherTargets(ti, tl))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        sch.step()
        if a.eval_every and step % a.eval_every == 0:
            m.eval()
            print(" ", student, step, {d: round(ev(m, d), 4) for d in DOMAINS}, flush=True)
            m.train()
    m.eval()
    res[student] = {d: ev(m, d) for d in DOMAINS}
    with torch.no_grad():
        for d in DOMAINS:
            x = held[d]
            ls = torch.log_softmax(m(input_ids=x).logits.float(), -1)
            lc = torch.log_softmax(teachers["code"](input_ids=x).logits.float(), -1)
            ld = torch.log_softmax(teachers["docs"](input_ids=x).logits.float(), -1)
            lm = torch.logsumexp(torch.stack([lc, ld]), 0) - math.log(2)
            lb = torch.log_softmax(base(input_ids=x).logits.float(), -1)
            print(
                "   on",
                d,
                "KL(code||s)",
                round(kl(lc, ls), 4),
                "KL(docs||s)",
                round(kl(ld, ls), 4),
                "KL(mix||s)",
                round(kl(lm, ls), 4),
                "KL(base||s)",
                round(kl(lb, ls), 4),
                flush=True,
            )
    print(
        student,
        {k: round(v, 4) for k, v in res[student].items()},
        f"{time.time() - t0:.0f}s",
        flush=True,
    )
for d in DOMAINS:
    print(d, "gap", f"{100 * (res['routed'][d] / res[d + ' only'][d] - 1):+.1f}%")
