"""Bad input to any `megatron-rails` command (issue #16, "tried as a new user would"): exit status 2, one
line on stderr naming the argument (or file and key) and what is allowed, never a traceback.

Runs the CLI in-process (`main(argv)`); argparse's usage errors leave it as SystemExit(2), errors found
while a command reads its input return 2. Every case fails before any work starts (no rank, no timing),
so the table stays fast.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_rails.cli import main
from megatron_rails.core.policy import ConfigError, as_policy


@pytest.fixture(autouse=True)
def _keep_affinity():
    """`plan` pins its process to one core (for its latency figures); in-process runs here must not
    leave the test process, and the subprocesses later tests start, on one core."""
    cores = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, cores)


ROOT = Path(__file__).resolve().parents[1]
MINI = str(ROOT / "configs" / "mini" / "mini-mixtral.yaml")
POLICY = str(ROOT / "configs" / "policies" / "default.yaml")
PLAN = ["plan", "--policy", "ultraep"]
LONG = "{tmp}/" + "c" * 300  # a file name longer than any file system allows (Path.is_dir raises)

# (id, argv with {tmp} for the files of `files`, a word the one error line must contain)
CASES = [
    # plan: numbers out of range, NaN, the reported tracebacks and silently accepted values
    ("plan repeats 0 budget 0", PLAN + ["--repeats", "0", "--budget", "0"], "--repeats"),
    ("plan repeats -1", PLAN + ["--repeats", "-1"], "--repeats"),
    ("plan budget -1", PLAN + ["--budget", "-1"], "--budget"),
    ("plan budget nan", PLAN + ["--budget", "nan"], "--budget"),
    ("plan budget inf", PLAN + ["--budget", "inf"], "--budget"),
    ("plan tokens 1e14", PLAN + ["--tokens-per-rank", "1e14"], "--tokens-per-rank"),
    ("plan tokens 0", PLAN + ["--tokens-per-rank", "0"], "--tokens-per-rank"),
    ("plan tokens text", PLAN + ["--tokens-per-rank", "many"], "--tokens-per-rank"),
    ("plan ranks 0", PLAN + ["--ranks", "0"], "--ranks"),
    ("plan ranks huge", PLAN + ["--ranks", "99999999999999999999"], "--ranks"),
    ("plan ranks with separator", PLAN + ["--ranks", "8_0"], "--ranks"),
    ("plan experts -8", PLAN + ["--experts", "-8"], "--experts"),
    ("plan topk above experts", PLAN + ["--topk", "9"], "topk"),
    ("plan seed -1", PLAN + ["--seed", "-1"], "--seed"),
    ("plan slots -1", PLAN + ["--slots", "-1"], "--slots"),
    ("plan slots 0 for ultraep", PLAN + ["--slots", "0"], "--slots"),
    ("plan tolerance 2", PLAN + ["--tolerance", "2"], "--tolerance"),
    ("plan window 0", PLAN + ["--window", "0"], "--window"),
    ("plan placement", ["plan", "--policy", "lp", "--placement", "magic"], "--placement"),
    ("plan node size", PLAN + ["--ranks-per-node", "3"], "--ranks-per-node"),
    ("plan bad skew", PLAN + ["--skew", "zipf:-1"], "skew"),
    ("plan counts with skew", PLAN + ["--counts", "{tmp}/c.npy", "--skew", "zipf:2"], "--skew"),
    ("plan counts vs ranks", PLAN + ["--counts", "{tmp}/c.npy", "--ranks", "8"], "--ranks"),
    ("plan counts vs experts", PLAN + ["--counts", "{tmp}/c.npy", "--experts", "16"], "--experts"),
    ("plan counts missing", PLAN + ["--counts", "{tmp}/nope.npy"], "nope.npy"),
    ("plan counts directory", PLAN + ["--counts", "{tmp}"], "directory"),
    ("plan counts negative", PLAN + ["--counts", "{tmp}/neg.npy"], "negative"),
    ("plan counts near 2^62", PLAN + ["--counts", "{tmp}/big.npy"], "2^53"),
    # bench
    ("bench unknown", ["bench", "magic", "--out", "{tmp}/b.json"], "invalid choice"),
    ("bench local dtype", ["bench", "local", "--dtype", "foo", "--out", "{tmp}/b.json"], "--dtype"),
    ("bench local shape", ["bench", "local", "--shape", "huge", "--out", "{tmp}/b.json"], "--shape"),
    ("bench local device", ["bench", "local", "--device", "tpu:x", "--out", "{tmp}/b.json"], "--device"),
    ("bench out directory", ["bench", "planners", "--out", "{tmp}"], "--out"),
    ("bench out no directory", ["bench", "planners", "--out", "{tmp}/no/b.json"], "--out"),
    ("bench step ranks", ["bench", "step", "--ranks", "4096", "--out", "{tmp}/b.json"], "--ranks"),
    ("bench step ranks not dividing the experts", ["bench", "step", "--ranks", "3", "--out", "{tmp}/b.json"],
     "--ranks must divide the step bench's experts (8): one of 1, 2, 4, 8, got 3"),
    ("bench step microbatches", ["bench", "step", "--microbatches", "0", "--out", "{tmp}/b.json"], "--microbatches"),
    # simulate run / a2a
    ("simulate run steps 1e9", ["simulate", "run", MINI, "--steps", "1000000000"], "--steps"),
    ("simulate run policy config", ["simulate", "run", POLICY], "policy config"),
    ("simulate run directory", ["simulate", "run", "{tmp}"], "directory"),
    ("simulate run empty", ["simulate", "run", "{tmp}/empty.yaml"], "empty"),
    ("simulate run lr nan", ["simulate", "run", MINI, "training.lr=.nan"], "training.lr"),
    ("simulate run nic inf", ["simulate", "run", MINI, "topology.nic_gbps=.inf"], "topology.nic_gbps"),
    ("simulate run skew inf", ["simulate", "run", MINI, "model.router_skew=.inf"], "model.router_skew"),
    ("simulate run layers huge", ["simulate", "run", MINI, "model.num_layers=99999999999999999999"],
     "model.num_layers"),
    ("simulate run mfu nan", ["simulate", "run", MINI, "--mfu", "nan"], "--mfu"),
    ("simulate run mfu 1e-300", ["simulate", "run", MINI, "--mfu", "1e-300"], "--mfu"),
    ("simulate run slots -1", ["simulate", "run", MINI, "--slots", "-1"], "--slots"),
    ("simulate run trace directory", ["simulate", "run", MINI, "--trace", "{tmp}"], "directory"),
    ("simulate run plot directory", ["simulate", "run", MINI, "--plot", "{tmp}"], "--plot"),
    ("simulate a2a nodes 0", ["simulate", "a2a", "--nodes", "0"], "--nodes"),
    # options that would change nothing
    ("simulate a2a dedup on one node", ["simulate", "a2a", "--nodes", "1", "--dedup", "on"], "--dedup on"),
    ("simulate run skew file seed", ["simulate", "run", MINI, "--skew", "file:{tmp}/c.npy", "--seed", "2",
                                     "parallelism.expert_model_parallel_size=4", "model.num_experts=8"], "--seed"),
    ("soak ranks without steps", ["soak", "--planner-calls", "5", "--steps", "0", "--ranks", "2"], "--ranks"),
    ("simulate a2a nodes huge", ["simulate", "a2a", "--nodes", "100", "--topology", "nvl72"], "--nodes"),
    ("simulate a2a tokens -1", ["simulate", "a2a", "--nodes", "1", "--tokens-per-rank", "-1"], "--tokens-per-rank"),
    ("simulate a2a empty topology", ["simulate", "a2a", "--nodes", "1", "--topology", "{tmp}/empty.yaml"], "empty"),
    ("simulate a2a topology preset", ["simulate", "a2a", "--nodes", "1", "--topology", "dgx-z9"], "dgx-a100"),
    # trace, soak, demo: refused before torchrun starts
    ("trace ranks 3", ["trace", "--out", "{tmp}/t.npz", "--ranks", "3"], "--ranks"),
    ("trace steps 0", ["trace", "--out", "{tmp}/t.npz", "--steps", "0"], "--steps"),
    ("trace slots 0 for ultraep", ["trace", "--out", "{tmp}/t.npz", "--policy", "ultraep", "--slots", "0"], "--slots"),
    ("trace extension", ["trace", "--out", "{tmp}/t.txt"], "--out"),
    ("soak ranks 3", ["soak", "--ranks", "3"], "--ranks"),
    ("soak planner calls -1", ["soak", "--planner-calls", "-1"], "--planner-calls"),
    ("soak steps -1", ["soak", "--steps", "-1"], "--steps"),
    ("demo ranks 3", ["demo", "--ranks", "3"], "--ranks"),
    ("demo steps 0", ["demo", "--steps", "0"], "--steps"),
    ("demo microbatches 0", ["demo", "--microbatches", "0"], "--microbatches"),
    ("demo empty config", ["demo", "--config", "{tmp}/empty.yaml"], "empty"),
    ("demo unknown preset", ["demo", "--config", "fastest"], "presets"),
    ("demo config directory", ["demo", "--config", "{tmp}"], "directory"),
    ("demo huge slots", ["demo", "--config", "{tmp}/slots.yaml"], "slots"),
    ("demo plot no directory", ["demo", "--plot", "{tmp}/no/d.png"], "--plot"),
    # config show / docs
    ("config show lr inf", ["config", "show", MINI, "training.lr=.inf", "--megatron-args"], "training.lr"),
    ("config show megatron-args of a policy", ["config", "show", POLICY, "--megatron-args"], "run config"),
    ("config show directory", ["config", "show", "{tmp}"], "directory"),
    ("config show typo kind", ["config", "show", "{tmp}/typo.yaml"], "did you mean 'policy'"),
    ("config docs out directory", ["config", "docs", "--out", "{tmp}"], "--out"),
    ("no command", [], "COMMAND"),
    ("config show without file", ["config", "show"], "required: FILE ("),  # not ", KEY=VALUE": optional
    # files that are no config or counts at all: not text, nested without end, cut off
    ("config show not utf-8", ["config", "show", "{tmp}/latin1.yaml"], "UTF-8"),
    ("topology not utf-8", ["simulate", "a2a", "--nodes", "2", "--topology", "{tmp}/latin1.yaml"], "UTF-8"),
    ("demo config nested deep", ["demo", "--config", "{tmp}/deep.yaml"], "nested"),
    ("config show duplicate key", ["config", "show", "{tmp}/dup.yaml"], "given twice"),
    ("topology empty", ["simulate", "a2a", "--nodes", "2", "--topology", ""], "empty topology"),
    ("run config empty path", ["simulate", "run", ""], "empty path"),
    ("run config a device", ["simulate", "run", "/dev/null"], "not a regular file"),
    ("plan counts empty npy", PLAN + ["--counts", "{tmp}/zero.npy"], "zero.npy"),
    ("plan counts empty npz", PLAN + ["--counts", "{tmp}/zero.npz"], "zero.npz"),
    ("plan counts cut npz", PLAN + ["--counts", "{tmp}/cut.npz"], "cut.npz"),
    ("plan counts deep json", PLAN + ["--counts", "{tmp}/deep.json"], "nested"),
    ("plan counts too many ranks", PLAN + ["--counts", "{tmp}/wide.npy"], "at most 4096"),
    ("config show experts 1e9", ["config", "show", MINI, "model.num_experts=1000000000"], "model.num_experts"),
    # outputs that cannot be written, found before the work
    ("out under /proc", ["config", "docs", "--out", "/proc/megatron-rails-x.md"], "cannot write"),
    ("out empty", ["config", "docs", "--out", ""], "--out"),
    ("plot format", ["simulate", "run", MINI, "--plot", "{tmp}/p.txt"], "--plot"),
    ("bench local meta device", ["bench", "local", "--quick", "--out", "{tmp}/l.json", "--device", "meta"], "--device"),
    ("soak nothing", ["soak", "--planner-calls", "0", "--steps", "0"], "nothing"),
    ("demo planners with training flags", ["demo", "--planners", "--steps", "3", "--ranks", "2"], "--steps, --ranks"),
    # found by a newcomer's sweep of every command (2026-11-27)
    ("extra argument blames the subcommand", PLAN + ["extra"], "plan: error: unrecognized arguments: extra (see "
                                                                "megatron-rails plan --help)"),
    ("out a pipe nobody reads", ["config", "docs", "--out", "{tmp}/pipe"], "a pipe nobody reads"),
    ("counts a pipe", PLAN + ["--counts", "{tmp}/pipe"], "not a regular file"),
    ("trace a pipe", ["simulate", "run", MINI, "--trace", "{tmp}/pipe"], "not a regular file"),
    ("counts a text file called .npy", PLAN + ["--counts", "{tmp}/text.npy"], "not a .npy file (no NumPy header)"),
    ("trace a text file called .npz", ["simulate", "run", MINI, "--trace", "{tmp}/text.npz"], "not a .npz archive"),
    ("trace all zero", ["simulate", "run", MINI, "--trace", "{tmp}/z48.npy"], "every count is 0"),
    ("run 0 slots with eplb among --policies", ["simulate", "run", MINI, "balancer=none", "--steps", "1"],
     "policy eplb cannot run with the config's 0 redundant slot(s)"),
    ("a2a planned traffic on 0 slots", ["simulate", "a2a", "--nodes", "2", "--traffic", "plan:eplb", "--slots", "0"],
     "needs slots >= 1 (--slots)"),
    ("a2a dedup planned traffic on 0 slots", ["simulate", "a2a", "--nodes", "2", "--traffic", "plan:ultraep",
                                              "--slots", "0", "--dedup", "on"], "needs slots >= 1 (--slots)"),
    ("bench option another benchmark takes", ["bench", "planners", "--out", "{tmp}/b.json", "--device", "cuda"],
     "bench planners does not take --device"),
    ("bench plot of one that plots none", ["bench", "dispatcher", "--out", "{tmp}/b.json", "--plot", "{tmp}/b.png"],
     "bench dispatcher does not take --plot"),
    ("bench figure over its results", ["bench", "rails", "--out", "{tmp}/r.png"], "the figure would overwrite"),
    ("demo config a run config", ["demo", "--config", MINI], "this is a run config; a policy config is needed"),
    ("policy file without its policy", ["config", "show", "{tmp}/slots_only.yaml"],
     "'slots' is a policy key, and a policy file names its policy"),
    ("topology override a directory", ["simulate", "run", MINI, "topology={tmp}"], "is a directory"),
    ("config show get and megatron-args", ["config", "show", MINI, "--get", "model", "--megatron-args"],
     "give one of them"),
    # the CLI audit of 2026-11-27 (/tmp/audit_cli): keys that are not names, in every loader
    ("policy integer key", ["config", "show", "{tmp}/intkey.yaml"], "intkey.yaml: key 1 (an integer, line 2) is not a "
                                                                   "name; keys are strings"),
    ("demo config boolean key", ["demo", "--config", "{tmp}/boolkey.yaml"], "boolkey.yaml: key true (a boolean"),
    ("null key", ["config", "show", "{tmp}/nullkey.yaml"], "nullkey.yaml: key null (YAML's null"),
    ("float key", ["config", "show", "{tmp}/floatkey.yaml"], "floatkey.yaml: key 1.5 (a number"),
    ("date key", ["config", "show", "{tmp}/datekey.yaml"], "datekey.yaml: key 2024-01-01 (a date"),
    ("a2a topology integer key", ["simulate", "a2a", "--nodes", "1", "--topology", "{tmp}/topo_intkey.yaml"],
     "topo_intkey.yaml: key 3 (an integer"),
    ("run config key in a section", ["simulate", "run", "{tmp}/run_intkey.yaml"], "run_intkey.yaml: model: key 7 (an "
                                                                                   "integer"),
    ("run config key in the balancer", ["config", "show", "{tmp}/run_bal_intkey.yaml"],
     "run_bal_intkey.yaml: balancer: key 9 (an integer"),
    ("override loading a topology file", ["simulate", "run", MINI, "topology={tmp}/topo_intkey.yaml"],
     "topology: {tmp}/topo_intkey.yaml: key 3 (an integer"),
    ("override loading a policy file", ["config", "show", MINI, "balancer={tmp}/intkey.yaml"],
     "balancer: {tmp}/intkey.yaml: key 1 (an integer"),
    ("override value with an integer key", ["config", "show", MINI, "balancer={1: 2}"],
     "override 'balancer={1: 2}': key 1 (an integer"),
    # aliases and values of any size: bounded work, bounded lines
    ("alias bomb", ["config", "show", "{tmp}/laughs.yaml"], "aliases (*name) expand to more than 10000 values"),
    ("self-referencing alias", ["config", "show", "{tmp}/recursive.yaml"], "inside the value it names"),
    # figures: a format needing LaTeX, a device
    ("plot pgf", ["simulate", "run", MINI, "--plot", "{tmp}/p.pgf"], "use one of .png"),
    ("plot a full device", ["simulate", "run", MINI, "--plot", "/dev/full"], "'/dev/full': not a regular file"),
    ("plot a device without suffix", ["simulate", "run", MINI, "--plot", "/dev/null"], "'/dev/null': not a regular"),
    ("demo plot a pipe", ["demo", "--plot", "{tmp}/pipe"], "pipe': not a regular file"),
    # /dev/stdout is a regular file when the stream goes to one (as under pytest): refused by name
    ("plot stdout", ["simulate", "run", MINI, "--plot", "/dev/stdout"], "'/dev/stdout': not a regular file"),
    # names no file can have: the option's error, not a traceback or exit 1
    ("out name too long", ["config", "docs", "--out", LONG + ".md"], "cannot write there (File name too long)"),
    ("plot name too long", ["simulate", "run", MINI, "--plot", LONG], "--plot '{tmp}/ccc"),
    ("counts name too long", PLAN + ["--counts", LONG + ".json"], "--counts {tmp}/ccc"),
    ("skew file name too long", PLAN + ["--skew", f"file:{LONG}.npy"], "--skew {tmp}/ccc"),
    ("run config name too long", ["simulate", "run", LONG + ".yaml"], "File name too long"),
    ("override file name too long", ["config", "show", MINI, f"topology={LONG}.yaml"], "topology={tmp}/ccc"),
    ("a2a uniform topk above experts", ["simulate", "a2a", "--nodes", "1", "--traffic", "uniform", "--topk", "9",
                                        "--experts", "8"], "topk=9 exceeds num_experts=8"),
    # an empty path is no file
    ("plan counts empty path", PLAN + ["--counts", ""], "--counts: an empty path"),
    ("simulate run trace empty path", ["simulate", "run", MINI, "--trace", ""], "--trace: an empty path"),
    ("demo config empty path", ["demo", "--config", ""], "--config: an empty path"),
    # options that would change nothing
    ("plan counts with topk", PLAN + ["--counts", "{tmp}/c.npy", "--topk", "3"], "so --topk would change nothing"),
    ("plan counts with seed and tokens", PLAN + ["--counts", "{tmp}/c.npy", "--seed", "0", "--tokens-per-rank", "9"],
     "so --tokens-per-rank, --seed would change nothing"),
    ("plan window for ultraep", PLAN + ["--window", "3"], "--window would change nothing with --policy ultraep"),
    ("plan interval for lp on ultraep", ["plan", "--policy", "lp", "--interval", "3"],
     "--interval would change nothing with --policy lp --placement ultraep"),
    ("plan placement for fsep", ["plan", "--policy", "fsep", "--placement", "eplb"], "--placement would change"),
    ("plan tolerance for none", ["plan", "--policy", "none", "--tolerance", "0.1"], "--tolerance would change"),
    ("plan slots for none", ["plan", "--policy", "none", "--slots", "2"], "--slots would change nothing with --policy none"),
    ("trace slots for none", ["trace", "--out", "{tmp}/t.npz", "--policy", "none", "--slots", "2"],
     "--slots 2 would change nothing with --policy none"),
    ("a2a slots for unplanned traffic", ["simulate", "a2a", "--nodes", "2", "--traffic", "zipf:1.2", "--slots", "2"],
     "--slots 2 would change nothing with --traffic zipf:1.2"),
    ("a2a slots for traffic planned by none", ["simulate", "a2a", "--nodes", "2", "--traffic", "mixtral:none",
                                              "--slots", "1", "--dedup", "on"], "--traffic mixtral:none: only"),
    ("plan tolerance for lp static", ["plan", "--policy", "lp", "--placement", "static", "--tolerance", "0.1"],
     "--tolerance would change nothing with --policy lp --placement static"),
    ("simulate run slots for none alone", ["simulate", "run", MINI, "--policies", "none", "--slots", "3"],
     "--slots 3 would change nothing with --policies none"),
    ("simulate run no policy named", ["simulate", "run", MINI, "--policies", ","], "--policies ',': no policy named"),
    ("simulate run no comm named", ["simulate", "run", MINI, "--comm", ""], "--comm '': no comm named"),
    ("simulate run trailing comma", ["simulate", "run", MINI, "--policies", "none,"],
     "--policies 'none,': an empty name (a stray comma?)"),
    ("simulate run empty comm", ["simulate", "run", MINI, "--comm", "direct,,rails"],
     "--comm 'direct,,rails': an empty name (a stray comma?)"),
    ("simulate run policy twice", ["simulate", "run", MINI, "--policies", "none,fsep,none"],
     "--policies 'none,fsep,none': 'none' named twice"),
    ("plan experts over ranks", PLAN + ["--ranks", "3", "--experts", "8"],
     "--experts 8 is not divisible by --ranks 3: Megatron-Core splits the experts evenly"),
    ("plan default experts over ranks", ["plan", "--policy", "fsep", "--ranks", "3"],
     "--experts 8 is not divisible by --ranks 3"),
    ("plan counts experts over ranks", PLAN + ["--counts", "{tmp}/c38.npy"],
     "c38.npy has E=8 experts, which is not divisible by its D=3 ranks"),
    ("balancer override a device", ["config", "show", MINI, "balancer=/dev/null"],
     "balancer: '/dev/null' is not a regular file"),
    ("empty data_path list", ["config", "show", MINI, "data.data_path=[]"], "data.data_path: an empty list"),
    ("empty balancer override", ["config", "show", MINI, "balancer="],
     "override 'balancer=': an empty value; write balancer=null"),
    ("simulate run trace-tokens without trace", ["simulate", "run", MINI, "--trace-tokens", "raw"],
     "give --trace FILE, or drop --trace-tokens"),
    ("simulate run seed with trace", ["simulate", "run", MINI, "--trace", "{tmp}/c.npy", "--seed", "3"],
     "a --trace replays its own counts: drop --seed"),
    ("plan counts all zero", PLAN + ["--counts", "{tmp}/z48.npy"], "every count is 0"),
    ("plan skew file all zero", PLAN + ["--skew", "file:{tmp}/z48.npy", "--ranks", "4", "--experts", "8"],
     "z48.npy: every count is 0"),
    ("simulate run skew file all zero", ["simulate", "run", MINI, "--skew", "file:{tmp}/z48.npy"], "every count is 0"),
    ("plan skew file with topk", PLAN + ["--skew", "file:{tmp}/c.npy", "--ranks", "4", "--experts", "8", "--topk", "2"],
     "so --topk would change nothing"),
    # messages that blame the flag the user gave, in YAML's words
    ("plan default node size", ["plan", "--policy", "fsep", "--ranks", "12", "--experts", "24"],
     "--ranks-per-node is 8 by default, which must divide the 12 ranks or be >= 12 (one node): pass "
     "--ranks-per-node 1, 2, 3, 4, 6 or 12"),
    ("simulate run slots flag", ["simulate", "run", MINI, "--slots", "0", "--policies", "eplb"],
     "--slots 0: policy eplb cannot run with it"),
    ("boolean slots in YAML's words", ["config", "show", "{tmp}/slots_true.yaml"], "slots: expected integer, got true"),
    ("null slots in YAML's words", ["config", "show", "{tmp}/slots_null.yaml"], "got an empty value"),
    ("negative count as the file holds it", PLAN + ["--counts", "{tmp}/neg.npy"], "counts[0, 1] = -1 is negative"),
    ("config show get empty", ["config", "show", MINI, "--get", ""], "--get: an empty key"),
    ("config show get typo", ["config", "show", MINI, "--get", "model.num_layer"], "did you mean 'model.num_layers'"),
    ("a preset named as such", ["config", "show", "dgx-h100", "nodes=abc"], "error: dgx-h100: nodes: expected integer"),
    # one loader, one set of words
    ("demo config key typo", ["demo", "--config", "{tmp}/slotz.yaml"], "slotz.yaml: slotz: unknown key; did you mean "
                                                                        "'slots'?"),
    ("a2a topology a run config", ["simulate", "a2a", "--nodes", "1", "--topology", MINI],
     "this is a run config; a topology is needed here"),
    ("counts header promising terabytes", PLAN + ["--counts", "{tmp}/hugehdr.npy"], "cut off or corrupt"),
    ("counts JSON key twice", PLAN + ["--counts", "{tmp}/dup.json"], "dup.json: key 'counts' given twice"),
    ("a path with a newline", ["simulate", "run", "{tmp}/a\nb.yaml"], "a\\nb.yaml: file not found"),
    ("balancer node size reported once", ["config", "show", MINI, "balancer.ranks_per_node=3"],
     "balancer.ranks_per_node: 3, but this layout puts 2"),
    ("unknown key points to config docs", ["config", "show", MINI, "model.zzzzzz=1"],
     "`megatron-rails config docs` lists the 27 valid keys"),
    # the leftovers argparse cannot place: only what is really unknown is named
    ("a2a json and wide", ["simulate", "a2a", "--nodes", "1", "--json", "--wide"], "--json prints no table"),
    ("run json and wide", ["simulate", "run", MINI, "--json", "--wide"], "--json prints no table"),
    ("override then a stray word", ["simulate", "run", MINI, "--steps", "1", "model.num_layers=3", "--wide", "foo"],
     "unrecognized arguments: foo (see"),
    ("out under a regular file", ["config", "docs", "--out", "{tmp}/c.npy/x.md"], "c.npy' is not a directory"),
    ("an empty key", ["config", "show", "{tmp}/emptykey.yaml"], "emptykey.yaml: '': unknown key"),
    ("counts JSON with booleans", PLAN + ["--counts", "{tmp}/bools.json"], "bools.json: counts must be integers"),
    ("counts JSON nested 500 deep", PLAN + ["--counts", "{tmp}/deep500.json"], "deep500.json: counts must be a rect"),
    ("skew FILE: in capitals with topk", PLAN + ["--skew", "FILE:{tmp}/c.npy", "--ranks", "4", "--experts", "8",
                                                  "--topk", "2"], "so --topk would change nothing"),
    ("counts name too long, flag abbreviated", PLAN + ["--coun", LONG + ".json"], "--counts {tmp}/ccc"),
]

def _npy_header(shape) -> bytes:
    """A .npy file's magic and header claiming int64 `shape` (the data is whatever follows)."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<i8", "fortran_order": False, "shape": shape})
    return buf.getvalue()


