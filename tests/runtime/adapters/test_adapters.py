"""The trainers' adapters over ``runtime.AutoTuner`` (``runtime.adapters``), on 2 gloo ranks: the loss at every step
bitwise the bare loop's, and the tuner done."""

from __future__ import annotations

import json

import pytest

from tests.multirank import run_ranks
from tests.runtime.in_loop.test_autotuner import KEYS


@pytest.mark.slow
def test_trainer_adapters_leave_the_loss_identical(tmp_path):
    """The Hugging Face and Lightning adapters, their hooks called where the trainers call them, with the
    frameworks' real state classes: the same loss at every step as the bare loop, and the tuner done at the end
    (or closed by on_train_end)."""
    pytest.importorskip("lightning")
    out = tmp_path / "adapters.json"
    run_ranks("adapters.py", str(out), json.dumps(KEYS))
    result = json.loads(out.read_text())
    assert result["hf"] == result["bare"] and result["lightning"] == result["bare"]
    assert result["phases"] == {"hf": "done", "lightning": "done"}


@pytest.mark.slow
def test_lightning_end_to_end(tmp_path):
    """Lightning's own fit loop (ModelParallelStrategy on CPU with gloo, accumulate_grad_batches=2) with the
    adapter: every batch's loss bitwise identical to the same fit without it, and the tuner done in 40 steps."""
    pytest.importorskip("lightning")
    for mode in ("bare", "tune"):
        run_ranks("lightning_e2e.py", mode, str(tmp_path))
    for rank in (0, 1):
        bare = json.loads((tmp_path / f"bare-{rank}.json").read_text())
        tuned = json.loads((tmp_path / f"tune-{rank}.json").read_text())
        assert len(bare["losses"]) == 80 and tuned["losses"] == bare["losses"]
        assert tuned["phase"] == "done"
