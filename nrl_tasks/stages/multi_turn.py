"""Multi-turn rollouts with exact tokens: generate, let the environment answer, continue.

For each episode (one row of the prompt batch), up to ``grpo.max_rollout_turns`` turns::

    ids = prompt ids                                  token_mask 0
    loop:
        sampled = generate(ids, stop strings)         token_mask 1, their sampler logprobs
        message_log += {"assistant": decode(sampled)}
        obs, reward, terminated = env.step(message_logs, metadata)
        reward_sum += reward
        stop when terminated, out of turns, or the next turn would not fit
        ids += render(obs)                            token_mask 0 (the chat template's suffix, tokenised once)

**Exact tokens.** The ids the policy sampled are appended as the generation worker returned them
and never re-tokenised; only the environment's observation is tokenised, once, as the text the
chat template appends to a conversation for that message (closing the assistant turn when the
sampled turn did not end with its end-of-turn token, and opening the next assistant turn). The
next turn generates from the ids so far. So the stored sequence is exactly what the policy saw
and sampled, and ``logprob``/``train`` (which read ``token_mask``) need no special case.

**Limits.** An episode ends *by termination* (the environment says so) or *by a limit*: out of
turns, or the next turn would not fit in ``policy.max_total_sequence_length`` (the observation
plus ``generation.max_new_tokens``). Either way its reward is what the environment returned
(summed over turns, like NeMo-RL); ``truncated`` marks the ones ended by a limit.

**Determinism.** Turn 0 samples with the row's seed (the single-turn seed), turn ``t`` with a seed
derived from it and ``t``; the environment gets the conversations and metadata only. So with a
deterministic environment a regenerated step gives the same rollouts, and the rollouts dataset
persists the environment's observations (``message_log``) and final ``env_metadata``: a replay or
a recomputed later stage never calls the environment again.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.environments.interfaces import Message, MessageLog
from nrl_tasks.environments.loading import initial_stop_strings
from nrl_tasks.stages.context import StepContext
from nrl_tasks.stages.data import clip_text, derive_seed, prompt_messages, text_budget

__all__ = [
    "MultiTurnRollout", "demonstration_tokens", "episode_runner", "first_turns", "multi_turn_rollouts", "observation_suffix",
]

_MARK = "\u2063NRL-TURN\u2063"  # a text no model writes: where the assistant's content ends in a rendered template


def observation_suffix(tokenizer: Any, obs: Message, *, chat_template: bool, closed_by: str | None) -> str:
    """The text appended to a conversation for observation ``obs``, up to the next assistant
    turn's start. With a chat template: what the template renders after an assistant message's
    content (its end-of-turn text, the observation's message, the generation prompt), less the
    end-of-turn text the sampled turn already ended with (``closed_by``: the decoded last sampled
    token when it was a stop token). Without one: ``"\\n<role>: <content>\\n"``."""
    if not chat_template:
        return f"\n{obs['role']}: {obs['content']}\n"
    convo = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}, dict(obs)]
    try:
        full = tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template that refuses the role: say which
        raise ValueError(f"the tokenizer's chat template cannot render a {obs['role']!r} message: {exc}") from exc
    suffix = full[full.rindex(_MARK) + len(_MARK):]
    if closed_by and suffix.startswith(closed_by):
        suffix = suffix[len(closed_by):]
    return suffix


def demonstration_tokens(
    tokenizer: Any, prompt_ids: list[int], demonstration: str | MessageLog, *, chat_template: bool, eos_id: int,
    max_tokens: int | None = None,
) -> tuple[list[int], list[float]]:
    """A demonstrated episode's ``(ids, token_mask)`` after ``prompt_ids``, built the way
    :class:`MultiTurnRollout` builds a sampled one (what an SFT warm start trains on): each
    assistant message's content tokenised as if sampled (mask 1; the last, the final answer,
    closed by ``eos_id``), every other message appended as its observation suffix (mask 0).
    ``demonstration``: the messages after the prompt (a JSON text, as a data row holds it).
    ``max_tokens``: only the row's last ``max_tokens`` tokens are kept, so each message's text is
    first cut to its last :func:`~nrl_tasks.stages.data.text_budget` characters."""
    log = json.loads(demonstration) if isinstance(demonstration, str) else demonstration
    if not (isinstance(log, list) and log and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in log)):
        raise ValueError("a demonstration must be a non-empty list of {'role', 'content'} messages")
    if log[-1]["role"] != "assistant":
        raise ValueError(f"a demonstration must end with the assistant's answer, not a {log[-1]['role']!r} message")
    ids, mask = list(prompt_ids), [0.0] * len(prompt_ids)
    for k, msg in enumerate(log):
        if msg["role"] == "assistant":
            text = str(msg["content"]) if max_tokens is None else clip_text(str(msg["content"]), max_tokens, keep="tail")
            toks = tokenizer(text, add_special_tokens=False)["input_ids"] + ([eos_id] if k == len(log) - 1 else [])
            ids += toks
            mask += [1.0] * len(toks)
        else:  # an earlier turn ended at a stop string, not at the end-of-turn token
            if max_tokens is not None:
                msg = {**msg, "content": clip_text(str(msg["content"]), max_tokens, keep="tail")}
            suffix = observation_suffix(tokenizer, msg, chat_template=chat_template, closed_by=None)
            toks = tokenizer(suffix, add_special_tokens=False)["input_ids"]
            ids += toks
            mask += [0.0] * len(toks)
    return ids, mask


class MultiTurnRollout:
    """Runs the episodes of one prompt batch (see the module docstring).

    ``generation``: the generation workers (``generate(data, greedy=, weights_version=)``);
    ``environment``: :class:`~nrl_tasks.environments.loading.EnvironmentWorkers` (or anything
    with its ``step``); ``stop_ids``: the token ids that end a turn (EOS)."""

    def __init__(
        self, generation: Any, environment: Any, tokenizer: Any, *, max_turns: int, max_total_tokens: int,
        max_new_tokens: int, chat_template: bool, first_stop_strings: list[str] | None, pad_id: int, stop_ids: list[int],
    ) -> None:
        self.generation, self.environment, self.tokenizer = generation, environment, tokenizer
        self.max_turns, self.max_total, self.max_new = max_turns, max_total_tokens, max_new_tokens
        self.chat_template, self.first_stops = chat_template, first_stop_strings
        self.pad_id, self.stop_ids = pad_id, set(stop_ids)
        self.env_seconds = 0.0
        self.generate_seconds = 0.0

    def run(
        self, prompts: BatchedDataDict, first_messages: list[MessageLog], rows: list[dict[str, Any]],
        weights_version: int | None, *, greedy: bool = False,
    ) -> BatchedDataDict:
        """The rollout batch of ``prompts`` (columns: :mod:`nrl_tasks.stages.generate`, plus
        ``num_turns``, ``env_rewards``, ``terminated``, ``message_log`` and ``env_metadata``).
        ``first_messages[i]``: the conversation the prompt ids render (system and user);
        ``rows[i]``: the prompt's data row, the episode's first metadata; ``greedy``: every turn
        greedy (validation and evaluation) instead of sampled with the row's seeds."""
        n = prompts.size
        lengths = prompts["input_lengths"].tolist()
        ids = [prompts["input_ids"][i, : lengths[i]].tolist() for i in range(n)]
        mask = [[0.0] * lengths[i] for i in range(n)]
        lps = [[0.0] * lengths[i] for i in range(n)]
        logs: list[MessageLog] = [[dict(m) for m in first] for first in first_messages]  # type: ignore[misc]
        meta: list[dict[str, Any] | None] = [dict(r) for r in rows]
        stops: list[list[str] | None] = [self.first_stops] * n
        reward = [0.0] * n
        turns = [0] * n
        ended = [False] * n
        terminated = [False] * n
        seeds = prompts["seeds"].tolist()
        for turn in range(self.max_turns):
            active = [i for i in range(n) if not ended[i]]
            if not active:
                break
            closed = self._sample(active, ids, mask, lps, logs, stops, seeds, turn, weights_version, greedy)
            t0 = time.perf_counter()
            out = self.environment.step([logs[i] for i in active], [meta[i] for i in active])
            self.env_seconds += time.perf_counter() - t0
            for j, i in enumerate(active):
                turns[i] += 1
                reward[i] += float(out.rewards[j])
                meta[i] = out.metadata[j]
                if bool(out.terminateds[j]):
                    ended[i] = terminated[i] = True
                    continue
                room = self.max_total - len(ids[i]) - self.max_new  # tokens the observation may take
                text = observation_suffix(self.tokenizer, out.observations[j], chat_template=self.chat_template, closed_by=closed[j])
                # a text longer than text_budget(room) characters has more than `room` tokens: never
                # tokenised (an environment's 20 MB observation would take minutes and GBs here)
                fits = turn + 1 < self.max_turns and room >= 0 and len(text) <= text_budget(room)
                suffix = self.tokenizer(text, add_special_tokens=False)["input_ids"] if fits else []
                if not fits or len(suffix) > room:
                    ended[i] = True  # by a limit: the next turn would not fit, or there is none
                    continue
                ids[i] += suffix
                mask[i] += [0.0] * len(suffix)
                lps[i] += [0.0] * len(suffix)
                logs[i].append(out.observations[j])
                stops[i] = out.next_stop_strings[j]
        return self._batch(prompts, ids, mask, lps, logs, meta, reward, turns, terminated, [len(f) for f in first_messages])

    # ------------------------------------------------------------------------------------------

    def _sample(
        self, active: list[int], ids: list[list[int]], mask: list[list[float]], lps: list[list[float]],
        logs: list[MessageLog], stops: list[list[str] | None], seeds: list[int], turn: int, version: int | None,
        greedy: bool,
    ) -> list[str | None]:
        """One turn of the ``active`` episodes: sampled ids, mask and logprobs appended, the
        assistant message logged; per episode the decoded stop token that closed the turn (or None)."""
        width = max(len(ids[i]) for i in active)
        inp = torch.full((len(active), width), self.pad_id, dtype=torch.int64)
        for j, i in enumerate(active):
            inp[j, : len(ids[i])] = torch.tensor(ids[i], dtype=torch.int64)
        turn_seeds = [seeds[i] if turn == 0 else derive_seed(seeds[i], "turn", turn) % (2**63) for i in active]
        data = BatchedDataDict({
            "input_ids": inp, "input_lengths": torch.tensor([len(ids[i]) for i in active], dtype=torch.int64),
            "seeds": torch.tensor(turn_seeds, dtype=torch.int64), "stop_strings": [stops[i] for i in active],
        })
        t0 = time.perf_counter()
        out = self.generation.generate(data, greedy=greedy, weights_version=version)
        self.generate_seconds += time.perf_counter() - t0
        closed: list[str | None] = []
        for j, i in enumerate(active):
            start, g = len(ids[i]), int(out["generation_lengths"][j])
            new = out["output_ids"][j, start : start + g].tolist()
            ids[i] += new
            mask[i] += [1.0] * g
            lps[i] += out["logprobs"][j, start : start + g].to(torch.float32).tolist()
            logs[i].append({"role": "assistant", "content": self.tokenizer.decode(new, skip_special_tokens=True)})
            closed.append(self.tokenizer.decode(new[-1:]) if new and new[-1] in self.stop_ids else None)
        return closed

    def _batch(
        self, prompts: BatchedDataDict, ids: list[list[int]], mask: list[list[float]], lps: list[list[float]],
        logs: list[MessageLog], meta: list[dict[str, Any] | None], reward: list[float], turns: list[int],
        terminated: list[bool], first: list[int],
    ) -> BatchedDataDict:
        n = len(ids)
        width = max(len(r) for r in ids)
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.int64)
        token_mask = torch.zeros((n, width), dtype=torch.float32)
        logprobs = torch.zeros((n, width), dtype=torch.float32)
        for i in range(n):
            k = len(ids[i])
            input_ids[i, :k] = torch.tensor(ids[i], dtype=torch.int64)
            token_mask[i, :k] = torch.tensor(mask[i])
            logprobs[i, :k] = torch.tensor(lps[i])
        total = torch.tensor([len(r) for r in ids], dtype=torch.int64)
        prompt_lengths = prompts["input_lengths"].to(torch.int64)
        return BatchedDataDict({
            "input_ids": input_ids,
            "input_lengths": total,
            "prompt_lengths": prompt_lengths,
            "generation_lengths": total - prompt_lengths,  # the episode after its prompt: sampled and observed
            "token_mask": token_mask,
            "generation_logprobs": logprobs * token_mask,
            "truncated": torch.tensor([not t for t in terminated], dtype=torch.bool),
            "seeds": prompts["seeds"],
            "group_id": prompts["group_id"],
            "record_index": prompts["record_index"],
            "prompt": list(prompts["prompt"]),
            "answer": list(prompts["answer"]),
            "response": [_continuation(log[k:]) for log, k in zip(logs, first)],
            "num_turns": torch.tensor(turns, dtype=torch.int64),
            "env_rewards": torch.tensor(reward, dtype=torch.float32),
            "terminated": torch.tensor(terminated, dtype=torch.bool),
            "message_log": [json.dumps(log, ensure_ascii=False) for log in logs],
            "env_metadata": [json.dumps(m, ensure_ascii=False, sort_keys=True, default=str) for m in meta],
        })