FILES = {  # name: YAML text, or a counts array
    "empty.yaml": "",
    "typo.yaml": "polcy: fsep\nslots: 1\n",
    "slots.yaml": "policy: ultraep\nslots: 99999999999999999999\n",
    "badtopo.yaml": "gpus_per_node: 0\nrails_per_node: 3\nnic_gbps: .nan\nlatency_us: -2\n",
    "c.npy": np.array([[0, 0, 100, 0, 0, 20, 0, 0]] * 4),
    "neg.npy": np.array([[1, -1]]),
    "big.npy": np.full((2, 2), 2**62 - 1),
    "latin1.yaml": "policy: fsep\n# Gr\u00fc\u00dfe\n".encode("latin-1"),
    "deep.yaml": "[" * 100_000,
    "dup.yaml": "policy: fsep\nslots: 1\npolicy: eplb\n",  # PyYAML alone would run eplb
    "zero.npy": b"",
    "zero.npz": b"",
    "cut.npz": b"PK\x03\x04" + bytes(20),
    "deep.json": "[" * 100_000 + "]" * 100_000,
    "wide.npy": np.ones((5000, 2)),
    "text.npy": "hello\n",
    "text.npz": "hello\n",
    "z48.npy": np.zeros((4, 8)),
    "c38.npy": np.ones((3, 8)),
    "slots_only.yaml": "slots: 2\n",
    "intkey.yaml": "policy: fsep\n1: 2\n",
    "boolkey.yaml": "policy: fsep\ntrue: 2\n",
    "nullkey.yaml": "policy: fsep\nnull: 2\n",
    "floatkey.yaml": "policy: fsep\n1.5: 2\n",
    "datekey.yaml": "policy: fsep\n2024-01-01: 2\n",
    "topo_intkey.yaml": "gpus_per_node: 8\n3: 2\n",
    "run_intkey.yaml": Path(MINI).read_text().replace("\nmodel:\n", "\nmodel:\n  7: x\n"),
    "run_bal_intkey.yaml": Path(MINI).read_text().replace("\nbalancer:\n", "\nbalancer:\n  9: 1\n"),
    # a "billion laughs": 10^9 strings once expanded, 9 lines as written
    "laughs.yaml": "policy: fsep\nslots:\n  - &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)),
    "recursive.yaml": "policy: fsep\nslots: &a [*a]\n",
    "slots_true.yaml": "policy: fsep\nslots: true\n",
    "slots_null.yaml": "policy: fsep\nslots:\n",
    "slotz.yaml": "policy: fsep\nslotz: 2\n",
    "long_value.yaml": "policy: fsep\nslots: " + "x" * 5000 + "\n",
    "hugehdr.npy": _npy_header((10**8, 10**5)) + bytes(64),
    "dup.json": '{"counts": [[1, 2]], "counts": [[3, 4]]}',
    "bools.json": "[[true, false], [1, 2]]",
    "deep500.json": "[" * 500 + "1" + "]" * 500,  # deeper than a recursive walk of Python's goes
    "emptykey.yaml": 'policy: fsep\n"": 1\n',
    "f16.npy": np.array([[60000, 5], [1, 2]], dtype=np.float16),
}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli_errors")
    for name, content in FILES.items():
        if isinstance(content, str):
            (d / name).write_text(content)
        elif isinstance(content, bytes):
            (d / name).write_bytes(content)
        else:
            np.save(d / name, content if content.dtype == np.float16 else content.astype(np.int64))
    os.mkfifo(d / "pipe")  # nothing ever reads or writes it: opening it for either would block
    return d


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv,word", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2(argv, word, tmp, capsys):
    rc, out, err = run_cli([a.replace("{tmp}", str(tmp)) for a in argv], capsys)
    word = word.replace("{tmp}", str(tmp))
    lines = err.strip().splitlines()
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in out + err
    assert len(lines) == 1 and lines[0].startswith("megatron-rails"), err
    assert ": error: " in lines[0] and word in lines[0], err


