"""``PolicyWorker``: one data-parallel rank of a :class:`~nrl_tasks.models.policy.lm_policy.Policy`.

A Ray actor holding a Hugging Face model, its AdamW optimizer and LR scheduler, and the
*reference* weights (the initial weights, as a CPU copy that is swapped in for reference
logprobs; no second model). With ``dtensor_cfg.lora_cfg.enabled`` the model is a ``peft`` LoRA
model: the optimizer holds only the adapters, the reference is the base model with the
adapters disabled (no copy kept), refits and ``weights_checksum`` see the merged weights under
the HF names and checkpoints hold the adapter (:mod:`~nrl_tasks.models.policy.workers.lora`).
Ranks form a default ``torch.distributed`` process group (gloo on
CPU, NCCL on GPU) and a ``DeviceMesh`` over it: with more than one rank the model is wrapped with
torch's FSDP2, sharded (``dtensor_cfg.enabled``, the default) or replicated
(:mod:`~nrl_tasks.models.policy.workers.parallel`), and FSDP2 reduces the gradients. Calls that
gather sharded tensors (refit, checksum, checkpoint, gradients) run on every rank.

Ray is not needed to import or use the class: without Ray it runs in-process as a single rank
(``benchmarks.gpu_check`` does so on a GPU image without Ray).

Lifecycle: the constructor only stores settings (cheap, so re-attaching by name is cheap);
``setup(master_addr, master_port)`` joins the process group and loads the model. ``status()``
says whether a (possibly re-attached) actor is set up and with which config.

Device moves: on a GPU worker the model lives on ``cuda`` and ``offload_*`` move weights and
optimizer state to CPU and back; on a CPU worker there is nothing to move, so those methods
only switch train/eval mode, free gradients and run the garbage collector.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from nrl_tasks.distributed.batched_data_dict import BatchedDataDict
from nrl_tasks.distributed.worker_groups import control_method
from nrl_tasks.models.policy import PolicyConfig
from nrl_tasks.models.policy.errors import NonFiniteTrainingError
from nrl_tasks.models.policy.workers import checkpointing as ckpt
from nrl_tasks.models.policy.workers.batches import check_inputs, on_device, to_float, with_default_masks
from nrl_tasks.models.policy.workers.checkpoint_mixin import CheckpointMixin
from nrl_tasks.models.policy.workers.finite_guard import StepGuard, refuse_invalid_weights
from nrl_tasks.models.policy.workers.lifecycle import LifecycleMixin
from nrl_tasks.models.policy.workers.logprob_mixin import LogprobMixin
from nrl_tasks.models.policy.workers.logprobs import (
    forward_logits,
    last_token_scores,
    token_values,
    packed_forward_logprobs,
    padded_forward_logprobs,
)
from nrl_tasks.models.policy.workers.optim import (
    all_finite,
    build_optimizer,
    build_scheduler,
    clip_and_norm,
    trainable_named_parameters,
)
from nrl_tasks.models.policy.workers.parallel import (
    Layout,
    full_tensor,
    layout_for,
    local_tensor,
    lockstep_count,
    parallelize,
    state_bytes,
)
from nrl_tasks.models.policy.workers.prefix_sharing import (
    PrefixPlan,
    prefix_lengths_from_mask,
    prefix_plan,
    shared_prefix_logprobs,
)
from nrl_tasks.models.policy.workers.refit_mixin import RefitMixin
from nrl_tasks.models.policy.workers.rng import configure_determinism, seed_everything
from nrl_tasks.models.policy.workers.sampling_mixin import SamplingMixin
from nrl_tasks.settings import WorkerEnv
from nrl_tasks.utils.collective import find_free_port, get_node_ip

logger = logging.getLogger(__name__)

__all__ = ["PolicyWorker"]


def _rank_from_env() -> tuple[int, int]:
    env = WorkerEnv()
    return env.rank, 1 if env.world_size is None else env.world_size


class PolicyWorker(LogprobMixin, SamplingMixin, RefitMixin, CheckpointMixin, LifecycleMixin):
    """One DP rank. Methods are called through Ray by ``Policy``; see the module docstring."""

    def __init__(
        self,
        config: dict[str, Any],
        tokenizer: Any = None,
        *,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        skip_weight_load: bool = False,
    ) -> None:
        self.cfg = PolicyConfig.model_validate(config)
        self.tokenizer = tokenizer
        self.rank, self.world_size = _rank_from_env()
        self.init_optimizer = init_optimizer
        self.init_reference_model = init_reference_model
        self.weights_path = weights_path
        self.optimizer_path = optimizer_path
        self.skip_weight_load = skip_weight_load
        self.ready = False
        self.weights_version = 0
        self.model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.reference: dict[str, torch.Tensor] | None = None
        self._profiler: Any = None
        self._offloaded = False
        self._busy: str | None = None
        self._invalid_weights: NonFiniteTrainingError | None = None  # set when a step broke the weights
        self.layout = Layout(False, False, self.world_size)
        configure_determinism(self.cfg.deterministic, self.cfg.torch_num_threads)
        self.device = self._pick_device()

    # ---------------------------------------------------------------------- setup
    @staticmethod
    def _pick_device() -> torch.device:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch.device("cuda", 0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        return torch.device("cpu")

    def get_free_address(self) -> tuple[str, int]:
        """``(ip, port)`` for the process-group rendezvous hosted by this (rank 0) worker."""

        ip = get_node_ip()
        return ip, find_free_port("0.0.0.0" if ip != "127.0.0.1" else ip)

    @control_method
    def status(self) -> dict[str, Any]:
        """Whether this actor is set up, with which config, at which weights version, and the
        call it is busy with (answers from the control thread, even during a long call)."""
        return {
            "ready": self.ready,
            "busy": self._busy,
            "rank": self.rank,
            "world_size": self.world_size,
            "config_hash": self.cfg.config_hash(),
            "config": self.cfg.model_dump(mode="json"),
            "weights_version": self.weights_version,
            "weights_valid": self._invalid_weights is None,
            "parallel": self.layout.mode,
            "pid": os.getpid(),
        }

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the DP process group and load model, optimizer and reference weights."""
        if dist.is_initialized():
            dist.destroy_process_group()
        backend = self.cfg.dp_backend
        if backend == "auto":
            backend = "nccl" if self.device.type == "cuda" else "gloo"
        from datetime import timedelta

        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=self.cfg.dist_timeout_s),
        )
        seed_everything(self.cfg.seed)
        self._load_model()
        self.layout = layout_for(self.cfg.dtensor_cfg, self.world_size, reward_model=self.cfg.reward_model_cfg.enabled)
        self.model = parallelize(self.model, self.cfg.dtensor_cfg, self.layout, self.device)
        named = trainable_named_parameters(self.model)
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        if self.init_optimizer:  # a reward model too: `nrl rm` trains one
            self.optimizer = build_optimizer(named, self.cfg.optimizer)
            self.scheduler = build_scheduler(self.optimizer, self.cfg.scheduler)
        if self.init_reference_model and not self.cfg.reward_model_cfg.enabled and self.cfg.lora is None:
            # this rank's part of the initial weights (all of them unless sharded)
            self.reference = {n: local_tensor(t).detach().to("cpu", copy=True) for n, t in self._swappable().items()}
        if self.weights_path:
            self._load_weights(self.weights_path)
        if self.optimizer_path:
            self._load_optimizer_and_rng(self.optimizer_path)
        self._invalid_weights = None
        self.ready = True
        return self.status()

    def _load_model(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

        path = self.cfg.model_name
        if not os.path.isdir(path):
            raise ValueError(f"model_name {path!r} is not a local directory (nothing is downloaded)")
        rm = self.cfg.reward_model_cfg.enabled
        auto = AutoModelForSequenceClassification if rm else AutoModelForCausalLM
        # a reward model has one output: a causal LM's folder (RM training's start) gets a new head
        head = {"num_labels": 1} if rm else {}
        # master weights stay float32; "bfloat16" runs forward/backward under autocast
        if self.skip_weight_load:
            model = auto.from_config(AutoConfig.from_pretrained(path, local_files_only=True, **head), dtype=torch.float32)
        else:
            model = auto.from_pretrained(path, dtype=torch.float32, local_files_only=True, **head)
        if rm and model.config.pad_token_id is None:  # HF's classifier refuses batches > 1 without one
            pad = getattr(self.tokenizer, "pad_token_id", None)
            eos = model.config.eos_token_id
            model.config.pad_token_id = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos) or 0
        if self.cfg.lora is not None:
            from nrl_tasks.models.policy.workers.lora import is_adapter_dir, wrap_with_lora

            if is_adapter_dir(path):  # e.g. a LoRA warm start: stacking adapters is not supported
                raise ValueError(
                    f"model_name {path!r} is a LoRA adapter folder; with dtensor_cfg.lora_cfg.enabled it must be "
                    "a full HF model (use a checkpoint's merged weights, lora_cfg.save_merged)"
                )
            model = wrap_with_lora(model, self.cfg.lora)
        self.model = model.to(self.device)
        self.model.train()

    def _load_weights(self, path: str) -> None:
        """Weights of a checkpoint into the live model: the adapter with LoRA, else HF weights."""
        if self.cfg.lora is not None:
            from nrl_tasks.models.policy.workers.lora import load_adapter_into

            load_adapter_into(self.model, path)
        else:
            ckpt.load_hf_weights_into(self.model, path)

    def _swappable(self) -> dict[str, torch.Tensor]:
        """Parameters (tied ones once) and persistent buffers, by name."""
        out = {n: p for n, p in self.model.named_parameters()}
        persistent = self.model.state_dict(keep_vars=True)
        for name, buf in self.model.named_buffers():
            if name in persistent:
                out[name] = buf
        return out

    def _require_ready(self) -> None:
        if not self.ready:
            raise RuntimeError(f"policy worker rank {self.rank} is not set up (call setup first)")

    def _require_valid_weights(self, what: str) -> None:
        """Refuse ``what`` while the weights are invalid (a train step left them non-finite or
        partially updated; see :class:`NonFiniteTrainingError`); ``load_checkpoint`` or ``setup``
        makes them valid again."""
        self._require_ready()
        refuse_invalid_weights(self._invalid_weights, what, rank=self.rank, weights_version=self.weights_version)

    def _autocast(self):
        if self.cfg.precision == "bfloat16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ forward
    def _mb_logprobs(self, mb: BatchedDataDict, packed: bool, *, prompt_logprobs: bool = True) -> torch.Tensor:
        """A micro-batch's logprobs ``[B, S]``; ``prompt_logprobs=False`` (training: the loss reads
        only ``token_mask`` positions) lets the shared-prompt forward skip the prompts' logits."""
        ids = mb["input_ids"].to(self.device)
        lengths = mb["input_lengths"].to(self.device)
        with self._autocast():
            if packed:
                return packed_forward_logprobs(
                    self.model, ids, lengths, self.cfg.temperature, self.cfg.sequence_packing.sequence_length_pad_multiple
                )
            plan = self._prefix_plan(mb, ids, lengths)
            if plan is not None:
                return shared_prefix_logprobs(self.model, ids, plan, self.cfg.temperature, prompt_logprobs=prompt_logprobs)
            return padded_forward_logprobs(self.model, ids, lengths, self.cfg.temperature)

    def _prefix_plan(self, mb: BatchedDataDict, ids: torch.Tensor, lengths: torch.Tensor) -> PrefixPlan | None:
        """Which rows of a padded micro-batch share their prompt (``share_prompt_prefix``), from
        their ``token_mask``; None to run the plain forward. Off on a wrapped model: there every
        rank must run as many forwards as the others."""
        if not self.cfg.share_prompt_prefix or self.layout.wrapped or "token_mask" not in mb:
            return None
        return prefix_plan(ids, lengths, prefix_lengths_from_mask(mb["token_mask"], lengths))

    def _microbatches(self, data: BatchedDataDict, mbs: int) -> tuple[list[BatchedDataDict], bool]:
        """Micro-batches of ``data`` per its plan (dynamic / packing) or of ``mbs`` rows."""
        if data.micro_batch_kind == "dynamic":
            return list(data.make_microbatch_iterator_with_dynamic_shapes()), False
        if data.micro_batch_kind == "packing":
            return list(data.make_microbatch_iterator_for_packable_sequences()), True
        return [data.slice(i, min(i + mbs, data.size)) for i in range(0, data.size, mbs)], False

    def _dummy_forwards(self, done: int, *, backward: bool) -> int:
        """Run zero-weighted forwards (and backwards) until this rank has run as many as the rank
        with the most (a wrapped model's forward is a collective). Returns how many ran."""
        extra = lockstep_count(done, self.layout, self._comm_device()) - done
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        lengths = torch.tensor([2], device=self.device)
        for _ in range(extra):
            with torch.set_grad_enabled(backward), self._autocast():
                lp = padded_forward_logprobs(self.model, ids, lengths, self.cfg.temperature)
            if backward:
                (lp.sum() * 0.0).backward()
        return extra

    def _check_causal_lm(self, what: str) -> None:
        if self.cfg.reward_model_cfg.enabled:
            raise ValueError(f"{what} needs a causal LM; this policy is a reward model (reward_model_cfg.enabled)")

    # -------------------------------------------------------------------- train
    def train(
        self,
        data: BatchedDataDict,
        loss_fn: Any,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """Train on this rank's shard: one optimizer step per global batch.

        Global valid token/sequence counts are all-reduced before each global batch's
        micro-batch loop and passed to ``loss_fn``, so micro-batch losses sum (over micro-batches
        and ranks) to the global-batch loss. Returns this rank's per-global-batch results.

        Finite-value guard (training only, not ``eval_mode``): a non-finite micro-batch loss,
        gradient norm or learning rate raises :class:`NonFiniteTrainingError` *before*
        ``optimizer.step()`` (on every rank alike: the decision rides on all-reduced values), so
        weights, optimizer state and version stay as they were. A step that overflows float32
        (torch refusing the step size, or a non-finite parameter after it) raises it with
        ``weights_valid=False``; the worker then refuses further use until ``load_checkpoint``.
        The checks live in :mod:`~nrl_tasks.models.policy.workers.finite_guard`.
        """
        self._require_valid_weights("train")
        kind = getattr(loss_fn, "input_type", "logprobs")  # BradleyTerryLossFn, ValueLossFn: a one-output head's
        head = kind in ("scores", "values")
        if head != self.cfg.reward_model_cfg.enabled:
            raise ValueError(f"train: {type(loss_fn).__name__} reads {'token logprobs' if kind == 'logprobs' else kind}, but "
                             f"this policy is {'a causal LM' if head else 'a reward model (reward_model_cfg.enabled: a head)'}")
        self._to_device()  # back from an offload, if any
        check_inputs(data)
        if not eval_mode and self.optimizer is None:
            raise ValueError("this policy was created with init_optimizer=False: it cannot train")
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        if data.micro_batch_kind is not None:
            global_batches = [data.get_batch(g) for g in range(len(data.elem_counts_per_gb or []))]
        else:
            local = gbs // self.world_size
            if local < 1 or data.size % local:
                raise ValueError(
                    f"rank {self.rank}: shard of {data.size} rows is not a multiple of the local batch "
                    f"{local} (gbs {gbs} / {self.world_size} ranks)"
                )
            global_batches = [data.get_batch(g, local) for g in range(data.size // local)]
        # every rank must run the same number of optimizer steps
        counts = torch.tensor([len(global_batches)], dtype=torch.long, device=self._comm_device())
        gathered = [torch.zeros_like(counts) for _ in range(self.world_size)]
        dist.all_gather(gathered, counts)
        if len({int(c) for c in gathered}) != 1:
            raise ValueError(f"ranks hold different numbers of global batches: {[int(c) for c in gathered]}")

        self.model.train()
        self._busy = "train"
        results: dict[str, Any] = {
            "global_loss": [], "grad_norm": [], "lr": [], "global_valid_toks": [], "global_valid_seqs": [],
            "num_microbatches": [], "all_mb_metrics": {},
        }
        start = time.perf_counter()
        try:
            for index, gb in enumerate(global_batches):
                self._train_global_batch(index, gb, loss_fn, eval_mode, mbs, results)
        except NonFiniteTrainingError as exc:
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)  # drop the non-finite gradients
            if not exc.weights_valid:
                self._invalid_weights = exc
            logger.error("%s", exc)
            raise
        finally:
            self._busy = None
        if not eval_mode:
            self.weights_version += 1
        results["weights_version"] = self.weights_version
        results["train_time_s"] = time.perf_counter() - start
        results["state_mb"] = self.state_mb()  # before finish_training frees the gradients
        return results

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _train_global_batch(
        self, index: int, gb: BatchedDataDict, loss_fn: Any, eval_mode: bool, mbs: int, results: dict
    ) -> None:
        gb = with_default_masks(gb)
        token_mask, sample_mask = gb["token_mask"], gb["sample_mask"]
        counts = torch.tensor(
            [float((token_mask[:, 1:].double() * sample_mask.double().unsqueeze(1)).sum()), float(sample_mask.double().sum())],
            dtype=torch.float64,
        ).to(self._comm_device())
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        global_valid_toks = counts[0].to(self.device, torch.float32)
        global_valid_seqs = counts[1].to(self.device, torch.float32)

        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        micro_batches, packed = self._microbatches(gb, mbs)
        reads = getattr(loss_fn, "input_type", "logprobs")
        reads_logits = reads == "logits"
        if reads != "logprobs" and packed:
            raise ValueError(f"{type(loss_fn).__name__} reads {reads}: packed micro-batches are not built for it")
        total = torch.zeros((), dtype=torch.float64)
        bad_mb: int | None = None  # first micro-batch of this rank whose loss is not finite
        for mb_index, mb in enumerate(micro_batches):
            mb = on_device(mb, self.device)
            with torch.set_grad_enabled(not eval_mode):
                if self.cfg.reward_model_cfg.enabled:  # the loss reads each row's score or each token's value
                    with self._autocast():
                        head = (token_values(self.model, mb["input_ids"]) if reads == "values"
                                else last_token_scores(self.model, mb["input_ids"], mb["input_lengths"]))
                    loss, metrics = loss_fn(head, mb, global_valid_seqs, global_valid_toks)
                elif reads_logits:  # e.g. DistillationLossFn: the whole next-token distribution
                    with self._autocast():
                        logits = forward_logits(self.model, mb["input_ids"]).float()
                    if self.cfg.temperature != 1.0:
                        logits = logits / self.cfg.temperature
                    loss, metrics = loss_fn(logits, mb, global_valid_seqs, global_valid_toks)
                else:
                    lp = self._mb_logprobs(mb, packed, prompt_logprobs=False)
                    loss, metrics = loss_fn(lp[:, 1:], mb, global_valid_seqs, global_valid_toks)
                if not eval_mode:
                    loss.backward()
            mb_loss = loss.detach().double().cpu()
            if bad_mb is not None:
                continue  # a wrapped model's backward is a collective: run on, the step is refused
            if not eval_mode and not bool(torch.isfinite(mb_loss)):
                # its gradients are dropped with the step
                bad_mb, total = mb_index, mb_loss
                if not self.layout.wrapped:
                    break  # no collective inside this loop
                continue
            total += mb_loss
            for key, value in (metrics or {}).items():
                results["all_mb_metrics"].setdefault(key, []).append(to_float(value))
        self._dummy_forwards(len(micro_batches), backward=not eval_mode)
        # the loss and "some rank saw a non-finite loss" in one all-reduce: every rank decides alike
        loss_and_flag = torch.stack([total, torch.tensor(float(bad_mb is not None), dtype=torch.float64)])
        loss_and_flag = loss_and_flag.to(self._comm_device())
        dist.all_reduce(loss_and_flag, op=dist.ReduceOp.SUM)
        loss_sum = loss_and_flag[0]
        grad_norm = 0.0
        if not eval_mode:
            guard = StepGuard(weights_version=self.weights_version + 1, global_batch=index, rank=self.rank)
            guard.check_loss(float(loss_and_flag[1]), loss_sum, total, bad_mb)
            grad_norm = clip_and_norm(self.params, self.cfg.max_grad_norm)  # FSDP2 reduced the gradients
            guard.check_grad_norm(grad_norm, self.param_names, self.params)
            lrs = guard.check_lr(self.optimizer)
            guard.step(self.optimizer, lrs[0])
            finite = self._on_every_rank(all_finite(self.params))  # of this rank's parts
            guard.check_parameters(self.param_names, self.params, loss=loss_sum, grad_norm=grad_norm, lr=lrs[0],
                                   finite=finite)
            self.scheduler.step()
        results["global_loss"].append(float(loss_sum))
        results["grad_norm"].append(grad_norm)
        results["lr"].append(float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else 0.0)
        results["global_valid_toks"].append(float(counts[0]))
        results["global_valid_seqs"].append(float(counts[1]))
        results["num_microbatches"].append(len(micro_batches))

    def _on_every_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (one all-reduce when the ranks hold different shards)."""
        if not self.layout.sharded:
            return flag
        t = torch.tensor([0 if flag else 1], dtype=torch.long, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return int(t) == 0

    def state_mb(self) -> float:
        """Parameters + gradients + optimizer state this rank holds, in MB (1e6 bytes)."""
        return state_bytes(self.model.parameters(), self.optimizer) / 1e6

    def get_gradients(self) -> dict[str, torch.Tensor]:
        """CPU copies of the whole gradients of the last global batch trained (after the DP
        reduction and clipping); empty after ``finish_training``. For checks and debugging; with
        sharding a collective (call it on every rank)."""
        self._require_ready()
        return {
            n: full_tensor(p.grad.detach()).to("cpu", copy=True)
            for n, p in zip(self.param_names, self.params) if p.grad is not None
        }
