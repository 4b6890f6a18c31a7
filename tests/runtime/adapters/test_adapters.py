"""The trainers' adapters over ``runtime.AutoTuner`` (``runtime.adapters``), on 2 gloo ranks: the loss at every step
bitwise the bare loop's, and the tuner done."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from planner.artifacts.profile import Profile
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


def _skipped_and_the_rest_bitwise(tmp_path, script: str, *args: str) -> None:
    """``oom``: an out-of-memory error on every rank in the first batch that runs a candidate, under the trainer's
    own loop; then ``skip:K``, the same training without the tuner skipping that optimizer step. The tuner skipped
    it (the trial FAIL, the reason stored), training went on to the end, and every other batch's loss is bitwise
    the reference's."""
    run_ranks(script, "oom", str(tmp_path), *args)
    oom = [json.loads((tmp_path / f"oom-{rank}.json").read_text()) for rank in (0, 1)]
    skipped = oom[0]["skipped"]
    assert skipped is not None and oom[1]["skipped"] == skipped
    assert any("out of memory on every rank" in reason for reason in oom[0]["failed"]), oom[0]["failed"]
    run_ranks(script, f"skip:{skipped}", str(tmp_path), *args)
    for rank in (0, 1):
        reference = json.loads((tmp_path / f"skip:{skipped}-{rank}.json").read_text())
        assert oom[rank]["losses"] == reference["losses"] and len(reference["losses"]) > 40
        assert oom[rank]["phase"] == "done"


@pytest.mark.slow
def test_lightning_skips_a_candidates_out_of_memory_step_and_trains_on(tmp_path):
    pytest.importorskip("lightning")
    _skipped_and_the_rest_bitwise(tmp_path, "lightning_e2e.py")


@pytest.mark.slow
def test_hugging_face_skips_a_candidates_out_of_memory_step_and_trains_on(tmp_path):
    pytest.importorskip("transformers.distributed")
    _skipped_and_the_rest_bitwise(tmp_path, "hf_e2e.py", "60")


def _same_losses_and_done(tmp_path, name: str, steps: int, ranks: int = 2) -> None:
    for rank in range(ranks):
        bare = json.loads((tmp_path / f"bare-{rank}.json").read_text())
        tuned = json.loads((tmp_path / f"tune-{rank}.json").read_text())
        assert len(bare["losses"]) >= steps and tuned["losses"] == bare["losses"], name
        assert tuned["phase"] == "done" and tuned["steps_tuning"] < steps, name


@pytest.mark.slow
def test_hugging_face_trainer_end_to_end(tmp_path):
    """``Trainer.train()`` on a small Llama that transformers shards with FSDP2 on CPU (``from_pretrained(...,
    distributed_config=DistributedConfig(fsdp_size=2))``), 2 microbatches a step, with the callback: every
    microbatch's loss bitwise the same train's without it, and the tuner done within its 60 steps."""
    pytest.importorskip("transformers.distributed")
    for mode in ("bare", "tune"):
        run_ranks("hf_e2e.py", mode, str(tmp_path), "60")
    _same_losses_and_done(tmp_path, "hf", 60)


def test_the_hf_callback_names_accelerates_fallback_to_ddp():
    """``TrainingArguments(fsdp=...)`` on CPU: Accelerate drops its FSDP plugin and trains the model under DDP, so
    the callback finds nothing sharded and says why, in one line."""
    pytest.importorskip("transformers")
    from torch import nn
    from transformers import TrainingArguments

    from planner.errors import NotShardedError
    from runtime.adapters.hf import sharded_model

    fsdp = TrainingArguments(output_dir="unused", use_cpu=True, fsdp=True, fsdp_config={"fsdp_version": 2},
                             report_to=[])
    with pytest.raises(NotShardedError, match="falls back to DDP.*DistributedConfig") as e:
        sharded_model(fsdp, nn.Linear(2, 2))
    assert "\n" not in str(e.value)
    with pytest.raises(NotShardedError, match="holds no module wrapped with fully_shard"):
        sharded_model(TrainingArguments(output_dir="unused", use_cpu=True, report_to=[]), nn.Linear(2, 2))


