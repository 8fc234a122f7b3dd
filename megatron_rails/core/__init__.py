"""Plan core: the plan model, the token route, the planners, the LP oracle, workloads, the policy
and topology settings and the RailS schedule. numpy only (no torch, no Megatron): everything above
builds on it, and it runs anywhere."""