def _continuation(messages: MessageLog) -> str:
    """The episode after its prompt as text: the assistant turns, the observations marked by role."""
    return "".join(m["content"] if m["role"] == "assistant" else f"\n[{m['role']}] {m['content']}\n" for m in messages)


def episode_runner(cfg: Any, tokenizer: Any, generation: Any, environment: Any) -> MultiTurnRollout:
    """The run's :class:`MultiTurnRollout` (``cfg``: the ``MasterConfig``): its turn and length
    limits, the generation config's stop ids and pad id, the environment's first stop strings."""

    if environment is None:
        raise RuntimeError(f"env.environment {cfg.env.environment!r} is set but no environment actors are running")
    gen, tok = cfg.gen, tokenizer
    eos = tok.eos_token_id
    stop_ids = [] if gen.ignore_eos else ([eos] if isinstance(eos, int) else list(eos or []))
    stop_ids += list(gen.stop_token_ids or [])
    pad = gen.pad_token_id if gen.pad_token_id is not None else (tok.pad_token_id if tok.pad_token_id is not None else stop_ids[0])
    return MultiTurnRollout(
        generation, environment, tok, max_turns=cfg.rollout.max_rollout_turns, max_total_tokens=cfg.policy.max_total_sequence_length,
        max_new_tokens=gen.max_new_tokens, chat_template=cfg.data.chat_template,
        first_stop_strings=initial_stop_strings(cfg.env.environment) or gen.stop_strings, pad_id=int(pad), stop_ids=stop_ids,
    )


