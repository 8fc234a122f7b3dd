"""Rank-to-rank token traffic of an expert-parallel all-to-all, for the RailS simulator.

Shape legend:  D ranks   E experts   T tokens per rank   H hidden size   (top-k spelled out: topk)

`tokens_DD[s, d]` is how many token rows rank s sends rank d in one dispatch all-to-all (top-k
expanded: a token routed to k experts on one rank counts k times, as Megatron's alltoall dispatcher
sends it). Bytes are tokens x hidden x dtype bytes (bf16 = 2 by default).

Families (`make_traffic(text, ...)`):

  uniform              every rank sends every rank (itself included) T*topk/D rows; the
                       remainder T*topk mod D goes one row each to the next ranks after s (cyclically).
  zipf:S               stock expert parallelism (policy `none`) on zipf:S routing of a generic
                       fine-grained MoE: E = the smallest multiple of D that is >= 256, top-8,
                       hidden 4096. The hot experts' ranks are the hot receivers.
  plan:POLICY[:SKEW]   the token route of POLICY's plan (slots = 1) on Mixtral-like routing
                       (E = 8, top-2, hidden 4096) at SKEW (default zipf:1.2).
  mixtral[:POLICY]     Mixtral 8x7B: E = 8, top-2, hidden 4096, zipf:1.2 routing, planned by POLICY
                       (default fsep: 8 experts on more than 8 ranks need a sharded layout).
  deepseek[:POLICY]    DeepSeek-V3-like: E = 256, top-8, hidden 7168, zipf:1.2, planned by POLICY.

Counts come from `workloads.counts` (step 0, layer 0) and are deterministic in (family, D, seed).
Mixtral's 8 experts cannot be laid out stock on more than 8 ranks, so its multi-node traffic is
always a replica/shard policy's plan; `plan:none` there is refused with the planner's error.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.errors import InputError
from ..core.workloads import SKEW_FORMS, WorkloadError, WorkloadSpec, counts, parse_skew

TRAFFIC_FORMS = "uniform | zipf:S | plan:POLICY[:SKEW] | mixtral[:POLICY] | deepseek[:POLICY]"
# SKEW in plan:POLICY[:SKEW]: the routing skews of core/workloads.py (SKEW_FORMS) but a file
SKEW_HERE = " | ".join(f for f in SKEW_FORMS.split(" | ") if not f.startswith("file:"))
DEFAULT_SKEW = "zipf:1.2"
GENERIC = dict(min_experts=256, topk=8, hidden=4096)
MIXTRAL = dict(experts=8, topk=2, hidden=4096)
DEEPSEEK = dict(experts=256, topk=8, hidden=7168)


class TrafficError(InputError):
    """A traffic family text or its parameters are invalid."""


@dataclass(frozen=True)
class Traffic:
    """One all-to-all's traffic: tokens_DD (int64 [D, D], read-only) and how rows become bytes."""

    family: str           # the canonical family text
    tokens_DD: np.ndarray = field(repr=False)
    hidden: int
    dtype_bytes: int
    experts: int
    topk: int
    tokens_per_rank: int
    skew: str             # routing skew ("" for uniform)
    policy: str           # planner whose route gave the traffic ("" for uniform)
    seed: int

    @property
    def num_ranks(self) -> int:
        return self.tokens_DD.shape[0]

    @property
    def bytes_per_token(self) -> int:
        return self.hidden * self.dtype_bytes

    @property
    def bytes_DD(self) -> np.ndarray:
        return self.tokens_DD * self.bytes_per_token

    def describe(self) -> dict:
        return {"traffic": self.family, "ranks": self.num_ranks, "experts": self.experts, "topk": self.topk,
                "hidden": self.hidden, "dtype_bytes": self.dtype_bytes, "tokens_per_rank": self.tokens_per_rank,
                "skew": self.skew, "policy": self.policy, "seed": self.seed,
                "total_bytes": int(self.tokens_DD.sum()) * self.bytes_per_token}


def _policies() -> tuple[str, ...]:
    from ..core.planners import POLICIES

    return POLICIES


def default_policy() -> str:
    """mixtral's policy when none is named: fsep, since Mixtral's 8 experts span more ranks than 8
    only as shards (an owner-layout policy, the product default included, is refused there)."""
    return "fsep"


def parse_traffic(text: str) -> tuple[str, str, str]:
    """(kind, skew, policy) of a family text; TrafficError naming the text and the accepted forms."""
    if not isinstance(text, str) or not text.strip():
        raise TrafficError(f"bad traffic {text!r}: expected {TRAFFIC_FORMS}")
    kind, _, rest = text.strip().partition(":")
    kind = kind.lower()

    def bad(why: str, forms: bool = True) -> TrafficError:
        """forms: list the traffic forms (not where the family is right and only its part is wrong)."""
        return TrafficError(f"bad traffic {text!r}: {why}" + (f"; expected {TRAFFIC_FORMS}" if forms else ""))

    def policy(name: str) -> str:
        if name not in _policies():
            raise bad(f"unknown policy {name!r} (policies: {', '.join(_policies())})", forms=False)
        return name

    def skew(s: str, whole: bool = False) -> str:
        """whole: the skew is the whole text (zipf:S): the family is right, only its exponent is not."""
        try:
            sk = parse_skew(s)
        except WorkloadError as err:
            why = str(err).split(";")[0]
            if whole:  # "bad skew 'zipf:-1': S must be ..." would repeat the text
                raise bad(why.split(": ", 1)[-1], forms=False) from None
            raise bad(f"{why} (SKEW: {SKEW_HERE})", forms=False) from None
        if sk.kind == "file":
            raise bad(f"file skews are not supported here (SKEW: {SKEW_HERE})", forms=False)
        return str(sk)

    if kind == "uniform":
        if rest:
            raise bad("uniform takes no parameters")
        return "uniform", "", ""
    if kind == "zipf":
        if not rest:
            raise bad("zipf needs an exponent, e.g. zipf:1.2")
        return "zipf", skew(text.strip(), whole=True), "none"
    if kind == "plan":
        name, _, sk = rest.partition(":")
        if not name:
            raise bad("plan needs a policy, e.g. plan:ultraep")
        return "plan", skew(sk) if sk else DEFAULT_SKEW, policy(name)
    if kind in ("mixtral", "deepseek"):
        return kind, DEFAULT_SKEW, policy(rest) if rest else default_policy()
    raise bad(f"unknown family {kind!r}")


