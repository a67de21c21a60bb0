"""Generation workers that receive the Policy's weights by packed broadcast.

* :mod:`.interfaces`: ``GenerationConfig``, ``GenerationInterface``, ``StaleWeightsError``, specs.
* :mod:`.hf_sampling`: the shared batched KV-cache decode loop (``generate_batch``).
* :mod:`.hf_worker` / :mod:`.hf_generation`: the ``hf`` backend (``HfGeneration``, Ray actors).
* :mod:`.vllm_worker_extension` / :mod:`.vllm_generation`: the ``vllm`` backend
  (``VllmGeneration``; imports without vLLM, constructing it needs vLLM).

Nothing heavy is imported here.
"""
