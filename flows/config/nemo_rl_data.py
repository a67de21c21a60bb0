"""NeMo-RL's dataset sections (``data.train``, ``data.validation``, ``data.default``) as this project's ``data`` keys.

NeMo-RL names a dataset per split, each item's missing keys taken from ``data.default``::

    data:
      train: {dataset_name: ResponseDataset, data_path: train.jsonl, input_key: question, output_key: answer}
      validation: {data_path: val.jsonl}
      default: {prompt_file: null, system_prompt_file: null, processor: math_hf_data_processor, env_name: math}

Local files map to ``data.dataset: file`` with ``data.train_path`` / ``data.val_path``:

- ``ResponseDataset`` (rows of ``input_key``/``output_key``, default ``input``/``output``): the
  prompt and answer keys (``data.prompt_key``/``data.answer_key``); an SFT run also reads chat
  ``messages`` rows from it;
- ``BinaryPreferenceDataset`` (``prompt_key``, ``chosen_key``, ``rejected_key``): DPO's pairs;
  this project's pair reader takes the columns ``chosen`` and ``rejected`` by those names.

Refused by name: a hub dataset (any other ``dataset_name``: nothing is downloaded here; the error
gives the override that works), several datasets, ``split_validation_size`` > 0 together with
``data.validation`` (it maps to ``data.split_validation_size``: a held-out slice), a ``prompt_file`` /
``system_prompt_file`` that cannot be read (both map to ``data.prompt_template`` /
``data.system_prompt``: the files' text, read when the config loads), and
``env_name`` other than ``math`` (which maps to the math-verify reward,
:mod:`nrl_tasks.environments.math_verify`, unless ``env.reward_fn`` names another scorer).
``processor`` maps to the algorithm's own row reader; ``split``, ``subset`` and the split ``seed``
only apply to hub datasets and splitting.
"""

from __future__ import annotations

import string
from typing import Any, Mapping

from nrl_tasks.config.master import ALGORITHM_SECTIONS
from nrl_tasks.environments.math_verify import MATH_REWARD_FN

__all__ = ["KEY_FATES", "map_datasets"]

_RESPONSE, _PAIRS = "ResponseDataset", "BinaryPreferenceDataset"
_HUB_ONLY = ("split", "subset", "seed", "processor")  # no effect on a local file without splitting
_KNOWN = {"repeat", "dataset_name", "data_path", "input_key", "output_key", "prompt_key", "chosen_key", "rejected_key",
          "split_validation_size", "prompt_file", "system_prompt_file", "env_name", *_HUB_ONLY}


KEY_FATES: dict[str, tuple[str, str]] = {
    "dataset_name": ("mapped", f"{_RESPONSE} / {_PAIRS} (a local file): `data.dataset: file`; a hub dataset is refused "
                               "with the override that works"),
    "data_path": ("mapped", "`data.train_path` / `data.val_path`"),
    "input_key": ("mapped", "`data.prompt_key`"),
    "output_key": ("mapped", "`data.answer_key`"),
    "prompt_key": ("mapped", "`data.prompt_key`"),
    "chosen_key": ("honoured when 'chosen', else refused", "the pair reader's column"),
    "rejected_key": ("honoured when 'rejected', else refused", "the pair reader's column"),
    "split_validation_size": ("honoured", "`data.split_validation_size`: that fraction of the train file held out as "
                              "the validation split (drawn with `data.split_seed`), the rest trained on"),
    "prompt_file": ("mapped", "`data.prompt_template`: the file's text read when the config loads (its `{}` as "
                    "`{prompt}`), saved in the run's config"),
    "system_prompt_file": ("mapped", "`data.system_prompt`: the file's text read when the config loads, saved in the "
                           "run's config"),
    "env_name": ("mapped when math, honoured when null, else refused",
                 f"`math` is env.reward_fn={MATH_REWARD_FN} (math-verify), unless env.reward_fn names another scorer"),
    **{k: ("ignored", "applies to hub datasets only") for k in ("split", "subset")},
    "seed": ("mapped", "`data.split_seed`, the held-out draw's seed, with split_validation_size"),
    "processor": ("mapped", "the algorithm's own row reader"),
    "repeat": ("honoured when 1 or null, else refused", "validation rows are not repeated"),
}
"""The fate of each key of a NeMo-RL dataset item (for the key table); any other key is refused."""


