"""The reliability soak (`megatron-rails soak`; tools layer). Fault injection points live in
runtime/faults.py, where the runtime calls them."""
