"""RailS scheduler properties, the all-to-all flow model, traffic families, `simulate a2a` and `bench rails`."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_rails import cli
from megatron_rails.core.planners import PlannerError
from megatron_rails.core.rails_schedule import rails_schedule
from megatron_rails.sim.rails import (SCHEMES, direct_schedule, ecmp_rail, ecmp_schedule, lower_bound_us, resource_loads, simulate)
from megatron_rails.core.topology import Topology, load_topology
from megatron_rails.sim.traffic import TrafficError, make_traffic, parse_traffic
from schedule_figures import rail_egress, rail_ingress

ROOT = Path(__file__).resolve().parents[1]
# (nodes, gpus_per_node, rails_per_node): the virtual topologies of the issue, plus two GPUs per rail
VIRTUAL = [(2, 2, 2), (2, 4, 4), (4, 2, 2), (3, 8, 8), (3, 8, 4), (2, 8, 4)]


def topo_of(V, G, J, **kw):
    return Topology(name=f"{V}x{G}r{J}", gpus_per_node=G, rails_per_node=J, nodes=V, **kw)


def random_traffic(rng, D, kind):
    if kind == 0:
        return rng.integers(0, 6, (D, D))
    if kind == 1:
        return rng.integers(0, 2000, (D, D)) * (rng.random((D, D)) < 0.3)
    if kind == 2:
        return (rng.pareto(1.0, (D, D)) * 50).astype(np.int64)
    traffic = rng.integers(0, 20, (D, D))  # hot receivers: a few columns carry most
    traffic[:, rng.integers(D, size=2)] += rng.integers(0, 10_000, (D, 1))
    return traffic


def cases(n_per_topo=12, seed=0):
    rng = np.random.default_rng(seed)
    for V, G, J in VIRTUAL:
        for k in range(n_per_topo):
            yield topo_of(V, G, J), random_traffic(rng, V * G, k % 4)


# -- the reference scheduler: the original per-pair loop, kept to pin the vectorized one's exact output ------

def reference_schedule(traffic, topo):
    traffic = np.asarray(traffic, dtype=np.int64)
    G, J = topo.gpus_per_node, topo.rails_per_node
    gpr, V = G // J, traffic.shape[0] // G
    cols = [[] for _ in range(6)]

    def emit(a, b, i, j, r, units):
        s, d = a * G + i, b * G + j
        f = s if i // gpr == r else a * G + r * gpr + i % gpr
        g = d if j // gpr == r else b * G + r * gpr + j % gpr
        for c, v in zip(cols, (s, d, r, f, g, units)):
            c.append(v)

    for a in range(V):
        for b in range(V):
            blk = traffic[a * G:(a + 1) * G, b * G:(b + 1) * G]
            i, j = np.nonzero(blk)
            if a == b:
                for ii, jj in zip(i, j):
                    for c, v in zip(cols, (a * G + ii, b * G + jj, -1, b * G + jj, b * G + jj, blk[ii, jj])):
                        c.append(v)
                continue
            if not i.size:
                continue
            u = blk[i, j]
            nat = j // gpr
            nat_load = np.bincount(nat, weights=u, minlength=J)
            base, rem = divmod(int(u.sum()), J)
            cap = np.full(J, base)
            cap[np.lexsort(((np.arange(J) - a - b) % J, -nat_load))[:rem]] += 1
            cap = cap.tolist()
            spill = []
            for k in np.lexsort((j, i, -u)):
                take = min(int(u[k]), cap[nat[k]])
                if take:
                    cap[nat[k]] -= take
                    emit(a, b, int(i[k]), int(j[k]), int(nat[k]), take)
                if u[k] > take:
                    spill.append((int(u[k]) - take, int(i[k]), int(j[k])))
            for left, ii, jj in sorted(spill, key=lambda x: (-x[0], x[1], x[2])):
                while left:
                    rr = max(range(J), key=lambda r: (cap[r], -r))
                    take = min(left, cap[rr])
                    cap[rr] -= take
                    left -= take
                    emit(a, b, ii, jj, rr, take)
    from megatron_rails.core.rails_schedule import RailSchedule

    return RailSchedule.from_chunks(topo, traffic, *cols)


FIELDS = ("src_K", "dst_K", "rail_K", "fwd_K", "land_K", "units_K", "off_K")


def test_vectorized_schedule_matches_reference():
    for topo, traffic in cases(n_per_topo=8, seed=1):
        got, ref = rails_schedule(traffic, topo), reference_schedule(traffic, topo)
        for f in FIELDS:
            assert np.array_equal(getattr(got, f), getattr(ref, f)), (topo.name, f)


def test_schedule_conservation_by_independent_recount():
    for topo, traffic in cases():
        sch = rails_schedule(traffic, topo)
        G, gpr = topo.gpus_per_node, topo.gpus_per_rail
        got, pieces = {}, {}
        for s, d, r, f, g, u, o in zip(*(getattr(sch, k).tolist() for k in FIELDS)):
            assert u > 0
            got[(s, d)] = got.get((s, d), 0) + u
            pieces.setdefault((s, d), []).append((o, u))
            if s // G == d // G:
                assert r == -1 and f == d and g == d
            else:
                assert 0 <= r < topo.rails_per_node
                assert f // G == s // G and (f % G) // gpr == r and g // G == d // G and (g % G) // gpr == r
                assert (f == s) == ((s % G) // gpr == r) and (g == d) == ((d % G) // gpr == r)
        want = {(int(s), int(d)): int(traffic[s, d]) for s, d in zip(*np.nonzero(traffic))}
        assert got == want, topo.name
        for (s, d), ps in pieces.items():  # offsets tile [0, traffic[s, d]) without gaps or overlaps
            ps.sort()
            assert ps[0][0] == 0 and all(o2 == o1 + u1 for (o1, u1), (o2, _) in zip(ps, ps[1:]))


def test_schedule_balances_every_node_egress_and_ingress_per_rail():
    for topo, traffic in cases(seed=2):
        sch = rails_schedule(traffic, topo)
        V, G, J = topo.nodes, topo.gpus_per_node, topo.rails_per_node
        pair_VVJ = np.zeros((V, V, J), dtype=np.int64)
        for s, d, r, u in zip(sch.src_K, sch.dst_K, sch.rail_K, sch.units_K):
            if r >= 0:
                pair_VVJ[s // G, d // G, r] += u
        tot_VV = traffic.reshape(V, G, V, G).sum(axis=(1, 3))
        np.fill_diagonal(tot_VV, 0)
        lo, hi = tot_VV // J, -(-tot_VV // J)
        # every node pair: each rail carries floor or ceil of the pair's total / J
        assert np.all(pair_VVJ >= lo[..., None]) and np.all(pair_VVJ <= hi[..., None])
        # so every node's egress AND ingress per rail is within the summed rounding bound (receiver uniformity)
        for axis in (1, 0):
            per_rail = pair_VVJ.sum(axis=axis)
            assert np.all(per_rail >= lo.sum(axis=axis)[:, None]) and np.all(per_rail <= hi.sum(axis=axis)[:, None])
            assert np.all(per_rail.max(1) - per_rail.min(1) <= (hi - lo).sum(axis=axis))
        assert np.array_equal(pair_VVJ.sum(axis=1), rail_egress(sch))
        assert np.array_equal(pair_VVJ.sum(axis=0), rail_ingress(sch))


def test_schedule_is_deterministic_and_dtype_blind():
    topo, traffic = next(cases(seed=3))
    a, b = rails_schedule(traffic, topo), rails_schedule(traffic.astype(np.int32), topo)
    assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


def test_nvlink_figures_skip_self_messages():
    topo = topo_of(2, 2, 2)
    traffic = np.zeros((4, 4), dtype=np.int64)
    traffic[0, 0], traffic[0, 1] = 7, 5
    loads = resource_loads(rails_schedule(traffic, topo))
    assert loads.nvl_out_D.tolist() == [5, 0, 0, 0] and loads.nvl_in_D.tolist() == [0, 5, 0, 0]
    assert loads.nic_out_VJ.sum() == 0 and loads.nic_in_VJ.sum() == 0


def test_direct_and_ecmp_schedules_are_valid():
    for topo, traffic in cases(n_per_topo=6, seed=4):
        G = topo.gpus_per_node
        d_sch, e_sch = direct_schedule(traffic, topo), ecmp_schedule(traffic, topo)
        for sch in (d_sch, e_sch):
            sch.check()
            assert sch.units_K.size == np.count_nonzero(traffic)  # whole messages
        inter = d_sch.rail_K >= 0
        assert np.array_equal(d_sch.rail_K[inter], topo.rail_of(d_sch.dst_K[inter]))
        assert np.array_equal(d_sch.land_K, d_sch.dst_K)  # no receiver-side forwarding
        inter = e_sch.rail_K >= 0
        want = ecmp_rail(e_sch.src_K[inter], e_sch.dst_K[inter], traffic.shape[0], topo.rails_per_node)
        assert np.array_equal(e_sch.rail_K[inter], want)
        assert np.array_equal(e_sch.src_K // G == e_sch.dst_K // G, ~(e_sch.rail_K >= 0))
    rails = ecmp_rail(np.repeat(np.arange(64), 64), np.tile(np.arange(64), 64), 64, 8)
    assert np.bincount(rails, minlength=8).min() > 400  # the hash spreads (s, d) over every rail


# -- the flow model against hand-computed cases ----------------------------------------------------------------

HAND = dict(nic_gbps=100.0, nvlink_gbps=400.0, latency_us=1.0)  # 1e6 B: 80 us on a NIC, 20 us on NVLink


def sim_bytes(traffic):
    res = {r.scheme: r for r in simulate(np.asarray(traffic, dtype=np.int64), topo_of(2, 2, 2, **HAND))}
    assert list(res) == list(SCHEMES)
    return res


def test_one_inter_node_message_by_hand():
    traffic = np.zeros((4, 4), dtype=np.int64)
    traffic[0, 3] = 10**6  # GPU 0 (node 0, rail 0) -> GPU 3 (node 1, rail 1)
    r = sim_bytes(traffic)
    # direct: 0 -NVLink-> 1 -rail 1-> 3: NIC 80 us + 2 hops; phased: (20 + 1) + (80 + 1)
    assert r["direct"].completion_us == pytest.approx(82.0) and r["direct"].phased_us == pytest.approx(102.0)
    # ecmp: rail 1 is direct's path; rail 0 is 0 -rail 0-> 2 -NVLink-> 3: 80 + 2 hops either way
    assert r["ecmp"].completion_us == pytest.approx(82.0)
    # rails: half on rail 1 (0 -> 1 -> 3), half on rail 0 (0 -> 2 -> 3): NIC 40 us + 2 hops;
    # phased (10 + 1) + (40 + 1) + (10 + 1)
    assert r["rails"].completion_us == pytest.approx(42.0) and r["rails"].phased_us == pytest.approx(63.0)
    # bound: node 0's 1e6 B over its 2 NICs = 40 us (> GPU 0's 1e6 B over NVLink + NIC = 16 us), + 1 latency
    for x in r.values():
        assert x.lower_bound_us == pytest.approx(41.0) and x.lb_term.startswith("nic_")
    # busbw (nccl-tests): size = 1e6 / 4 ranks, algbw = size / t, busbw = algbw * 3 / 4
    assert r["rails"].busbw_GBps == pytest.approx(250_000 / 42e-6 / 1e9 * 0.75)
    assert r["rails"].busbw_gbps == pytest.approx(8 * r["rails"].busbw_GBps)


def test_hot_receiver_by_hand():
    traffic = np.zeros((4, 4), dtype=np.int64)
    traffic[0, 3] = traffic[1, 3] = 10**6  # both GPUs of node 0 -> GPU 3
    r = sim_bytes(traffic)
    # direct: both on rail 1 (2e6 B: 160 us), GPU 0 forwards through GPU 1
    assert r["direct"].completion_us == pytest.approx(162.0) and r["direct"].phased_us == pytest.approx(182.0)
    assert r["direct"].bottleneck == "nic_out[0,1]"
    # rails: 0 -> 3 keeps rail 1 (via GPU 1); 1 -> 3 sprays onto rail 0: 1 -> 0 -rail 0-> 2 -> 3 (3 hops)
    assert r["rails"].completion_us == pytest.approx(83.0) and r["rails"].hops == 3
    assert r["rails"].phased_us == pytest.approx(21.0 + 81.0 + 21.0)
    # bound: 2e6 B over node 0's 2 NICs = 80 us (> GPU 3's 2e6 B over NVLink + NIC = 32 us), + 1
    assert r["rails"].lower_bound_us == pytest.approx(81.0)
    assert r["rails"].busbw_GBps == pytest.approx(500_000 / 83e-6 / 1e9 * 0.75)


def test_intra_node_and_self_messages_by_hand():
    traffic = np.zeros((4, 4), dtype=np.int64)
    traffic[0, 1] = 10**6
    for x in sim_bytes(traffic).values():
        assert x.completion_us == pytest.approx(21.0) and x.lower_bound_us == pytest.approx(21.0)
    traffic[0, 1], traffic[2, 2] = 0, 10**6  # a rank's message to itself moves nothing
    for x in sim_bytes(traffic).values():
        assert x.completion_us == 0.0 and x.lower_bound_us == 0.0 and x.hops == 0


def test_loads_follow_the_chunks():
    topo = topo_of(3, 8, 4)
    traffic = random_traffic(np.random.default_rng(5), 24, 3)
    loads = resource_loads(rails_schedule(traffic, topo), bytes_per_unit=3)
    np.testing.assert_array_equal(loads.nic_out_VJ, rail_egress(rails_schedule(traffic, topo)) * 3)
    inter_bytes = 3 * sum(int(traffic[s, d]) for s in range(24) for d in range(24) if s // 8 != d // 8)
    assert loads.nic_out_VJ.sum() == loads.nic_in_VJ.sum() == inter_bytes
    assert loads.nvl_out_D.sum() == loads.nvl_in_D.sum()


@pytest.mark.parametrize("nvlink", [3600.0, 400.0, 50.0])  # NVLink fast, equal-ish to and slower than a NIC
def test_lower_bound_never_exceeds_any_scheme(nvlink):
    for topo, traffic in cases(n_per_topo=6, seed=6):
        topo = Topology(name="x", gpus_per_node=topo.gpus_per_node, rails_per_node=topo.rails_per_node,
                        nodes=topo.nodes, nic_gbps=400.0, nvlink_gbps=nvlink, latency_us=2.0)
        res = simulate(traffic, topo, bytes_per_unit=4096)
        lb = lower_bound_us(traffic * 4096, topo)[0]
        for r in res:
            assert r.lower_bound_us == pytest.approx(lb)
            assert lb <= r.completion_us * (1 + 1e-12) and r.completion_us <= r.phased_us * (1 + 1e-12)


@pytest.mark.parametrize("topology", ["dgx-h100", "dgx-a100"])
def test_rails_within_3_percent_of_the_bound_on_skewed_traffic(topology):
    for nodes in (2, 4):
        topo = load_topology(topology).with_nodes(nodes)
        for fam in ("zipf:0.8", "zipf:1.5", "mixtral", "deepseek", "plan:ultraep"):
            tr = make_traffic(fam, topo.world_size, 8, tokens_per_rank=4096)  # the bench's size
            res = {r.scheme: r for r in simulate(tr.tokens_DD, topo, tr.bytes_per_token)}
            assert res["rails"].completion_us <= 1.03 * res["rails"].lower_bound_us, (topology, nodes, fam)
            assert res["rails"].completion_us < res["direct"].completion_us


# -- traffic families -----------------------------------------------------------------------------------------

def test_traffic_families():
    u = make_traffic("uniform", 16, 8, tokens_per_rank=101)  # 808 rows over 16 ranks: 50 or 51
    assert u.tokens_DD.sum(axis=1).tolist() == [808] * 16 and u.tokens_DD.sum(axis=0).tolist() == [808] * 16
    assert u.tokens_DD.max() - u.tokens_DD.min() == 1
    assert make_traffic("uniform", 16, 8, tokens_per_rank=128).tokens_DD.min() == 64
    z = make_traffic("zipf:1.2", 16, 8, tokens_per_rank=512, seed=3)
    assert (z.experts, z.topk, z.hidden, z.policy, z.family) == (256, 8, 4096, "none", "zipf:1.2")
    assert z.tokens_DD.sum(axis=1).tolist() == [512 * 8] * 16  # every token's k copies leave its rank
    recv = z.tokens_DD.sum(axis=0)
    assert recv.max() > 2 * recv.mean()  # skewed receivers
    assert np.array_equal(z.tokens_DD, make_traffic("zipf:1.2", 16, 8, tokens_per_rank=512, seed=3).tokens_DD)
    assert not np.array_equal(z.tokens_DD, make_traffic("zipf:1.2", 16, 8, tokens_per_rank=512, seed=4).tokens_DD)
    assert make_traffic("zipf:1.2", 1024 // 8 * 3, 8, tokens_per_rank=4).experts == 384  # a multiple of D >= 256
    m = make_traffic("mixtral", 16, 8, tokens_per_rank=256)
    assert (m.experts, m.topk, m.hidden, m.policy, m.family) == (8, 2, 4096, "fsep", "mixtral:fsep")
    assert m.bytes_per_token == 4096 * 2
    d = make_traffic("deepseek:ultraep", 16, 8, tokens_per_rank=256)
    assert (d.experts, d.topk, d.hidden, d.policy) == (256, 8, 7168, "ultraep")
    p = make_traffic("plan:lp:zipf:1.5", 16, 8, tokens_per_rank=256)
    assert (p.experts, p.skew, p.policy, p.family) == (8, "zipf:1.5", "lp", "plan:lp:zipf:1.5")
    assert parse_traffic("plan:eplb") == ("plan", "zipf:1.2", "eplb")


FORMS = "expected uniform | zipf:S"


# each error lists what its wrong part accepts: the traffic forms, the policies or the skews
@pytest.mark.parametrize("text, words, listed", [
    ("zipf", "exponent", FORMS), ("zipf:x", "S must be a number", None), ("plan:", "policy", FORMS),
    ("plan:magic", "unknown policy", "policies: none"), ("mixtral:x", "unknown policy", "policies: none"),
    ("gauss", "unknown family", FORMS), ("uniform:1", "no parameters", FORMS), ("", "expected", FORMS),
    ("plan:lp:zipf:-1", "S must be in", "SKEW: uniform | zipf:S")])
def test_bad_traffic_is_a_clear_error(text, words, listed):
    with pytest.raises(TrafficError, match=words) as e:
        parse_traffic(text)
    msg = str(e.value)
    assert (listed or "") in msg and (FORMS in msg) == (listed == FORMS), msg
    assert "bad skew" not in msg or not text.startswith("zipf"), msg  # zipf:S is the skew: named once


def test_stock_mixtral_beyond_eight_ranks_is_refused():
    with pytest.raises(PlannerError, match="divisible"):
        make_traffic("plan:none", 16, 8, tokens_per_rank=64)


# -- CLI ------------------------------------------------------------------------------------------------------

KEYS = {"scheme", "completion_us", "lower_bound_us", "busbw_gbps", "busbw_GBps", "phased_us", "ratio_to_lb",
        "rail_max_over_mean", "rail_node_max_over_mean", "busbw_gain_over_direct", "traffic", "nodes", "topology"}


def test_simulate_a2a_json_entry_point():
    p = subprocess.run([sys.executable, "-m", "megatron_rails.cli", "simulate", "a2a", "--topology", "dgx-h100",
                        "--nodes", "2", "--traffic", "zipf:1.2", "--tokens-per-rank", "512", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert [r["scheme"] for r in rows] == list(SCHEMES) and all(KEYS <= set(r) for r in rows)
    assert all(r["lower_bound_us"] <= r["completion_us"] for r in rows)


def test_simulate_a2a_table_and_yaml_topology(tmp_path, capsys):
    f = tmp_path / "mini.yaml"
    f.write_text("gpus_per_node: 4\nrails_per_node: 2\nnic_gbps: 100\nnvlink_gbps: 800\n")
    assert cli.main(["simulate", "a2a", "--topology", str(f), "--nodes", "3", "--traffic", "uniform",
                     "--tokens-per-rank", "96", "--hidden", "1024"]) == 0
    out = capsys.readouterr().out
    assert "mini x 3 nodes (12 GPUs)" in out and all(s in out for s in SCHEMES)


@pytest.mark.parametrize("argv, words", [
    (["--nodes", "0"], "--nodes must be >= 1"),
    (["--nodes", "2", "--traffic", "zipf:oops"], "bad traffic 'zipf:oops'"),
    (["--nodes", "2", "--traffic", "bogus"], "unknown family 'bogus'"),
    (["--nodes", "2", "--topology", "dgx-z900"], "unknown topology 'dgx-z900'"),
    (["--nodes", "2", "--traffic", "plan:none"], "divisible"),
])
def test_simulate_a2a_errors_are_clear(argv, words, capsys):
    try:
        rc = cli.main(["simulate", "a2a", "--tokens-per-rank", "64"] + argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc != 0 and words in capsys.readouterr().err


def assert_rails_target_from_schemes(res):
    """bench rails' target and figures recomputed from each row's per-scheme results: RailS completion <= 1.03 x
    the lower bound on every skewed case of the preset topologies; gains as bus-bandwidth ratios (busbw is
    the same bytes over the completion time, so rails/direct busbw - 1 is the gain in completion time)."""
    preset_skewed = [r for r in res["rows"] if not r["what_if"] and r["family"] != "uniform"]
    fails = [r for r in preset_skewed if r["schemes"]["rails"]["completion_us"] > 1.03 * r["lower_bound_us"]]
    assert [(r["topology"], r["nodes"], r["family"]) for r in fails] == []
    assert (res["summary"]["skewed_cases"], res["summary"]["failing"]) == (len(preset_skewed), 0)
    assert res["summary"]["target_met"] is True
    for r in res["rows"]:
        busbw = {k: v["busbw_GBps"] for k, v in r["schemes"].items()}
        met = r["schemes"]["rails"]["completion_us"] <= 1.03 * r["lower_bound_us"]
        assert r["skewed"] == (r["family"] != "uniform") and r["target_met"] == (met if r["skewed"] else None)
        for other in ("direct", "ecmp"):
            want = busbw["rails"] / busbw[other] - 1
            assert r[f"busbw_gain_over_{other}"] == pytest.approx(want, rel=1e-9, abs=1e-12), (r["family"], other)


def test_bench_rails_quick(tmp_path):
    from megatron_rails.bench.rails import bench_rails

    out = tmp_path / "r.json"
    res = bench_rails(str(out), quick=True)
    disk = json.loads(out.read_text())
    assert disk["summary"] == json.loads(json.dumps(res["summary"]))
    assert sorted((r["topology"], r["nodes"], r["family"]) for r in disk["rows"]) == sorted(
        ("dgx-h100", n, f) for n in (2, 4) for f in ("uniform", "zipf:1.2", "mixtral"))
    for row in disk["rows"]:
        assert set(row["schemes"]) == set(SCHEMES)
    assert_rails_target_from_schemes(disk)
    assert all(r["busbw_gain_over_direct"] > 0 for r in disk["rows"] if r["family"] != "uniform")
    assert (tmp_path / "r.png").stat().st_size > 10_000


# -- docs/rails.md: every command in it runs, and its results table is bench/rails.json's ---------------------

DOC = ROOT / "docs" / "rails.md"


def doc_commands():
    text = DOC.read_text()
    blocks = re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, flags=re.S)
    return [ln.strip().removeprefix("$ ") for b in blocks for ln in b.splitlines()
            if ln.strip().removeprefix("$ ").startswith("megatron-rails ")]


def _full_bench(cmd):
    return "bench rails" in cmd and "--quick" not in cmd


FULL_BENCH = pytest.mark.skipif(
    not os.environ.get("MEGATRON_RAILS_FULL_BENCH"),
    reason="the full `bench rails` grid (~100 s) reproduces bench/rails.json only with MEGATRON_RAILS_FULL_BENCH=1; "
           "its code path runs in the --quick command")


@pytest.mark.parametrize("cmd", [pytest.param(c, marks=[pytest.mark.slow, FULL_BENCH]) if _full_bench(c) else c
                                 for c in doc_commands()])
def test_doc_command_runs(cmd, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the doc's paths are relative to the repository
    argv = shlex.split(cmd)[1:]
    if "--out" in argv:  # write next to the test, never over the committed results
        committed = ROOT / argv[argv.index("--out") + 1]
        argv[argv.index("--out") + 1] = str(tmp_path / "out.json")
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    if "--json" in argv:
        assert all(KEYS <= set(r) for r in json.loads(out))
    if _full_bench(cmd):  # the full grid reproduces the committed JSON (everything but timings)
        new, old = (json.loads(p.read_text()) for p in (tmp_path / "out.json", committed))
        strip = [{k: v for k, v in r.items() if k != "seconds"} for r in new["rows"]]
        assert strip == [{k: v for k, v in r.items() if k != "seconds"} for r in old["rows"]]


def markdown_tables(result: dict) -> str:
    """The results tables of docs/rails.md, from a bench result (written from it, kept in sync here)."""
    rows = result["rows"]
    lines = []
    for topo in dict.fromkeys(r["topology"] for r in rows):
        sel = [r for r in rows if r["topology"] == topo]
        nodes = sorted({r["nodes"] for r in sel})
        label = f"{topo} (what-if, not a preset)" if any(r.get("what_if") for r in sel) else topo
        lines += [f"{label}: RailS bus-bandwidth gain over direct / over ecmp, by number of nodes; "
                  "the worst RailS completion / lower bound of the row", "",
                  "| traffic | " + " | ".join(str(n) for n in nodes) + " | max RailS/LB |",
                  "|---" * (len(nodes) + 2) + "|"]
        for fam in dict.fromkeys(r["family"] for r in sel):
            cells = []
            for n in nodes:
                r = next((r for r in sel if r["family"] == fam and r["nodes"] == n), None)
                cells.append("-" if r is None else f"{100 * r['busbw_gain_over_direct']:+.0f}% / "
                                                   f"{100 * r['busbw_gain_over_ecmp']:+.0f}%")
            worst = max(r["rails_over_lb"] for r in sel if r["family"] == fam)
            lines.append(f"| {fam} | " + " | ".join(cells) + f" | {worst:.4f} |")
        lines.append("")
    return "\n".join(lines)


def test_doc_lists_commands_and_the_committed_results():
    cmds = doc_commands()
    assert any(c.startswith("megatron-rails simulate a2a") for c in cmds)
    assert "megatron-rails bench rails --out bench/rails.json" in cmds
    res = json.loads((ROOT / "bench" / "rails.json").read_text())
    assert res["meta"]["command"] == "megatron-rails bench rails"
    assert_rails_target_from_schemes(res)
    assert markdown_tables(res) in DOC.read_text()
    assert (ROOT / "bench" / "rails.png").stat().st_size > 10_000


def test_doc_topology_keys_match_the_dataclass():
    import dataclasses

    keys = re.findall(r"^\| `(\w+)` \|", DOC.read_text().split("## The RailS schedule")[0], flags=re.M)
    assert keys == [f.name for f in dataclasses.fields(Topology)]
    for f in dataclasses.fields(Topology):  # the defaults column too
        row = next(ln for ln in DOC.read_text().splitlines() if ln.startswith(f"| `{f.name}` |"))
        default = row.split("|")[3].strip()
        if f.name == "name":
            assert default == "the file's stem"
        elif isinstance(f.default, str):
            assert default == '""', f.name
        else:
            assert float(default) == f.default, f.name

def test_doc_quoted_figures():
    from megatron_rails.cli.sim import run_a2a

    def rows(*argv):
        args = cli.build_parser().parse_args(["simulate", "a2a", *argv])
        return {r["scheme"]: r for r in run_a2a(args)[1]}

    r = rows("--topology", "dgx-h100", "--nodes", "8", "--traffic", "zipf:1.2")
    assert [round(r[s]["completion_us"]) for s in SCHEMES] == [35462, 11897, 8912]
    assert round(r["rails"]["lower_bound_us"]) == 8907
    r = rows("--topology", "dgx-h100", "--nodes", "2", "--traffic", "plan:ultraep", "--tokens-per-rank", "1024")
    assert (round(r["rails"]["completion_us"], 1), round(r["rails"]["lower_bound_us"], 1)) == (131.2, 127.1)
    assert round(r["rails"]["ratio_to_lb"], 3) == 1.032 and r["rails"]["hops"] == 3
    text = DOC.read_text()
    assert "35462 µs" in text and "8912 µs" in text and "8907 µs" in text and "131.2 vs 127.1" in text


def test_topology_takes_numpy_numbers_and_refuses_what_is_no_size():
    """Sizes computed with numpy are taken as the numbers they are; a fractional node count, a world
    of no ranks, and a topology given as neither name nor path are errors, not truncated or a crash."""
    from megatron_rails.core.policy import ConfigError
    from megatron_rails.core.topology import Topology, load_topology

    t = Topology(gpus_per_node=np.int64(8), rails_per_node=np.int32(4), nic_gbps=np.float32(400.0))
    assert t == Topology(gpus_per_node=8, rails_per_node=4, nic_gbps=400.0)
    assert type(t.gpus_per_node) is int and type(t.nic_gbps) is float
    assert t.with_nodes(np.int64(2)).nodes == 2 and t.for_world(np.int64(16)).nodes == 2
    for bad, words in ((lambda: t.with_nodes(2.7), "nodes: expected an integer"),
                       (lambda: t.for_world(0), "world size must be a positive integer"),
                       (lambda: t.for_world(None), "world size must be a positive integer"),
                       (lambda: Topology(gpus_per_node=np.True_), "gpus_per_node: expected an integer"),
                       (lambda: load_topology(None), "expected a preset name or a path"),
                       (lambda: load_topology(8), "expected a preset name or a path")):
        with pytest.raises(ConfigError, match=words):
            bad()


def test_rails_entry_points_take_a_preset_name_and_refuse_bad_arguments():
    from megatron_rails.core.errors import InputError
    from megatron_rails.core.rails_schedule import rail_imbalance, rails_schedule
    from megatron_rails.core.topology import load_topology
    from megatron_rails.sim.rails import simulate

    T = np.random.default_rng(0).integers(0, 50, (16, 16))
    topo = load_topology("dgx-h100")
    a, b = rails_schedule(T, "dgx-h100"), rails_schedule(T, topo)
    assert np.array_equal(a.units_K, b.units_K) and np.array_equal(a.rail_K, b.rail_K)
    assert rail_imbalance(T, "dgx-h100") == rail_imbalance(T, topo)
    one = simulate(T, topo, 2, "rails")  # one scheme by name, not its letters
    assert [r.scheme for r in one] == ["rails"] and one[0].to_dict() == simulate(T, topo, 2)[2].to_dict()
    for bad, words in ((lambda: rails_schedule(-T, topo), "non-negative integers"),
                       (lambda: rails_schedule(T[:3], topo), "square"),
                       (lambda: rails_schedule(T * 0.5, topo), "non-negative integers"),
                       (lambda: rail_imbalance(np.zeros((0, 0), int), topo), "D >= 1"),
                       (lambda: simulate(T, topo, -1), "bytes_per_unit"),
                       (lambda: simulate(T, topo, 2, ["rails", "magic"]), "unknown magic")):
        with pytest.raises(InputError, match=words):
            bad()
