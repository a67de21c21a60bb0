"""The SFT warm start's batch: prompt + `` answer`` + EOS, loss only on the completion."""

from __future__ import annotations

import torch

from tests.fixtures.grpo_runs import TINY_CONFIG


def test_sft_batch_masks_the_answer_and_its_eos(tiny_model_dir):
    from transformers import AutoTokenizer

    from flows.config import load_config
    from flows.sft import build_sft_batch

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = load_config(TINY_CONFIG)
    recs = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10+20=", "answer": "30"}]
    b = build_sft_batch(recs, tok, cfg.data, 64)
    for row, r in enumerate(recs):
        ans = tok(" " + r["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        n = int(b["input_lengths"][row])
        assert b["input_ids"][row, n - len(ans): n].tolist() == ans
        assert b["token_mask"][row].nonzero().flatten().tolist() == list(range(n - len(ans), n))
    assert torch.equal(b["sample_mask"], torch.ones(2))
