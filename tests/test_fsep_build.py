"""Building an fsep layer shards its experts at once, by an exchange over the EP group: the weights
must reach it on the device that group's collectives take (Megatron's --use-cpu-initialization
builds them on the host, and NCCL takes no host tensors), and weights that are not there yet (the
meta device) are refused by name instead of being sharded as garbage."""
import pytest
import torch

from megatron_rails.runtime.expert_kind import ExpertKind, UnsupportedExperts
from megatron_rails.runtime.sharded import ShardedExpertStore

E, F, H = 4, 3, 5


class Kind(ExpertKind):  # E experts of one [F, H] weight each
    def __init__(self, device="cpu"):
        self.module = torch.nn.Module()
        self.module.w = torch.nn.Parameter(torch.randn(E * F, H, device=device))
        self.num_local, self.slot_names = E, ("w",)

    def slices(self, i):
        return [("w", lambda t, i=i: t[i * F:(i + 1) * F])]


def test_weights_built_elsewhere_are_exchanged_on_the_collectives_device():
    """The store hands the build-time exchange its tensors moved to `stage` and puts the result back
    beside the weights. (`meta` stands in for CUDA, which this machine has not: the exchange only
    records where its input is and answers in the weights' own layout.)"""
    seen = []

    def exchange(x, send_D, recv_D, traffic_DD=None):
        seen.append(x.device.type)
        return expected.clone()  # what a one-rank exchange returns: its input, here on the host

    kind = Kind()
    expected = kind.module.w.detach().reshape(E, F * H).clone()
    store = ShardedExpertStore(kind, E, rank=0, num_ranks=1, exchange=exchange, stage=torch.device("meta"))
    assert seen == ["meta"], seen
    assert store.shards.device.type == "cpu"
    assert torch.equal(store.shards.detach(), expected)

    seen.clear()  # on the collectives' own device nothing moves
    ShardedExpertStore(Kind(), E, rank=0, num_ranks=1, exchange=exchange)
    assert seen == ["cpu"], seen


def test_meta_device_weights_are_refused_by_name():
    with pytest.raises(UnsupportedExperts, match="meta device"):
        ShardedExpertStore(Kind("meta"), E, rank=0, num_ranks=1, exchange=lambda x, *a: x)
