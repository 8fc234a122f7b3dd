"""The one compiled part: ultraep's planning hot path (megatron_rails/core/planners/_ultraep_c.c).

Optional: where no C compiler is available the build goes on without it and ultraep plans in pure
Python (same plans, slower). Everything else is declared in pyproject.toml.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("megatron_rails.core.planners._ultraep_c", ["megatron_rails/core/planners/_ultraep_c.c"],
                             extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra"], optional=True)])
