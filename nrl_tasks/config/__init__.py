"""The run config's schema: typed sections, their bounds and cross-field checks, the config hash.

Reading YAML, dotted overrides, :func:`flows.config.load_config` and writing ``config.yaml`` stay
in ``flows`` (:mod:`flows.config`, which re-exports the names below); the stages see the
validated :class:`~nrl_tasks.config.master.MasterConfig` on their ``RunContext``. One job per module:

- :mod:`~nrl_tasks.config.base`: ``Section``, the base class of every section (also of the policy,
  generation and loss sections that live next to their code in ``nrl_tasks.models`` / ``nrl_tasks.algorithms``);
- :mod:`~nrl_tasks.config.errors`: ``ConfigError``;
- :mod:`~nrl_tasks.config.master`: ``MasterConfig``, the whole config;
- :mod:`~nrl_tasks.config.grpo` (``grpo``, ``warm_start``), :mod:`~nrl_tasks.config.advantages`
  (``grpo.adv_estimator``), :mod:`~nrl_tasks.config.async_grpo` (``grpo.async_grpo``),
  :mod:`~nrl_tasks.config.dpo` (``dpo``), :mod:`~nrl_tasks.config.data` (``data``, ``env``),
  :mod:`~nrl_tasks.config.cluster` (``cluster``, ``storage``, ``checkpointing``),
  :mod:`~nrl_tasks.config.logger` (``logger``): the sections;
- :mod:`~nrl_tasks.config.bounds`: the maxima, and the checks pydantic's lax mode skips (booleans as
  numbers, inf/nan);
- :mod:`~nrl_tasks.config.combinations`: keys valid alone that do not go together;
- :mod:`~nrl_tasks.config.credentials`: credential-looking keys, found and redacted;
- :mod:`~nrl_tasks.config.hash`: the config hash, ``changed_keys`` and ``digest``, the one hashing helper.

This package imports nothing at import time: ``nrl_tasks.models.policy`` derives from
:mod:`~nrl_tasks.config.base` while :mod:`~nrl_tasks.config.master` embeds ``PolicyConfig``, so
import the module that holds a name (``from nrl_tasks.config.master import MasterConfig``).
"""
