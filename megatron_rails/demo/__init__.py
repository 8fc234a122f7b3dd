"""The training demo behind `make demo` and routing traces (tools layer)."""
