"""The finite-value guard of ``PolicyWorker.train``: the checks that keep a NaN out of the model.

What is checked, and when (training only; ``eval_mode`` skips the guard), for each global batch:

1. before the gradient all-reduce: the loss (:meth:`StepGuard.check_loss`). The caller stops its
   micro-batch loop at the first non-finite micro-batch loss (no collective inside that loop) and
   all-reduces a "this rank saw one" flag together with the loss sum; the check decides from
   those all-reduced values, so every rank decides alike and none is left in a collective;
2. after clipping, before ``optimizer.step()``: the gradient norm
   (:meth:`StepGuard.check_grad_norm`; computed from the all-reduced gradients, so alike on
   every rank) and every param group's learning rate (:meth:`StepGuard.check_lr`);
3. during the step: torch refusing a step size beyond float32 (:meth:`StepGuard.step`);
4. after the step: every trainable parameter (:meth:`StepGuard.check_parameters`).

Each failure raises :class:`~nrl_tasks.models.policy.errors.NonFiniteTrainingError` carrying the
version the step would have produced, the global batch index and the rank. State left behind:
a failure in 1 or 2 happens before ``optimizer.step()``, so weights and optimizer state are the
ones the global batch started with (``weights_valid`` is True when it is the call's first global
batch; False otherwise, since earlier global batches of the call did step). A failure in 3 or 4
comes after (part of) the step was applied: ``weights_valid`` is False. Apart from running that
step (:meth:`StepGuard.step`) the guard changes nothing; ``PolicyWorker.train`` then drops the gradients, records an error with
``weights_valid=False`` so that :func:`refuse_invalid_weights` refuses further use until a
checkpoint is loaded, and re-raises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nrl_tasks.models.policy.errors import NonFiniteTrainingError
from nrl_tasks.models.policy.workers.optim import all_finite, first_nonfinite

__all__ = ["StepGuard", "refuse_invalid_weights"]


def refuse_invalid_weights(
    invalid: NonFiniteTrainingError | None, what: str, *, rank: int, weights_version: int
) -> None:
    """Raise if ``invalid`` (the error that broke a worker's weights) is set: ``what`` is refused
    until ``load_checkpoint`` or ``setup`` makes the weights valid again."""
    if invalid is not None:
        raise NonFiniteTrainingError(
            f"policy worker rank {rank}: {what} refused: the weights are invalid since a failed train "
            f"call ({invalid}); load a checkpoint (or re-create the policy) first",
            what="invalid_weights", weights_version=weights_version, rank=rank, weights_valid=False,
        )


@dataclass(frozen=True)
class StepGuard:
    """The checks around one global batch's optimizer step (see the module docstring).

    ``weights_version`` is the version the step would produce (the worker's version + 1),
    ``global_batch`` the index of the global batch within the train call, ``rank`` this rank.
    """

    weights_version: int
    global_batch: int
    rank: int

    def _where(self, weights_valid: bool | None = None) -> dict:
        # weights and optimizer state are untouched until optimizer.step(); only if an
        # earlier global batch of this call stepped are they no longer the call's start
        return {"weights_version": self.weights_version, "global_batch": self.global_batch, "rank": self.rank,
                "weights_valid": self.global_batch == 0 if weights_valid is None else weights_valid}

    def _state_note(self) -> str:
        if self.global_batch == 0:
            return "; weights and optimizer state are unchanged"
        return (f"; the {self.global_batch} earlier global batch(es) of this call did step, so the weights are a "
                "partial update and no longer valid: load a checkpoint before using this policy")

    def check_loss(self, nonfinite_ranks: float, loss_sum: torch.Tensor, local_loss: torch.Tensor,
                   microbatch: int | None) -> None:
        """Before the step: ``nonfinite_ranks`` (all-reduced count of ranks that stopped at a
        non-finite micro-batch loss) must be 0 and the all-reduced ``loss_sum`` finite.
        ``local_loss`` and ``microbatch`` (this rank's first non-finite micro-batch, or None)
        go into the error."""
        if nonfinite_ranks > 0 or not math.isfinite(float(loss_sum)):
            mb_text = f"micro-batch {microbatch}" if microbatch is not None else "a micro-batch of another rank"
            raise NonFiniteTrainingError(
                f"non-finite loss ({float(local_loss)}) in {mb_text} of global batch {self.global_batch} of the "
                f"train call for weights version {self.weights_version} (rank {self.rank}); optimizer step skipped"
                f"{self._state_note()}",
                what="loss", value=float(local_loss), microbatch=microbatch, **self._where(),
            )

    def check_grad_norm(self, grad_norm: float, names: list[str], params: list[torch.nn.Parameter]) -> None:
        """Before the step: the (pre-clipping) gradient norm must be finite; the error names the
        first non-finite gradient, if any."""
        if not math.isfinite(grad_norm):
            bad = first_nonfinite([(n, p.grad) for n, p in zip(names, params)])
            detail = f"first non-finite gradient: {bad}" if bad else "every gradient is finite, their norm overflows float32"
            raise NonFiniteTrainingError(
                f"non-finite grad_norm ({grad_norm}) in global batch {self.global_batch} of the train call for weights "
                f"version {self.weights_version} (rank {self.rank}; {detail}); optimizer step skipped"
                f"{self._state_note()}",
                what="grad_norm", value=grad_norm, parameter=bad, **self._where(),
            )

    def check_lr(self, optimizer: torch.optim.Optimizer) -> list[float]:
        """Before the step: every param group's learning rate must be finite. Returns them."""
        lrs = [float(g["lr"]) for g in optimizer.param_groups]
        if not all(math.isfinite(lr) for lr in lrs):
            raise NonFiniteTrainingError(
                f"non-finite learning rate {lrs} in global batch {self.global_batch} of the train call for weights "
                f"version {self.weights_version} (rank {self.rank}); optimizer step skipped{self._state_note()}",
                what="lr", value=next(lr for lr in lrs if not math.isfinite(lr)), **self._where(),
            )
        return lrs

    def step(self, optimizer: torch.optim.Optimizer, lr: float) -> None:
        """``optimizer.step()``; torch refusing a step size beyond float32 (``lr`` 1e39, say)
        becomes a ``NonFiniteTrainingError`` with ``weights_valid=False`` (some parameters and
        moments were already updated); any other error propagates unchanged."""
        try:
            optimizer.step()
        except (RuntimeError, OverflowError) as exc:
            if "overflow" not in str(exc):
                raise
            raise NonFiniteTrainingError(
                f"the optimizer step of global batch {self.global_batch} of the train call for weights version "
                f"{self.weights_version} overflowed float32 (rank {self.rank}; lr {lr}): {exc}. The weights "
                "and optimizer state of this policy are no longer valid: load a checkpoint (or re-create the "
                "policy) before using it",
                what="update", value=lr, **self._where(weights_valid=False),
            ) from exc

    def check_parameters(self, names: list[str], params: list[torch.nn.Parameter], *, loss: torch.Tensor,
                         grad_norm: float, lr: float, finite: bool | None = None) -> None:
        """After the step: every parameter must be finite (``weights_valid=False`` if not);
        ``loss`` (the all-reduced loss sum), ``grad_norm`` and ``lr`` of the step go into the error.
        ``finite``: the decision, when the caller took it over all ranks (sharded parameters);
        the error then names a parameter only if this rank's part of it is not finite."""
        if not (all_finite(params) if finite is None else finite):
            bad = first_nonfinite(list(zip(names, params))) or "(held by another rank)"
            raise NonFiniteTrainingError(
                f"parameter {bad} is not finite after the optimizer step of global batch {self.global_batch} of the "
                f"train call for weights version {self.weights_version} (rank {self.rank}; loss {float(loss)}, "
                f"grad_norm {grad_norm}, lr {lr}): the update overflowed. The weights and optimizer state of "
                "this policy are no longer valid: load a checkpoint (or re-create the policy) before using it",
                what="parameter", parameter=bad, **self._where(weights_valid=False),
            )
