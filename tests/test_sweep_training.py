"""Cases of the randomized training sweep (tests/sweep_training.py), so that the tool keeps
working: case 14 at 4 ranks, EP 2 (two expert-data-parallel replicas, lp, overlap_grad_reduce,
the distributed optimizer and overlap_param_gather), which fails without grad_sync.InOrderLaunch;
case 1 at EP 3 (the shipped default config, uneven node size); Megatron-Core's interleaved pipeline
schedule (2 stages x 2 model chunks): case 10 (fsep, overlap_grad_reduce, the distributed
optimizer, recompute) and, under tensor parallelism with sequence parallelism and an EP group
spanning the TP pair, case 18 (the default config, overlap_grad_reduce, recompute); and the 1F1B
schedule under context parallelism with the EP group spanning the CP pair: case 0 (lp,
overlap_grad_reduce, the distributed optimizer, recompute); with Megatron MoE features drawn,
case 7 at EP 2 (fsep, shared experts overlapped inside the dispatcher, capacity drops, aux loss);
and with grouped experts, case 3 at 4 ranks, EP 2 (the default config over TEGroupedMLP with
linear biases and fused weight-gradient accumulation into main_grad), which fails where the
TEGroupedMLP stand-in leaves its biases to the dense (all data-parallel ranks) reduction."""
import pytest

import sweep_training

CASES = {  # (world, ep, case, tp, pp, cp): what the case is there for
    (4, 2, 14, 1, 1, 1): dict(policy="lp", overlap_grad_reduce=True, distopt=True, overlap_param_gather=True),
    (3, 3, 1, 1, 1, 1): dict(policy="default"),
    (4, 2, 10, 1, 2, 1): dict(policy="fsep", vpp=2, overlap_grad_reduce=True, distopt=True, recompute=True),
    (4, 2, 18, 2, 2, 1): dict(policy="default", vpp=2, overlap_grad_reduce=True, recompute=True),
    (4, 2, 0, 1, 2, 2): dict(policy="lp", vpp=1, overlap_grad_reduce=True, distopt=True, recompute=True),
    # with features drawn (the last key)
    (2, 2, 7, 1, 1, 1, True): dict(policy="fsep", recompute=True,
                                   features={"shared": True, "capacity": "probs", "aux_loss": True}),
    # with features and grouped experts drawn (the last two keys)
    (4, 2, 3, 1, 1, 1, True, True): dict(policy="default", module="te", fuse_wgrad=True,
                                         features={"capacity": "probs", "sigmoid_bias": True, "bias": True,
                                                   "aux_loss": True}),
}


@pytest.mark.parametrize("key", list(CASES), ids=lambda key: "-".join(map(str, key)))
def test_sweep_case_trains_like_stock(key):
    world, ep, case, tp, pp, cp, *flags = key  # flags: features, grouped
    c = sweep_training.draw(ep, world, case, tp, pp, cp, *flags)
    want = CASES[key]
    assert {k: c[k] for k in want} == want, c
    sweep_training.run(world, ep, case, tp, pp, cp, *flags)
