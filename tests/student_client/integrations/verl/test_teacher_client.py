"""verl 0.9.1's own teacher path around the plugin's client, against live teachers.

verl is installed beside the project (``devtools.verl_install``: a folder of its own, no
GPU packages) and runs in a subprocess with that folder on ``PYTHONPATH``: ``import verl``
loads this project's plugin through verl's ``verl.plugins`` entry point, the distillation
config (verl's own ``distillation.yaml``, zero teacher GPUs) builds its teachers through
verl's ``MultiTeacherModelManager`` name, and verl's
``AsyncTeacherLLMServerManager.compute_teacher_logprobs_single`` asks them, with its own
sampling parameters and its own assertions, then ``_pad_teacher_outputs`` pads the rows
as verl's agent loop does. The tensors are compared here with a dense float64
transformers forward pass of each teacher's weights, in verl's layout."""

from __future__ import annotations

import numpy as np
import pytest
from dense_reference import dense_logprobs_f64
from side_frameworks import run_driver

from devtools.tiny_model import write_tiny_model
from devtools.verl_install import verl_env

#: The tolerance the issue asks for, against the float64 reference.
TOLERANCE = 2e-4

#: Runs verl's teacher path: ARGV spec.json out.npz. The spec names the student model,
#: the teachers (entry name -> routing key, URL) and the cases (loss mode, top-k,
#: sequences with their routing keys).
_DRIVER = r"""
import asyncio, json, sys
from pathlib import Path
import numpy as np
import verl.experimental.teacher_loop as teacher_loop
from verl.experimental.teacher_loop.teacher_manager import (
    AsyncTeacherLLMServerManager, _pad_teacher_outputs)
from devtools.verl_config import distillation_config

spec = json.loads(Path(sys.argv[1]).read_text())

def config(case):
    return distillation_config(spec["student"], case["teachers"], case["loss_mode"], case["topk"])

out = {}
for c, case in enumerate(spec["cases"]):
    cfg = config(case)
    manager = teacher_loop.MultiTeacherModelManager(config=cfg, resource_pool=None)
    out[f"manager{c}"] = np.array(type(manager).__name__)
    teachers = AsyncTeacherLLMServerManager(cfg, manager.get_client())

    async def score_all():
        return await asyncio.gather(*(
            teachers.compute_teacher_logprobs_single(seq, routing_key=key)
            for seq, key in case["sequences"]))

    for i, (ids, lps) in enumerate(asyncio.run(score_all())):
        out[f"{c}_{i}_ids"], out[f"{c}_{i}_lps"] = ids.numpy(), lps.numpy()
        n = len(case["sequences"][i][0])
        pad_ids, pad_lps = _pad_teacher_outputs(ids, lps, 4, n, min(n, 3), n - min(n, 3), 0)
        out[f"{c}_{i}_padded"] = pad_lps.numpy()
np.savez(sys.argv[2], **out)
"""


def _ragged(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, n).tolist() for n in (5, 37, 123, 300)]


def check_rows(ids: np.ndarray, lps: np.ndarray, dense: np.ndarray, seq: list[int], k: int) -> None:
    """verl's layout of one sequence against the reference: row ``j`` the distribution of
    ``x[j + 1]`` (K = 0: that token and its log-prob; else the top-K by rank), the last
    row zeros."""
    n, width = len(seq), max(k, 1)
    assert ids.shape == lps.shape == (n, width)
    assert ids.dtype == np.int32 and lps.dtype == np.float32
    assert not ids[-1].any() and not lps[-1].any()
    rows = dense[: n - 1]
    if k == 0:
        np.testing.assert_array_equal(ids[:-1, 0], seq[1:])
        np.testing.assert_allclose(
            lps[:-1, 0], rows[np.arange(n - 1), seq[1:]], rtol=0, atol=TOLERANCE
        )
        return
    best = -np.sort(-rows, axis=-1)[:, :k]
    np.testing.assert_allclose(lps[:-1], best, rtol=0, atol=TOLERANCE)  # by rank
    np.testing.assert_allclose(
        np.take_along_axis(rows, ids[:-1], -1), lps[:-1], rtol=0, atol=TOLERANCE
    )


@pytest.mark.vllm
def test_verl_s_teacher_path_on_live_teachers(
    vllm_teacher, teacher_factory, tiny_model_dir, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """K = 0 (loss k3, one teacher) and K = 8 (forward_kl_topk, two teachers routed by
    key: the vLLM teacher and a transformers teacher of other weights), ragged
    sequences of 5 to 300 tokens."""
    other_dir = write_tiny_model(tmp_path / "other-teacher", seed=1)
    other = teacher_factory(["--backend", "transformers", "--model", str(other_dir)])
    url = {
        "math": f"topk-distill://{vllm_teacher.target}",
        "code": f"topk-distill://{other.target}",
    }
    seqs = _ragged(0)
    routed = [(s, key) for s in seqs for key in ("math", "code")]
    spec = {
        "student": str(tiny_model_dir),
        "cases": [
            {"loss_mode": "k3", "topk": 8, "teachers": {"teacher_model": ["default", url["math"]]},
             "sequences": [(s, None) for s in seqs]},
            {"loss_mode": "forward_kl_topk", "topk": 8,
             "teachers": {"t_math": ["math", url["math"]], "t_code": ["code", url["code"]]},
             "sequences": routed},
        ],
    }  # fmt: skip
    got = run_driver(_DRIVER, spec, tmp_path, verl_env())

    assert str(got["manager0"]) == str(got["manager1"]) == "ServedTeachers"
    models = {"math": tiny_model_dir, "code": other_dir}
    for i, seq in enumerate(seqs):  # K = 0: verl's k3 reads the actual token's log-prob
        check_rows(
            got[f"0_{i}_ids"], got[f"0_{i}_lps"], dense_logprobs_f64(models["math"], seq), seq, 0
        )
    for i, (seq, key) in enumerate(routed):  # each sequence to both teachers
        check_rows(
            got[f"1_{i}_ids"], got[f"1_{i}_lps"], dense_logprobs_f64(models[key], seq), seq, 8
        )
        assert got[f"1_{i}_padded"].shape == (1, 4 + len(seq), 8)  # verl's own padding
    # the two teachers' answers differ well beyond the tolerance: each matched its own
    assert np.abs(got["1_0_lps"] - got["1_1_lps"]).max() > 100 * TOLERANCE
