"""Lightning's Trainer(strategy="pagemem") against plain Lightning: bit for bit in fp32 (fused
AdamW in the reference), pages moving, checkpoints resumed with ckpt_path="last"; bf16 trains;
misuse refused at start."""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

import pagemem  # noqa: E402
from integration_setup import BATCH, config_for, differing, gpt2, one_thread, sequences  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from pagemem.integrations.lightning import PagememStrategy  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_one_thread():
    with one_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class LM(pl.LightningModule):
    """A Hugging Face GPT-2 under a LightningModule: fused AdamW, a warm-up schedule stepped per
    optimizer step, the data in a fixed order (an epoch is 10 steps of accumulation 2)."""

    def __init__(self, optimizer: str = "adamw", amsgrad: bool = False) -> None:
        super().__init__()
        self.model = gpt2()
        self.optimizer, self.amsgrad = optimizer, amsgrad
        self.data = sequences(40)

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
        else:
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True,
                                    amsgrad=self.amsgrad)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=BATCH, shuffle=False)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.data[:4], batch_size=BATCH)


class Stats(pl.Callback):
    """The engine's stats at the end of training (the engine closes at teardown)."""

    def on_train_end(self, trainer, module):
        self.stats = trainer.strategy.engine.stats()
        self.lr = trainer.strategy.engine.optimizer.param_groups[0]["lr"]
        self.dtype = trainer.strategy.engine.config.compute_dtype


def trainer(**kw) -> pl.Trainer:
    """Clipping, accumulation 2, on the cpu."""
    base = dict(max_steps=20, accumulate_grad_batches=2, gradient_clip_val=1.0, accelerator="cpu", devices=1,
                logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                limit_val_batches=0)
    base.update(kw)
    return pl.Trainer(**base)


def plain(**kw) -> dict[str, torch.Tensor]:
    module = LM()
    trainer(**kw).fit(module)
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_strategy_equals_plain_lightning_for_a_few_steps(tmp_path):
    """Fast: 4 steps, states on cpu, pages moving, a validation pass through the engine."""
    want = plain(max_steps=4)
    module, stats = LM(), Stats()
    trainer(max_steps=4, strategy=PagememStrategy(config_for(tmp_path)), callbacks=[stats], limit_val_batches=2,
            val_check_interval=4).fit(module)
    assert not differing(want, module.state_dict())  # validation changes nothing
    assert stats.stats["evictions"] > 0 and stats.stats["iterations"]["planned"] > 0
    assert type(next(module.parameters())) is torch.nn.Parameter  # closed at teardown: plain parameters again


def test_the_strategy_is_registered_by_name():
    t = pl.Trainer(strategy="pagemem", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert isinstance(t.strategy, PagememStrategy)
    assert t.strategy.precision_plugin.precision == "32-true"


def checkpoints(tmp_path, every: int = 10) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_last=True, save_top_k=-1)


@pytest.mark.slow
def test_strategy_20_steps_bit_for_bit_saves_and_resumes_last(tmp_path):
    """The acceptance run: 20 steps, clipping, accumulation 2, warm-up; states on nvme; a run
    stopped at step 10 resumed with ckpt_path="last" ends where the uninterrupted run ends."""
    want = plain()
    cfg = config_for(tmp_path, "nvme")
    module, stats = LM(), Stats()
    trainer(strategy=PagememStrategy(cfg), callbacks=[stats]).fit(module)
    assert not differing(want, module.state_dict())
    assert stats.stats["evictions"] > 0 and stats.stats["optimizer_tier"] == "nvme"
    first = LM()
    trainer(strategy=PagememStrategy(cfg), callbacks=[checkpoints(tmp_path)], enable_checkpointing=True,
            max_steps=10).fit(first)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert sorted(os.listdir(last)) == ["latest", "lightning-00000010.pt", "step-00000010"]
    resumed, after = LM(), Stats()
    t = trainer(strategy=PagememStrategy(cfg), callbacks=[checkpoints(tmp_path), after], enable_checkpointing=True)
    t.fit(resumed, ckpt_path="last")
    assert t.global_step == 20
    assert not differing(want, resumed.state_dict())
    assert after.lr == stats.lr


