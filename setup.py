"""The compiled parts: the planners' hot paths (ultraep's cascade, megatron_rails/core/planners/_ultraep_c.c;
fsep's layout, _fsep_c.c; the exact min-max flow, _flow_c.c), a plan's token route with a rank's tables from it
(megatron_rails/core/_route_c.c) and the simulator's distinct-token model (megatron_rails/sim/_dedup_c.c).

Optional: where no C compiler is available the build goes on without them and both run in pure
Python (same results, slower). Everything else is declared in pyproject.toml.
"""
from setuptools import Extension, setup

FLAGS = ["-O3", "-std=c11", "-Wall", "-Wextra"]
WITHIN = "megatron_rails/core/planners/_within.h"  # the planners' tolerance test, shared by both
BUFFERS = "megatron_rails/core/_buffers.h"  # taking the arrays, shared by the route and the flow
setup(ext_modules=[Extension("megatron_rails.core.planners._ultraep_c", ["megatron_rails/core/planners/_ultraep_c.c"],
                             depends=[WITHIN], extra_compile_args=FLAGS, optional=True),
                   Extension("megatron_rails.core.planners._fsep_c", ["megatron_rails/core/planners/_fsep_c.c"],
                             depends=[WITHIN], extra_compile_args=FLAGS, optional=True),
                   Extension("megatron_rails.core.planners._flow_c", ["megatron_rails/core/planners/_flow_c.c"],
                             depends=[BUFFERS], extra_compile_args=FLAGS, optional=True),
                   Extension("megatron_rails.core._route_c", ["megatron_rails/core/_route_c.c"],
                             depends=[BUFFERS], extra_compile_args=FLAGS, optional=True),
                   # no fused multiply-adds: bit-identical to the numpy loop it replaces
                   Extension("megatron_rails.sim._dedup_c", ["megatron_rails/sim/_dedup_c.c"],
                             extra_compile_args=FLAGS + ["-ffp-contract=off"], optional=True)])
