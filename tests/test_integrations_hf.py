"""PagememTrainer against the plain Hugging Face Trainer: bit for bit in fp32 (fused AdamW in the
reference), pages moving, checkpoints resumed; bf16 trains; misuse refused at start."""

from __future__ import annotations

import dataclasses
import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import pagemem  # noqa: E402
from integration_setup import BATCH, config_for, differing, gpt2, one_thread, sequences  # noqa: E402
from pagemem.integrations.hf import PagememTrainer  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def dataset(n: int) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": x, "labels": x} for x in sequences(n)]


def args(out, **kw) -> transformers.TrainingArguments:
    """Clipping, accumulation 2, a warm-up schedule, fused AdamW, on the cpu."""
    base = dict(output_dir=str(out), max_steps=20, per_device_train_batch_size=BATCH, gradient_accumulation_steps=2,
                max_grad_norm=1.0, learning_rate=3e-3, warmup_steps=5, weight_decay=0.1, optim="adamw_torch_fused",
                logging_steps=5, save_strategy="no", report_to=[], seed=0, use_cpu=True, disable_tqdm=True)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def plain(out, data, **kw) -> dict[str, torch.Tensor]:
    trainer = transformers.Trainer(gpt2(), args(out, **kw), train_dataset=data)
    trainer.train()
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_trainer_equals_plain_trainer_for_a_few_steps(tmp_path):
    """Fast: 4 steps, states on cpu, pages moving; evaluation before (the engine made for it)
    and during training through the engine."""
    data, held_out = dataset(16), dataset(4)
    kw = dict(max_steps=4, warmup_steps=2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=BATCH,
              logging_steps=2)
    ref = transformers.Trainer(gpt2(), args(tmp_path / "ref", **kw), train_dataset=data, eval_dataset=held_out)
    ref_first = ref.evaluate()["eval_loss"]
    ref.train()
    trainer = PagememTrainer(gpt2(), args(tmp_path / "pm", **kw), train_dataset=data, eval_dataset=held_out,
                             pagemem_config=config_for(tmp_path))
    assert trainer.evaluate()["eval_loss"] == ref_first
    trainer.train()
    assert not differing(ref.model.state_dict(), trainer.model.state_dict())
    evals = [[h["eval_loss"] for h in t.state.log_history if "eval_loss" in h] for t in (ref, trainer)]
    assert len(evals[0]) == 2 and evals[0] == evals[1]
    logged = [[(h["loss"], h["grad_norm"], h["learning_rate"]) for h in t.state.log_history if "loss" in h]
              for t in (ref, trainer)]
    assert len(logged[0]) == 2 and logged[0] == logged[1]  # the loss, the norm before clipping, the schedule
    stats = trainer.engine.stats()
    assert stats["evictions"] > 0 and stats["iterations"]["planned"] > 0
    assert trainer.engine.config.accumulation_steps == 2
    trainer.engine.close()


@pytest.mark.slow
def test_trainer_20_steps_bit_for_bit_saves_and_resumes(tmp_path):
    """The acceptance run: 20 steps, clipping, accumulation 2, warm-up; states on nvme; a
    checkpoint at step 10 resumed in a new trainer ends where the uninterrupted run ends."""
    data = dataset(80)
    want = plain(tmp_path / "ref", data)
    cfg = config_for(tmp_path, "nvme")
    saving = dict(save_strategy="steps", save_steps=10)
    whole = PagememTrainer(gpt2(), args(tmp_path / "pm", **saving), train_dataset=data, pagemem_config=cfg)
    whole.train()
    assert not differing(want, whole.model.state_dict())
    stats = whole.engine.stats()
    assert stats["evictions"] > 0 and stats["iterations"]["planned"] > 0 and stats["optimizer_tier"] == "nvme"
    whole.engine.close()
    ckpt = tmp_path / "pm" / "checkpoint-10"
    assert (ckpt / "pagemem" / "latest").is_file() and (ckpt / "scheduler.pt").is_file()
    assert not (ckpt / "optimizer.pt").exists()  # the engine's checkpoint, never every moment in host memory
    resumed = PagememTrainer(gpt2(), args(tmp_path / "pm", **saving), train_dataset=data, eval_dataset=data[:4],
                             pagemem_config=cfg)
    resumed.evaluate()  # an engine made before the resume: train() starts again from the checkpoint
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 20
    assert not differing(want, resumed.model.state_dict())
    assert resumed.optimizer.param_groups[0]["lr"] == whole.optimizer.param_groups[0]["lr"]
    resumed.engine.close()


@pytest.mark.slow
def test_trainer_bf16_trains(tmp_path):
    data = dataset(40)
    trainer = PagememTrainer(gpt2(), args(tmp_path / "pm", bf16=True, logging_steps=1), train_dataset=data,
                             pagemem_config=config_for(tmp_path))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert trainer.engine.config.compute_dtype == torch.bfloat16
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) < sum(losses[:5])
    after = trainer.model.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert differing(before, after)  # it trained
    trainer.engine.close()


# ---------------------------------------------------------------------- refused at start

def refused(tmp_path, match: str, *, model=None, config=None, **kw) -> None:
    with pytest.raises(pagemem.ConfigError, match=match):
        trainer = PagememTrainer(model or gpt2(), args(tmp_path / "pm", **kw.pop("targs", {})),
                                 train_dataset=dataset(8), pagemem_config=config or config_for(tmp_path), **kw)
        trainer.train()


