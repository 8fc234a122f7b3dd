"""Cases of the randomized training sweep (tests/sweep_training.py), so that the tool keeps
working: case 14 at 4 ranks, EP 2 (two expert-data-parallel replicas, lp, overlap_grad_reduce,
the distributed optimizer and overlap_param_gather), which fails without grad_sync.InOrderLaunch;
case 1 at EP 3 (the shipped default config, uneven node size); and Megatron-Core's interleaved
pipeline schedule (2 stages x 2 model chunks): case 10 (fsep, overlap_grad_reduce, the distributed
optimizer, recompute) and, under tensor parallelism with sequence parallelism and an EP group
spanning the TP pair, case 18 (the default config, overlap_grad_reduce, recompute)."""
import pytest

import sweep_training


@pytest.mark.parametrize("world,ep,case,tp,pp", [(4, 2, 14, 1, 1), (3, 3, 1, 1, 1), (4, 2, 10, 1, 2), (4, 2, 18, 2, 2)])
def test_sweep_case_trains_like_stock(world, ep, case, tp, pp):
    c = sweep_training.draw(ep, world, case, tp, pp)
    # what each case is there for
    assert c["overlap_grad_reduce"] or world == 3
    assert pp == 1 or (c["vpp"] == 2 and c["policy"] in ("fsep", "default") and c["recompute"])
    sweep_training.run(world, ep, case, tp, pp)
