"""A layer step's metric record (runtime/layer.py `_record`): the values Megatron's tracker reads
every training forward are in it when the dispatch returns; the rest (traffic, per-rank lists,
weight bytes) follow once the token all-to-all is launched, or when the records are read. Values
against a numpy reference from every rank's routing map."""
import numpy as np
import pytest
import torch

from moe_harness import build_moe_layer, moe_config, spawn

NOW = {"policy", "max_over_mean_before", "max_over_mean_after", "unbalanced", "unbalanced_steps", "plan_us",
       "count_gather_us"}


def _worker(rank, world):
    import megatron_rails

    megatron_rails.install({"policy": "ultraep", "slots": 1})
    torch.manual_seed(0)
    layer = build_moe_layer(moe_config(world, "alltoall", experts=8, topk=2, hidden=16, ffn=24))
    megatron_rails.uninstall()
    rt = layer.token_dispatcher.runtime
    T, E, H, k = 64, 8, 16, 2
    maps = []
    for d in range(world):  # every rank's routing, known to all: experts 0 and 1 hot
        g = np.random.default_rng(100 + d)
        p = np.array([8, 4, 1, 1, 1, 1, 1, 1], dtype=float)
        m = np.zeros((T, E), dtype=bool)
        for t in range(T):
            m[t, g.choice(E, size=k, replace=False, p=p / p.sum())] = True
        maps.append(m)
    counts_DE = np.stack([m.sum(axis=0) for m in maps]).astype(np.int64)
    stock = counts_DE.sum(axis=0).reshape(world, E // world).sum(axis=1)  # Megatron's contiguous owners
    routing_map = torch.from_numpy(maps[rank])
    probs = torch.where(routing_map, 0.5, 0.0)
    for read_first in (False, True):
        x_P, probs_P, record = rt.dispatch(torch.randn(T, H), routing_map, probs)
        assert set(record) == NOW, sorted(record)  # the rest waits for the exchange
        assert record["max_over_mean_before"] == pytest.approx(stock.max() / stock.mean(), rel=1e-12)
        if read_first:  # reading the records completes them, exchange or not
            assert rt.metrics[-1] is record and "token_bytes_sent" in record
        rt.exchange_tokens(x_P, probs_P)
        assert set(record) > NOW and rt.metrics[-1] is record
        assert record["tokens_per_rank_before"] == stock.tolist()
        after = np.array(record["tokens_per_rank_after"])
        assert after.sum() == counts_DE.sum()
        assert record["max_over_mean_after"] == pytest.approx(after.max() / after.mean(), rel=1e-12)
        assert record["max_over_mean_after"] < record["max_over_mean_before"]  # ultraep balanced it
        sent = record["token_bytes_sent"]  # every rank's rows to another rank, fp32 rows of H
        assert sent % (H * 4) == 0 and 0 < sent // (H * 4) <= counts_DE.sum()
        assert record["layout"] == "owner" and record["replicas_used"] > 0
    assert len(rt.metrics) == 2


def test_records_complete_after_the_token_exchange():
    spawn(_worker, 2)