def test_deepspeed_also_configured_is_refused(tmp_path):
    a = args(tmp_path / "pm")
    a.deepspeed = {"zero_optimization": {"stage": 3}}  # as TrainingArguments(deepspeed=...) leaves it
    with pytest.raises(pagemem.ConfigError, match="TrainingArguments.deepspeed"):
        PagememTrainer(gpt2(), a, train_dataset=dataset(8), pagemem_config=config_for(tmp_path))


def test_fsdp_also_configured_is_refused(tmp_path):
    a = args(tmp_path / "pm")
    a.fsdp = ["full_shard"]
    with pytest.raises(pagemem.ConfigError, match="TrainingArguments.fsdp"):
        PagememTrainer(gpt2(), a, train_dataset=dataset(8), pagemem_config=config_for(tmp_path))


@pytest.mark.parametrize("optim", ["sgd", "adafactor", "adamw_torch_4bit"])
def test_an_optimizer_the_engine_does_not_offer_is_refused(tmp_path, optim):
    refused(tmp_path, "TrainingArguments.optim", targs=dict(optim=optim))


def test_an_optimizer_given_that_is_not_adamw_is_refused_before_any_step(tmp_path):
    model = gpt2()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    refused(tmp_path, "torch.optim.AdamW, got torch.optim.sgd.SGD", model=model, optimizers=(sgd, None))
    assert not differing(before, model.state_dict())  # nothing trained, the model is its own again


def test_amsgrad_is_refused(tmp_path):
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), amsgrad=True)
    refused(tmp_path, r"param_groups\[0\].amsgrad", model=model, optimizers=(opt, None))


def test_fp16_is_refused(tmp_path):
    a = args(tmp_path / "pm")
    a.fp16 = True
    with pytest.raises(pagemem.ConfigError, match="TrainingArguments.fp16"):
        PagememTrainer(gpt2(), a, train_dataset=dataset(8), pagemem_config=config_for(tmp_path))


@pytest.mark.parametrize("change, match", [
    (dict(max_grad_norm=1.0), "pagemem_config.max_grad_norm: the framework clips"),
    (dict(accumulation_steps=3), "pagemem_config.accumulation_steps: .*must be 1 or 2, got 3"),
    (dict(compute_dtype=torch.float16), "pagemem_config.compute_dtype"),
])
def test_engine_knobs_the_trainer_owns_are_refused(tmp_path, change, match):
    cfg = dataclasses.replace(config_for(tmp_path), **change)
    refused(tmp_path, match, config=cfg, targs=dict(bf16=True) if "compute_dtype" in change else {})


def test_a_config_that_is_not_an_engine_config_is_refused(tmp_path):
    with pytest.raises(pagemem.ConfigError, match="pagemem_config: must be a pagemem.EngineConfig, got dict"):
        PagememTrainer(gpt2(), args(tmp_path / "pm"), train_dataset=dataset(8), pagemem_config={"gpu_bytes": 1})


def test_resuming_a_checkpoint_without_the_engine_part_is_refused(tmp_path):
    ckpt = tmp_path / "checkpoint-5"  # a plain Trainer's: model weights, no pagemem/
    gpt2().save_pretrained(ckpt)
    trainer = PagememTrainer(gpt2(), args(tmp_path / "pm"), train_dataset=dataset(8),
                             pagemem_config=config_for(tmp_path))
    with pytest.raises(pagemem.ConfigError, match="resume_from_checkpoint: .*holds no pagemem checkpoint"):
        trainer.train(resume_from_checkpoint=str(ckpt))


def test_updates_during_backward_where_the_trainer_neither_clips_nor_accumulates(tmp_path):
    """overlap_update stays possible (here forced on the host stand-in) without clipping or
    accumulation, and the Trainer then equals the plain one, its grad norm unlogged."""
    data = dataset(8)
    kw = dict(max_steps=4, warmup_steps=2, max_grad_norm=0.0, gradient_accumulation_steps=1)
    want = plain(tmp_path / "ref", data, **kw)
    cfg = dataclasses.replace(config_for(tmp_path), overlap_update=True)
    trainer = PagememTrainer(gpt2(), args(tmp_path / "pm", **kw), train_dataset=data, pagemem_config=cfg)
    trainer.train()
    assert not differing(want, trainer.model.state_dict())
    assert trainer.engine.stats()["overlapped_updates"] > 0
    trainer.engine.close()


@pytest.mark.parametrize("targs, match", [
    (dict(max_grad_norm=1.0, gradient_accumulation_steps=1), "cannot be clipped afterwards"),
    (dict(max_grad_norm=0.0, gradient_accumulation_steps=2), "an epoch's last may take fewer"),
])
def test_updates_during_backward_with_clipping_or_accumulation_are_refused(tmp_path, targs, match):
    refused(tmp_path, f"pagemem_config.overlap_update: .*{match}",
            config=dataclasses.replace(config_for(tmp_path), overlap_update=True), targs=targs)


@pytest.mark.slow
def test_an_epoch_ending_in_a_shorter_step_equals_the_plain_trainer(tmp_path):
    """9 batches an epoch with accumulation 2: each epoch ends with a one-backward step."""
    data = dataset(18)
    want = plain(tmp_path / "ref", data, max_steps=6)
    trainer = PagememTrainer(gpt2(), args(tmp_path / "pm", max_steps=6), train_dataset=data,
                             pagemem_config=config_for(tmp_path))
    trainer.train()
    assert not differing(want, trainer.model.state_dict())
    trainer.engine.close()
