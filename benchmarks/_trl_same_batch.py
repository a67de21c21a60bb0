"""TRL's side of ``bench_vs_trl.py --same-batch``: one rollout batch of the other side through TRL's own loss code.

    .venv-trl/bin/python benchmarks/_trl_same_batch.py BATCH.json OURS.pt

Imports only torch, transformers, datasets and trl. ``BATCH.json`` holds the model folder, the prompt
and completion token ids of each rollout (the completion as generated, EOS included), the rewards, the
group size and the micro-batch size; ``OURS.pt`` the other side's loss, gradient norm and per-parameter
gradient norms. The batch goes through ``GRPOTrainer._compute_loss`` (TRL 1.16, ``loss_type="dapo"``,
prompts left-padded with TRL's masks, completions right-padded) micro-batch by micro-batch with the
advantage TRL computes (``(r - group mean) / (group std + 1e-4)``, written out here: TRL computes it
inside its generation step). Prints one JSON line comparing the two.
"""

from __future__ import annotations

import json
import sys

import torch


def main(batch_path: str, ours_path: str) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    b = json.load(open(batch_path))
    ours = torch.load(ours_path)
    torch.set_num_threads(int(b.get("threads", 2)))
    tok = AutoTokenizer.from_pretrained(b["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(b["model_dir"], dtype=torch.float32)
    n, group, mbs = len(b["rewards"]), int(b["group"]), int(b["micro_batch"])
    args = GRPOConfig(output_dir=b["work"], report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                      per_device_train_batch_size=mbs, gradient_accumulation_steps=n // mbs, num_generations=group,
                      max_completion_length=int(b["max_new_tokens"]), loss_type="dapo", beta=0.0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=args,
                          train_dataset=Dataset.from_list([{"prompt": "unused"}] * group), processing_class=tok)
    trainer.current_gradient_accumulation_steps = n // mbs  # set by the training loop, read by the dapo normaliser
    model = trainer.model
    model.train()
    r = torch.tensor(b["rewards"], dtype=torch.float32)
    grouped = r.view(-1, group)
    advantages = (r - grouped.mean(1).repeat_interleave(group)) / (grouped.std(1).repeat_interleave(group) + 1e-4)
    pad = tok.pad_token_id

    def padded(rows: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        w = max(len(x) for x in rows)
        ids = [[pad] * (w - len(x)) + x if left else x + [pad] * (w - len(x)) for x in rows]
        mask = [[0] * (w - len(x)) + [1] * len(x) if left else [1] * len(x) + [0] * (w - len(x)) for x in rows]
        return torch.tensor(ids), torch.tensor(mask)

    num_items = torch.tensor(float(sum(len(c) for c in b["completion_ids"])))
    total = 0.0
    for start in range(0, n, mbs):
        rows = slice(start, start + mbs)
        prompt_ids, prompt_mask = padded(b["prompt_ids"][rows], left=True)
        completion_ids, completion_mask = padded(b["completion_ids"][rows], left=False)
        loss = trainer._compute_loss(model, {
            "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages[rows], "num_items_in_batch": num_items})
        loss.backward()
        total += float(loss.detach())
    norms = {name: float(p.grad.double().norm()) for name, p in model.named_parameters() if p.grad is not None}
    grad_norm = sum(v * v for v in norms.values()) ** 0.5
    rel = {k: abs(norms[k] - ours["param_grad_norms"][k]) / max(ours["param_grad_norms"][k], 1e-12) for k in norms}
    worst = max(rel, key=rel.get)
    print(json.dumps({
        "trl_loss": total, "ours_loss": ours["loss"], "trl_grad_norm": grad_norm, "ours_grad_norm": ours["grad_norm"],
        "max_abs_advantage_diff": float((advantages - ours["advantages"]).abs().max()),
        "worst_param_grad_norm_rel_diff": [rel[worst], worst], "same_parameters": sorted(norms) == sorted(ours["param_grad_norms"]),
    }))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.splitlines()[2].strip())
    main(sys.argv[1], sys.argv[2])
