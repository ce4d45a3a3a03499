"""Profiles: built-ins, config.toml, precedence (CLI > LOCALCHAT_* > profile > auto), validation, writing."""

from __future__ import annotations

import pytest

from localchat.cli import main
from localchat.errors import UserError
from localchat.planning import profiles
from localchat.planning.memory import GIB, Device

BUILTINS = {"rtx4090", "rtx3090", "rtx4080", "rtx4070", "rtx3060", "rtx4060", "a100-80gb", "h100-80gb", "cpu"}
CPU = Device("cpu", "Test CPU", 16 * GIB, 8 * GIB)


@pytest.fixture()
def config(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCHAT_CONFIG_DIR", str(tmp_path))
    for key in [*profiles.SETTINGS, "profile"]:
        monkeypatch.delenv(profiles.env_name(key), raising=False)
    path = tmp_path / "config.toml"

    def write(text: str):
        path.write_text(text)
        return path

    return write


def test_builtins_are_all_there_and_valid(config):
    found = profiles.builtin_profiles()
    assert set(found) == BUILTINS
    assert profiles.validate() == []
    assert found["rtx4090"].meta["memory_gb"] == 24 and found["rtx4090"].values["weights"] == "nf4"
    assert found["rtx4080"].meta["memory_gb"] == 16 and found["rtx4060"].meta["memory_gb"] == 8


def test_precedence_cli_over_env_over_profile(config):
    config('default_profile = "mine"\n[profiles.mine]\nbudget = 2048\nchunk = 256\nlocal = 50\npolicy = "h2o"\n')
    env = {"LOCALCHAT_CHUNK": "384", "LOCALCHAT_LOCAL": "60"}
    r = profiles.resolve({"local": 70}, env=env)
    assert r.values == {"budget": 2048, "chunk": 384, "local": 70, "policy": "h2o"}
    assert r.sources["local"] == "command line"
    assert r.sources["chunk"] == "LOCALCHAT_CHUNK"
    assert r.sources["budget"].startswith("profile mine")
    assert "stabilizers" not in r.values  # left to the auto-detected layer (card / planner)
    assert r.profile_source.startswith("default_profile")


def test_precedence_cli_over_saved_chat_over_env_over_profile(config):
    """A saved chat's settings sit between the flags given now and the environment."""
    config('default_profile = "mine"\n[profiles.mine]\nbudget = 2048\nchunk = 256\nlocal = 50\npolicy = "h2o"\n')
    env = {"LOCALCHAT_CHUNK": "384", "LOCALCHAT_LOCAL": "60", "LOCALCHAT_BUDGET": "999"}
    saved = {"budget": 512, "chunk": 128, "policy": "streaming"}
    r = profiles.resolve({"local": 70}, env=env, saved=saved, saved_label="chat 't1'")
    assert r.values == {"budget": 512, "chunk": 128, "local": 70, "policy": "streaming"}
    assert r.sources == {"budget": "chat 't1'", "chunk": "chat 't1'", "local": "command line", "policy": "chat 't1'"}
    r = profiles.resolve({"budget": 64}, env=env, saved=saved)
    assert r.values["budget"] == 64 and r.sources["budget"] == "command line" and r.values["local"] == 60


def test_a_saved_chats_settings_resolve_into_the_same_spec(config):
    """resolve(): a follow-up with no flags gets the first turn's RunSpec back (budget, chunk, n_s, positions,
    precision); a flag overrides one; a flag naming another policy or model drops what belonged to the old one."""
    from localchat.planning.resolve import changed_settings, resolve, saved_flags

    first = resolve({"policy": "locret", "budget": 512, "stabilizers": 100, "chunk": 256, "kv": "int8"}, env={},
                    device=CPU)
    saved = saved_flags(first.to_dict())
    again = resolve({}, env={"LOCALCHAT_BUDGET": "4096"}, device=CPU, saved=saved, saved_label="chat 't1'")
    assert again.to_dict() == first.to_dict() and changed_settings(saved, again) == []
    assert again.sources["budget"] == "chat 't1'" and again.sources["stabilizers"] == "chat 't1'"
    bigger = resolve({"budget": 1024}, env={}, device=CPU, saved=saved)
    assert (bigger.policy.budget, bigger.chunk, bigger.kv) == (1024, 256, "int8")
    assert changed_settings(saved, bigger) == ["budget 512 -> 1024"]
    other = resolve({"policy": "streaming"}, env={}, device=CPU, saved=saved)
    assert other.policy.name == "streaming" and other.chunk == 256 and "stabilizers" not in dict(other.policy.params)
    assert changed_settings(saved, other)[0] == "policy locret -> streaming"
    assert resolve({"model": "tests/data/configs/qwen2.5-7b-instruct.json"}, env={}, device=CPU, plan=False,
                   saved=saved).chunk != 256  # another model: nothing saved applies


def test_profile_choice_order(config):
    config('default_profile = "cpu"\n')
    assert profiles.resolve({}, env={}).profile.name == "cpu"
    assert profiles.resolve({}, env={"LOCALCHAT_PROFILE": "rtx4090"}).profile.name == "rtx4090"
    assert profiles.resolve({}, "rtx4080", env={"LOCALCHAT_PROFILE": "rtx4090"}).profile.name == "rtx4080"
    r = profiles.resolve({}, "none", env={"LOCALCHAT_PROFILE": "rtx4090"})
    assert r.profile is None and r.values == {}


def test_user_profile_replaces_a_builtin_of_the_same_name(config):
    config("[profiles.cpu]\nbudget = 512\n")
    p = profiles.find("cpu")
    assert p.values == {"budget": 512} and p.origin.endswith("config.toml")


def test_unknown_profile_lists_the_known_ones(config):
    with pytest.raises(UserError, match=r"unknown profile 'rtx9090'; known profiles: a100-80gb, cpu, .*rtx4090"):
        profiles.resolve({}, "rtx9090", env={})


def test_malformed_toml_names_file_and_line(config):
    path = config('default_profile = "cpu"\n[profiles.a]\nbudget = \n')
    with pytest.raises(UserError) as e:
        profiles.read_config()
    assert str(path) in str(e.value) and "line 3" in str(e.value) and "\n" not in str(e.value)


def test_validate_one_line_per_problem(config):
    config('default_profile = "ghost"\n[keys]\nattach = "ctrl+t"\n[profiles.a]\nbudget = 0\nchunk = "big"\npolicy = "zzz"\n'
           'positions = "sideways"\nweights = "fp8"\nfoo = 1\n[profiles.b]\nbudget = 100\nstabilizers = 100\n')
    bad = profiles.validate()
    joined = "\n".join(bad)
    assert "default_profile 'ghost' is not a known profile" in joined
    assert "keys" not in joined  # the chat window's [keys] table is not a profile's business
    assert "profiles.a.budget: must be >= 1 (got 0)" in joined
    assert "profiles.a.chunk: must be an integer >= 1 (got 'big')" in joined
    assert "profiles.a.policy: must be one of" in joined
    assert "profiles.a.positions: must be one of compact, original (got 'sideways')" in joined
    assert "profiles.a.weights: must be one of" in joined
    assert "profiles.a.foo: unknown setting" in joined
    assert "profiles.b: --stabilizers (100) must be below --budget (100)" in joined  # LOCRET's own rule
    assert len(bad) == 8 and all("\n" not in line for line in bad)


def test_bad_env_value_is_an_error(config):
    with pytest.raises(UserError, match="LOCALCHAT_BUDGET: must be an integer"):
        profiles.resolve({}, env={"LOCALCHAT_BUDGET": "lots"})
    with pytest.raises(UserError, match="LOCALCHAT_POSITIONS: must be one of"):
        profiles.resolve({}, env={"LOCALCHAT_POSITIONS": "sideways"})


def test_a_bad_profile_in_use_is_an_error(config):
    config("[profiles.a]\nchunk = -4\n")
    with pytest.raises(UserError, match=r"profiles\.a\.chunk: must be >= 1 \(got -4\)"):
        profiles.resolve({}, "a", env={})


def test_profile_for_another_device_warns(config):
    r = profiles.resolve({}, "rtx4090", env={}, device=CPU)
    assert r.warnings == ["profile rtx4090 is for an RTX 4090 (24 GB); this machine has Test CPU"]
    gpu = Device("cuda", "NVIDIA GeForce RTX 4090", 24 * GIB, 23 * GIB, "8.9")
    assert profiles.resolve({}, "rtx4090", env={}, device=gpu).warnings == []
    assert profiles.resolve({}, "cpu", env={}, device=CPU).warnings == []
    config(f'[profiles.t]\nfingerprint = "{gpu.fingerprint}"\nbudget = 64\n')
    warn = profiles.resolve({}, "t", env={}, device=CPU).warnings
    assert len(warn) == 1 and "was tuned on" in warn[0] and CPU.fingerprint in warn[0]
    assert profiles.resolve({}, "t", env={}, device=gpu).warnings == []


def test_save_profile_keeps_the_rest_and_replaces_the_old_one(config):
    path = config('# my settings\n[profiles.keep]\nbudget = 300  # hand-tuned\n')
    profiles.save_profile("tuned", {"budget": 100, "measured": {"chunks": [256, 512], "tokens_per_s": [1.5, 2.0]}},
                          make_default=True)
    profiles.save_profile("tuned", {"budget": 200, "measured": {"chunks": [512], "tokens_per_s": [3.0]}},
                          make_default=True)
    text = path.read_text()
    assert "# my settings" in text and "hand-tuned" in text
    assert text.count("[profiles.tuned]") == 1 and text.count("[profiles.tuned.measured]") == 1
    data = profiles.read_config()
    assert data["default_profile"] == "tuned"
    assert data["profiles"]["tuned"] == {"budget": 200, "measured": {"chunks": [512], "tokens_per_s": [3.0]}}
    assert data["profiles"]["keep"] == {"budget": 300}
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".config.toml")]  # no temp file left


