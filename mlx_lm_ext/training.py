"""What the host installs in ``mlx_lm.lora`` for a plugin's ``--loss NAME``.

- owner ``lora.loss``: ``mlx_lm.lora.train`` and ``.evaluate`` get ``loss=``
  from ``make_loss`` (one per model) and, when the plugin has one,
  ``iterate_batches=`` from the hook of that name.
- owner ``lora.data``: ``mlx_lm.lora.load_dataset`` asks the hook
  ``load_dataset`` first (a plugin whose rows are not mlx-lm's formats).
- owner ``lora.report``, for the length of one ``train`` call: a loss that
  names ``metrics`` has them printed beside mlx-lm's train and validation
  lines (a ``TrainUI`` subclass in ``mlx_lm.tuner.trainer``) and added to
  the reporting callbacks' dicts; ``--test`` prints them after the test loss.
  Each train line also gives mlx-lm's iterations per second and peak memory
  (its callback's values, which its own console line leaves out). A
  non-finite training loss stops the run at the step that made it (exit 2),
  before any adapters of that step or later are saved.

Metrics inside the compiled step: mlx-lm compiles its step with the model's
state as input and output, so the loss adds each batch's values to an array
the model holds under ``METRICS`` (a key starting with ``_``: not a
parameter, never trained or saved). The step evaluates it with the model;
the report reads and resets it between steps. Evaluation is not compiled:
its values are summed here.
"""

import contextlib
import functools
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx

from . import PluginError, patching, plugins

log = logging.getLogger("mlx_lm_ext")

METRICS = "_mlx_lm_ext_metrics"


def install(loss: str, args: Any) -> None:
    """Install the ``lora.loss`` (and ``lora.data``) owners for ``--loss loss``."""
    mod = sys.modules["mlx_lm.lora"]
    made: Dict[int, Callable] = {}
    sums: Dict[str, Any] = {}  # "eval": [sum of each metric..., batches]

    def loss_for(model):
        # One loss per model: train and evaluate share its one-time checks.
        if id(model) not in made:
            fn = plugins.first("make_loss", name=loss, model=model, args=args)
            if fn is None:
                plugins.fail(f"no active plugin provides the loss '{loss}'")
            names = tuple(getattr(fn, "metrics", ()) or ())
            made[id(model)] = _reporting(fn, names, sums) if names else fn
        return made[id(model)]

    def batches():
        return plugins.first("iterate_batches", name=loss, args=args)

    def make_train(train):
        @functools.wraps(train)
        def wrapper(*a, **kw):
            model = kw.get("model", a[0] if a else None)
            try:
                _fill(kw, loss_for(model), batches())
                names = getattr(kw["loss"], "metrics", ())
                if not names:
                    return train(*a, **kw)
                with _reports(model, names, sums, kw):
                    return train(*a, **kw)
            except PluginError as e:  # bad input found on the first batch: exit 2, one line
                plugins.fail(str(e))

        return wrapper

    def make_evaluate(evaluate):
        @functools.wraps(evaluate)
        def wrapper(*a, **kw):
            model = kw.get("model", a[0] if a else None)
            try:
                _fill(kw, loss_for(model), batches())
                sums.pop("eval", None)
                value = evaluate(*a, **kw)
            except PluginError as e:
                plugins.fail(str(e))
            names = getattr(kw["loss"], "metrics", ())
            if names:  # mlx_lm.lora's evaluate is its --test
                from mlx_lm.cli_ui import rprint

                rprint("Test " + _line(names, _means(sums.pop("eval", None))))
            return value

        return wrapper

    patching.wrap("lora.loss", mod, "train", make_train)
    patching.wrap("lora.loss", mod, "evaluate", make_evaluate)
    if plugins.active_implements("load_dataset"):
        patching.wrap("lora.data", mod, "load_dataset", _make_loader(loss, args))


def _fill(kw, loss, iterate):
    if kw.get("loss") is None:
        kw["loss"] = loss
    if kw.get("iterate_batches") is None and iterate is not None:
        kw["iterate_batches"] = iterate


def _make_loader(loss, args):
    def make(original):
        @functools.wraps(original)
        def load_dataset(run_args, tokenizer):
            data = getattr(run_args, "data", None)
            if not getattr(run_args, "hf_dataset", None) and plugins.missing_folder(data):
                plugins.fail(f"--data {data}: no such folder")
            try:
                sets = plugins.first("load_dataset", name=loss, args=run_args, tokenizer=tokenizer)
            except PluginError as e:  # a bad row: its file and line, exit 2
                plugins.fail(str(e))
            if sets is not None:
                return sets
            try:
                return original(run_args, tokenizer)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                # mlx-lm's reader names neither the file nor the line
                plugins.fail(_bad_line(data) or f"--data: {e}")

        return load_dataset

    return make


