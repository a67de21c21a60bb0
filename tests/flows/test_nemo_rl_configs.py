"""NeMo-RL's own config files (tests/data/nemo_rl_configs/, copied with their source commit) load
here: every key has a decided fate (issue 42, item 2), the table in docs/nemo_rl_keys.md is the
one the rules write, NeMo-RL's scheduler list is torch's SequentialLR, and the algorithms not
built here are refused by name. Nothing here starts Ray or Prefect.
"""

from __future__ import annotations

import glob
import io
import logging
import os
import re
from contextlib import redirect_stdout

import pytest

from flows.cli import main
from flows.config import ConfigError, load_config
from flows.config.compose import compose_file, resolve_interpolations
from flows.config.nemo_rl import _main as write_key_table
from flows.config.nemo_rl import fate_of, leaf_keys, schema_keys, translate
from nrl_tasks.config.master import SECTION_KINDS

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CONFIGS = os.path.join(ROOT, "tests", "data", "nemo_rl_configs")
FILES = sorted(glob.glob(os.path.join(CONFIGS, "*.yaml"))) + sorted(glob.glob(os.path.join(CONFIGS, "recipes", "llm", "*.yaml")))

# the model, step-count and cluster-size overrides a CPU user gives (issue 42, item 5); the data
# overrides are _local_data's (here, the files' hub datasets replaced by the built-in task)
COMMON = ["policy.model_name=builtin:tiny", "policy.tokenizer.name=builtin:tiny", "policy.max_total_sequence_length=64",
          "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8", "cluster.gpus_per_node=1",
          "cluster.num_nodes=1", "logger.wandb_enabled=false", "data.max_input_seq_length=32",
          "data.train=null", "data.validation=null", "data.default=null"]
BY_KIND = {
    "grpo": ["grpo.max_num_steps=2", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
             "policy.generation.backend=hf", "policy.generation.max_new_tokens=8",
             "policy.generation.vllm_cfg.max_model_len=64"],
    "dpo": ["dpo.max_num_steps=2"],
    # ppo_math_1B.yaml: its DAPO verifier is NeMo-RL's other math_verify_impl; vLLM colocated needs a GPU
    "ppo": ["ppo.max_num_steps=2", "ppo.num_prompts_per_step=4", "ppo.num_generations_per_prompt=4",
            "ppo.ppo_epochs=2", "policy.generation.backend=hf", "policy.generation.max_new_tokens=8",
            "policy.generation.vllm_cfg.max_model_len=64", "env.math.math_verify_impl=hf_math_verify",
            "value.max_total_sequence_length=64", "value.train_global_batch_size=16", "value.train_micro_batch_size=8",
            "logger.wandb.name=ppo", "logger.swanlab.name=ppo", "logger.tensorboard.log_dir=tb"],
    # distillation_math.yaml: the student samples colocated (its file's choice); the teacher is a tiny Llama too
    "distillation": ["distillation.max_num_steps=2", "distillation.num_prompts_per_step=4",
                     "distillation.num_generations_per_prompt=4", "distillation.topk_logits_k=16",
                     "policy.generation.backend=hf", "policy.generation.max_new_tokens=8",
                     "policy.generation.vllm_cfg.max_model_len=64", "policy.dtensor_cfg.tensor_parallel_size=1",
                     "policy.dtensor_cfg.context_parallel_size=1", "teacher.model_name=builtin:tiny-seed3",
                     "teacher.tokenizer.name=builtin:tiny", "teacher.max_total_sequence_length=64",
                     "teacher.dtensor_cfg.tensor_parallel_size=1", "teacher.dtensor_cfg.context_parallel_size=1",
                     "logger.wandb.name=d", "logger.swanlab.name=d", "logger.tensorboard.log_dir=tb"],
    # rm.yaml's -1 (one epoch) would be 2 steps here too; it names its loggers' runs like sft.yaml
    "rm": ["rm.max_num_steps=2", "logger.wandb.name=rm", "logger.swanlab.name=rm", "logger.tensorboard.log_dir=tb",
           "logger.mlflow.run_name=rm"],
    # sft.yaml names its loggers' runs after ${data.train.dataset_name}
    "sft": ["sft.max_num_steps=2", "logger.wandb.name=sft", "logger.swanlab.name=sft",
            "logger.tensorboard.log_dir=tb", "logger.mlflow.run_name=sft"],
}