def test_checking_an_output_path_leaves_a_link_alone(tmp, capsys):
    """--out a link to a file not there yet: the path check neither makes the target nor removes the
    link, even when another argument then fails."""
    link = tmp / "link.json"
    link.symlink_to(tmp / "target.json")
    rc, _, err = run_cli(["soak", "--out", str(link), "--ranks", "3"], capsys)
    assert rc == 2 and "--ranks" in err
    assert link.is_symlink() and not (tmp / "target.json").exists()


def test_overrides_after_an_option_are_overrides(tmp, capsys):
    rc, out, err = run_cli(["simulate", "run", MINI, "--steps", "1", "--quiet", "--json", "model.num_layers=3"], capsys)
    assert rc == 0, err
    import json

    assert json.loads(out)["setup"]["layers"] == 3


def test_topology_reports_every_error(tmp, capsys):
    rc, _, err = run_cli(["simulate", "a2a", "--nodes", "1", "--topology", str(tmp / "badtopo.yaml")], capsys)
    assert rc == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert [ln.split(": ")[3] for ln in lines] == ["gpus_per_node", "nic_gbps", "latency_us"], err
    assert all(ln.startswith("megatron-rails simulate a2a: error: ") for ln in lines)


def test_plot_to_stdout_redirected_to_a_file_is_refused(tmp):
    """/dev/stdout is a regular file when the stream goes to one: the figure must not land beside it
    in /dev (as /dev/stdout.png)."""
    import subprocess

    with open(tmp / "redirected.txt", "w") as f:
        p = subprocess.run([sys.executable, "-m", "megatron_rails.cli", "simulate", "run", MINI, "--steps", "1",
                            "--quiet", "--plot", "/dev/stdout"], stdout=f, stderr=subprocess.PIPE, text=True,
                           timeout=120)
    assert p.returncode == 2 and "'/dev/stdout': not a regular file" in p.stderr, p.stderr


