"""Policy configs: every shipped YAML loads; bad input names the file and key."""
from pathlib import Path

import pytest

from megatron_rails.core.policy import ConfigError, PolicyConfig

POLICY_DIR = Path(__file__).resolve().parent.parent / "configs" / "policies"


@pytest.mark.parametrize("path", sorted(POLICY_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_policy_configs_load(path):
    cfg = PolicyConfig.from_yaml(path)
    assert path.stem == "default" or cfg.policy == path.stem


def test_default_is_fsep():
    default = PolicyConfig.from_yaml(POLICY_DIR / "default.yaml")
    assert (default.policy, default.comm) == ("ultraep", "rails")  # the product's shape: ultraep + RailS


@pytest.mark.parametrize("text, match", [
    ("policy: magic\n", "policy: unknown policy 'magic'"),
    ("policy: fsep\nslotz: 2\n", "slotz: unknown key; did you mean 'slots'"),
    ("policy: fsep\nslots: two\n", "slots: expected"),
    ("policy: fsep\nslots: -1\n", "slots: expected"),
    ("policy: fsep\ncomm: smoke\n", "comm: must be one of"),
    ("policy: fsep\ncheck_plan: 3\n", "check_plan"),
    ("policy: ultraep\ntolerance: -0.01\n", "tolerance: expected a number in"),
    ("policy: ultraep\ntolerance: lots\n", "tolerance: expected a number in"),
    ("policy: fsep\ncomm: rails\nrails_tolerance: 2\n", "rails_tolerance: expected a number in"),
    ("policy: fsep\ncomm: rails\nrails_tolerance: true\n", "rails_tolerance: expected a number in"),
    ("- just\n- a list\n", "mapping"),
])
def test_bad_configs_name_file_and_key(tmp_path, text, match):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match) as err:
        PolicyConfig.from_yaml(f)
    assert "bad.yaml" in str(err.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        PolicyConfig.from_yaml("/nonexistent/policy.yaml")


def test_exponent_without_dot_reads_as_a_number_everywhere(tmp_path):
    """YAML 1.1 reads `1e-2` and `4e2` (no dot) as strings; every loader takes them as the numbers a
    user meant, the policy and topology loaders as the run-config loader does (they disagreed)."""
    from megatron_rails.config.run import load_any
    from megatron_rails.core.topology import load_topology

    pol = tmp_path / "p.yaml"
    pol.write_text("policy: ultraep\ntolerance: 1e-2\n")
    assert PolicyConfig.from_yaml(pol).tolerance == 0.01
    topo = tmp_path / "t.yaml"
    topo.write_text("gpus_per_node: 8\nrails_per_node: 8\nnic_gbps: 4e2\n")
    assert load_topology(str(topo)).nic_gbps == 400.0
    assert load_any(str(topo)).nic_gbps == 400.0
    pol.write_text("policy: ultraep\ntolerance: 1e-2x\n")
    with pytest.raises(ConfigError, match="tolerance"):
        PolicyConfig.from_yaml(pol)


def test_yaml_merge_keys_load_and_duplicates_do_not(tmp_path):
    """A config may override what a merge (`<<: *base`) brings in; a key written twice is refused."""
    from megatron_rails.core.yamlfile import read_mapping

    f = tmp_path / "m.yaml"
    f.write_text("base: &b\n  a: 1\n  c: 3\nx:\n  <<: *b\n  a: 2\n")
    assert read_mapping(f, ConfigError, "YAML", "") == {"base": {"a": 1, "c": 3}, "x": {"a": 2, "c": 3}}
    f.write_text("x:\n  a: 1\n  a: 2\n")
    with pytest.raises(ConfigError, match="key 'a' given twice"):
        read_mapping(f, ConfigError, "YAML", "")


def test_a_long_list_without_aliases_is_no_alias_bomb():
    """The alias limit counts expanded values only where aliases expanded them: a data blend of
    thousands of shards written out is a config's own size."""
    from megatron_rails.core.yamlfile import MAX_VALUES, YamlShapeError, parse

    blend = "data_path: [" + ", ".join(f"1, /data/shard{i}" for i in range(MAX_VALUES)) + "]"
    assert len(parse(blend)["data_path"]) == 2 * MAX_VALUES
    bomb = "a: &a [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcd", "bcde"))
    with pytest.raises(YamlShapeError, match="aliases"):
        parse(bomb)


@pytest.mark.parametrize("text,value", [
    ("010", 10), ("0o10", "0o10"), ("0x1f", "0x1f"), ("0b101", "0b101"), ("1_000", "1_000"), ("-5", -5),
    ("true", True), ("False", False), ("yes", "yes"), ("off", "off"), ("On", "On"), ("2:00", "2:00"),
    ("1:30.5", "1:30.5"), ("1_0.5", "1_0.5"), ("1.5", 1.5), ("6.02e+23", 6.02e23), ("1e-3", 1e-3), ("-.5", -0.5),
    ("!!int 0x10", 16)])
def test_yaml_scalars_read_strictly(text, value):
    # YAML 1.1 (PyYAML) read 010 as 8, 0x1f as 31, 1_000 as 1000, 2:00 as 120, 1:30.5 as 90.5 and yes/on
    # as true: a config that says `slots: 2:00` ran with 120 slots, `slots: 0x10` with 16; now they are
    # text, which the key's type check refuses (an explicit tag is read as tagged)
    from megatron_rails.core.yamlfile import parse

    got = parse(f"a: {text}")["a"]
    assert got == value and type(got) is type(value)


def test_yaml_1_1_forms_are_refused_where_a_number_or_boolean_belongs(tmp_path):
    for body, words in (("slots: 2:00", "slots: expected integer, got '2:00'"),
                        ("slots: 0x10", "slots: expected integer, got '0x10'"),
                        ("slots: 1_0", "slots: expected integer, got '1_0'"),
                        ("check_plan: yes", "check_plan: expected true or false, got 'yes'")):
        path = tmp_path / "p.yaml"
        path.write_text(f"policy: ultraep\n{body}\n")
        with pytest.raises(ConfigError, match=words):
            from megatron_rails.config.run import load_any
            load_any(path)


def test_unprintable_key_characters_are_escaped_in_messages(tmp_path):
    # a key holding a terminal escape or a right-to-left override must not recolor or reorder the message
    from megatron_rails.config.run import load_any

    path = tmp_path / "p.yaml"
    path.write_text('policy: fsep\n"\\e[31mRED": 1\n"a\\u202eb": 2\n', encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_any(path)
    text = str(err.value)
    assert "\\x1b[31mRED: unknown key" in text and "a\\u202eb: unknown key" in text
    assert "\x1b" not in text and "\u202e" not in text