def _bad_line(data: Any) -> Optional[str]:
    """``"train.jsonl line 4, column 10: ..."`` for the first line of the local
    dataset folder ``data`` that mlx-lm's reader cannot take, else None."""
    if not data or not Path(data).is_dir():
        return None
    for name in ("train", "valid", "test"):  # the order mlx-lm reads them in
        path = Path(data) / f"{name}.jsonl"
        if not path.is_file():
            continue
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    col = len(raw[: e.start].decode("utf-8", "replace")) + 1
                    return f"{path.name} line {n}, column {col}: not UTF-8 text (byte 0x{raw[e.start]:02x})"
                try:
                    json.loads(text)
                except json.JSONDecodeError as e:
                    return f"{path.name} line {n}, column {e.colno}: not valid JSON ({e.msg})"
    return None


# ---------------------------------------------------------------- metrics


def _reporting(fn: Callable, names: tuple, sums: Dict[str, Any]) -> Callable:
    """A loss returning ``(loss, ntokens)`` that records ``fn``'s third value."""

    def loss(model, *batch):
        value, ntoks, values = fn(model, *batch)
        # [metrics..., loss, batches]: the loss column tells a diverged step
        loss_col = value.astype(mx.float32).reshape(1)
        row = mx.concatenate([values.astype(mx.float32).reshape(-1), loss_col, mx.ones((1,))])
        if model.training:  # inside the compiled step: the model carries the sums
            model[METRICS] = model[METRICS] + row if METRICS in model else row
        else:
            mx.eval(value, ntoks, row)
            sums["eval"] = row if sums.get("eval") is None else sums["eval"] + row
        return value, ntoks

    loss.metrics = names
    return loss


def _means(acc: Optional[mx.array]) -> Optional[List[float]]:
    if acc is None:
        return None
    acc = acc.tolist()
    return [v / acc[-1] for v in acc[:-2]] if acc[-1] else None


def _line(names, means) -> str:
    if means is None:
        return "metrics: no batches"
    return ", ".join(f"{n.replace('_', ' ')} {v:.3f}" for n, v in zip(names, means, strict=True))


class _Callback:
    """mlx-lm's reporting callback, with the metrics added to its dicts."""

    def __init__(self, inner: Any, last: Dict[str, Any]):
        self.inner, self.last = inner, last

    def on_train_loss_report(self, info: Dict[str, Any]) -> None:
        from mlx_lm.cli_ui import rprint

        line = self.last.get("train_line")
        if line is not None:
            its, peak = info.get("iterations_per_second"), info.get("peak_memory")
            if its is not None and peak is not None:
                line += f", {its:.3f} it/s, peak mem {peak:.2f} GB"
            rprint(line)
        info.update({f"train_{k}": v for k, v in self.last.get("train", {}).items()})
        if self.inner is not None:
            self.inner.on_train_loss_report(info)

    def on_val_loss_report(self, info: Dict[str, Any]) -> None:
        info.update({f"val_{k}": v for k, v in self.last.get("val", {}).items()})
        if self.inner is not None:
            self.inner.on_val_loss_report(info)


def _reports(model, names, sums, kw):
    """For one ``train`` call: the sums on the model, the report lines, the callback."""
    import mlx_lm.tuner.trainer as trainer
    from mlx_lm.cli_ui import rprint

    last: Dict[str, Any] = {}
    base = trainer.TrainUI

    def reset():
        model[METRICS] = mx.zeros((len(names) + 2,))

    class TrainUI(base):
        steps = 0

        def advance(self):
            super().advance()
            self.steps += 1
            acc = model.get(METRICS)  # evaluated with the step's state
            loss = acc[-2].item() if acc is not None else 0.0
            if not math.isfinite(loss):
                raise PluginError(
                    f"the training loss is {loss} at iteration {self.steps}: training stopped "
                    "before saving adapters from this step (a smaller --learning-rate or "
                    "loss strength may help)"
                )

        def report_train(self, it, train_loss, tokens_sec, trained_tokens):
            super().report_train(it, train_loss, tokens_sec, trained_tokens)
            means = _means(model.get(METRICS))
            reset()
            last["train"] = dict(zip(names, means or [], strict=False))
            # printed by the callback, which has mlx-lm's it/s and peak memory
            last["train_line"] = f"  {it:>4}    train {_line(names, means)}"

        def report_val(self, it, val_loss, val_time):
            super().report_val(it, val_loss, val_time)
            means = _means(sums.pop("eval", None))
            last["val"] = dict(zip(names, means or [], strict=False))
            rprint(f"  {it:>4}    val {_line(names, means)}")

    reset()  # before mlx-lm captures the model's state for its compiled step
    kw["training_callback"] = _Callback(kw.get("training_callback"), last)

    @contextlib.contextmanager
    def scope():
        try:
            with patching.scoped("lora.report", [(trainer, "TrainUI", TrainUI)]):
                yield
        finally:
            model.pop(METRICS, None)

    return scope()
