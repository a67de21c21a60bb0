"""TRL's side of ``benchmarks/bench_vs_trl.py``: one GRPOTrainer run, run with TRL's own venv.

    .venv-trl/bin/python benchmarks/_trl_driver.py SPEC.json OUT.json

Imports only torch, transformers, datasets and trl (never this project: the project does not depend
on TRL, and TRL does not see the project). ``SPEC.json`` (written by ``bench_vs_trl.py``) names the
local model folder, the seed, the budget and the prompts: ``train`` in the order this project's run
uses them (8 per step, so TRL's sampler runs with ``shuffle_dataset=False`` and sees the same
prompts at the same step) and ``val`` (the held-out prompts), each with this project's token ids
of the chat-templated prompt (``chat``, default true) or of the plain text, which are checked against
TRL's own tokenisation first.

Settings: TRL 1.16's GRPO defaults (``loss_type="dapo"``, ``scale_rewards="group"``, ``beta=0``,
``epsilon=0.2``, ``num_iterations=1``, ``top_k=0``) with the budget of the spec, and three changes
of default to match the other side: ``bf16=False`` and ``gradient_checkpointing=False`` (TRL defaults
both to True; the other side trains in float32 without activation checkpointing), and
``lr_scheduler_type="constant"`` (transformers' default is linear decay). ``optim="adamw_torch"``
(``torch.optim.AdamW``), weight decay 0, grad-norm clip 1.0.

Measured: greedy accuracy on ``val`` before, after and every ``val_every`` steps (HF ``generate``,
``do_sample=False``; outside the step times, as ``curve`` with the training seconds so far), the
training reward per step (TRL's logged ``reward``), each step's wall time (a ``TrainerCallback``)
and the time spent in ``model.generate`` inside it (a timing wrapper on the model instance), the
completion tokens of each step (``completion_ids`` handed to the reward function) and the
process's peak RSS (VmHWM). ``OUT.json`` holds them all.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from typing import Any

_INTEGER = re.compile(r"-?\d+")


def first_integer_reward(text: str, answer: str) -> float:
    """1.0 when the first integer in ``text`` equals ``answer`` (compared as integers), else 0.0."""
    got, want = _INTEGER.search(text), _INTEGER.search(answer)
    return 1.0 if got is not None and want is not None and int(got.group()) == int(want.group()) else 0.0


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def check_token_ids(tokenizer: Any, rows: list[dict[str, Any]], chat: bool) -> int:
    """How many prompts TRL tokenises differently from the other side (``rows[i]["ids"]``): a chat
    prompt through the chat template, a plain one as TRL's trainer does (``processing_class(text=...)``)."""
    bad = 0
    for r in rows:
        if chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]
        else:
            ids = tokenizer(text=[r["text"]])["input_ids"][0]
        bad += int(list(ids) != list(r["ids"]))
    return bad


def trl_prompt(row: dict[str, Any], chat: bool) -> Any:
    """The dataset's ``prompt`` of ``row``: a one-message conversation, or the other side's exact text."""
    return [{"role": "user", "content": row["prompt"]}] if chat else row["text"]


def greedy_accuracy(model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int, batch: int) -> dict[str, Any]:
    """Greedy accuracy of ``rows`` (left-padded batches, HF ``generate``) and the responses."""
    import torch

    model.eval()
    rewards, responses = [], []
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        width = max(len(r["ids"]) for r in chunk)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(r["ids"])) + list(r["ids"]) for r in chunk])
        mask = torch.tensor([[0] * (width - len(r["ids"])) + [1] * len(r["ids"]) for r in chunk])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, top_p=None, top_k=None,
                                 temperature=None)
        for r, row in zip(chunk, out[:, width:].tolist()):
            text = tokenizer.decode(row, skip_special_tokens=True)
            responses.append(text)
            rewards.append(first_integer_reward(text, r["answer"]))
    model.train()
    return {"accuracy": sum(rewards) / max(1, len(rewards)), "responses": responses}