def test_config_validate_goes_on_after_a_name_no_file_can_have(tmp, capsys):
    rc, out, err = run_cli(["config", "validate", LONG.replace("{tmp}", str(tmp)) + ".yaml", "eplb"], capsys)
    assert rc == 1 and "Traceback" not in out + err, err
    assert "File name too long" in err and "1 of 2 file(s) invalid" in err, err
    assert "OK eplb" in out, out


def test_config_validate_names_each_problem(tmp, capsys):
    """validate reports (exit 1: some file is invalid), one line per problem, the same words as the
    other commands: an empty file, a directory, a misspelled kind key, every topology error."""
    files = [tmp / "empty.yaml", tmp, tmp / "typo.yaml", tmp / "badtopo.yaml"]
    rc, _, err = run_cli(["config", "validate", *map(str, files)], capsys)
    assert rc == 1 and "Traceback" not in err
    errors = [ln for ln in err.splitlines() if ln.startswith("megatron-rails config validate: error: ")]
    assert "the file is empty" in errors[0] and "is a directory" in errors[1]
    assert "unknown key 'polcy'; did you mean 'policy'?" in errors[2]
    assert len(errors) == 6 and "4 of 4 file(s) invalid" in err


def test_empty_policy_is_the_same_error_everywhere(tmp):
    """install(path) and demo --config read a policy through as_policy: an empty file is an error there
    too, not the fsep default."""
    with pytest.raises(ConfigError, match="empty"):
        as_policy(str(tmp / "empty.yaml"))


