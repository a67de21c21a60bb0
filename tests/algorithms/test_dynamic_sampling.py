"""DAPO dynamic sampling's pure parts, with worked numbers: which groups qualify, which are
picked over generation batches, and the prompt draws of generation batches."""

from __future__ import annotations

import pytest
import torch

from nrl_tasks.algorithms.dynamic_sampling import DynamicSamplingError, groups_with_signal, select_groups
from nrl_tasks.stages.data import gen_batch_record_indices, step_record_indices


def test_a_group_qualifies_when_its_valid_rewards_differ():
    # groups of 3: [1,0,1] differs; [1,1,1] all right; [0,0,0] all wrong; [2,5,2] with the 5
    # invalid is [2,2]: no signal; [7, inv, inv] has one valid reward: no signal; [0.5, 0.25, 0.5] differs
    r = torch.tensor([1, 0, 1, 1, 1, 1, 0, 0, 0, 2, 5, 2, 7, 0, 0, 0.5, 0.25, 0.5])
    v = torch.ones(18, dtype=torch.bool)
    v[10] = v[13] = v[14] = False
    gid = torch.arange(6).repeat_interleave(3)
    assert groups_with_signal(r, v, gid) == [0, 5]


def test_first_qualifying_groups_in_generation_order_fill_the_batch():
    # batch 0 has 4 groups of which 1 and 3 qualify; batch 1 has 4 of which 0, 2, 3 qualify;
    # 3 groups are needed: (0,1), (0,3), (1,0); 2 qualifying groups are surplus; 2 + 1 groups had
    # zero variance
    sel = select_groups([[1, 3], [0, 2, 3]], [4, 4], 3)
    assert sel.picked == ((0, 1), (0, 3), (1, 0))
    assert (sel.surplus_groups, sel.zero_std_groups, sel.gen_batches) == (2, 3, 2)
    exact = select_groups([[0, 1, 2]], [3], 3)
    assert exact.picked == ((0, 0), (0, 1), (0, 2)) and exact.surplus_groups == 0


def test_too_few_qualifying_groups_is_an_error_naming_the_keys():
    with pytest.raises(DynamicSamplingError, match=r"found 1 of the 2 groups.*grpo.dynamic_sampling_max_gen_batches"):
        select_groups([[], [3]], [4, 4], 2)


def test_generation_batch_draws_are_pure_functions_of_seed_step_and_batch():
    kw = {"num_records": 50, "num_prompts": 8, "seed": 3}
    # batch 0 is the step's block of the run's prompt order
    assert gen_batch_record_indices(step=4, gen_batch=0, **kw) == step_record_indices(step=4, **kw)
    b1 = gen_batch_record_indices(step=4, gen_batch=1, **kw)
    assert b1 == gen_batch_record_indices(step=4, gen_batch=1, **kw)  # reproducible
    assert b1 != gen_batch_record_indices(step=5, gen_batch=1, **kw)  # a stream per step
    assert b1 != gen_batch_record_indices(step=4, gen_batch=2, **kw)
    assert len(set(b1)) == 8 and all(0 <= i < 50 for i in b1)
