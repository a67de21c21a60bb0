"""Prompt datasets: files (JSONL/Parquet/Arrow), bad input, deterministic per-step draws, tokenising."""

from __future__ import annotations

import json
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nrl_tasks.stages.data import (
    derive_seed,
    epoch_permutation,
    format_prompt,
    load_prompt_file,
    load_prompt_records,
    step_record_indices,
    tokenize_prompts,
)


def _data_cfg(**kw):
    base = dict(
        dataset="arithmetic", train_path=None, val_path=None, prompt_key="q", answer_key="a",
        prompt_template="{prompt}", chat_template=False, system_prompt=None, overlong_prompts="reject", shuffle=True,
        arithmetic=types.SimpleNamespace(num_train=20, num_val=5, max_operand=9, ops=["+"]),
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


ROWS = [{"q": "What is 1+1?", "a": 2}, {"q": "What is 2+3?", "a": "5"}, {"q": "Name?", "a": None}]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrow"])
def test_load_prompt_file_formats(tmp_path, fmt):
    path = tmp_path / f"p.{fmt}"
    if fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    else:
        table = pa.table({"q": [r["q"] for r in ROWS], "a": [None if r["a"] is None else str(r["a"]) for r in ROWS]})
        if fmt == "parquet":
            pq.write_table(table, path)
        else:
            with pa.ipc.new_file(str(path), table.schema) as w:
                w.write_table(table)
    recs = load_prompt_file(str(path), prompt_key="q", answer_key="a")
    assert recs == [
        {"prompt": "What is 1+1?", "answer": "2"},
        {"prompt": "What is 2+3?", "answer": "5"},
        {"prompt": "Name?", "answer": ""},
    ]


def test_a_prompt_files_other_columns_stay_on_the_record(tmp_path):
    """Every column of a row reaches the record (an environment's episode metadata starts as it):
    text as it is, other values as JSON text."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"q": "Guess", "a": 7, "lo": 1, "tools": ["calculator"], "note": "n", "gone": None}) + "\n")
    recs = load_prompt_file(str(path), prompt_key="q", answer_key="a")
    assert recs == [{"prompt": "Guess", "answer": "7", "lo": "1", "tools": '["calculator"]', "note": "n"}]


def test_bad_prompt_files(tmp_path):
    missing = tmp_path / "m.jsonl"
    missing.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0: missing field 'q'"):
        load_prompt_file(str(missing), prompt_key="q")
    empty = tmp_path / "e.jsonl"
    empty.write_text(json.dumps({"q": "  "}) + "\n")
    with pytest.raises(ValueError, match="empty prompt"):
        load_prompt_file(str(empty), prompt_key="q")
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b'{"q": "\xff\xfe"}\n')
    with pytest.raises(ValueError, match="not UTF-8"):
        load_prompt_file(str(binary), prompt_key="q")
    with pytest.raises(ValueError, match="does not exist"):
        load_prompt_file(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="unsupported extension"):
        (tmp_path / "x.csv").write_text("q\n1\n")
        load_prompt_file(str(tmp_path / "x.csv"))
    bad_json = tmp_path / "j.jsonl"
    bad_json.write_text('{"q": 1\n')
    with pytest.raises(ValueError, match="line 1: invalid JSON"):
        load_prompt_file(str(bad_json), prompt_key="q")


#: the line separators of ``str.splitlines`` that are not JSONL's ``"\\n"``: valid inside a JSON string
SEPARATORS = "\u2028\u2029\x85\x0b\x0c\x1c\x1d\x1e"


def test_jsonl_lines_end_at_newline_only(tmp_path):
    """Text holding U+2028 and the other ``str.splitlines`` separators, as ``json.dumps(...,
    ensure_ascii=False)`` writes it, is read back whole by every JSONL reader (prompt files,
    preference files, ``metrics.jsonl``); ``\\r\\n`` line ends and a last line without one are fine,
    and line numbers in errors still count ``\\n`` lines."""
    from flows.observe.metrics import read_metrics
    from nrl_tasks.stages.preferences import load_preference_file

    texts = [f"a{sep}b" for sep in SEPARATORS]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\r\n".join(json.dumps({"q": t, "a": i}, ensure_ascii=False) for i, t in enumerate(texts)),
                       encoding="utf-8", newline="")
    assert [r["prompt"] for r in load_prompt_file(str(prompts), prompt_key="q", answer_key="a")] == texts

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": t, "chosen": f" {t}", "rejected": " x"}, ensure_ascii=False) + "\n"
                             for t in texts), encoding="utf-8")
    assert [r["chosen"] for r in load_preference_file(str(pairs))] == [f" {t}" for t in texts]

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i + 1, "note": t}, ensure_ascii=False) + "\n" for i, t in enumerate(texts)),
                       encoding="utf-8")
    assert [r["note"] for r in read_metrics(str(metrics))] == texts

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": texts[0]}, ensure_ascii=False) + "\n\n" + '{"q": 1\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 3: invalid JSON"):
        load_prompt_file(str(bad), prompt_key="q")


def test_step_draw_is_deterministic_and_covers_each_epoch():
    n, p = 7, 3
    draws = [step_record_indices(num_records=n, step=s, num_prompts=p, seed=5) for s in range(1, 8)]
    assert draws == [step_record_indices(num_records=n, step=s, num_prompts=p, seed=5) for s in range(1, 8)]
    stream = [i for d in draws for i in d]
    for e in range(3):  # every epoch is a permutation of the records
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n))
    assert stream[:n] == epoch_permutation(n, 5, 0)
    assert draws != [step_record_indices(num_records=n, step=s, num_prompts=p, seed=6) for s in range(1, 8)]
    with pytest.raises(ValueError, match="count from 1"):
        step_record_indices(num_records=n, step=0, num_prompts=p, seed=5)


def test_derive_seed_distinguishes_parts():
    seeds = {derive_seed(1, s, st, i) for s in (1, 2) for st in ("generate", "eval") for i in range(4)}
    assert len(seeds) == 16 and all(0 <= x < 2**63 for x in seeds)


def test_arithmetic_records_train_val_differ():
    cfg = _data_cfg()
    train = load_prompt_records(cfg, "train", seed=0)
    val = load_prompt_records(cfg, "val", seed=0)
    assert len(train) == 20 and len(val) == 5
    assert train == load_prompt_records(cfg, "train", seed=0)
    assert train[:5] != val


def test_format_and_tokenize(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = _data_cfg(prompt_template="Q: {prompt}", chat_template=True, system_prompt="Be brief.")
    text = format_prompt("What is 1+1?", cfg, tok)
    assert "Q: What is 1+1?" in text and "Be brief." in text and text.endswith("assistant\n")
    ids, lengths = tokenize_prompts(["What is 1+1? Answer:", "Hi"], tok, max_length=64)
    assert ids.shape[0] == 2 and lengths.tolist()[1] < lengths.tolist()[0]
    assert int(ids[1, lengths[1]:].ne(tok.pad_token_id).sum()) == 0  # right-padded
    with pytest.raises(ValueError, match="prompt 0 has .* tokens > 3"):
        tokenize_prompts(["What is 1+1? Answer:"], tok, max_length=3)
    cut, n = tokenize_prompts(["What is 1+1? Answer:"], tok, max_length=3, overlong="truncate")
    assert n.tolist() == [3] and cut[0].tolist() == ids[0, lengths[0] - 3 : lengths[0]].tolist()


_HUGE_LINE_SCRIPT = r"""
import json, resource, sys

resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, 4 << 30))  # the unbounded code must not take the machine down
from transformers import AutoTokenizer