def test_plan_reads_a_trace_npz(tmp, capsys):
    from megatron_rails.core.trace import save_trace

    c = np.load(tmp / "c.npy")
    save_trace(tmp / "t.npz", np.stack([np.stack([c, c])] * 3), {"topk": 2})
    rc, out, err = run_cli(["plan", "--policy", "none", "--counts", str(tmp / "t.npz"), "--ranks", "4", "--json",
                            "--repeats", "1", "--budget", "0"], capsys)
    assert rc == 0, err
    assert '"tokens": 480' in out and '"ranks": 4' in out


def test_help_shows_defaults_and_version(capsys):
    from megatron_rails import __version__

    rc, out, _ = run_cli(["--version"], capsys)
    assert rc == 0 and out.strip() == f"megatron-rails {__version__}"
    rc, out, _ = run_cli(["plan", "--help"], capsys)
    text = " ".join(out.split())
    assert rc == 0 and "plan one counts matrix" in text
    for shown in ("default: 8;", "(default: zipf:1.2)", "(default: 50; 1 to 2000)", "bursty:S[:F[:R]]"):
        assert shown in text, shown
    rc, out, _ = run_cli(["simulate", "a2a", "--help"], capsys)
    assert all(name in out for name in ("cpu-2x2", "dgx-a100", "dgx-h100", "nvl72"))


