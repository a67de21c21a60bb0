"""The stage graph of one GRPO step: the single list every other module derives its stage facts from.

::

    prompts ──► generate ──► rollouts ─┬─► score ──► rewards ─┐
                                       ├─► logprob ──► logprobs ─┼─► train ──► (refit, checkpoint)
                                       └───────────────────────► advantages ┘
                          (advantages reads rollouts and rewards; logprobs too for REINFORCE++
                           with the KL in the reward)

Each :class:`StageSpec` names a stage (its Prefect task), the dataset it commits under
``steps/step_N/<output>``, the datasets of the same step it reads, the actors it calls and whether
an actor fault is worth a retry (after the flow re-plans the run's recovery). From it:

- :data:`DATA_STAGES`: the step's datasets in pipeline order;
- :func:`dependants`: what a changed dataset invalidates (``--recompute`` of a step not trained yet);
- :data:`REPLAY_INPUTS`: what a replayed ``train`` reads; :data:`STEP_INPUTS`: a step's datasets
  before ``train`` (what retention may prune, what a replay may have to recompute);
- :data:`DATASET_STAGE` / :func:`stage_of`: dataset name <-> stage name;
- the metrics line's ``<stage>_s`` and ``<stage>_attempts`` keys.

>>> DATA_STAGES
('prompts', 'rollouts', 'rewards', 'logprobs', 'advantages', 'train')
>>> dependants("rewards")
('rewards', 'advantages', 'train')
>>> REPLAY_INPUTS
('rollouts', 'logprobs', 'advantages')
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DATASET_STAGE",
    "GRPO_GRAPH",
    "DATA_STAGES",
    "REPLAY_INPUTS",
    "RETRIED_STAGES",
    "STAGES",
    "STEP_INPUTS",
    "StageGraph",
    "StageSpec",
    "dependants",
    "spec",
    "stage_of",
]


@dataclass(frozen=True)
class StageSpec:
    """One data stage of a step."""

    #: stage (and Prefect task) name, e.g. ``generate``
    name: str
    #: dataset it commits, e.g. ``rollouts``
    output: str
    #: datasets of the same step it reads (outputs of earlier stages)
    inputs: tuple[str, ...] = ()
    #: actors it calls (``policy``, ``generation``, ``reward_model``)
    actors: tuple[str, ...] = ()
    #: retried on actor faults (the flow re-plans recovery, then runs the step again)
    retried: bool = False
    #: datasets of the same step it reads in some configurations only (``advantages`` reads
    #: ``logprobs`` for REINFORCE++ with the KL in the reward); counted by :func:`dependants`
    optional_inputs: tuple[str, ...] = ()
    #: its name in the metrics line (``<label>_s``, ``<label>_attempts``; default: ``name``)
    label: str = ""

    @property
    def key(self) -> str:
        """The stage's name in the metrics line."""
        return self.label or self.name

    @property
    def all_inputs(self) -> tuple[str, ...]:
        return self.inputs + self.optional_inputs


class StageGraph:
    """The data stages of one algorithm's step, in pipeline order (inputs always come before
    their readers), and the tables derived from them. Each algorithm has one (its recipe's
    ``graph``): GRPO's is :data:`GRPO_GRAPH`; DPO's and SFT's live with their stages.

    >>> g = StageGraph((StageSpec("batch", "batch"), StageSpec("fit", "train", ("batch",), ("policy",), retried=True)))
    >>> g.datasets, g.step_inputs, g.replay_inputs, g.retried, g.dependants("batch")
    (('batch', 'train'), ('batch',), ('batch',), ('fit',), ('batch', 'train'))
    """

    def __init__(self, stages: tuple[StageSpec, ...]) -> None:
        self.stages = tuple(stages)
        self._by_name = {s.name: s for s in self.stages}
        self._by_output = {s.output: s for s in self.stages}
        if "train" not in self._by_output:
            raise ValueError("a step's stage graph needs a stage whose output is 'train' (it marks the step trained)")
        #: the step's datasets, in pipeline order
        self.datasets: tuple[str, ...] = tuple(s.output for s in self.stages)
        #: dataset -> the stage that makes it
        self.dataset_stage: dict[str, str] = {s.output: s.name for s in self.stages}
        #: what the stage making ``train`` reads (and a replay of it)
        self.replay_inputs: tuple[str, ...] = self._by_output["train"].inputs
        #: a step's datasets before ``train``: recomputable, prunable
        self.step_inputs: tuple[str, ...] = tuple(d for d in self.datasets if d != "train")
        #: stages retried on actor faults
        self.retried: tuple[str, ...] = tuple(s.name for s in self.stages if s.retried)

    def spec(self, name: str) -> StageSpec:
        """The spec of stage ``name`` (or of the stage whose output is ``name``)."""
        found = self._by_name.get(name) or self._by_output.get(name)
        if found is None:
            raise KeyError(f"no stage or dataset named {name!r}; stages: {[s.name for s in self.stages]}")
        return found

    def dependants(self, name: str) -> tuple[str, ...]:
        """The output of stage/dataset ``name`` and every dataset that (transitively) reads it, in
        pipeline order."""
        hit = {self.spec(name).output}
        for s in self.stages:  # pipeline order: inputs always come before their readers
            if hit.intersection(s.all_inputs):
                hit.add(s.output)
        return tuple(d for d in self.datasets if d in hit)


#: GRPO's step (the module docstring's picture)
GRPO_GRAPH = StageGraph((
    StageSpec("prompts", "prompts"),
    StageSpec("generate", "rollouts", ("prompts",), ("generation",), retried=True),
    StageSpec("score", "rewards", ("rollouts",), ("reward_model",)),
    StageSpec("logprob", "logprobs", ("rollouts",), ("policy",), retried=True),
    StageSpec("advantages", "advantages", ("rollouts", "rewards"), optional_inputs=("logprobs",)),
    StageSpec("train", "train", ("rollouts", "logprobs", "advantages"), ("policy",), retried=True),
))

STAGES: tuple[StageSpec, ...] = GRPO_GRAPH.stages
#: The step's datasets, in pipeline order.
DATA_STAGES: tuple[str, ...] = GRPO_GRAPH.datasets
#: dataset -> the stage that makes it
DATASET_STAGE: dict[str, str] = GRPO_GRAPH.dataset_stage
#: What ``train`` reads (and a replay of it).
REPLAY_INPUTS: tuple[str, ...] = GRPO_GRAPH.replay_inputs
#: A step's datasets before ``train``: recomputable, prunable.
STEP_INPUTS: tuple[str, ...] = GRPO_GRAPH.step_inputs
#: Stages retried on actor faults.
RETRIED_STAGES: tuple[str, ...] = GRPO_GRAPH.retried


def spec(name: str) -> StageSpec:
    """The spec of GRPO's stage ``name`` (or of the stage whose output is ``name``)."""
    return GRPO_GRAPH.spec(name)


def stage_of(name: str) -> str:
    """Stage name of a stage or dataset name (``rollouts`` -> ``generate``)."""
    return spec(name).name


def dependants(name: str) -> tuple[str, ...]:
    """The output of GRPO's stage/dataset ``name`` and every dataset that (transitively) reads it, in
    pipeline order."""
    return GRPO_GRAPH.dependants(name)
