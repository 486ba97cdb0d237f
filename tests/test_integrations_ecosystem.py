"""The examples of docs/integrations_ecosystem.md, run: Hugging Face ``Trainer`` (``optimizers=``
and ``optimizer_cls_and_kwargs``), Lightning (``precision="bf16-true"``) and accelerate.

Each library is optional (none is a dependency of bf16opt or of its test extra): a test is
skipped, naming the package, where it is not installed.  The memory each example costs is
asserted here from ``memory_report``, as the document states it.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch

import bf16opt

DOCUMENT = Path(__file__).resolve().parent.parent / "docs" / "integrations_ecosystem.md"

WIDTH = 16


def tiny_data(count: int = 32) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(WIDTH, 1, generator=generator)
    rows = []
    for _ in range(count):
        x = torch.randn(WIDTH, generator=generator)
        rows.append({"x": x.to(torch.bfloat16), "labels": x @ teacher})
    return rows


class Regressor(torch.nn.Module):
    """A model the way Trainer expects one: keyword inputs, a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.body(x).float().squeeze(-1)
        result = {"logits": out}
        if labels is not None:
            result["loss"] = torch.nn.functional.mse_loss(out, labels.float().reshape(out.shape))
        return result


MyModel = Regressor  # the document's name for the user's model


def state_dtypes(opt: torch.optim.Optimizer) -> set[tuple[str, torch.dtype]]:
    return {(key, value.dtype) for state in opt.state.values() for key, value in state.items()
            if isinstance(value, torch.Tensor) and key != "step"}


# ---------------------------------------------------------------- Hugging Face Trainer
def hf_args(tmp_path, **extra):
    transformers = pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate "
                                              "(pip install accelerate)")
    settings = dict(output_dir=str(tmp_path / "trainer"), max_steps=4, per_device_train_batch_size=8,
                    learning_rate=1e-3, weight_decay=0.1, report_to=[], save_strategy="no",
                    logging_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    settings.update(extra)
    return transformers, transformers.TrainingArguments(**settings)


def test_hf_trainer_with_an_optimizer_and_a_scheduler(tmp_path):
    transformers, args = hf_args(tmp_path)
    model = Regressor().to(torch.bfloat16)
    start = [p.detach().clone() for p in model.parameters()]
    dataset = tiny_data()
    # --- as in the document
    opt = bf16opt.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, precision="bf16-kahan")
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / args.max_steps)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset,
                                   optimizers=(opt, schedule))
    trainer.train()
    # ---
    assert trainer.lr_scheduler is schedule and schedule.last_epoch == args.max_steps
    assert all(state["step"] == args.max_steps for state in opt.state.values())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(start, model.parameters()))
    assert state_dtypes(opt) == {("exp_avg", torch.bfloat16), ("exp_avg_sq", torch.bfloat16),
                                 ("compensation", torch.bfloat16)}
    assert bf16opt.memory_report(opt).optimizer_bytes_per_param == pytest.approx(6, abs=0.1)


def test_hf_trainer_builds_the_optimizer_from_class_and_kwargs_and_resumes_exactly(tmp_path):
    """``optimizer_cls_and_kwargs``: Trainer makes its two param groups (weight decay / none) and
    passes bf16opt's keywords through; a run resumed from a Trainer checkpoint (bf16 weights,
    bf16opt's state dict with the step counters, scheduler, data position) ends with the same bits
    as the uninterrupted run, stochastic rounding included."""
    kwargs = {"lr": 1e-3, "precision": "bf16-sr", "seed": 7}

    def train(output, **extra):
        transformers, args = hf_args(output, **extra)
        model = Regressor().to(torch.bfloat16)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=tiny_data(),
                                       optimizer_cls_and_kwargs=(bf16opt.AdamW, kwargs))
        return trainer, model

    trainer, model = train(tmp_path / "a", save_strategy="steps", save_steps=2)
    trainer.train()
    opt = trainer.optimizer.optimizer  # accelerate's AcceleratedOptimizer wraps it
    assert type(opt) is bf16opt.AdamW
    assert [group["weight_decay"] for group in opt.param_groups] == [0.1, 0.0]
    assert {bf16opt.PRESETS["bf16-sr"]} == {group["precision"] for group in opt.param_groups}
    assert state_dtypes(opt) == {("exp_avg", torch.bfloat16), ("exp_avg_sq", torch.bfloat16)}
    assert bf16opt.memory_report(opt).optimizer_bytes_per_param == pytest.approx(4, abs=0.1)

    resumed_trainer, resumed = train(tmp_path / "a", save_strategy="no")
    resumed_trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "trainer" / "checkpoint-2"))
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- Lightning
def test_lightning_bf16_true(tmp_path):
    lightning = pytest.importorskip("lightning", reason="needs lightning (pip install lightning)")

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Regressor()

        def training_step(self, batch, batch_index):
            return self.model(**batch)["loss"]

        # --- as in the document
        def configure_optimizers(self):
            # precision="bf16-true" has made the params bf16 by now; bf16opt keeps an exact fp32
            # master as the bf16 param plus a 16-bit remainder
            opt = bf16opt.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1, precision="fp32-remainder")
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.max_steps)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
        # ---

    module = Module()
    loader = torch.utils.data.DataLoader(tiny_data(), batch_size=8)
    trainer = lightning.Trainer(precision="bf16-true", max_steps=4, accelerator="cpu", devices=1,
                                gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                default_root_dir=str(tmp_path))
    trainer.fit(module, loader)
    opt = trainer.optimizers[0]
    assert type(opt) is bf16opt.AdamW
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    assert all(state["step"] == 4 for state in opt.state.values())
    assert state_dtypes(opt) == {("exp_avg", torch.float32), ("exp_avg_sq", torch.float32),
                                 ("remainder", torch.int16)}
    assert bf16opt.memory_report(opt).optimizer_bytes_per_param == pytest.approx(10, abs=0.1)
    # a Lightning checkpoint holds bf16opt's state dict as it is
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["optimizer_states"][0]
    fresh = bf16opt.AdamW(Regressor().to(torch.bfloat16).parameters(), lr=1e-3, precision="fp32-remainder")
    fresh.load_state_dict(saved)
    assert state_dtypes(fresh) == state_dtypes(opt)
    for a, b in zip(fresh.state.values(), opt.state.values()):
        assert torch.equal(a["remainder"], b["remainder"])