@dataclass(frozen=True)
class Family:
    """A parsed family with its shape resolved for D ranks: kind, canonical text, routing skew, policy,
    experts E, topk, hidden H (the family's defaults unless overridden)."""

    kind: str
    canon: str
    skew: str
    policy: str
    experts: int
    topk: int
    hidden: int


def check_ints(**values) -> None:
    """TrafficError unless every given value (name=(value, lowest)) is None or an integer >= lowest."""
    for name, (v, lo) in values.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo):
            raise TrafficError(f"{name} must be an integer >= {lo}, got {v!r}")


def family(text: str, num_ranks: int, *, hidden: int | None = None, experts: int | None = None,
           topk: int | None = None) -> Family:
    """The family `text` on `num_ranks` ranks: its canonical text and shape (overrides applied)."""
    kind, sk, pol = parse_traffic(text)
    D = int(num_ranks)
    if kind in ("uniform", "zipf"):
        shape = dict(experts=-(-GENERIC["min_experts"] // D) * D, topk=GENERIC["topk"], hidden=GENERIC["hidden"])
    else:
        shape = dict(DEEPSEEK if kind == "deepseek" else MIXTRAL)
    shape.update({k: int(v) for k, v in (("experts", experts), ("topk", topk), ("hidden", hidden)) if v is not None})
    canon = {"uniform": "uniform", "zipf": sk, "plan": f"plan:{pol}:{sk}"}.get(kind, f"{kind}:{pol}")
    if shape["topk"] > shape["experts"]:  # every family, uniform too (its rows are T*topk/D each)
        raise TrafficError(f"traffic {text!r}: topk={shape['topk']} exceeds num_experts={shape['experts']}: a token "
                           "picks topk distinct experts")
    return Family(kind, canon, sk, pol, shape["experts"], shape["topk"], shape["hidden"])


def check_policy_slots(text: str, policy: str, slots: int) -> None:
    """A planned traffic's policy can run on `slots` redundant slots per rank (eplb, ultraep and lp
    on an owner placement need one at least; with none they would silently plan stock's route)."""
    from ..core.policy import ConfigError, PolicyConfig

    try:
        PolicyConfig(policy=policy, slots=int(slots))
    except ConfigError as err:
        raise TrafficError(f"traffic {text!r} with {int(slots)} slots: {str(err).partition(': ')[2].split(' (')[0]}"
                           f" (--slots)") from None


def make_traffic(text: str, num_ranks: int, ranks_per_node: int = 8, *, tokens_per_rank: int = 4096,
                 hidden: int | None = None, dtype_bytes: int = 2, experts: int | None = None,
                 topk: int | None = None, seed: int = 0, slots: int = 1) -> Traffic:
    """The traffic of family `text` on `num_ranks` ranks (`ranks_per_node` per node, for the planners).

    hidden / experts / topk override the family's shape; slots: the planners' redundant slots per rank
    (PlannerConfig.slots).
    """
    parse_traffic(text)  # a bad family text is reported before bad numbers
    check_ints(num_ranks=(num_ranks, 1), ranks_per_node=(ranks_per_node, 1), tokens_per_rank=(tokens_per_rank, 0),
               dtype_bytes=(dtype_bytes, 1), seed=(seed, 0), slots=(slots, 0), hidden=(hidden, 1),
               experts=(experts, 1), topk=(topk, 1))
    D = int(num_ranks)
    fam = family(text, D, hidden=hidden, experts=experts, topk=topk)
    E, top_k, H, canon, sk, pol = fam.experts, fam.topk, fam.hidden, fam.canon, fam.skew, fam.policy
    if fam.kind == "uniform":
        tok = _uniform_DD(D, int(tokens_per_rank) * top_k)
        return _traffic(canon, tok, H, dtype_bytes, E, top_k, tokens_per_rank, "", "", seed)
    from ..core.planners import PlannerConfig, make_planner

    try:
        spec = WorkloadSpec(D, E, top_k, int(tokens_per_rank), sk, int(seed))
    except WorkloadError as err:
        raise TrafficError(f"traffic {text!r}: {err}") from None
    check_policy_slots(text, pol, slots)
    c = counts(spec)
    plan, _ = make_planner(pol, PlannerConfig(D, E, min(int(ranks_per_node), D), int(slots))).plan(c)
    return _traffic(canon, plan.send_DD, H, dtype_bytes, E, top_k, tokens_per_rank, sk, pol, seed)


def _uniform_DD(D: int, rows: int) -> np.ndarray:
    base, rem = divmod(rows, D)
    out = np.full((D, D), base, dtype=np.int64)
    if rem:
        s = np.arange(D)[:, None]
        out[s, (s + 1 + np.arange(rem)[None, :]) % D] += 1
    return out


def _traffic(canon, tok, H, dtype_bytes, E, top_k, T, sk, pol, seed) -> Traffic:
    tok = np.array(tok, dtype=np.int64)
    tok.setflags(write=False)
    return Traffic(canon, tok, int(H), int(dtype_bytes), int(E), int(top_k), int(T), sk, pol, int(seed))