def _hub_error(where: str, name: Any) -> str:
    if name is None:
        return f"{where}.dataset_name is not set (in it or in data.default): {_RESPONSE} or {_PAIRS} with a data_path"
    return (f"{where}.dataset_name: {name!r} names a hub dataset, which cannot be downloaded here; give a local file: "
            f"`{where}.dataset_name={_RESPONSE} {where}.data_path=FILE` ({_PAIRS} for DPO pairs), "
            f"or `data.train=null data.validation=null data.default=null data.train_path=FILE`")


def _one(where: str, spec: Mapping[str, Any], errors: list[str]) -> dict[str, Any] | None:
    """Our ``data`` keys for one split's merged spec, or ``None`` (errors appended)."""
    name = spec.get("dataset_name")
    if name not in (_RESPONSE, _PAIRS):
        errors.append(_hub_error(where, name))
        return None
    bad = sorted(k for k in set(spec) - _KNOWN if spec[k] is not None)
    if bad:
        errors.append(f"{where}: {', '.join(bad)}: not read here (keys of {name}: {', '.join(sorted(_KNOWN))})")
    if not spec.get("data_path"):
        errors.append(f"{where}.data_path: a local JSONL/Parquet/Arrow file is required for {name}")
    if spec.get("repeat") not in (None, 1):
        errors.append(f"{where}.repeat: repeating the validation set is not implemented (`nrl eval --num-samples K` "
                      f"samples K responses per prompt); set `{where}.repeat=1`")
    prompts = _prompt_files(where, spec, errors)
    if name == _PAIRS:
        for key, ours in (("chosen_key", "chosen"), ("rejected_key", "rejected")):
            if spec.get(key, ours) != ours:
                errors.append(f"{where}.{key}: the pair reader takes the column {ours!r} (got {spec[key]!r})")
        keys = {"prompt_key": spec.get("prompt_key", "prompt")}
    else:
        keys = {"prompt_key": spec.get("input_key", "input"), "answer_key": spec.get("output_key", "output")}
    if spec.get("split_validation_size"):  # held out of the train file
        keys["split_validation_size"] = spec["split_validation_size"]
        if spec.get("seed") is not None:
            keys["split_seed"] = spec["seed"]
    return {"path": spec.get("data_path"), **keys, **prompts}


#: the most bytes of a prompt file read
MAX_PROMPT_FILE_BYTES = 1 << 20


def _prompt_files(where: str, spec: Mapping[str, Any], errors: list[str]) -> dict[str, str]:
    """``prompt_file`` as ``data.prompt_template`` (:func:`nemo_prompt_template`) and
    ``system_prompt_file`` as ``data.system_prompt``: the files' text, read now (a path from the
    working directory, as NeMo-RL reads it), so the run's saved config holds it."""
    out: dict[str, str] = {}
    for key, ours in (("prompt_file", "prompt_template"), ("system_prompt_file", "system_prompt")):
        path = spec.get(key)
        if path is None:
            continue
        try:
            with open(str(path), "rb") as fh:
                raw = fh.read(MAX_PROMPT_FILE_BYTES + 1)
            if len(raw) > MAX_PROMPT_FILE_BYTES:
                raise ValueError(f"larger than {MAX_PROMPT_FILE_BYTES} bytes")
            text = raw.decode("utf-8")
            out[ours] = nemo_prompt_template(text) if key == "prompt_file" else text
        except FileNotFoundError:
            errors.append(f"{where}.{key}: no file {str(path)!r} (a path from the working directory, as NeMo-RL "
                          f"reads it: copy NeMo-RL's examples/prompts/ here or give the path; or `data.default.{key}=null`)")
        except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            errors.append(f"{where}.{key}: {str(path)!r}: {exc}")
    return out