@pytest.mark.slow
def test_torchtitan_trainer_end_to_end_with_tensor_parallelism(tmp_path, monkeypatch):
    """torchtitan 0.3's own ``Trainer`` on its llama3 debug model in its 2-D layout, dp 2 x tp 2 on 4 CPU ranks
    (``tensor_parallel_degree = 2``: each block's fused q/k/v, output projection and MLP split over the TP ranks,
    sequence parallel on the norms, FSDP over the dp ranks; seq_len 64, ``ChunkedLossWrapper`` calling ``lm_head``
    from the loss, selective activation checkpointing), as ``TunedTrainer`` (the AutoTuner in torchtitan's loop):
    every microbatch's loss on every rank bitwise the plain ``Trainer``'s, the tuner done within 50 steps, and the
    profile it recorded all-gathers the TP-local tensors over the 2 dp ranks. Under CI, where ``.ci/run`` installs
    torchtitan, a missing torchtitan fails instead of skipping."""
    if importlib.util.find_spec("torchtitan") is None:
        if os.environ.get("CI"):
            raise AssertionError("torchtitan is not installed; .ci/run installs it (pip install --no-deps "
                                 "torchtitan==0.3.0 and its import-time dependencies)")
        pytest.skip("torchtitan is not installed: pip install 'prefetch-planner[torchtitan]'")
    monkeypatch.setenv("TEST_TENSOR_PARALLEL", "2")
    for mode in ("bare", "tune"):
        run_ranks("torchtitan_e2e.py", mode, str(tmp_path), "50", nproc=4, timeout=900)
    _same_losses_and_done(tmp_path, "torchtitan", 50, ranks=4)
    profile = Profile.load(tmp_path / "tune.profile.json")
    assert (profile.fingerprint.tensor_parallel, profile.fingerprint.shard_size) == (2, 2)
    # dim 256, FFN 768, bf16 all-gathers: the fused q/k/v (768 x 256) and w1, w3 (768 x 256) column-wise, wo
    # (256 x 256) and w2 (256 x 768) row-wise, each halved over the TP ranks; the 2 norms whole
    local = 384 * 256 + 256 * 128 + 2 * 384 * 256 + 256 * 384 + 2 * 256
    blocks = [m for fqn, m in profile.modules.items() if fqn.startswith("layers.")]
    assert len(blocks) == 6 and all(m.unsharded_bytes == 2 * local for m in blocks)
    assert all(m.all_gather_ms > 0 and m.reduce_scatter_ms > 0 for m in blocks)


def test_enable_false_turns_each_trainer_callback_into_nothing():
    """``enable=False``: the callback builds no tuner and adds nothing to a step; the same calls with the tuner on
    build one, and fail here on a model that is not sharded (the contrast that shows the switch acts)."""
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    from types import SimpleNamespace

    from torch import nn

    from planner.errors import NotShardedError
    from runtime.adapters.hf import PrefetchTuningCallback
    from runtime.adapters.lightning import PrefetchTuning

    model, args, trainer = nn.Linear(2, 2), SimpleNamespace(fsdp=None), SimpleNamespace(accumulate_grad_batches=1)
    hf = PrefetchTuningCallback("s", enable=False)
    for _ in range(2):
        hf.on_step_begin(args, None, None, model=model)
        hf.on_step_end(args, None, None)
    hf.on_train_end(args, None, None)
    assert hf.tuner is None
    with pytest.raises(NotShardedError):
        PrefetchTuningCallback("s").on_step_begin(args, None, None, model=model)

    lightning = PrefetchTuning("s", enable=False)
    lightning.on_train_start(trainer, model)
    for i in range(2):
        lightning.on_train_batch_start(trainer, model, None, i)
        lightning.on_train_batch_end(trainer, model, None, None, i)
    lightning.on_train_end(trainer, model)
    assert lightning.tuner is None
    with pytest.raises(NotShardedError):
        PrefetchTuning("s").on_train_start(trainer, model)