def test_bench_choices_match_the_benchmark():
    """The CLI lists bench local's shapes and dtypes without importing torch; they must stay its own."""
    from megatron_rails.bench.local import DTYPES, SHAPES
    from megatron_rails.cli.main import BENCH_DTYPES, BENCH_SHAPES

    assert set(BENCH_SHAPES) == set(SHAPES) and set(BENCH_DTYPES) == set(DTYPES)


def test_bench_step_ranks_divide_its_experts():
    """--ranks is checked against the step bench's experts without importing torch: the count must be its own."""
    from megatron_rails.bench.step import QUICK_SHAPE, SHAPE
    from megatron_rails.cli.main import STEP_EXPERTS

    assert SHAPE["experts"] == QUICK_SHAPE["experts"] == STEP_EXPERTS


# -- issue #16: --help of every command --------------------------------------------------------------------------

def _every_action():
    """(command words, parser, action) of every argument of every command and sub-command."""
    import argparse

    from megatron_rails.cli import build_parser

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, path + (name,))
            elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                yield path, parser, action

    return list(walk(build_parser(), ()))


def test_every_option_has_help_saying_its_default():
    """Every argument has a help text; every option that takes a value and may be left out says what
    happens then ("default: ..."), whether argparse fills it in or the text does."""
    import argparse

    missing = []
    for path, parser, action in _every_action():
        text = parser._get_formatter()._get_help_string(action) if action.help else ""
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if not text or (action.option_strings and not action.required and not flag and "default" not in text):
            missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing


@pytest.mark.parametrize("argv,kinds", [
    (["simulate", "run"], ("policies", "topologies")),   # balancer=NAME, topology=NAME overrides
    (["config", "show"], ("policies", "topologies")),    # FILE and the overrides
    (["config", "validate"], ("policies", "topologies")),
    (["demo"], ("policies",)),                           # --config
    (["simulate", "a2a"], ("topologies",)),              # --topology
])
def test_help_lists_every_preset_where_one_is_accepted(argv, kinds, capsys):
    from megatron_rails.core import presets

    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    names = {"policies": presets.names(presets.POLICY_DIR), "topologies": presets.names(presets.TOPOLOGY_DIR)}
    for kind in kinds:
        assert ", ".join(names[kind]) in text, (argv, kind)


def test_config_show_and_validate_take_preset_names(capsys):
    rc, out, err = run_cli(["config", "show", "dgx-h100", "--get", "rails_per_node"], capsys)
    assert rc == 0 and out.strip() == "8", err
    rc, out, err = run_cli(["config", "show", "ultraep", "slots=3", "--get", "slots"], capsys)
    assert rc == 0 and out.strip() == "3", err
    # a bad --get among good ones: nothing printed, the error alone (a script reading $(...) gets no half answer)
    rc, out, err = run_cli(["config", "show", MINI, "--get", "parallelism.world_size", "--get", "balancer.nope"], capsys)
    assert rc == 2 and out == "" and "--get balancer.nope" in err
    rc, out, _ = run_cli(["config", "validate", "default", "nvl72"], capsys)
    assert rc == 0 and "OK default (policy: ultraep" in out and "OK nvl72 (topology" in out
    rc, _, err = run_cli(["config", "show", "dgx-z9"], capsys)
    assert rc == 2 and "no preset has that name" in err and "dgx-a100" in err and "ultraep" in err


def test_one_skew_syntax_in_help_and_errors(capsys):
    """Skews are KIND:PARAMS everywhere (zipf:1.2): the help texts and defaults of every command and the
    errors of the three commands that read one never spell them another way (zipf 1.2, zipf=1.2...)."""
    import re

    texts = []
    for path, parser, action in _every_action():
        texts.append(parser._get_formatter()._get_help_string(action) or "")
        texts.append(str(action.default))
    for argv in (PLAN + ["--skew", "zipf"], ["simulate", "run", MINI, "--skew", "zipf", "--quiet"],
                 ["simulate", "a2a", "--nodes", "2", "--traffic", "zipf"]):
        rc, _, err = run_cli(argv, capsys)
        assert rc == 2 and "zipf:" in err, err
        texts.append(err)
    text = " ".join(texts)
    assert "zipf:S" in text and "zipf:1.2" in text
    other = re.findall(r"zipf(?!:)[\s=(_-]*(?:\d|[sS]\b)", text)  # zipf 1.2, zipf=1.2, zipf(s), zipf-S ...
    assert not other, other


def test_unknown_presets_and_skews_name_what_is_accepted(capsys):
    """A bad preset in a run-config override lists the presets; a bad skew inside a2a's plan:POLICY:SKEW
    traffic lists the skew forms (core/workloads.py SKEW_FORMS, less file:PATH, which a2a refuses)."""
    from megatron_rails.core import presets
    from megatron_rails.core.workloads import SKEW_FORMS

    for key, pdir in (("topology", presets.TOPOLOGY_DIR), ("balancer", presets.POLICY_DIR)):
        rc, _, err = run_cli(["simulate", "run", MINI, f"{key}=nosuch", "--quiet"], capsys)
        assert rc == 2 and "'nosuch' not found" in err and ", ".join(presets.names(pdir)) in err, err
    forms = SKEW_FORMS.replace(" | file:PATH", "")
    assert forms != SKEW_FORMS and forms.startswith("uniform | zipf:S")
    for bad in ("plan:ultraep:zipf", "plan:ultraep:file:x.npy"):
        rc, _, err = run_cli(["simulate", "a2a", "--nodes", "2", "--traffic", bad], capsys)
        assert rc == 2 and f"(SKEW: {forms})" in err and err.count("\n") == 1, err


def test_plot_without_suffix_is_png_and_named_so(tmp, capsys):
    """--plot NAME writes NAME.png and says so (matplotlib adds the suffix itself)."""
    rc, out, err = run_cli(["simulate", "run", MINI, "--plot", str(tmp / "fig")], capsys)
    assert rc == 0, err
    assert (tmp / "fig.png").is_file() and f"wrote {tmp / 'fig.png'}" in out + err