from nrl_tasks.config.data import DataConfig
from nrl_tasks.stages.data import check_prompt_lengths, format_prompt, load_prompt_file, tokenize_prompts
from nrl_tasks.stages.preferences import build_pair_batch, load_preference_file

def peak_kb():  # this process's own peak RSS: VmHWM starts afresh at exec (ru_maxrss keeps the parent's)
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))


model_dir, pref_path, prompt_path = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(model_dir)
before = peak_kb()
cfg = DataConfig(overlong_prompts="truncate")
pairs = build_pair_batch(load_preference_file(pref_path), [0], tok, cfg, 64)
prompts = load_prompt_file(prompt_path)
over = check_prompt_lengths(prompts, cfg, tok, 64)
ids, lengths = tokenize_prompts([format_prompt(r["prompt"], cfg, tok, max_tokens=64) for r in prompts], tok,
                                max_length=64, overlong="truncate")
try:
    check_prompt_lengths(prompts, DataConfig(), tok, 64)
    rejected = ""
except ValueError as exc:
    rejected = str(exc)
print(json.dumps({"before_kb": before, "peak_kb": peak_kb(),
                  "over": over, "lengths": lengths.tolist(), "pair_lengths": pairs["input_lengths"].tolist(),
                  "last_ids": ids[0, :64].tolist(), "rejected": rejected}))
"""


def test_a_50mb_line_is_cut_by_characters_before_it_is_tokenised(tmp_path, tiny_model_dir):
    """A 50 MB response in a DPO preference file and a 50 MB prompt in a prompt file: loading,
    checking and tokenising them stays under 1 GB peak (it took 16.5 GB when the text was tokenised
    whole), truncation keeps the same last tokens as a short prompt with the same end, and
    ``data.overlong_prompts: reject`` still rejects (issue 27, item 5)."""
    import subprocess
    import sys

    huge = "What is 2+3? Answer: 5\n" * (50_000_000 // 23)
    pref, prompt = tmp_path / "pairs.jsonl", tmp_path / "prompts.jsonl"
    pref.write_text(json.dumps({"prompt": "What is 1+1?", "chosen": huge, "rejected": " 3"}) + "\n")
    prompt.write_text(json.dumps({"prompt": huge + "What is 7+1?", "answer": "8"}) + "\n")
    proc = subprocess.run([sys.executable, "-c", _HUGE_LINE_SCRIPT, tiny_model_dir, str(pref), str(prompt)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["peak_kb"] < 1 << 20, f"peak RSS {out['peak_kb'] / 1024:.0f} MiB (before loading: {out['before_kb'] / 1024:.0f} MiB)"
    assert out["over"] == 1 and out["lengths"] == [64] and max(out["pair_lengths"]) == 64
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    short = ("What is 2+3? Answer: 5\n" * 100 + "What is 7+1?")
    assert out["last_ids"] == tok(short, add_special_tokens=False)["input_ids"][-64:]
    assert "record 0 (" in out["rejected"] and "characters)" in out["rejected"] and "data.overlong_prompts=truncate" in out["rejected"]