@pytest.mark.slow
def test_strategy_bf16_trains(tmp_path):
    module, stats = LM(), Stats()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    losses = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer(strategy=PagememStrategy(config_for(tmp_path)), precision="bf16-mixed",
            callbacks=[stats, Losses()]).fit(module)
    assert stats.dtype == torch.bfloat16
    assert len(losses) == 40 and all(map(lambda x: x == x and abs(x) < 1e4, losses))
    assert sum(losses[-10:]) < sum(losses[:10])
    after = module.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values()) and differing(before, after)
    assert after["model.lm_head.weight"].dtype == torch.float32  # trained in bf16 over fp32 master weights


# ---------------------------------------------------------------------- refused at start

def refused(tmp_path, match, module=None, config=None, **kw) -> None:
    with pytest.raises(pagemem.ConfigError, match=match):
        trainer(strategy=PagememStrategy(config or config_for(tmp_path)), **kw).fit(module or LM())


def test_deepspeed_precision_also_configured_is_refused(tmp_path):
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision

    with pytest.raises(pagemem.ConfigError, match="precision: .*got DeepSpeedPrecision"):
        trainer(strategy=PagememStrategy(config_for(tmp_path)), plugins=[DeepSpeedPrecision("32-true")])


def test_fsdp_precision_also_configured_is_refused(tmp_path):
    from lightning.pytorch.plugins.precision import FSDPPrecision

    with pytest.raises(pagemem.ConfigError, match="precision: .*got FSDPPrecision"):
        trainer(strategy=PagememStrategy(config_for(tmp_path)), plugins=[FSDPPrecision("32-true")])


@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_a_precision_the_strategy_does_not_offer_is_refused(tmp_path, precision):
    with pytest.raises(pagemem.ConfigError, match="precision: "):
        trainer(strategy=PagememStrategy(config_for(tmp_path)), precision=precision)


def test_an_optimizer_the_engine_does_not_offer_is_refused_before_any_step(tmp_path):
    module = LM(optimizer="sgd")
    before = {k: v.clone() for k, v in module.state_dict().items()}
    refused(tmp_path, "configure_optimizers: .*torch.optim.AdamW, got torch.optim.sgd.SGD", module)
    assert not differing(before, module.state_dict())


def test_amsgrad_is_refused(tmp_path):
    refused(tmp_path, r"configure_optimizers.param_groups\[0\].amsgrad", LM(amsgrad=True))


@pytest.mark.parametrize("change, match", [
    (dict(max_grad_norm=1.0), "PagememStrategy.config.max_grad_norm: the framework clips"),
    (dict(accumulation_steps=3), "PagememStrategy.config.accumulation_steps: .*must be 1 or 2, got 3"),
])
def test_engine_knobs_the_trainer_owns_are_refused(tmp_path, change, match):
    refused(tmp_path, match, config=dataclasses.replace(config_for(tmp_path), **change))


def test_a_checkpoint_that_is_not_the_strategys_is_refused(tmp_path):
    plain_ckpt = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, plain_ckpt)
    with pytest.raises(pagemem.ConfigError, match="ckpt_path: .*holds no pagemem checkpoint"):
        trainer(strategy=PagememStrategy(config_for(tmp_path))).fit(LM(), ckpt_path=str(plain_ckpt))


def test_a_config_that_is_not_an_engine_config_is_refused():
    with pytest.raises(pagemem.ConfigError, match="config: must be a pagemem.EngineConfig or None, got dict"):
        PagememStrategy({"gpu_bytes": 1})


