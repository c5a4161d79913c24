"""The training loop of every shipped model: optimizer steps with gradient clipping and a learning
rate schedule, a progress bar, periodic evaluation that keeps the best weights, and the time taken.

Each model's ``train`` sets up its data, optimizer and schedule and says what one unit of work is
(a step, or an epoch of steps for the recommender) and how it is evaluated; :func:`loop` does the
rest, the same way for all of them::

    trainer = Trainer(model, optimizer, scheduler, clip=1.0)
    result = loop(trainer, steps, lambda step: {"loss": trainer.step(loss_of(batch()))},
                  evaluate=every_so_often, every=steps // 10)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["Result", "Trainer", "loop", "warmup_cosine", "warmup_times_cosine"]


class Trainer:
    """One optimizer with its schedule and clipping: :meth:`step` makes one update from a loss."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        clip: float | None = 1.0,
    ):
        self.model, self.optimizer, self.scheduler, self.clip = model, optimizer, scheduler, clip
        self.running: float | None = None  # the loss, smoothed over about 50 steps

    def step(self, loss: torch.Tensor) -> float:
        """Backward, clip, update, advance the schedule; returns the loss as a float."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        value = loss.item()
        self.running = value if self.running is None else 0.98 * self.running + 0.02 * value
        return value


@dataclass
class Result:
    """What a run gives back besides the model: its evaluations, the best score kept, its time."""

    history: list[dict] = field(default_factory=list)
    best: float | None = None
    seconds: float = 0.0


def loop(
    trainer: Trainer,
    units: int,
    work: Callable[[int], dict],
    *,
    unit: str = "step",
    progress: bool | None = True,
    every: int | None = None,
    evaluate: Callable[[int], dict] | None = None,
    last: bool = True,
    best: str | None = None,
    ties: bool = False,
    log: Callable[[str], object] | None = None,
    describe: Callable[[int, dict], str] | None = None,
) -> Result:
    """Run ``work(i)`` for ``i`` in ``range(units)`` with the model in train mode and a progress bar
    showing what it returns; every ``every`` units (and after the last one, unless ``last=False``),
    ``evaluate(i)`` with the model in eval mode, its dict kept in the history (and
    ``log(describe(i, metrics))``). With ``best`` (a key of the evaluations), the weights of the
    best evaluation (the later one of equal scores with ``ties=True``) are put back at the end.
    The model is left in eval mode."""
    from tqdm.auto import tqdm

    model = trainer.model
    start = time.perf_counter()
    result = Result()
    best_state: dict[str, torch.Tensor] | None = None
    bar = tqdm(range(units), desc="training", unit=unit, disable=not progress)
    for i in bar:
        model.train()
        shown = work(i)
        bar.set_postfix(**{k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in shown.items()})
        due = every is not None and ((i + 1) % every == 0 or (last and i == units - 1))
        if evaluate is not None and due:
            model.eval()
            metrics = evaluate(i)
            result.history.append(metrics)
            if log is not None and describe is not None:
                log(describe(i, metrics))
            better = result.best is None or metrics[best] > result.best or (ties and metrics[best] == result.best)
            if best is not None and better:
                result.best = metrics[best]
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    result.seconds = round(time.perf_counter() - start, 1)
    return result


def warmup_cosine(steps: int, warmup: int) -> Callable[[int], float]:
    """Linear warmup over ``warmup`` steps, then a cosine from 1 to 0 over the rest."""

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return schedule


def warmup_times_cosine(steps: int, warmup: int) -> Callable[[int], float]:
    """A linear warmup times a cosine over all ``steps`` (both from step 0)."""
    return lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps)))
