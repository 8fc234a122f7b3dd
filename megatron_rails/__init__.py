"""megatron-rails: skew-aware expert parallelism for Megatron-Core."""
__version__ = "0.1.0"