def nemo_prompt_template(text: str) -> str:
    """A NeMo-RL prompt file's text (``text.format(problem)``: one positional ``{}``, literal braces
    doubled) as ``data.prompt_template`` (the literal text with ``{prompt}`` where the problem goes,
    :func:`nrl_tasks.stages.data.prompt_messages`), the same prompt for every problem.

    >>> nemo_prompt_template("Q: {} (answer inside {{}})")
    'Q: {prompt} (answer inside {})'
    >>> nemo_prompt_template("no slot")
    Traceback (most recent call last):
    ...
    ValueError: a prompt file needs one {} where the problem goes (NeMo-RL formats it with the problem), found 0
    """
    parts, slots = [], 0
    for literal, field, spec, conversion in string.Formatter().parse(text):
        if "{prompt}" in literal:
            raise ValueError("a prompt file's text holds a literal {prompt}, which the template would fill too")
        parts.append(literal)
        if field is not None:
            if field not in ("", "0") or spec or conversion:
                raise ValueError(f"a prompt file's only placeholder is {{}} (the problem), found {{{field}}}")
            slots += 1
            parts.append("{prompt}")
    if slots != 1:
        raise ValueError(f"a prompt file needs one {{}} where the problem goes (NeMo-RL formats it with the problem), "
                         f"found {slots}")
    return "".join(parts)


def map_datasets(data: dict[str, Any], env_reward_fn: Any, errors: list[str]) -> list[tuple[str, str]]:
    """Replace ``data.train``/``validation``/``default`` in ``data`` (a config's data, changed in
    place) by ``data.dataset: file`` and its keys; returns the ``(key, how)`` pairs mapped.
    Nothing is done when ``data.train`` is absent or null (the rules of :mod:`flows.config.nemo_rl`
    then decide ``data.validation`` / ``data.default``)."""
    section = data.get("data")
    if not isinstance(section, dict) or section.get("train") is None:
        return []
    default = section.pop("default", None) or {}
    train, val = section.pop("train"), section.pop("validation", None)
    if isinstance(train, list) or isinstance(val, list) or not isinstance(train, Mapping):
        errors.append("data.train: several datasets (a list) are not implemented; give one local file")
        return []
    env_name = {**default, **train}.get("env_name")
    mapped = []
    if env_name not in (None, "math"):
        errors.append(f"data.default.env_name: {env_name!r} is not an environment here (set `env.environment` to a plug-in)")
    elif env_name == "math" and env_reward_fn is None:  # NeMo-RL's math environment: math-verify, as a reward function
        data.setdefault("env", {})["reward_fn"] = MATH_REWARD_FN
        mapped.append(("data.default.env_name", f"`math`: env.reward_fn={MATH_REWARD_FN} (math-verify, as NeMo-RL's)"))
    ours = _one("data.train", {**default, **train}, errors)
    if ours is not None:
        section.update(dataset="file", train_path=ours.pop("path"), **ours)
        mapped.append(("data.train", f"data.dataset=file, data.train_path, {', '.join(f'data.{k}' for k in ours)}"))
    if val is None and not section.get("split_validation_size"):  # NeMo-RL validates nothing without a validation set
        for algo in ("grpo", *ALGORITHM_SECTIONS):
            if isinstance(data.get(algo), dict) and any(data[algo].get(k) for k in ("val_period", "val_at_start", "val_at_end")):
                data[algo].update(val_period=0, val_at_start=False, val_at_end=False)
                mapped.append(("data.validation", f"null: no validation, as NeMo-RL skips it without a validation set "
                                                  f"({algo}.val_period=0, {algo}.val_at_start=false, {algo}.val_at_end=false)"))
    if isinstance(val, Mapping) and section.get("split_validation_size"):
        errors.append("data.train.split_validation_size and data.validation: give one (a held-out slice of the train "
                      "file, or a validation file)")
    elif isinstance(val, Mapping):
        vals = _one("data.validation", {**default, **val}, errors)
        if vals is not None:
            path = vals.pop("path")
            clash = [k for k, v in vals.items() if ours is not None and section.get(k) != v]
            if clash:
                errors.append(f"data.validation: {', '.join(clash)} differ from data.train's (one reader reads both files)")
            section["val_path"] = path
            mapped.append(("data.validation", "data.val_path"))
    return mapped