def _kind(path: str) -> str:
    """The algorithm section of one of NeMo-RL's files (``distillation`` for distillation_math.yaml)."""
    name = os.path.basename(path)
    return next(k for k in BY_KIND if name.startswith(k))


def _run_kind(section: str) -> str:
    """The run kind of a section (``nrl distill`` trains the ``distillation`` section)."""
    return SECTION_KINDS.get(section, section)


def _resolved(path: str) -> dict:
    return resolve_interpolations(compose_file(path), repr(path))


def test_the_tested_files_are_nemo_rls_own_with_their_source():
    assert len(FILES) == 10
    for path in FILES:
        with open(path, encoding="utf-8") as fh:
            head = fh.readline()
        assert "NVIDIA-NeMo/RL" in head and "at commit " in head, path


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_every_key_of_nemo_rls_files_has_a_fate(path):
    known = schema_keys()
    data = _resolved(path)
    undecided = [k for k in leaf_keys(data) if fate_of(k, known)[0] == "unknown"]
    assert undecided == []


def test_the_key_table_in_docs_is_the_one_the_rules_write():
    out = io.StringIO()
    with redirect_stdout(out):
        write_key_table([os.path.relpath(p, ROOT) for p in FILES])
    with open(os.path.join(ROOT, "docs", "nemo_rl_keys.md"), encoding="utf-8") as fh:
        assert fh.read() == out.getvalue(), "regenerate: python -m flows.config.nemo_rl tests/data/nemo_rl_configs/*.yaml " \
                                            "tests/data/nemo_rl_configs/recipes/llm/*.yaml > docs/nemo_rl_keys.md"


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_each_file_validates_with_the_cpu_overrides_and_nrl_check_says_so(path, tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.chdir(tmp_path)
    overrides = COMMON + BY_KIND[_kind(path)]
    with caplog.at_level(logging.WARNING, logger="flows.config"):
        cfg = load_config(path, overrides)
    assert cfg.kind == _run_kind(_kind(path))
    ignored = [r.getMessage() for r in caplog.records if "NeMo-RL keys ignored" in r.getMessage()]
    assert len(ignored) == 1 and "policy.offload_optimizer_for_logprob" in ignored[0]  # one line naming the keys
    assert cfg.checkpointing.metric_name.startswith("val_")  # NeMo-RL's val:<name>, mapped
    capsys.readouterr()
    assert main(["check", path, *overrides]) == 0
    out = capsys.readouterr().out
    assert f"a valid {_run_kind(_kind(path)).upper()} config" in out
    # the file's keys by fate: counts, then the mapped and ignored ones with how or why
    counts = re.search(r"keys by fate \(docs/nemo_rl_keys.md\): (\d+) honoured, (\d+) mapped, (\d+) ignored, 0 refused", out)
    assert counts and int(counts.group(1)) > 50 and int(counts.group(3)) > 0, out[:3000]
    assert "  ignored: policy.offload_optimizer_for_logprob: " in out and "  mapped: checkpointing.metric_name: " in out
    assert os.listdir(tmp_path) == []


def test_grpo_math_1b_without_the_overrides_names_what_is_refused_and_why():
    with pytest.raises(ConfigError) as err:
        load_config(os.path.join(CONFIGS, "grpo_math_1B.yaml"))
    text = str(err.value)
    for needle in ("data.train.dataset_name: 'OpenMathInstruct-2' names a hub dataset",
                   "data.train.dataset_name=ResponseDataset data.train.data_path=FILE",
                   "policy.generation: colocated.enabled=true with backend='vllm' is not built"):
        assert needle in text
    assert "unknown key" not in text  # every key has a fate


@pytest.mark.parametrize(
    "override, needle",
    [
        ("policy.megatron_cfg.enabled=true", "policy.megatron_cfg: Megatron-Core training is not available here"),
        ("grpo.val_start_at=5", "grpo.val_start_at: delayed periodic validation is not implemented"),
        ("grpo.seq_logprob_error_threshold=0.5", "grpo.seq_logprob_error_threshold: the sequence logprob-error filter"),
        ("policy.dtensor_cfg.lora_cfg.enabled=true", "policy.dtensor_cfg.lora_cfg.dropout_position"),  # post, dropout>0
        ("grpo.adv_estimator.normalize_rewards=false", "grpo.adv_estimator.normalize_rewards: False disagrees with "
                                                       "grpo.normalize_rewards (True)"),
        ("checkpointing.model_save_format=torch_save", "checkpoints are safetensors"),
    ],
)
def test_a_value_that_turns_on_what_is_not_built_is_refused_by_name(override, needle):
    path = os.path.join(CONFIGS, "grpo_math_1B.yaml")
    extra = ["policy.dtensor_cfg.lora_cfg.dropout=0.1"] if "lora" in override else []
    with pytest.raises(ConfigError) as err:
        load_config(path, COMMON + BY_KIND["grpo"] + [override] + extra)
    assert needle in str(err.value)


def test_gpus_per_node_1_runs_on_cpu_with_a_local_ray_on_a_machine_without_a_gpu(monkeypatch, caplog):
    import torch

    from flows.run.ray_session import usable_gpus_per_node

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(os.path.join(CONFIGS, "grpo_math_1B.yaml"), COMMON + BY_KIND["grpo"] + ["cluster.ray.address=null"])
    assert cfg.cluster.gpus_per_node == 1
    if torch.cuda.device_count():
        pytest.skip("this machine has a GPU")
    with caplog.at_level(logging.WARNING):
        assert usable_gpus_per_node(cfg) == 0
    assert "cluster.gpus_per_node=1 but this machine has no GPU: the workers run on CPU" in caplog.text
    remote = load_config(os.path.join(CONFIGS, "grpo_math_1B.yaml"), COMMON + BY_KIND["grpo"] + ["cluster.ray.address=ray://h:10001"])
    assert usable_gpus_per_node(remote) == 1  # a cluster's GPUs are its own to report


@pytest.mark.parametrize("name", ["grpo_math_1B.yaml", "dpo.yaml", "sft.yaml", "rm.yaml"])
def test_max_num_epochs_ends_the_run_after_the_fewer_steps(name, tmp_path):
    from flows.algorithms.registry import recipe_of

    kind = _kind(os.path.join(CONFIGS, name))
    overrides = [o for o in COMMON if not o.startswith(("data.train=", "data.validation=", "data.default="))]
    overrides += [o for o in BY_KIND[kind] if not o.startswith("logger.")] + _local_data(kind, tmp_path)
    long = [o for o in overrides if not o.startswith(f"{kind}.max_num_steps=")] + [f"{kind}.max_num_steps=1000"]
    cfg = load_config(os.path.join(CONFIGS, name), long)
    recipe = recipe_of(cfg.model_dump(mode="json"))
    assert getattr(cfg, kind).max_num_epochs == 1  # the file's
    assert recipe.budget(cfg) == 2  # one pass: 11 prompts // 4 (GRPO), 32 pairs // 16 (DPO), 34 rows // 16 (SFT)
    two = load_config(os.path.join(CONFIGS, name), long + [f"{kind}.max_num_epochs=2"])
    assert recipe.budget(two) == 4
    few = load_config(os.path.join(CONFIGS, name), overrides + [f"{kind}.max_num_steps=1"])
    assert recipe.budget(few) == 1  # the fewer steps wins
    assert recipe.check_config(cfg) == []


def test_grpo_keys_implemented_since_are_honoured_from_nemo_rl_files():
    path = os.path.join(CONFIGS, "grpo_math_1B.yaml")
    cfg = load_config(path, COMMON + BY_KIND["grpo"] + [
        "grpo.overlong_filtering=true", "grpo.advantage_clip_low=-1.0", "grpo.advantage_clip_high=2.0",
        "grpo.val_at_end=true", "grpo.reward_scaling.enabled=true", "grpo.reward_scaling.target_min=-1",
        "grpo.stop_at_validation_metric=accuracy", "grpo.stop_at_validation_threshold=0.8"])
    g = cfg.grpo
    assert g.overlong_filtering and (g.advantage_clip_low, g.advantage_clip_high) == (-1.0, 2.0) and g.val_at_end
    assert (g.stop_at_validation_metric, g.stop_at_validation_threshold) == ("accuracy", 0.8)
    assert g.reward_scaling.enabled and g.reward_scaling.target_min == -1.0


def test_mapped_keys_take_effect_here():
    data = {"grpo": {"normalize_rewards": True, "adv_estimator": {"use_leave_one_out_baseline": False}},
            "checkpointing": {"metric_name": "val:validation-default_loss", "checkpoint_dir": "results/x"},
            "policy": {"generation": {"vllm_kwargs": {"enforce_eager": True}}}}
    out = translate(data)
    assert out.errors == []
    assert out.data["grpo"] == {"normalize_rewards": True, "adv_estimator": {}, "use_leave_one_out_baseline": False}
    assert out.data["checkpointing"] == {"metric_name": "val_loss"}  # the run's layout holds its checkpoints
    assert out.data["policy"]["generation"] == {"vllm_cfg": {"llm_kwargs": {"enforce_eager": True}}}
    assert {k for k, _ in out.fates["mapped"]} == {"grpo.adv_estimator.use_leave_one_out_baseline", "checkpointing.metric_name",
                                                   "checkpointing.checkpoint_dir", "policy.generation.vllm_kwargs"}


def test_nemo_rls_scheduler_list_is_torchs_sequential_lr(tmp_path):
    import torch

    cfg = load_config(os.path.join(CONFIGS, "dpo.yaml"), COMMON + BY_KIND["dpo"])
    sched = cfg.policy.scheduler
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, end_factor=1.0, total_iters=20),
              torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=10000000000)], milestones=[20])
    expected = []
    for _ in range(40):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        ref.step()
    assert [sched.factor(i) for i in range(40)] == pytest.approx(expected, rel=1e-12)
    assert sched.factor(0) == pytest.approx(0.1) and sched.factor(39) == 1.0