# ---------------------------------------------------------------- accelerate
def test_accelerate_prepare_changes_no_bit(tmp_path):
    """accelerator.prepare wraps the optimizer; the steps are bit for bit those of a plain loop."""
    accelerate = pytest.importorskip("accelerate", reason="needs accelerate (pip install accelerate)")

    def plain():
        model = Regressor().to(torch.bfloat16)
        opt = bf16opt.AdamW(model.parameters(), lr=1e-3, precision="bf16-sr", seed=3)
        for batch in torch.utils.data.DataLoader(tiny_data(), batch_size=8):
            loss = model(**batch)["loss"]
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        return model

    dataset, checkpoint_dir = tiny_data(), str(tmp_path / "state")
    # --- as in the document
    accelerator = accelerate.Accelerator(cpu=True)
    model = MyModel().to(torch.bfloat16)
    opt = bf16opt.AdamW(model.parameters(), lr=1e-3, precision="bf16-sr", seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for batch in loader:
        loss = model(**batch)["loss"]
        opt.zero_grad()
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    accelerator.save_state(checkpoint_dir)
    # ---
    trained = plain()
    untrained = MyModel().to(torch.bfloat16)
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), untrained.parameters()))
    for a, b in zip(model.parameters(), trained.parameters()):
        assert torch.equal(a, b)
    inner = opt.optimizer
    assert type(inner) is bf16opt.AdamW
    # accelerate's checkpoint holds the model and bf16opt's state dict: a fresh run loads both
    again = accelerate.Accelerator(cpu=True)
    fresh = Regressor().to(torch.bfloat16)
    torch.nn.init.zeros_(fresh.body[0].weight)
    fresh_opt = bf16opt.AdamW(fresh.parameters(), lr=1e-3, precision="bf16-sr", seed=0)
    fresh, fresh_opt = again.prepare(fresh, fresh_opt)
    again.load_state(checkpoint_dir)
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert fresh_opt.optimizer.state_dict()["param_groups"] == inner.state_dict()["param_groups"]
    for a, b in zip(fresh_opt.optimizer.state.values(), inner.state.values()):
        assert all(torch.equal(a[key], b[key]) for key in ("exp_avg", "exp_avg_sq"))


# ---------------------------------------------------------------- the document
def snippets_run_here() -> list[str]:
    source = Path(__file__).read_text(encoding="utf-8")
    return [textwrap.dedent(block).strip()
            for block in re.findall(r"# --- as in the document\n(.*?)\n *# ---\n", source, re.DOTALL)]


def document_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOCUMENT.read_text(encoding="utf-8"), re.DOTALL)


def stripped_lines(text: str) -> str:
    """The lines without their indentation: a method tested inside a class here is the same
    code as the method inside the document's class."""
    return "\n".join(line.strip() for line in text.strip().splitlines())


def test_document_examples_are_the_tested_code():
    """Each example tested above is part of a code block of docs/integrations_ecosystem.md,
    line for line."""
    blocks = [stripped_lines(block) for block in document_blocks()]
    snippets = snippets_run_here()
    assert len(snippets) == 3
    for snippet in snippets:
        assert any(stripped_lines(snippet) in block for block in blocks), snippet
    text = DOCUMENT.read_text(encoding="utf-8")
    for words in ("optimizers=", "optimizer_cls_and_kwargs", 'precision="bf16-true"', "accelerator.prepare"):
        assert words in text


@pytest.mark.parametrize("index,package", [(0, "transformers"), (1, "lightning"), (2, "accelerate")])
def test_document_example_runs_as_written(index, package, tmp_path, monkeypatch):
    """Each code block of the document is a complete program: it runs as written."""
    pytest.importorskip(package, reason=f"needs {package} (pip install {package})")
    if package == "transformers":
        pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (pip install accelerate)")
    monkeypatch.chdir(tmp_path)
    blocks = document_blocks()
    assert len(blocks) == 3 and package in blocks[index]
    exec(compile(blocks[index], f"{DOCUMENT.name} example {index}", "exec"), {"__name__": "example"})  # noqa: S102