def test_full_disk_and_closed_pipe_are_one_line(tmp):
    """A write the machine refuses (/dev/full) is one error line, exit 1; a reader that leaves
    (`| head -1`) ends the command quietly, exit 1: no traceback either way."""
    import subprocess
    import sys

    cli = [sys.executable, "-m", "megatron_rails.cli"]
    p = subprocess.run(cli + ["config", "docs", "--out", "/dev/full"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == ["megatron-rails config docs: error: --out /dev/full: No space left on device"]
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first write: every write fails (EPIPE)
    try:
        p = subprocess.run(cli + ["config", "show", MINI], stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert p.returncode == 1 and p.stderr == "", p.stderr
    # argparse's own output (help, version) too, buffered or not: argparse drops a failed write
    for argv in (["--help"], ["--version"], ["simulate", "run", "--help"]):
        for unbuffered in ("", "1"):
            env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
            env |= {"PYTHONUNBUFFERED": unbuffered} if unbuffered else {}
            with open("/dev/full", "w") as full:
                p = subprocess.run(cli + argv, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, env=env)
            assert p.returncode == 1 and p.stderr.strip().endswith("error: No space left on device"), (argv, p.stderr)
            assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr


# -- the CLI audit of 2026-11-27: focused cases ------------------------------------------------------------------

def test_config_validate_reports_every_file_whatever_its_keys(tmp, capsys):
    """Keys that are not names and an alias bomb are errors of their own files; validate still reads
    every file given and says which are fine."""
    files = [tmp / "intkey.yaml", tmp / "laughs.yaml", tmp / "run_bal_intkey.yaml", POLICY]
    rc, out, err = run_cli(["config", "validate", *map(str, files)], capsys)
    assert rc == 1 and "Traceback" not in err
    errors = [ln for ln in err.splitlines() if ln.startswith("megatron-rails config validate: error: ")]
    assert [e.split(": ")[2] for e in errors] == [str(f) for f in files[:3]]
    assert "key 1 (an integer" in errors[0] and "10000 values" in errors[1] and "balancer: key 9" in errors[2]
    assert out.startswith(f"OK {POLICY}") and "3 of 4 file(s) invalid" in err


def test_an_error_shows_a_bounded_value(tmp, capsys):
    """A 5000-character value is cut in the message (the line stays readable), not printed whole."""
    rc, _, err = run_cli(["config", "show", str(tmp / "long_value.yaml")], capsys)
    assert rc == 2 and "slots: expected integer, got 'xxx" in err and "...'" not in err
    assert len(err.strip().splitlines()[0]) < len(str(tmp)) + 150, err


def test_a_plot_that_fails_loses_no_results(tmp, capsys, monkeypatch):
    """The JSON is printed before the figure is drawn; a backend that fails (a format needing LaTeX)
    is one line naming the file, exit 1, and no file is left where the figure was to be."""
    import json

    import matplotlib.figure

    def fail(self, *a, **kw):
        raise RuntimeError("latex was not found\nsecond line")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", fail)
    png = tmp / "fails.png"
    rc, out, err = run_cli(["simulate", "run", MINI, "--steps", "1", "--quiet", "--json", "--plot", str(png)], capsys)
    assert rc == 1 and json.loads(out)["rows"]
    assert err.strip().splitlines() == [f"megatron-rails simulate run: error: --plot {png}: the figure could not be "
                                        "written (latex was not found second line)"]
    assert not png.exists() and not [p for p in tmp.iterdir() if ".tmp" in p.name]


def test_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch):
    import importlib

    cli_main = importlib.import_module("megatron_rails.cli.main")  # the package's `main` is the function

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_main, "cmd_plan", interrupted)
    rc, out, err = run_cli(PLAN, capsys)
    assert (rc, out, err) == (130, "", "megatron-rails plan: interrupted\n")


def test_bench_planners_to_stdout_is_one_json_document(tmp, capfd, monkeypatch):
    """--out /dev/stdout: the results are the one JSON document on stdout (the targets summary goes to
    stderr), written once, with no figure beside it and no progress file; a file --out gets the same
    result and its progress file is gone afterwards."""
    import json

    import megatron_rails.bench.planners as bp
    import megatron_rails.core.planners.lp as lp

    monkeypatch.setattr(bp, "QUICK_GRID", dict(ranks=[8], experts=[8], slots=[1], skews=["uniform", "zipf:1.2"]))
    monkeypatch.setattr(lp, "time_vs_oracle", lambda n, seed=0: {"instances": n})
    assert main(["bench", "planners", "--quick", "--out", "/dev/stdout"]) == 0
    out, err = capfd.readouterr()
    result = json.loads(out)  # one document, nothing after it
    assert len(result["rows"]) == 2 * 5 and "targets" in result and '"ultraep_balance"' in err
    assert "bench planners: no figure (--out /dev/stdout is no file to put one beside" in err
    out_file = tmp / "planners.json"
    assert main(["bench", "planners", "--quick", "--out", str(out_file), "--plot", str(tmp / "planners.svg")]) == 0
    capfd.readouterr()
    assert json.loads(out_file.read_text())["rows"] and (tmp / "planners.svg").is_file()
    assert not (tmp / "planners.json.partial").exists()


def test_soak_to_stdout_with_json_is_one_json_document(capfd):
    """soak --out /dev/stdout --json: the result once on stdout (it printed it twice before)."""
    import json

    assert main(["soak", "--planner-calls", "3", "--steps", "0", "--out", "/dev/stdout", "--json"]) == 0
    out, _ = capfd.readouterr()
    result = json.loads(out)  # raises on a second document after the first
    assert result["ok"] is True and result["planner"]["calls"] == 3


def test_benchmark_progress_file_holds_what_is_measured_so_far(tmp):
    from megatron_rails.bench.planners import Results

    result = {"rows": [1]}
    saved = Results(str(tmp / "r.json"), result)
    saved.checkpoint()
    assert (tmp / "r.json.partial").read_text().count("1") == 1 and not (tmp / "r.json").exists()
    result["rows"].append(2)
    saved.write()
    assert not (tmp / "r.json.partial").exists() and '"rows": [\n  1,\n  2\n ]' in (tmp / "r.json").read_text()
    assert Results("/dev/stdout", result).partial is None


def test_float16_counts_read_exactly_without_warnings(tmp, capsys):
    import json
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rc, out, err = run_cli(["plan", "--policy", "none", "--counts", str(tmp / "f16.npy"), "--json", "--repeats",
                                "1", "--budget", "0"], capsys)
    assert rc == 0 and err == "", err
    assert json.loads(out)["tokens"] == 60000 + 5 + 1 + 2


def test_a_trace_npz_is_a_file_skew_too(tmp, capsys):
    """--skew file:X takes the trace .npz that --counts and --trace take, and the help says so."""
    from megatron_rails.core.trace import save_trace

    c = np.load(tmp / "c.npy")
    save_trace(tmp / "skew.npz", np.stack([np.stack([c])] * 2), {"topk": 2})
    rc, out, err = run_cli(["plan", "--policy", "fsep", "--skew", f"file:{tmp / 'skew.npz'}", "--ranks", "4",
                            "--experts", "8", "--json", "--repeats", "1", "--budget", "0"], capsys)
    assert rc == 0 and '"tokens": 480' in out, err
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "file:PATH (PATH: .npy or .json counts, or a `megatron-rails trace` .npz)" in " ".join(
        capsys.readouterr().out.split())


def test_policy_options_are_taken_by_the_policies_that_read_them(capsys):
    for argv in (["--policy", "lp", "--placement", "eplb", "--window", "3", "--interval", "2"],
                 ["--policy", "eplb", "--window", "3", "--tolerance", "0.1"], ["--policy", "fsep", "--tolerance", "0"]):
        rc, _, err = run_cli(["plan", *argv, "--json", "--repeats", "1", "--budget", "0"], capsys)
        assert rc == 0, (argv, err)


def test_help_states_ranges_and_what_each_benchmark_measures(capsys):
    """Every option whose type checks a range says it in --help, once; bench --help says what each
    benchmark measures."""
    from megatron_rails.cli.main import BENCH_MEASURES

    for path, parser, action in _every_action():
        rng = getattr(action.type, "range_text", None)
        if rng:
            text = parser._get_formatter()._get_help_string(action)
            assert text.count(rng) == 1 and text.endswith(")"), (path, action.dest, text)
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "eplb: moving-average window (steps) (default: 10; 1 to 1048576)" in text
    assert "ranks sharing a node (G): a divisor of D, or >= D for one node (default: 8; 1 to 4096)" in text
    with pytest.raises(SystemExit):
        main(["soak", "--help"])
    assert "(default: 4; divides 8: 1, 2, 4, 8)" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, phrase in BENCH_MEASURES.items():
        assert f"{name}: {phrase}" in text, name


def test_megatron_args_paste_as_one_command(capsys, monkeypatch):
    """--megatron-args: on a terminal, shell lines of at most 80 columns continued with ` \\`, which a
    shell joins back into exactly the flags of the run config; into a pipe, one line of them."""
    import shlex

    from megatron_rails.config.run import load_run_config

    cfg = str(ROOT / "configs" / "mixtral" / "mixtral-8x7b.yaml")
    want = load_run_config(cfg).megatron_args()
    rc, out, _ = run_cli(["config", "show", cfg, "--megatron-args"], capsys)
    assert rc == 0 and out.count("\n") == 1 and shlex.split(out) == want
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    rc, out, _ = run_cli(["config", "show", cfg, "--megatron-args"], capsys)
    lines = out.rstrip("\n").split("\n")
    assert rc == 0 and len(lines) > 5 and max(map(len, lines)) <= 80
    assert all(ln.endswith(" \\") for ln in lines[:-1]) and not lines[-1].endswith("\\")
    assert shlex.split(out.replace(" \\\n", " ")) == want


@pytest.mark.parametrize("argv,named,suffix", [
    (["config", "show", MINI, "topology={f}"], "topology={f}", ".yaml"),
    (["simulate", "run", "{f}"], "{f}", ".yaml"),
    (["plan", "--policy", "ultraep", "--counts", "{f}"], "--counts {f}", ".json"),
    (["simulate", "run", MINI, "--steps", "1", "--skew", "file:{f}"], "--skew {f}", ".json"),
], ids=["override", "positional", "counts", "skew-file"])
def test_an_unreadable_file_is_named_with_its_flag(argv, named, suffix, tmp, capsys, monkeypatch):
    """A file the user may not read (EACCES: what a mode-000 file gives a user other than root, who
    runs CI, so the open is made to fail as it would): its flag and name and the reason, in words."""
    import builtins
    import errno
    import io

    f = tmp / f"unreadable{suffix}"
    f.write_text("not read\n")
    real_open = io.open

    def refusing_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file) == str(f):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", refusing_open)
    monkeypatch.setattr(builtins, "open", refusing_open)
    rc, out, err = run_cli([a.replace("{f}", str(f)) for a in argv], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Errno" not in err, err
    assert lines[0].endswith(f"error: {named.replace('{f}', str(f))}: Permission denied"), err


@pytest.mark.parametrize("what", ["planners", "rails"])
def test_bench_checks_its_default_figure_and_running_copy_before_the_work(what, tmp_path, capsys):
    """The figure beside --out (OUT.png) and the copy of the results so far (OUT.partial) are checked
    up front, as a given --plot is: a directory there fails in one line before any case runs."""
    out = tmp_path / "r.json"
    (tmp_path / "r.png").mkdir()
    rc, _, err = run_cli(["bench", what, "--quick", "--out", str(out)], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "r.png' is a directory" in err, err
    (tmp_path / "r.png").rmdir()
    (tmp_path / "r.json.partial").mkdir()
    rc, _, err = run_cli(["bench", what, "--quick", "--out", str(out)], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "r.json.partial' is a directory" in err, err
    assert not out.exists() and not (tmp_path / "r.png").exists()


def test_dash_is_standard_output_for_results_and_refused_for_a_figure(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(["config", "docs", "--out", "-"], capfd)  # written to /dev/stdout: fd 1
    assert rc == 0 and out.startswith("# Configuration reference") and not (tmp_path / "-").exists(), err
    rc, _, err = run_cli(["bench", "rails", "--quick", "--out", "r.json", "--plot", "-"], capfd)
    assert rc == 2 and "--plot -: that is standard output" in err, err


def test_bad_input_wraps_on_a_terminal(tmp, capsys, monkeypatch):
    """On a terminal (its width given here: capsys is none; the next test runs a real one) every
    error of the table wraps at that width: continuation lines indented two columns, only a single
    word longer than the width (a path) over it, and the words those of the one-line form, in order."""
    from megatron_rails.cli import args as cli_args

    width = 64
    for _, argv, _ in CASES:
        argv = [a.replace("{tmp}", str(tmp)) for a in argv]
        monkeypatch.setattr(cli_args, "_terminal_width", lambda: None)
        _, _, one = run_cli(argv, capsys)
        monkeypatch.setattr(cli_args, "_terminal_width", lambda: width)
        _, _, wrapped = run_cli(argv, capsys)
        lines = wrapped.splitlines()
        assert lines[0].startswith("megatron-rails") and ": error:" in lines[0], wrapped
        for ln in lines[1:]:
            assert ln.startswith("  ") and not ln.startswith("   "), wrapped
        assert all(len(ln) <= width or len(ln.split()) == 1 for ln in lines), wrapped
        assert wrapped.split() == one.split(), (one, wrapped)
        assert len(one.strip().splitlines()) == 1 and (len(lines) > 1) == (len(one.strip()) > width)


def test_error_wraps_on_a_terminal_and_not_in_a_pipe(tmp):
    """On a terminal of 60 columns (a pseudo-terminal as stderr) a long error wraps at 60; written to a
    pipe the same error is one line, also with COLUMNS exported (as readline does in a Python
    process that starts the command)."""
    import fcntl
    import pty
    import struct
    import subprocess
    import termios

    argv = [sys.executable, "-m", "megatron_rails.cli", *PLAN, "--counts", str(tmp / "c.npy"), "--seed", "3",
            "--tokens-per-rank", "64"]
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    piped = subprocess.run(argv, capture_output=True, text=True, env=dict(env, COLUMNS="60"), cwd=ROOT, timeout=120)
    assert piped.returncode == 2 and len(piped.stderr.splitlines()) == 1 and len(piped.stderr) > 100, piped.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 60, 0, 0))
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=follower, env=env, cwd=ROOT, timeout=120)
    os.close(follower)
    got = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the terminal's other side closed
            break
        if not chunk:
            break
        got += chunk
    os.close(leader)
    lines = got.decode().replace("\r\n", "\n").splitlines()
    assert p.returncode == 2 and len(lines) > 2 and max(map(len, lines)) <= 60, lines
    assert " ".join(lines).split() == piped.stderr.split()