def test_save_profile_rejects_odd_names(config):
    with pytest.raises(UserError, match="letters, digits"):
        profiles.save_profile("a b]", {"budget": 1})


# --- the command line --------------------------------------------------------------------------------------


def test_profile_list_and_show(config, capsys):
    config('[profiles.mine]\nchunk = 256\n')
    assert main(["profile", "list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BUILTINS | {"mine"})
    assert main(["--chunk", "128", "profile", "show", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith(" ")}
    assert "command line" in lines["chunk"] and "128" in lines["chunk"]
    assert "profile cpu (built-in)" in lines["budget"]
    assert main(["profile", "show", "--profile", "none"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line and line[0] != " "}
    assert lines["budget"].split()[1] == "1024" and "model card" in lines["budget"]  # the card below the profile
    assert lines["policy"].split()[1] == "locret" and "heads ship" in lines["policy"]


def test_max_copies_from_a_profile_or_the_environment_reaches_locret(config, capsys):
    """LOCRET's --max-copies is a profile setting like --stabilizers: profile < LOCALCHAT_MAX_COPIES < flag."""
    from localchat.planning.resolve import resolve

    config('[profiles.long]\npolicy = "locret"\nmax_copies = 64\n[profiles.wrong]\npolicy = "h2o"\nmax_copies = 8\n'
           '[profiles.neg]\nmax_copies = -1\n')
    params = lambda spec: dict(spec.policy.params)  # noqa: E731
    spec = resolve({"profile": "long"}, env={}, plan=False, quiet=True)
    assert spec.policy.name == "locret" and params(spec)["max_copies"] == 64
    assert spec.sources["asked.max_copies"] == "profile long (config.toml)"
    spec = resolve({"profile": "long"}, env={"LOCALCHAT_MAX_COPIES": "32"}, plan=False, quiet=True)
    assert params(spec)["max_copies"] == 32
    assert params(resolve({"profile": "long", "max_copies": 0}, env={}, plan=False, quiet=True))["max_copies"] == 0
    with pytest.raises(UserError, match="--max-copies applies to --policy locret, not to h2o"):
        resolve({"profile": "wrong"}, env={}, plan=False, quiet=True)
    assert main(["profile", "validate"]) == 2
    assert "profiles.neg.max_copies: must be >= 0 (got -1)" in capsys.readouterr().err


def test_every_policys_options_can_be_set_in_a_profile(config, capsys):
    """The profile keys come from Policy.options: OmniKV's --offload and --sparse-prefill too, under the flag's name,
    checked by kind and by the policy, and a switch not given on the command line leaves the profile's value."""
    from localchat.engine.policies import POLICIES
    from localchat.planning import profiles
    from localchat.planning.resolve import resolve

    keys = {o.key for cls in POLICIES.values() for o in cls.options.values()}
    assert keys <= set(profiles.SETTINGS) and {"offload", "sparse_prefill", "stabilizers"} <= keys
    config('[profiles.omni]\npolicy = "omnikv"\nsparse_prefill = 2.0\noffload = true\n'
           '[profiles.badkind]\npolicy = "omnikv"\noffload = "yes"\n'
           '[profiles.badvalue]\npolicy = "omnikv"\nsparse_prefill = -1.0\n')
    gpu = Device("cuda", "NVIDIA GeForce RTX 4090", 24 * GIB, 23 * GIB, "8.9")  # --offload is for a GPU
    spec = resolve({"profile": "omni", "offload": False}, env={}, plan=False, quiet=True, device=gpu)
    params = dict(spec.policy.params)
    assert spec.policy.name == "omnikv" and params["prefill_ratio"] == 2.0 and params["offload"] is True
    assert spec.sources["asked.sparse_prefill"] == "profile omni (config.toml)"
    spec = resolve({"profile": "omni"}, env={"LOCALCHAT_SPARSE_PREFILL": "3"}, plan=False, quiet=True, device=gpu)
    assert dict(spec.policy.params)["prefill_ratio"] == 3.0
    assert main(["profile", "validate"]) == 2
    err = capsys.readouterr().err
    assert "profiles.badkind.offload: must be true or false (got 'yes')" in err
    assert "profiles.badvalue.sparse_prefill: must be >= 0 (got -1.0)" in err


def test_profile_validate_exit_codes(config, capsys):
    assert main(["profile", "validate"]) == 0
    config("[profiles.a]\nbudget = 0\n")
    assert main(["profile", "validate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "profiles.a.budget: must be >= 1" in err


@pytest.mark.parametrize("argv, text", [
    (["--profile", "nope", "profile", "show"], "unknown profile 'nope'; known profiles:"),
    (["plan", "--profile", "nope"], "unknown profile 'nope'"),
])
def test_bad_profile_on_the_command_line(config, capsys, argv, text):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert text in err and err.count("\n") == 1 and "Traceback" not in err


def test_malformed_config_exits_2_with_one_line(config, capsys):
    config("[profiles.a\n")
    assert main(["profile", "list"]) == 2
    err = capsys.readouterr().err
    assert "config.toml: malformed TOML" in err and "line 1" in err and err.count("\n") == 1


def test_bad_config_files_and_dirs_are_one_line_errors(config, capsys, tmp_path, monkeypatch):
    path = config("")
    path.write_bytes(b'default_profile = "cpu"\n\xff\xfe budget = 1\n')  # not UTF-8
    assert main(["profile", "show"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "not UTF-8" in err and err.count("\n") == 1
    config("[profiles.x]\nbudget = \n")  # malformed TOML: `--profile none` still works
    assert main(["--profile", "none", "plan", "--json"]) == 0
    capsys.readouterr()
    config("[profiles.huge]\nbudget = 100000000000000000000\n")
    assert main(["--profile", "huge", "plan"]) == 2
    assert "budget: must be below" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(blocker))
    assert main(["sessions"]) == 2
    err = capsys.readouterr().err
    assert f"LOCALCHAT_DATA_DIR={blocker}" in err and err.count("\n") == 1
    monkeypatch.delenv("LOCALCHAT_DATA_DIR")
    assert main(["sessions", "--delete", ""]) == 2
    assert "session name is empty" in capsys.readouterr().err


def test_a_cards_measured_policy_is_the_default_before_its_shipped_heads(config):
    """Gemma 3 270M's card ships heads but names SirLLM at b=512 and original positions (measured better). A flag
    wins; the card's [locret] budget serves every evicting policy, its positions LOCRET only."""
    from localchat.planning.resolve import resolve
    from localchat.planning.sources import Kind

    spec = resolve({"model": "gemma3-270m"}, env={}, plan=False, quiet=True)
    assert (spec.policy.name, spec.policy.budget, spec.policy.positions) == ("sirllm", 512, "original")
    assert spec.sources["policy"].kind == spec.sources["budget"].kind == spec.sources["positions"].kind == Kind.CARD
    spec = resolve({"model": "gemma3-270m", "budget": 256}, env={}, plan=False, quiet=True)
    assert (spec.policy.name, spec.policy.budget) == ("sirllm", 256) and spec.sources["budget"].kind == Kind.FLAG
    spec = resolve({"model": "gemma3-270m", "policy": "streaming"}, env={}, plan=False, quiet=True)
    assert (spec.policy.positions, spec.policy.budget) == ("compact", 512)  # its own positions, the card's budget
    spec = resolve({"model": "gemma3-270m", "policy": "locret"}, env={}, plan=False, quiet=True)
    assert (spec.policy.budget, spec.policy.positions) == (512, "original")
    assert spec.sources["positions"].kind == Kind.CARD
    spec = resolve({}, env={}, plan=False, quiet=True)  # the default model: its shipped heads, LOCRET
    assert spec.policy.name == "locret" and spec.sources["policy"].kind == Kind.DEFAULT
