"""vLLM worker extension: the refit consumer inside each vLLM worker process.

Passed to vLLM as ``LLM(..., worker_extension_cls=NRL_WORKER_EXTENSION)``; vLLM mixes it into
its worker class, and ``llm.collective_rpc("nrl_...", args=...)`` runs the methods in every
worker (one per tensor-parallel rank). Method names carry an ``nrl_`` prefix because vLLM
refuses extension attributes that collide with its worker's own.

Weights arrive as HF-checkpoint-named tensors (``packed_broadcast_consumer`` with
``return_iterator=True``) and go through vLLM's ``reload_weights(weights_iterator=...,
is_checkpoint_format=True)``, which maps names onto fused parameters and re-runs each layer's
post-load processing (on CPU, vLLM repacks linear weights after loading, so writing into
``model.load_weights`` alone is not enough). That reload buffers a layer's tensors until the
whole layer has arrived, so each received tensor is copied out of the reusable receive buffer
first (memory: about one layer). This module imports without vLLM installed.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

from nrl_tasks.models.generation.vllm_lora import write_adapter_folder
from nrl_tasks.utils.collective import create_broadcast_group
from nrl_tasks.utils.packed_tensor import packed_broadcast_consumer
from nrl_tasks.utils.refit import metadata_to_consumer_iter, weights_checksum

__all__ = ["NRL_WORKER_EXTENSION", "NrlWorkerExtension", "checksum_tee"]

NRL_WORKER_EXTENSION = "nrl_tasks.models.generation.vllm_worker_extension.NrlWorkerExtension"

_END = object()


def checksum_tee(items: Iterator[tuple[str, torch.Tensor]]) -> tuple[Iterator[tuple[str, torch.Tensor]], Any]:
    """Pass ``(name, tensor)`` pairs through while ``weights_checksum`` hashes them.

    Returns ``(iterator, result)``: consume ``iterator`` fully, then ``result()`` gives the
    :func:`nrl_tasks.utils.refit.weights_checksum` of everything that went through. Each pair is
    hashed (in a helper thread running the unchanged checksum function) before it is passed on,
    and the next pair is only requested after that, so reused receive buffers are safe.
    """

    handoff: queue.Queue = queue.Queue(maxsize=1)
    hashed = threading.Semaphore(0)
    box: dict[str, Any] = {}

    def feed() -> Iterator[tuple[str, torch.Tensor]]:
        while (item := handoff.get()) is not _END:
            yield item
            hashed.release()  # the checksum asked for the next pair: this one is hashed

    def run() -> None:
        try:
            box["checksum"] = weights_checksum(feed())
        except BaseException as exc:  # surfaced by passthrough()/result()
            box["error"] = exc
            hashed.release()

    thread = threading.Thread(target=run, name="nrl-refit-checksum", daemon=True)
    thread.start()

    def passthrough() -> Iterator[tuple[str, torch.Tensor]]:
        try:
            for item in items:
                handoff.put(item)
                hashed.acquire()
                if "error" in box:
                    raise box["error"]
                yield item
        finally:
            handoff.put(_END)

    def result() -> str:
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["checksum"]

    return passthrough(), result


class NrlWorkerExtension:
    """Methods mixed into vLLM's worker: join the refit group, receive and load weights (or, for a
    LoRA policy, receive adapters and write them for vLLM's LoRA loader)."""

    def nrl_init_collective(
        self, host: str, port: int, base_rank: int, world_size: int, timeout_s: float, backend: str = "gloo"
    ) -> int:
        """Join the broadcast group as ``base_rank + <this worker's rank>``; returns that rank."""

        self.nrl_teardown_collective()
        rank = int(base_rank) + int(getattr(self, "rank", 0))
        self._nrl_group = create_broadcast_group(
            host, int(port), rank, int(world_size), timeout_s=float(timeout_s), backend=backend
        )
        return rank

    def nrl_teardown_collective(self) -> None:
        group = getattr(self, "_nrl_group", None)
        self._nrl_group = None
        if group is not None:
            group.close()

    def _nrl_receive(self, metadata: list[Any], buffer_size_bytes: int, with_checksum: bool) -> tuple[Iterator[tuple[str, torch.Tensor]], Any]:
        """The packed broadcast of ``metadata`` from rank 0 as ``(name, tensor)`` pairs (tensors
        live in reused receive buffers: copy what is kept), and the checksum's ``result()`` or None."""

        group = getattr(self, "_nrl_group", None)
        if group is None:
            raise RuntimeError("nrl refit: call nrl_init_collective first")
        stream = packed_broadcast_consumer(
            metadata_to_consumer_iter(metadata), group, 0, None, return_iterator=True,
            buffer_size_bytes=int(buffer_size_bytes),
        )
        if not with_checksum:
            return stream, None
        return checksum_tee(stream)

    def nrl_update_weights(self, metadata: list[Any], buffer_size_bytes: int, with_checksum: bool = True) -> dict[str, Any]:
        """Receive one packed broadcast (src rank 0) and reload the weights in place.

        ``metadata``: ``[[name, shape, dtype_name], ...]`` in the producer's order (HF names).
        Returns ``{"tensors": n, "checksum": weights_checksum of the received tensors or None}``.
        On failure the group is closed (re-create it before retrying) and vLLM's reload state is
        reset so that the retry can load every layer again.
        """
        expected = len(metadata)
        count = 0
        try:
            stream, checksum = self._nrl_receive(metadata, buffer_size_bytes, with_checksum)

            def counted() -> Iterator[tuple[str, torch.Tensor]]:
                # vLLM's layerwise reload keeps references to a layer's tensors until the whole
                # layer has arrived, while the consumer reuses its receive buffers: hand it copies
                nonlocal count
                for name, tensor in stream:
                    count += 1
                    yield name, tensor.clone()

            self.reload_weights(weights_iterator=counted(), is_checkpoint_format=True)
            for _ in stream:  # a loader that stopped early must not leave bytes on the wire
                count += 1
            if count != expected:
                raise RuntimeError(f"refit received {count} tensors, expected {expected}")
            return {"tensors": count, "checksum": checksum() if checksum is not None else None}
        except BaseException:
            self.nrl_teardown_collective()
            self._nrl_abort_reload()
            raise

    def nrl_update_adapter(
        self, metadata: list[Any], buffer_size_bytes: int, layout: dict[str, Any], out_dir: str, base_model: str
    ) -> dict[str, Any]:
        """Receive an adapters-only refit (src rank 0); tensor-parallel rank 0 writes it as a PEFT
        folder at ``out_dir`` (:func:`~nrl_tasks.models.generation.vllm_lora.write_adapter_folder`)
        for the actor's ``LoRARequest``. Returns ``{"tensors", "checksum"}``; on failure the group
        is closed and no folder is left at ``out_dir``."""

        try:
            stream, checksum = self._nrl_receive(metadata, buffer_size_bytes, True)
            tensors = {name: tensor.clone() for name, tensor in stream}
            if len(tensors) != len(metadata):
                raise RuntimeError(f"refit received {len(tensors)} adapter tensors, expected {len(metadata)}")
            if int(getattr(self, "rank", 0)) == 0:
                write_adapter_folder(out_dir, layout, tensors, base_model)
            return {"tensors": len(tensors), "checksum": checksum()}
        except BaseException:
            self.nrl_teardown_collective()
            raise

    def _nrl_abort_reload(self) -> None:
        """After a reload that died mid-stream, put every layer back in a loadable state.

        vLLM's layerwise reload moves layers to the meta device and wraps their loaders until
        each layer is complete; left like that, the next reload fails. Finalising it restores
        untouched layers and processes partly loaded ones (their weights are then a mix: the
        worker stays stale until a complete refit).
        """
        try:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
        except Exception as exc:  # noqa: BLE001 - best effort; the original error is what matters
            import logging

            logging.getLogger(__name__).warning("could not reset vLLM's layerwise reload state: %s", exc)