def test_nemo_rls_multi_teacher_distillation_is_refused_naming_what_is_missing(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(f"defaults: {os.path.join(CONFIGS, 'grpo_math_1B.yaml')}\non_policy_distillation: {{teachers: [a]}}\n")
    assert main(["check", str(path), *COMMON, *BY_KIND["grpo"]]) == 2
    assert "on_policy_distillation: multi-teacher on-policy distillation is not implemented" in capsys.readouterr().err


# ---------------------------------------------------------------------------- NeMo-RL's dataset sections
def _jsonl(path, rows) -> str:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _local_data(kind: str, tmp_path) -> list[str]:
    """Overrides giving ``kind``'s NeMo-RL file a local dataset in NeMo-RL's own keys, exactly those
    of issue 42, item 5: GRPO keeps its file's ``split_validation_size`` (a held-out slice) and
    ``env_name: math`` (math-verify), as does the SFT LoRA recipe its 5% slice; DPO and SFT run
    without a validation set otherwise."""
    if kind in ("dpo", "rm"):
        rows = [{"prompt": f"What is {i}+1?", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(32)]
        return ["data.train.dataset_name=BinaryPreferenceDataset", f"data.train.data_path={_jsonl(tmp_path / 'pairs.jsonl', rows)}",
                "data.validation=null"]
    # GRPO: 11 of 12 rows train (one held out), 2 steps of 4 prompts in its one epoch; SFT: 2 steps of 16
    # rows (the LoRA recipe holds 2 of the 34 out)
    rows = [{"question": f"What is {i}+1?", "solution": str(i + 1)} for i in range(34 if kind == "sft" else 12)]
    keys = ["data.train.dataset_name=ResponseDataset", f"data.train.data_path={_jsonl(tmp_path / 'qa.jsonl', rows)}",
            "data.train.input_key=question", "data.train.output_key=solution"]
    if kind in ("grpo", "distillation", "ppo"):  # (a recipe's validation set, e.g. AIME repeated 16 times, is a hub dataset: none)
        return keys + ["data.default.prompt_file=null", "data.validation=null"]
    return keys + ["data.validation=null"]


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_local_datasets_in_nemo_rls_keys_map_to_the_file_reader(path, tmp_path, monkeypatch):
    kind = _kind(path)
    monkeypatch.chdir(tmp_path)
    overrides = [o for o in COMMON if not o.startswith(("data.train=", "data.validation=", "data.default="))]
    overrides += [o for o in BY_KIND[kind] if not o.startswith("logger.")] + _local_data(kind, tmp_path)
    cfg = load_config(path, overrides)
    assert (cfg.data.dataset, os.path.basename(cfg.data.train_path), cfg.data.val_path) == (
        "file", "pairs.jsonl" if kind in ("dpo", "rm") else "qa.jsonl", None)
    if kind not in ("dpo", "rm"):
        assert (cfg.data.prompt_key, cfg.data.answer_key) == ("question", "solution")
    if kind == "grpo" and "grpo_math_1B" in path:  # its 5% held out; its math environment: math-verify
        assert cfg.data.split_validation_size == 0.05 and cfg.data.split_seed == cfg.grpo.seed
        assert cfg.env.reward_fn == "nrl_tasks.environments.math_verify:math_reward"
    if kind in ("dpo", "sft", "rm") and not cfg.data.split_validation_size:  # no validation set: none, as in NeMo-RL
        assert getattr(cfg, kind).val_period == 0
    if "lora" in path:  # the SFT recipe's own held-out 5% of the train file, validated every 20 steps
        assert cfg.data.split_validation_size == 0.05 and cfg.sft.val_period == 20
    assert main(["check", path, *overrides]) == 0  # the preflight reads the file


@pytest.mark.parametrize(
    "override, needle",
    [
        ("data.train.dataset_name=squad", "data.train.dataset_name: 'squad' names a hub dataset"),
        ("data.default.env_name=code", "data.default.env_name: 'code' is not an environment here"),
        ("data.default.prompt_file=no-such-cot.txt", "data.train.prompt_file: no file 'no-such-cot.txt'"),
        ("data.validation.input_key=q", "data.validation: prompt_key differ from data.train's"),
        ("data.validation.repeat=16", "data.validation.repeat: repeating the validation set is not implemented"),
        ("data.train.split_validation_size=0.1", "data.train.split_validation_size and data.validation: give one"),
        ("env.math.math_verify_impl=dapo_math_verify", "env.math: only NeMo-RL's default `math_verify_impl: hf_math_verify`"),
    ],
)
def test_what_the_file_reader_cannot_honour_is_refused_with_the_override_that_works(override, needle, tmp_path):
    path = os.path.join(CONFIGS, "grpo_math_1B.yaml")
    overrides = [o for o in COMMON if not o.startswith(("data.train=", "data.validation=", "data.default="))]
    val = [] if override.startswith(("data.default.", "env.")) else [  # a validation file as well
        "data.validation.dataset_name=ResponseDataset", f"data.validation.data_path={tmp_path / 'v.jsonl'}",
        "data.validation.input_key=question", "data.validation.output_key=solution"]
    if override.startswith("data.validation") or override.startswith("data.train.split"):
        val += ["data.train.split_validation_size=0"] if not override.startswith("data.train.split") else []
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides + BY_KIND["grpo"] + _local_data("grpo", tmp_path) + val + [override])
    assert needle in str(err.value)


# NeMo-RL's examples/prompts/cot.txt (at the commit the config files were copied from)
COT = "Think step-by-step to solve the following problem. Output your answer inside of \\\\boxed{{}} tags.:\n{}\n\nLet's think step-by-step"


def test_prompt_files_map_to_the_template_and_system_prompt_nemo_rl_would_build(tmp_path):
    from nrl_tasks.stages.data import prompt_messages

    (tmp_path / "cot.txt").write_text(COT, encoding="utf-8")
    (tmp_path / "system.txt").write_text("You are a careful mathematician.", encoding="utf-8")
    path = os.path.join(CONFIGS, "grpo_math_1B.yaml")
    overrides = [o for o in COMMON if not o.startswith(("data.train=", "data.validation=", "data.default="))]
    data = [o for o in _local_data("grpo", tmp_path) if not o.startswith("data.default.prompt_file")]
    cfg = load_config(path, overrides + BY_KIND["grpo"] + data + [
        f"data.default.prompt_file={tmp_path / 'cot.txt'}", f"data.default.system_prompt_file={tmp_path / 'system.txt'}"])
    problem = "What is {x} if 2x = 6?"  # braces in the problem stay as they are
    assert prompt_messages(problem, cfg.data) == [  # what NeMo-RL's math processor puts in the conversation
        {"role": "system", "content": "You are a careful mathematician."},
        {"role": "user", "content": COT.format(problem)}]
    assert "\\boxed{}" in cfg.data.prompt_template  # NeMo-RL's doubled braces are its str.format's


@pytest.mark.parametrize("text, needle", [("no slot here", "needs one {} where the problem goes"),
                                          ("{} and {}", "found 2"), ("{problem}", "found {problem}")])
def test_a_prompt_file_nemo_rl_could_not_format_is_refused_naming_the_key(text, needle, tmp_path):
    (tmp_path / "p.txt").write_text(text, encoding="utf-8")
    path = os.path.join(CONFIGS, "grpo_math_1B.yaml")
    overrides = [o for o in COMMON if not o.startswith(("data.train=", "data.validation=", "data.default="))]
    data = [o for o in _local_data("grpo", tmp_path) if not o.startswith("data.default.prompt_file")]
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides + BY_KIND["grpo"] + data + [f"data.default.prompt_file={tmp_path / 'p.txt'}"])
    assert "data.train.prompt_file" in str(err.value) and needle in str(err.value)
