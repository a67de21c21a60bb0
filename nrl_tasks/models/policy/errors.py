"""Errors a policy update raises instead of committing a broken model.

:class:`NonFiniteTrainingError` is raised by ``PolicyWorker.train`` when the loss, the gradient
norm or the learning rate of a global batch is not finite (checked *before* ``optimizer.step()``,
so neither weights nor optimizer state change), or when the step overflows float32 (torch
refuses the step size half-way, or a parameter is not finite *after* the step; e.g. a huge
learning rate: that step cannot be undone without a second copy of the weights and optimizer
state, which would double their memory, so the worker's weights are then invalid).

``weights_valid`` says which case it was: ``True`` means the policy still holds exactly the
weights, optimizer state and weights version it held before the failed call; ``False`` means
it does not (a non-finite step was applied, or an earlier global batch of the same call already
stepped) and the worker refuses further use (``status()["weights_valid"]`` is ``False``) until a
checkpoint is loaded. Retrying the same data reproduces the same non-finite value, so it is not
an actor fault (:func:`nrl_tasks.stages.errors.is_actor_fault`).
"""

from __future__ import annotations

__all__ = ["NonFiniteTrainingError"]


class NonFiniteTrainingError(RuntimeError):
    """A non-finite loss / grad_norm / lr / parameter in a train call (see the module docstring).

    Attributes: ``what`` (before the step: ``"loss"``, ``"grad_norm"``, ``"lr"``; in or after
    it: ``"update"`` (torch refused a step size beyond float32 half-way through the step),
    ``"parameter"``; or ``"invalid_weights"`` for a call refused because an earlier one broke
    the weights),
    ``value`` (the offending value as a float, or None), ``weights_version`` (the version the
    update would have produced), ``global_batch`` and ``microbatch`` (indices within the call,
    None where not applicable), ``parameter`` (the first non-finite parameter or gradient, by
    name), ``rank`` and ``weights_valid``.
    """

    def __init__(
        self,
        message: str,
        *,
        what: str,
        value: float | None = None,
        weights_version: int | None = None,
        global_batch: int | None = None,
        microbatch: int | None = None,
        parameter: str | None = None,
        rank: int | None = None,
        weights_valid: bool = True,
    ) -> None:
        super().__init__(message)
        self.what = what
        self.value = value
        self.weights_version = weights_version
        self.global_batch = global_batch
        self.microbatch = microbatch
        self.parameter = parameter
        self.rank = rank
        self.weights_valid = weights_valid

    def _fields(self) -> dict:
        return {
            "what": self.what, "value": self.value, "weights_version": self.weights_version,
            "global_batch": self.global_batch, "microbatch": self.microbatch, "parameter": self.parameter,
            "rank": self.rank, "weights_valid": self.weights_valid,
        }

    def __reduce__(self):  # keyword-only fields survive pickling (Ray ships worker exceptions)
        return (_rebuild, (type(self), str(self), self._fields()))


def _rebuild(cls: type, message: str, fields: dict) -> NonFiniteTrainingError:
    return cls(message, **fields)
