"""Keep plans: the same count in every layer and every group, the best of each group, and the counts refused."""

from __future__ import annotations

import numpy as np
import pytest

from moe_lm.errors import DataError, UserError
from moe_lm.pruning.plan import KeepPlan, RoutingShape, keep_count

SHAPE = RoutingShape(n_experts=16, n_group=4, topk_group=2, k=3)


@pytest.mark.parametrize("seed", range(5))
def test_each_group_keeps_its_highest_scoring_experts_and_every_layer_the_same_number(seed):
    rng = np.random.default_rng(seed)
    scores = {layer: rng.random(16) for layer in (1, 2, 5)}
    plan = KeepPlan.from_scores(scores, 8, 4)
    for layer, s in scores.items():
        ids = plan.kept[layer]
        assert list(ids) == sorted(ids) and len(ids) == 8
        for g in range(4):  # the reference: each group's 2 best by a plain sort
            group = list(range(4 * g, 4 * g + 4))
            assert sorted(e for e in ids if e in group) == sorted(sorted(group, key=lambda e: -s[e])[:2])
        assert sorted(set(plan.removed(layer)) | set(ids)) == list(range(16))


def test_ties_go_to_the_lower_id_and_a_plan_round_trips_through_json():
    plan = KeepPlan.from_scores({3: np.zeros(8)}, 4, 2, {"criterion": "random", "sparsity": 0.5})
    assert plan.kept == {3: (0, 1, 4, 5)}
    again = KeepPlan.from_json(plan.to_json())
    assert again == plan and again.about["criterion"] == "random"
    with pytest.raises(DataError, match="not a pruning plan"):
        KeepPlan.from_json({"layers": {"3": {"kept": [0]}}})


def test_a_plan_that_breaks_the_groups_cannot_be_made():
    with pytest.raises(ValueError, match="each group"):
        KeepPlan(8, 2, {1: (0, 1, 2, 5)})  # 3 in the first group, 1 in the second
    with pytest.raises(ValueError, match="same number"):
        KeepPlan(8, 1, {1: (0, 1), 2: (0, 1, 2)})


@pytest.mark.parametrize(
    "sparsity, keep, n_keep",
    [(0.5, None, 8), (0.25, None, 12), (0.26, None, 12), (None, 12, 12), (None, 8, 8)],
)
def test_a_sparsity_removes_the_nearest_count_of_experts(sparsity, keep, n_keep):
    assert keep_count(SHAPE, sparsity, keep) == n_keep  # 0.26 x 16 = 4.16: 4 removed


@pytest.mark.parametrize(
    "sparsity, keep, message",
    [
        (0.0, None, "between 0 and 1"),
        (1.0, None, "between 0 and 1"),
        (-0.2, None, "between 0 and 1"),
        (None, 16, "removes none"),
        (None, 2, "fewer than the 3 each token is routed to"),
        (None, 10, "cannot share equally.*nearest valid: --keep 8 \\(sparsity 0.5\\) or --keep 12 \\(sparsity 0.25\\)"),
        (None, 4, "sum of its top-2"),
    ],
)
def test_counts_that_leave_the_routing_invalid_are_one_line_errors(sparsity, keep, message):
    with pytest.raises(UserError, match=message) as e:
        keep_count(SHAPE, sparsity, keep)
    assert "\n" not in str(e.value)


def test_too_few_in_the_best_groups_for_k():
    shape = RoutingShape(n_experts=32, n_group=8, topk_group=1, k=3)  # one group kept: it must hold 3
    with pytest.raises(UserError, match="topk_group=1 best groups must hold the 3"):
        keep_count(shape, keep=16)
    assert keep_count(shape, keep=24) == 24


def test_a_count_the_groups_cannot_share_is_kept_without_the_groups_when_asked():
    """8 experts in 4 groups of 2 (the tiny preset's routing) keep none but all of them with their groups; the error
    says --ungroup keeps the count, and the ungrouped routing (one group, all of it used) takes any count >= k."""
    tiny = RoutingShape(n_experts=8, n_group=4, topk_group=2, k=2)
    for keep in (7, 6, 4):
        with pytest.raises(UserError, match=f"no count can be pruned.*or keep {keep} with --ungroup") as e:
            keep_count(tiny, keep=keep)
        assert "\n" not in str(e.value)
        assert keep_count(tiny.ungrouped(), keep=keep) == keep
    assert tiny.ungrouped() == RoutingShape(8, 1, 1, 2) and keep_count(tiny.ungrouped(), 0.125) == 7
    with pytest.raises(UserError, match="fewer than the 2") as e:
        keep_count(tiny.ungrouped(), keep=1)
    assert "--ungroup" not in str(e.value)
    plan = KeepPlan.from_scores({1: np.array([5.0, 4, 3, 2, 1, 0, 7, 6])}, 3, 1)  # the best over the whole layer
    assert plan.kept == {1: (0, 6, 7)} and plan.n_group == 1


def test_ungroup_of_a_source_without_groups_is_refused():
    from moe_lm.pruning.run import plan_shape

    with pytest.raises(UserError, match="--ungroup: runs/x routes without expert groups already"):
        plan_shape(RoutingShape(8, 1, 1, 2), True, "runs/x")
    assert plan_shape(SHAPE, False, "runs/x") == SHAPE and plan_shape(SHAPE, True, "runs/x").n_group == 1
