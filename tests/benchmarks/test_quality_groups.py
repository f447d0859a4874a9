"""The pure parts of `benchmarks/quality_groups.py`: the budget rule (a run stops when
one more step of its average cost would not fit), the teacher CPU meter (cumulative per
``score`` call, the whole process tree counted) and the table."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.quality_groups import (
    GroupRun,
    TeacherMeter,
    format_table,
    next_step_fits,
    tree_cpu_seconds,
)
from examples.distill import EvalResult
from examples.onpolicy import OnPolicyConfig, OnPolicyResult


def test_next_step_fits_the_budget_at_the_average_step_cost() -> None:
    assert next_step_fits([], 0.0)
    assert next_step_fits([1.0], 2.0)  # 1 + 1 <= 2
    assert not next_step_fits([1.0], 1.9)
    assert next_step_fits([1.0, 2.0, 3.0], 4.0)  # 3 + 1 <= 4
    assert not next_step_fits([1.0, 2.0, 3.5], 4.0)  # 3.5 + 1.17 > 4
    # A run that steps until it no longer fits stays within the budget at a steady cost.
    cumulative: list[float] = []
    while next_step_fits(cumulative, 10.0):
        cumulative.append(0.7 * (len(cumulative) + 1))
    assert len(cumulative) == 14 and cumulative[-1] <= 10.0


def test_tree_cpu_seconds_counts_the_children_and_a_gone_process_is_zero() -> None:
    import psutil

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    child = subprocess.Popen([sys.executable, "-c", burn + "\ntime.sleep(60)"])
    try:
        proc = psutil.Process(child.pid)
        while sum(proc.cpu_times()[:2]) < 0.3:
            time.sleep(0.05)
        own = psutil.Process().cpu_times()
        alone = own.user + own.system + own.children_user + own.children_system
        assert tree_cpu_seconds(os.getpid()) >= alone + 0.25
    finally:
        child.kill()
        child.wait()
    assert tree_cpu_seconds(child.pid) == 0.0


# CPU seconds each fake ``score`` call burns. The meter reads the process's CPU times,
# which the kernel counts in clock ticks (10 ms), so each reading may be a tick short:
# the checks below allow two ticks per difference.
BURN_S = 0.2
TICKS_S = 0.02


class _Client:
    def __init__(self) -> None:
        self.calls = 0

    def score(self, *args: object, **kwargs: object) -> str:
        self.calls += 1
        t = time.process_time()
        while time.process_time() - t < BURN_S:
            pass
        return f"payload {self.calls}"


def test_teacher_meter_adds_up_the_cpu_time_inside_each_score_call() -> None:
    client = _Client()
    meter = TeacherMeter(client, os.getpid())  # this process plays the teacher
    assert meter.score("x", k=1) == "payload 1"
    assert meter.score("y") == "payload 2"
    assert len(meter.per_step) == 2
    assert BURN_S - TICKS_S <= meter.per_step[0] < meter.per_step[1]
    assert meter.per_step[1] - meter.per_step[0] >= BURN_S - TICKS_S
    assert meter.total() >= meter.per_step[-1]


def _run(steps: int, cpu: float, kl: float, *, same: EvalResult | None = None) -> GroupRun:
    ev = EvalResult(student_ce=3.0, kl_teacher_student=kl, teacher_ce=2.0, onpolicy_kl=kl / 2)
    result = OnPolicyResult(before=EvalResult(5.0, 4.0, 2.0, 6.0, 4.5), after=ev)
    result.steps_done = steps
    result.teacher_positions_answered = 64 * steps
    result.teacher_positions_computed = 128 * steps
    result.full_rows = 512 * steps
    cumulative = [cpu * (i + 1) / steps for i in range(steps)]
    return GroupRun(result, cumulative, cpu + 1.0, 0.0, same, cpu / 2)


def test_format_table_puts_the_runs_at_their_teacher_cpu() -> None:
    cfg = OnPolicyConfig(steps=4, min_prompt=384, max_prompt=512)
    one = _run(4, 2.0, 1.5)
    eight = _run(9, 1.8, 1.0, same=EvalResult(3.1, 1.6, 2.0, 2.0, 1.7))
    table = format_table([(cfg, one, eight)])
    assert "| G = 1 | 4 | 2.0 | 2.00 | 1.500 |" in table
    assert "| G = 8, same steps | 4 | 0.9 |  | 1.600 |" in table
    assert "| G = 8, same teacher CPU | 9 | 1.8 | 2.00 | 1.000 |" in table
    assert "| (untrained) | 0 |  |  | 4.000 | 6.000 | 4.500 |" in table
    assert "prompts of 384-512 bytes" in table
    assert "KL(teacher || student) 1/1, KL(student || teacher) 0/1, on-policy 1/1" in table