def first_turns(records: list[dict[str, Any]], prompts: BatchedDataDict, data_cfg: Any) -> tuple[list[MessageLog], list[dict[str, Any]]]:
    """Per row of ``prompts``: the conversation its prompt opens and its data row (the episode's
    first metadata), from ``records`` by the row's ``record_index``."""
    rows = [dict(records[int(i)]) for i in prompts["record_index"].tolist()]
    return [prompt_messages(r["prompt"], data_cfg) for r in rows], rows  # type: ignore[misc]


def multi_turn_rollouts(ctx: StepContext, prompt_batch: BatchedDataDict, weights_version: int) -> tuple[BatchedDataDict, dict[str, Any]]:
    """The step's episodes on the run's environment actors (``env.environment``) and the
    ``generate`` stage's figures: turns per episode, episodes ended by termination, environment seconds."""
    cfg = ctx.cfg
    rollout = episode_runner(cfg, ctx.tokenizer, ctx.generation, ctx.run.actors.environment)
    first, rows = first_turns(ctx.run.records("train"), prompt_batch, cfg.data)
    out = rollout.run(prompt_batch, first, rows, weights_version)
    turns = out["num_turns"].to(torch.float64)
    return out, {
        "generate_seconds": rollout.generate_seconds, "env_seconds": rollout.env_seconds,
        "new_tokens": int(out["token_mask"].sum()), "turns_mean": float(turns.mean()), "turns_max": int(turns.max()),
        "terminated_frac": float(out["terminated"].to(torch.float64).mean()),
    }
