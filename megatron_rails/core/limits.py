"""Bounds on the sizes the planners and the policy take, far beyond real MoE models (DeepSeek-V3:
256 experts, EP 64), shared by the policy, the planners and the CLI: a typo such as
`num_experts=4 * 10**11` is refused with its name, not by numpy's MemoryError."""
import os

MAX_EXPERTS = 4096  # experts per layer
MAX_SLOTS = 1024    # redundant slots per rank: more than any rank can hold experts for
MAX_RANKS = 4096    # ranks of one expert-parallel group (twice the simulator's 2048 GPUs)
MAX_WINDOW = 1 << 20  # steps of eplb's history window and re-planning interval


def cores_for_ranks(ranks: int) -> None:
    """A ValueError in one line unless `ranks` CPU ranks can each get a core of their own among those
    this process may run on (ranks sharing a core cannot show stragglers: only total work counts)."""
    cores = len(os.sched_getaffinity(0))
    if ranks < 1 or ranks > cores:
        raise ValueError(f"--ranks {ranks}: this machine gives us {cores} core{'s' if cores != 1 else ''} and "
                         f"every rank needs its own (ranks sharing a core cannot show stragglers); use --ranks "
                         f"1..{cores}")
