"""Run-config values that Megatron-LM (core_v0.16.1: megatron/training/arguments.py validate_args and its
argparse choices) refuses at start-up are refused by our validation instead: one line naming the key, exit 2
from `config show`, and the boundary value is accepted."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from megatron_rails.cli import main
from megatron_rails.config.run import TOKENIZER_TYPES, RunConfig, load_any, load_run_config

ROOT = Path(__file__).resolve().parents[1]
MINI = str(ROOT / "configs" / "mini" / "mini-mixtral.yaml")  # seq_length 32, lr 3e-3, rope, world 4
# policies/ and topology/ are links into the package, which "**" does not follow
ALL = sorted({*(ROOT / "configs").glob("**/*.yaml"), *(ROOT / "configs").glob("*/*.yaml")})


@pytest.fixture(autouse=True)
def _keep_affinity():
    cores = os.sched_getaffinity(0)
    yield
    os.sched_setaffinity(0, cores)


def run_cli(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


# (id, overrides, the key the error names, a word of the rule)
REFUSED = [
    ("min_lr above lr", ["training.min_lr=5"], "training.min_lr", "min_lr <= lr"),
    ("min_lr above a lowered lr", ["training.min_lr=1e-4", "training.lr=1e-5"], "training.min_lr", "min_lr <= lr"),
    ("max_position_embeddings under seq_length (rope)", ["model.max_position_embeddings=16"],
     "model.max_position_embeddings", "seq_length"),
    ("max_position_embeddings under seq_length (learned)", ["model.max_position_embeddings=31",
     "model.position_embedding_type=learned_absolute"], "model.max_position_embeddings", "seq_length"),
    ("seq_length over max_position_embeddings", ["model.max_position_embeddings=32", "model.seq_length=40"],
     "model.max_position_embeddings", "seq_length"),
    ("save without save_interval", ["training.save=/tmp/ck"], "training.save", "save_interval"),
    ("tokenizer_type unknown", ["data.tokenizer_type=Foo"], "data.tokenizer_type", "NullTokenizer"),
    ("tokenizer_type case", ["data.tokenizer_type=nulltokenizer"], "data.tokenizer_type", "NullTokenizer"),
    ("seq_length vs context parallel", ["model.seq_length=36", "parallelism.context_parallel_size=4"],
     "model.seq_length", "2 x context_parallel_size"),
    *[(f"split {s!r}", [f"data.split='{s}'"], "data.split", "969,30,1")
      for s in ("abc", "0,0,0", "0", "1,2,3,4", "1e-3", "1,-2,3", "1,,2", "969;30;1", "1.2.3", ".", "abc1")],
    *[(f"split {s!r}", [f"data.split='{s}'"], "data.split", "no value for --split") for s in ("-1,2,3", "")],
    # YAML numbers, taken as their text: a negative or an infinite one is no split either
    *[(f"split number {s}", [f"data.split={s}"], "data.split", w) for s, w in (("-3", "no value for --split"),
                                                                              (".inf", "969,30,1"), ("0", "969,30,1"))],
    ("split true", ["data.split=true"], "data.split", "expected string or null"),
]

ACCEPTED = [
    ("min_lr equal to lr", ["training.min_lr=3e-3"]),
    ("max_position_embeddings equal to seq_length", ["model.max_position_embeddings=32"]),
    ("max_position_embeddings equal, learned", ["model.max_position_embeddings=32",
                                                "model.position_embedding_type=learned_absolute"]),
    ("save with save_interval", ["training.save=/tmp/ck", "training.save_interval=1"]),
    *[(f"tokenizer_type {t}", [f"data.tokenizer_type={t}"]) for t in ("NullTokenizer", "SFTTokenizer",
                                                                       "HuggingFaceTokenizer", "Llama2Tokenizer")],
    ("seq_length a multiple of 2 x cp", ["model.seq_length=40", "parallelism.context_parallel_size=4"]),
    *[(f"split number {s}", [f"data.split={s}"]) for s in ("100", "99.5")],  # YAML numbers, as Megatron's text
    *[(f"split {s!r}", [f"data.split='{s}'"]) for s in ("969,30,1", "969, 30, 1", "99/1", "1", "1.5,0.5,0",
                                                         "0,0,1", " 90,5,5 ")],
]


@pytest.mark.parametrize("overrides,key,word", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_one_line_exit_2(overrides, key, word, capsys):
    rc, out, err = run_cli(["config", "show", MINI, *overrides], capsys)
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"{MINI}: {key}: " in lines[0] and word in lines[0], err
    assert "from override '" in lines[0], err  # names the override that made the value


@pytest.mark.parametrize("overrides", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_boundary_accepted(overrides, capsys):
    rc, out, err = run_cli(["config", "show", MINI, *overrides, "--megatron-args"], capsys)
    assert rc == 0, err


@pytest.mark.parametrize("value,text", [("100", "100"), ("99.5", "99.5"), ("1.0e-5", "0.00001"),
                                        ("2.5e+3", "2500")])
def test_split_number_reaches_megatron_as_its_text(value, text, capsys):
    """`split: 100` (a YAML number) is Megatron-LM's `--split 100`: everything to training; a float
    written out (Megatron-LM reads `1e-05` as the numbers 1 and 05)."""
    rc, out, err = run_cli(["config", "show", MINI, f"data.split={value}", "--megatron-args"], capsys)
    assert rc == 0 and f"--split {text} " in " ".join(out.split()) + " ", (out, err)


def test_config_validate_names_the_key(tmp_path, capsys):
    """A file holding each refused value: `config validate` reports it naming the key (exit 1: invalid files)."""
    data = yaml.safe_load(Path(MINI).read_text())
    data["training"].update(min_lr=1.0, save="/tmp/ck")
    data["model"]["max_position_embeddings"] = 16
    data["data"].update(split="abc")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    rc, out, err = run_cli(["config", "validate", str(bad)], capsys)
    assert rc == 1 and "Traceback" not in err
    named = [ln.split(": ")[3] for ln in err.splitlines() if ln.startswith("megatron-rails config validate: error: ")]
    assert named == ["model.max_position_embeddings", "training.min_lr", "training.save", "data.split"], err
    data = yaml.safe_load(Path(MINI).read_text())
    data["data"]["tokenizer_type"] = "Foo"
    bad.write_text(yaml.safe_dump(data))
    rc, out, err = run_cli(["config", "validate", str(bad)], capsys)
    assert rc == 1 and "data.tokenizer_type: must be one of" in err and len(err.strip().splitlines()) == 2, err


def test_tokenizer_choices_are_megatrons():
    assert TOKENIZER_TYPES == (  # megatron/training/arguments.py, core_v0.16.1, --tokenizer-type choices
        "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
        "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "Llama2Tokenizer", "TikTokenizer",
        "MultimodalTokenizer", "NullTokenizer", "NullMultimodalTokenizer", "SFTTokenizer")


def test_max_position_embeddings_always_emitted():
    """Megatron-LM requires --max-position-embeddings (validate_args' required_args): null emits seq_length."""
    args = load_run_config(MINI).megatron_args()
    assert args[args.index("--max-position-embeddings") + 1] == "32"
    args = load_run_config(MINI, ["model.max_position_embeddings=64"]).megatron_args()
    assert args[args.index("--max-position-embeddings") + 1] == "64"


@pytest.mark.parametrize("path", ALL, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_every_shipped_config_still_validates(path, capsys):
    obj = load_any(path)
    rc, out, err = run_cli(["config", "validate", str(path)], capsys)
    assert rc == 0 and out.startswith("OK "), err
    if isinstance(obj, RunConfig):
        args = obj.megatron_args()
        assert int(args[args.index("--max-position-embeddings") + 1]) >= obj.model.seq_length
        assert obj.training.min_lr <= obj.training.lr
        assert obj.training.save is None or obj.training.save_interval is not None
