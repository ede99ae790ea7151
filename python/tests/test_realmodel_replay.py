"""SmolLM2's recorded activations replayed on each backend (the GPU half of the real-model check).

bench/realmodel_replay.py record saves real activations of SmolLM2-135M-Instruct (a subset of its
layers: the prompt's keys and values, and several decode steps' q, k, v) to a file of a few MB, on
the CPU where the model wheel is installed; `replay --backend ref --json ref.json` writes the digests
of every decode output and selection. Where both files are given,

    SKV_REALMODEL_ACTS=build/realmodel/smollm2-acts.npz SKV_REALMODEL_REF=build/realmodel/replay-ref.json

this test replays the recording on the backend under test (ref, cpu; cuda in the GPU half) and checks
that the reproducible mode's outputs and every run's selections (and, with rank 0, the ranks) are
bitwise those of the reference. Skips when the variables are not set or the files are missing.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("numpy")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "bench"))
import realmodel_replay as rr  # noqa: E402

ACTS = os.environ.get("SKV_REALMODEL_ACTS", "")
REF = os.environ.get("SKV_REALMODEL_REF", "")


@pytest.mark.skipif(not (ACTS and REF and os.path.exists(ACTS) and os.path.exists(REF)),
                    reason="SKV_REALMODEL_ACTS and SKV_REALMODEL_REF (a recording and its reference digests from "
                           "bench/realmodel_replay.py) are not set or missing")
def test_replay_matches_reference(backend):
    if backend == "cuda":
        pytest.importorskip("torch")
    with open(REF) as f:
        ref = json.load(f)
    modes = sorted({k.split("/")[1] for k in ref["runs"]})
    got = rr.replay(rr.argparse.Namespace(file=ACTS, backend=backend, modes=",".join(modes), arrays="numpy",
                                          json=None))
    assert got["runs"], "no setting replayed"
    missing = sorted(set(ref["runs"]) - set(got["runs"]))
    assert not missing, f"runs of the reference not replayed on {backend}: {missing}"
    bad = rr.compare(ref, got)
    assert not bad, f"{backend} against {ref['backend']}: " + "; ".join(bad)
