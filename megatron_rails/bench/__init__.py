"""`megatron-rails bench ...` (tools layer): planners, dispatcher, local work, RailS; results as JSON."""
