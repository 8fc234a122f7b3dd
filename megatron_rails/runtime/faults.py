"""Fault injection for the reliability tests: make one rank die, hang or raise at a named site.

Set MEGATRON_RAILS_FAULT before the processes start, e.g.

    MEGATRON_RAILS_FAULT="rank=1,site=token_dispatch,call=3,action=kill"

rank:   the EP rank that misbehaves (default 0).
site:   where: token_dispatch (before the token all-to-all) or token_combine.
call:   the n-th time (1-based, counted per process over all layers) the site is reached (default 1).
action: kill (SIGKILL itself: a crashed process), hang (sleep: a stuck process), raise (an exception).

Unset, `maybe_fault` is a dictionary lookup; nothing else in the package reads this variable.
"""
from __future__ import annotations

import os
import signal
import time

ENV = "MEGATRON_RAILS_FAULT"
SITES = ("token_dispatch", "token_combine")
ACTIONS = ("kill", "hang", "raise")


class InjectedFault(RuntimeError):
    """Raised by action=raise."""


def parse(text: str) -> dict:
    spec = {"rank": 0, "site": "token_dispatch", "call": 1, "action": "kill"}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, val = part.partition("=")
        if not sep or key not in spec:
            raise ValueError(f"{ENV}: expected comma-separated key=value with keys {', '.join(spec)}, got {part!r}")
        spec[key] = int(val) if key in ("rank", "call") else val
    if spec["site"] not in SITES:
        raise ValueError(f"{ENV}: site must be one of {', '.join(SITES)}, got {spec['site']!r}")
    if spec["action"] not in ACTIONS:
        raise ValueError(f"{ENV}: action must be one of {', '.join(ACTIONS)}, got {spec['action']!r}")
    return spec


_spec = parse(os.environ[ENV]) if os.environ.get(ENV) else None
_calls: dict[str, int] = {}


def maybe_fault(site: str, rank: int) -> None:
    if _spec is None or _spec["site"] != site or _spec["rank"] != rank:
        return
    _calls[site] = n = _calls.get(site, 0) + 1
    if n != _spec["call"]:
        return
    print(f"[megatron-rails] injected fault on EP rank {rank}: {_spec['action']} at {site} (call {n})", flush=True)
    if _spec["action"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif _spec["action"] == "hang":
        while True:
            time.sleep(3600)
    raise InjectedFault(f"injected fault at {site} on EP rank {rank}")
