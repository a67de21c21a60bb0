"""Multi-turn rollouts with exact tokens (nrl_tasks.stages.multi_turn) on real generation workers
and a user environment defined here, run by real environment actors.

What is checked: the ids the policy sampled are stored as the generation workers returned them,
turn by turn (no re-tokenisation); the environment's observations sit at positions where
``token_mask`` is 0 and render through the chat template; decoding the ``token_mask == 1`` spans
gives exactly the assistant messages of ``message_log``; rewards sum over turns; the limits mark
episodes ``truncated``; an environment returning the wrong shapes fails with its name.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import torch

from nrl_tasks.environments.interfaces import EnvironmentInterface, EnvironmentReturn

pytestmark = pytest.mark.timeout(300)

ENV = "tests.environments.test_multi_turn:CountdownEnvironment"


class CountdownEnvironment(EnvironmentInterface):
    """Ends an episode after ``turns`` assistant turns (with ``early``, also after a turn whose
    text has an even length: episodes of different lengths and rewards); replies as the user with
    the turn count; reward 0.5 per turn, 1 more at the end."""

    def __init__(self, turns: int = 3, early: bool = False) -> None:
        self.turns, self.early = int(turns), bool(early)

    def step(self, message_logs, metadata):
        obs, metas, rewards, done = [], [], [], []
        for log, meta in zip(message_logs, metadata):
            meta = dict(meta)
            meta["seen"] = int(meta.get("seen", 0)) + 1
            end = meta["seen"] >= self.turns or (self.early and len(log[-1]["content"]) % 2 == 0)
            obs.append({"role": "user", "content": f"turn {meta['seen']} of {self.turns}: go on"})
            metas.append(meta)
            rewards.append(0.5 + (1.0 if end else 0.0))
            done.append(end)
        return EnvironmentReturn(obs, metas, [None] * len(obs), torch.tensor(rewards), torch.tensor(done), [None] * len(obs))


class BrokenUntilFixedEnvironment(CountdownEnvironment):
    """Raises while the file ``broken`` exists (a bug the user then fixes), else a countdown."""

    def __init__(self, broken: str, turns: int = 2) -> None:
        super().__init__(turns)
        self.broken = broken

    def step(self, message_logs, metadata):
        import os

        if os.path.exists(self.broken):
            raise KeyError("the environment's own bug")
        return super().step(message_logs, metadata)


class WrongShapeEnvironment(EnvironmentInterface):
    """Returns one reward too few."""

    def step(self, message_logs, metadata):
        n = len(message_logs)
        return EnvironmentReturn([{"role": "user", "content": "x"}] * n, list(metadata), [None] * n, torch.zeros(n - 1),
                                 torch.zeros(n, dtype=torch.bool), None)


class RecordingGeneration:
    """The real generation workers, with what each ``generate`` call returned kept for the checks."""

    def __init__(self, gen: Any) -> None:
        self.gen, self.calls = gen, []

    def generate(self, data, **kw):
        out = self.gen.generate(data, **kw)
        self.calls.append((data, out))
        return out


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def gen(ray_session, tiny_model_dir):
    from nrl_tasks.distributed.virtual_cluster import RayVirtualCluster
    from nrl_tasks.models.generation.hf_generation import HfGeneration
    from nrl_tasks.models.generation.interfaces import GenerationConfig

    tag = uuid.uuid4().hex[:8]
    cfg = GenerationConfig(model_name=tiny_model_dir, max_new_tokens=6, temperature=1.0, num_workers=1, num_cpus_per_worker=0.5)
    cluster = RayVirtualCluster([1], name=f"mt-{tag}", num_cpus_per_bundle=0.5)
    group = HfGeneration(cluster, cfg, namespace=f"nrl-mt-{tag}")
    yield group
    group.shutdown()
    cluster.shutdown()


def _prompts(tokenizer, n: int = 4):
    from nrl_tasks.distributed.batched_data_dict import BatchedDataDict

    texts = [f"Count with me, game {i}." for i in range(n)]
    first = [[{"role": "user", "content": t}] for t in texts]
    rendered = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in first]
    rows = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in rendered]
    width = max(map(len, rows))
    ids = torch.full((n, width), tokenizer.pad_token_id, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    batch = BatchedDataDict({
        "input_ids": ids, "input_lengths": torch.tensor([len(r) for r in rows]), "seeds": torch.arange(n) * 11 + 3,
        "group_id": torch.arange(n), "record_index": torch.arange(n), "prompt": rendered, "answer": [str(i) for i in range(n)],
    })
    return batch, first, [{"prompt": t, "answer": str(i)} for i, t in enumerate(texts)]


def _rollout(gen, tokenizer, env_spec: str, *, turns: int, max_total: int = 256, env_turns: int = 3):
    from nrl_tasks.environments.loading import EnvironmentWorkers
    from nrl_tasks.stages.multi_turn import MultiTurnRollout

    env = EnvironmentWorkers(env_spec, {"turns": env_turns} if "Countdown" in env_spec else {}, num_workers=2)
    rec = RecordingGeneration(gen)
    try:
        roll = MultiTurnRollout(rec, env, tokenizer, max_turns=turns, max_total_tokens=max_total, max_new_tokens=6,
                                chat_template=True, first_stop_strings=None, pad_id=tokenizer.pad_token_id,
                                stop_ids=[tokenizer.eos_token_id])
        batch, first, rows = _prompts(tokenizer)
        return roll.run(batch, first, rows, weights_version=0), rec, first
    finally:
        env.shutdown()


def mask_spans(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """The runs of ``ids`` where ``mask`` is true, in order."""
    spans: list[list[int]] = []
    cur: list[int] = []
    for tok, on in zip(ids.tolist(), mask.tolist()):
        if on:
            cur.append(tok)
        elif cur:
            spans.append(cur)
            cur = []
    return spans + [cur] if cur else spans


def test_sampled_ids_are_stored_as_returned_and_observations_are_masked(gen, tokenizer):
    out, rec, first = _rollout(gen, tokenizer, ENV, turns=3)
    n = out.size
    assert out["num_turns"].tolist() == [3] * n and out["terminated"].all() and not out["truncated"].any()
    assert torch.allclose(out["env_rewards"], torch.full((n,), 0.5 * 3 + 1.0))
    # turn by turn, what the workers returned is what the row holds, at the row's growing end
    sampled: list[list[int]] = [[] for _ in range(n)]
    for data, res in rec.calls:
        assert res["output_ids"].shape[0] == n  # every episode lives 3 turns here
        for i in range(n):
            start, g = int(data["input_lengths"][i]), int(res["generation_lengths"][i])
            new = res["output_ids"][i, start : start + g].tolist()
            assert out["input_ids"][i, start : start + g].tolist() == new
            assert out["token_mask"][i, start : start + g].tolist() == [1.0] * g
            assert torch.equal(out["generation_logprobs"][i, start : start + g], res["logprobs"][i, start : start + g])
            sampled[i] += new
    for i in range(n):
        k = int(out["input_lengths"][i])
        m = out["token_mask"][i, :k].bool()
        ids = out["input_ids"][i, :k]
        assert ids[m].tolist() == sampled[i]  # exactly the sampled ids carry mask 1
        log = json.loads(out["message_log"][i])
        assert log[: len(first[i])] == first[i]
        assistant = [msg["content"] for msg in log if msg["role"] == "assistant"]
        # decoding each token_mask == 1 span gives the assistant messages, in order
        assert [tokenizer.decode(s, skip_special_tokens=True) for s in mask_spans(ids, m)] == assistant
        # the observations are in the sequence, at mask-0 positions, rendered as user turns
        unmasked = tokenizer.decode(ids[~m].tolist())
        for msg in log[len(first[i]):]:
            if msg["role"] == "user":
                assert f"<|im_start|>user\n{msg['content']}<|im_end|>" in unmasked
        assert json.loads(out["env_metadata"][i])["seen"] == 3


def test_turn_and_length_limits_end_episodes_as_truncated(gen, tokenizer):
    out, _, _ = _rollout(gen, tokenizer, ENV, turns=2, env_turns=5)
    assert out["num_turns"].tolist() == [2] * out.size and out["truncated"].all() and not out["terminated"].any()
    assert torch.allclose(out["env_rewards"], torch.full((out.size,), 1.0))  # two turns of 0.5, as the environment said
    short, _, _ = _rollout(gen, tokenizer, ENV, turns=5, env_turns=5, max_total=int(_prompts(tokenizer)[0]["input_lengths"].max()) + 14)
    assert short["truncated"].all() and (short["num_turns"] < 5).all()
    assert (short["input_lengths"] <= int(_prompts(tokenizer)[0]["input_lengths"].max()) + 14).all()


def test_an_environment_returning_wrong_shapes_fails_naming_it(gen, tokenizer):
    spec = "tests.environments.test_multi_turn:WrongShapeEnvironment"
    with pytest.raises(ValueError, match=r"environment tests\.environments\.test_multi_turn:WrongShapeEnvironment: step\(\) returned rewards of shape"):
        _rollout(gen, tokenizer, spec, turns=2)


def test_observation_suffix_renders_the_template_after_the_assistant_turn(tokenizer):
    from nrl_tasks.stages.multi_turn import observation_suffix

    obs = {"role": "tool", "content": "42"}
    suffix = observation_suffix(tokenizer, obs, chat_template=True, closed_by=None)
    assert suffix == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert observation_suffix(tokenizer, obs, chat_template=True, closed_by="<|im_end|>") == suffix[len("<|im_end|>"):]
    assert observation_suffix(tokenizer, obs, chat_template=False, closed_by=None) == "\ntool: 42\n"


def test_bad_environment_specs_are_config_errors_naming_the_key():
    from nrl_tasks.environments.loading import make_environment

    with pytest.raises(ValueError, match="env.environment 'no_such_module:Env': cannot import"):
        make_environment("no_such_module:Env")
    with pytest.raises(ValueError, match="is not an environment class"):
        make_environment("json:JSONDecoder")
    with pytest.raises(ValueError, match="env.environment_kwargs"):
        make_environment(ENV, {"no_such_arg": 1})
    with pytest.raises(ValueError, match="must be a built-in"):
        make_environment("calculatr")
    assert make_environment("calculator") is not None


class HugeObservationEnvironment(CountdownEnvironment):
    """Answers each turn with a 20 MB observation."""

    def step(self, message_logs, metadata):
        out = super().step(message_logs, metadata)
        return out._replace(observations=[{"role": "user", "content": "x" * (20 << 20)} for _ in message_logs])


class ExitingEnvironment(CountdownEnvironment):
    """Calls ``sys.exit`` in ``step``."""

    def step(self, message_logs, metadata):
        import sys

        sys.exit(3)


class HardExitEnvironment(CountdownEnvironment):
    """Ends its process with ``os._exit`` in ``step``."""

    def step(self, message_logs, metadata):
        import os

        os._exit(1)


class SleepingEnvironment(CountdownEnvironment):
    """Never returns from ``step`` (sleeps an hour)."""

    def step(self, message_logs, metadata):
        import time

        time.sleep(3600)


class CountingTokenizer:
    """The real tokenizer; remembers the longest text it was asked to tokenise."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.longest = tok, 0

    def __call__(self, text, **kw):
        self.longest = max(self.longest, max(map(len, [text] if isinstance(text, str) else text)))
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_huge_observation_ends_the_episode_without_being_tokenised(gen, tokenizer):
    from nrl_tasks.environments.loading import EnvironmentWorkers
    from nrl_tasks.stages.multi_turn import MultiTurnRollout

    env = EnvironmentWorkers("tests.environments.test_multi_turn:HugeObservationEnvironment", {"turns": 5})
    tok = CountingTokenizer(tokenizer)
    try:
        roll = MultiTurnRollout(gen, env, tok, max_turns=3, max_total_tokens=256, max_new_tokens=6, chat_template=True,
                                first_stop_strings=None, pad_id=tokenizer.pad_token_id, stop_ids=[tokenizer.eos_token_id])
        batch, first, rows = _prompts(tokenizer)
        out = roll.run(batch, first, rows, weights_version=0)
    finally:
        env.shutdown()
    assert out["num_turns"].tolist() == [1] * out.size and out["truncated"].all()
    assert tok.longest < 100_000, tok.longest  # the 20 MB text was never tokenised


