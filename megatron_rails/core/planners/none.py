"""`none`: stock expert parallelism. Rank d owns experts d*E/D ... (d+1)*E/D - 1, no replicas."""
from __future__ import annotations

from ..plan import Placement, Plan
from .base import PlannerBase, PlannerError


class NonePlanner(PlannerBase):
    name = "none"

    def check_config(self) -> None:
        E, D = self.cfg.num_experts, self.cfg.num_ranks
        if E % D:
            raise PlannerError(f"policy 'none' is stock expert parallelism and needs num_experts ({E}) divisible "
                               f"by the expert-parallel size ({D}); use fsep, ultraep, eplb or lp for E % D != 0")
        self._placement = Placement.owner(E, D, self.cfg.ranks_per_node)

    def plan(self, counts_DE, state=None):
        # one replica per expert, in expert order: its quota is the expert's whole load, so the
        # plan holds by construction
        counts, load_E = self.counts_and_load(counts_DE)
        load_E.flags.writeable = False
        plan = Plan.trusted(self._placement, counts, load_E, policy=self.name)
        plan.__dict__["load_E"] = load_E
        return plan, None