def main(spec_path: str, out_path: str) -> None:
    spec = json.load(open(spec_path))
    import torch

    torch.set_num_threads(int(spec["threads"]))
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from trl import GRPOConfig, GRPOTrainer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    set_seed(int(spec["seed"]))
    t_load = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    load_s = time.perf_counter() - t_load
    out: dict[str, Any] = {"versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                                        "torch": torch.__version__}, "load_s": load_s}
    chat = bool(spec.get("chat", True))
    out["token_id_mismatches"] = {"train": check_token_ids(tokenizer, spec["train"], chat),
                                  "val": check_token_ids(tokenizer, spec["val"], chat)}

    t0 = time.perf_counter()
    before = greedy_accuracy(model, tokenizer, spec["val"], spec["max_new_tokens"], spec["val_batch_size"])
    out["val_before"], out["val_before_s"] = before["accuracy"], time.perf_counter() - t0

    # timing of generation inside the steps: TRL calls the (unwrapped) model's generate
    gen_times: list[float] = []
    plain_generate = model.generate

    def timed_generate(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return plain_generate(*args, **kwargs)
        finally:
            gen_times.append(time.perf_counter() - t)

    model.generate = timed_generate  # type: ignore[method-assign]

    per_step, val_every = int(spec["prompts_per_step"]), int(spec.get("val_every") or 0)
    curve: list[dict[str, float]] = [{"step": 0, "train_s": 0.0, "acc": before["accuracy"]}]
    seen_prompts: list[str] = []
    completion_tokens: list[int] = []

    def reward_first_integer(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], answer: list[str],
                             **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        group = len(prompts) // per_step
        seen_prompts.extend(p[-1]["content"] if isinstance(p, list) else p for p in prompts[::group])  # text if plain
        completion_tokens.append(sum(len(c) for c in completion_ids))
        return [first_integer_reward(t, a) for t, a in zip(texts, answer)]

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.t = 0.0
            self.steps: list[dict[str, float]] = []
            self.logs: list[dict[str, Any]] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t, self.gen_at = time.perf_counter(), len(gen_times)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.steps.append({"step_s": time.perf_counter() - self.t, "generate_s": sum(gen_times[self.gen_at:])})
            if val_every and state.global_step % val_every == 0:  # held-out accuracy, outside the step's time
                acc = greedy_accuracy(model, tokenizer, spec["val"], spec["max_new_tokens"], spec["val_batch_size"])
                curve.append({"step": state.global_step, "train_s": sum(s["step_s"] for s in self.steps),
                              "acc": acc["accuracy"], "responses": acc["responses"]})

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    train = Dataset.from_list([{"prompt": trl_prompt(r, chat), "answer": r["answer"]} for r in spec["train"]])
    steps = int(spec["steps"])
    micro = int(spec["micro_batch_size"])
    rollouts = per_step * int(spec["num_generations"])
    work = tempfile.mkdtemp(prefix="trl-grpo-")
    args = GRPOConfig(
        output_dir=work, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, use_cpu=True,
        seed=int(spec["seed"]), data_seed=int(spec["seed"]), max_steps=steps,
        per_device_train_batch_size=micro, gradient_accumulation_steps=rollouts // micro,  # one optimizer step per batch
        num_generations=int(spec["num_generations"]), max_completion_length=int(spec["max_new_tokens"]),
        temperature=float(spec["temperature"]), top_p=float(spec["top_p"]), top_k=0,
        learning_rate=float(spec["lr"]), lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=float(spec["max_grad_norm"]),
        beta=0.0, epsilon=0.2, num_iterations=1, loss_type="dapo", scale_rewards="group",
        shuffle_dataset=False, bf16=False, gradient_checkpointing=False, dataloader_num_workers=0,
        log_completions=False,
    )
    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_first_integer], args=args, train_dataset=train,
                          processing_class=tokenizer, callbacks=[timer])
    t0 = time.perf_counter()
    trainer.train()
    out["train_s"] = time.perf_counter() - t0
    model.generate = plain_generate  # type: ignore[method-assign]

    t0 = time.perf_counter()
    if curve[-1]["step"] != steps:  # the last step was not validated inside the run
        acc = greedy_accuracy(model, tokenizer, spec["val"], spec["max_new_tokens"], spec["val_batch_size"])
        curve.append({"step": steps, "train_s": sum(s["step_s"] for s in timer.steps), "acc": acc["accuracy"],
                      "responses": acc["responses"]})
    out["val_after"], out["val_after_s"] = curve[-1]["acc"], time.perf_counter() - t0
    out["val_responses_after"] = curve[-1].pop("responses")
    out["curve"] = [{k: v for k, v in point.items() if k != "responses"} for point in curve]
    out["steps"] = [
        {**s, "reward": float(log.get("reward", float("nan"))), "completion_tokens": n, "grad_norm": log.get("grad_norm"),
         "loss": log.get("loss")}
        for s, log, n in zip(timer.steps, timer.logs, completion_tokens)
    ]
    expected = [r["prompt" if chat else "text"] for r in spec["train"]][: len(seen_prompts)]
    out["prompt_order_matches"] = seen_prompts == expected and len(seen_prompts) == steps * per_step
    out["config"] = {k: getattr(args, k) for k in (
        "loss_type", "scale_rewards", "beta", "epsilon", "epsilon_high", "num_iterations", "importance_sampling_level",
        "mask_truncated_completions", "top_k", "top_p", "temperature", "bf16", "gradient_checkpointing", "optim",
        "lr_scheduler_type", "generation_batch_size", "steps_per_generation", "gradient_accumulation_steps")}
    out["config"]["optim"] = str(out["config"]["optim"])
    out["config"]["lr_scheduler_type"] = str(out["config"]["lr_scheduler_type"])
    out["peak_rss_mb"] = peak_rss_mb()
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.splitlines()[2].strip())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1], sys.argv[2])