def _one_step(spec: str, **kw):
    from nrl_tasks.environments.loading import EnvironmentWorkers

    env = EnvironmentWorkers(spec, {}, **kw)
    try:
        return env.step([[{"role": "user", "content": "hi"}]], [{"prompt": "hi", "answer": "1"}])
    finally:
        env.shutdown()


def test_an_environment_calling_sys_exit_fails_naming_it_and_is_not_retried(ray_session):
    from nrl_tasks.stages.errors import describe_error, is_actor_fault

    with pytest.raises(RuntimeError) as ei:
        _one_step("tests.environments.test_multi_turn:ExitingEnvironment")
    assert "environment tests.environments.test_multi_turn:ExitingEnvironment" in str(ei.value) and "sys.exit(3)" in str(ei.value)
    assert not is_actor_fault(ei.value)  # the same episodes exit again: a retry cannot help
    assert "ExitingEnvironment" in describe_error(ei.value)


def test_an_environment_ending_its_process_is_an_actor_fault_naming_it(ray_session):
    from nrl_tasks.environments.loading import EnvironmentDiedError
    from nrl_tasks.stages.errors import describe_error, is_actor_fault

    with pytest.raises(EnvironmentDiedError) as ei:
        _one_step("tests.environments.test_multi_turn:HardExitEnvironment")
    assert is_actor_fault(ei.value)  # retried on fresh actors, like any dead actor
    assert "environment tests.environments.test_multi_turn:HardExitEnvironment" in describe_error(ei.value)


def test_a_hanging_environment_step_times_out_naming_it_and_the_key(ray_session):
    from nrl_tasks.environments.loading import EnvironmentTimeoutError
    from nrl_tasks.stages.errors import is_actor_fault

    with pytest.raises(EnvironmentTimeoutError, match=r"SleepingEnvironment: step\(\) of 1 episodes did not return within env\.step_timeout_s=2 s") as ei:
        _one_step("tests.environments.test_multi_turn:SleepingEnvironment", step_timeout_s=2.0)
    assert not is_actor_fault(ei.value)