class Regression(pl.LightningModule):
    """A module whose steps call ``self(x)`` (its own forward, inside the engine's call of it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        g = torch.Generator().manual_seed(1)
        self.xy = list(zip(torch.randn(32, 32, generator=g), torch.randn(32, 1, generator=g)))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val", torch.nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.xy, batch_size=8)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.xy[:8], batch_size=8)


def test_a_module_calling_its_own_forward_trains_and_validates_as_plain_lightning(tmp_path):
    from exactness import engine_config

    def run(**kw):
        module = Regression()
        t = trainer(max_steps=4, limit_val_batches=1, val_check_interval=2, **kw)
        t.fit(module)
        t.validate(module)  # after fit: an engine for evaluation only
        return module.state_dict(), float(t.callback_metrics["val"])

    want, want_val = run()
    x, y = map(torch.stack, zip(*Regression().xy[:8]))
    cfg = engine_config(Regression().net, lambda run, m, s: torch.nn.functional.mse_loss(run(x), y), tmp_path)
    got, got_val = run(strategy=PagememStrategy(cfg))
    assert not differing(want, got) and got_val == want_val


def test_several_devices_are_refused(tmp_path):
    with pytest.raises(pagemem.ConfigError, match="Trainer.devices, Trainer.num_nodes: .*got 2 devices on 1 nodes"):
        trainer(strategy=PagememStrategy(config_for(tmp_path)), devices=2).fit(LM())


def test_a_save_that_fails_leaves_the_last_whole_checkpoint_to_resume(tmp_path):
    """A full disk while the engine's part is written (Lightning's part already there): resuming
    the directory takes the checkpoint ``latest`` still names, with its own Lightning part."""
    from exactness import engine_config

    x, y = map(torch.stack, zip(*Regression().xy[:8]))
    cfg = engine_config(Regression().net, lambda run, m, s: torch.nn.functional.mse_loss(run(x), y), tmp_path)

    class DiskFull(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 4:
                def save(*args, **kwargs):
                    raise OSError(28, "No space left on device")
                trainer.strategy.engine.save = save

    def run(callbacks=(), ckpt_path=None, **kw):
        module = Regression()
        trainer(max_steps=4, callbacks=[checkpoints(tmp_path, every=2), *callbacks], enable_checkpointing=True,
                **kw).fit(module, ckpt_path=ckpt_path)
        return module.state_dict()

    want = run(strategy=PagememStrategy(cfg))
    shutil.rmtree(tmp_path / "ckpt")
    with pytest.raises(OSError, match="No space left"):
        run([DiskFull()], strategy=PagememStrategy(cfg))
    partial, last = tmp_path / "ckpt" / "epoch=1-step=4.ckpt", tmp_path / "ckpt" / "last.ckpt"
    assert (partial / "lightning-00000004.pt").is_file() and not (partial / "latest").exists()
    assert (last / "latest").read_text() == "step-00000002"
    with pytest.raises(pagemem.ConfigError, match="ckpt_path: .*holds no pagemem checkpoint"):
        run(strategy=PagememStrategy(cfg), ckpt_path=str(partial))
    got = run(strategy=PagememStrategy(cfg), ckpt_path="last")
    assert not differing(want, got)


def test_updates_during_backward_where_lightning_neither_clips_nor_accumulates(tmp_path):
    from exactness import engine_config

    def run(**kw):
        module = Regression()
        trainer(**{"max_steps": 4, "gradient_clip_val": None, "accumulate_grad_batches": 1, **kw}).fit(module)
        assert "strategy" not in kw or all(p.grad is None for p in module.parameters())  # no handle outlives it
        return module.state_dict()

    x, y = map(torch.stack, zip(*Regression().xy[:8]))
    cfg = engine_config(Regression().net, lambda run, m, s: torch.nn.functional.mse_loss(run(x), y), tmp_path,
                        overlap_update=True)
    stats = Stats()
    assert not differing(run(), run(strategy=PagememStrategy(cfg), callbacks=[stats]))
    assert stats.stats["overlapped_updates"] > 0
    with pytest.raises(pagemem.ConfigError, match="PagememStrategy.config.overlap_update: .*cannot be clipped"):
        run(strategy=PagememStrategy(cfg), gradient_clip_val=0.5)
