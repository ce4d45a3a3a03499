"""What the command line and the planner read without torch agrees with the engine it stands for: the policy
catalog with the policy classes, the memory model's layout constants with the cache's, the --weights / --kv values
with the quantizers', the CPU's class with torch's; and a setting's source is a kind plus the text people read."""

from __future__ import annotations

import pickle
import subprocess
import sys
from dataclasses import replace

import pytest

from localchat.config import PolicySpec, RunSpec
from localchat.engine.policies import POLICIES, Policy
from localchat.engine.policies.catalog import CATALOG, ROWS, options
from localchat.planning import memory, resolve
from localchat.planning.sources import DEFAULT, FLAG, Kind, Source, kind_of


@pytest.mark.parametrize("name", list(CATALOG))
def test_the_catalog_row_is_what_the_class_declares(name):
    row, cls = CATALOG[name], POLICIES[name]
    assert cls.__module__.removeprefix("localchat.engine.policies.").split(".")[0] == row.module
    assert (row.summary, row.evicts, row.selects, row.hybrid, row.attention_function, row.options) == \
        (cls.summary, cls.evicts, cls.selects, cls.hybrid, cls.attention_function, cls.options)
    assert row.heads == ("heads" in cls.fields())
    assert row.uses_budget() == cls.uses_budget()


def test_the_catalog_lists_every_policy_in_order_and_the_flags_once():
    assert list(POLICIES) == [row.name for row in ROWS]
    flags = [opt.flag for cls in POLICIES.values() for opt in cls.options.values()]
    assert list(options()) == list(dict.fromkeys(flags))


@pytest.mark.parametrize("name", list(CATALOG))
def test_positions_default_is_the_policys_own_when_it_evicts(name):
    cls = POLICIES[name]
    assert cls.positions_default() == (cls.default_positions if cls.evicts else "original")
    spec, sources = resolve.policy_spec(name, {}, {}, None, "cpu")
    assert spec.positions == cls.positions_default() and sources["positions"].kind is Kind.POLICY_DEFAULT


def test_the_memory_models_layout_is_the_caches():
    from localchat.engine.cache import REST_BYTES
    from localchat.engine.qcache import RESIDUAL
    from localchat.kernels.qattn import BLOCK_UNITS
    from localchat.kernels.quant import GROUP, group_size

    assert (memory.KV_GROUP, memory.REST_BYTES, memory.RESIDUAL, memory.BLOCK_UNITS) == \
        (GROUP, REST_BYTES, RESIDUAL, BLOCK_UNITS)
    assert [memory.group_size(d) for d in range(1, 513)] == [group_size(d) for d in range(1, 513)]


def test_the_quant_values_are_the_engines_and_checked_in_one_place():
    from localchat.args import check_quant
    from localchat.engine import precision, qcache, quantize
    from localchat.engine.heads import CONFIG, WEIGHTS
    from localchat.engine.heads_files import CONFIG as LIGHT_CONFIG
    from localchat.engine.heads_files import WEIGHTS as LIGHT_WEIGHTS
    from localchat.errors import UserError

    assert qcache.KV_CHOICES is precision.KV_CHOICES and quantize.WEIGHTS is precision.WEIGHTS
    assert (WEIGHTS, CONFIG) == (LIGHT_WEIGHTS, LIGHT_CONFIG)
    check_quant("nf4", "int2")
    with pytest.raises(UserError, match="unknown --kv 'int3'; choose one of: none, int8, int4, int2"):
        check_quant(None, "int3")
    with pytest.raises(UserError, match="unknown --weights 'int3'"):
        quantize.check("int3", None)


def test_the_cpu_class_read_without_torch_is_torchs():
    import torch

    light = subprocess.run([sys.executable, "-c", "import sys; from localchat.planning.planner import cpu_class; "
                            "print(cpu_class(), 'torch' in sys.modules)"], capture_output=True, text=True, check=True)
    assert light.stdout.split() == [torch.backends.cpu.get_cpu_capability(), "False"]


def test_a_source_reads_as_before_and_compares_by_kind():
    assert FLAG == "command line" and FLAG.kind is Kind.FLAG
    assert Source.plan("the largest that fits 1.0 GiB") == "plan: the largest that fits 1.0 GiB"
    assert Source.plan() == "plan" and Source.default() == "default" == DEFAULT
    assert Source.default("heads ship for the model") == "default (heads ship for the model)"
    noted = Source(Kind.CARD).noted("lowered to fit the budget")
    assert noted == "model card, lowered to fit the budget" and noted.kind is Kind.CARD
    assert pickle.loads(pickle.dumps(noted)).kind is Kind.CARD
    assert kind_of(None) is Kind.DEFAULT and kind_of("command line") is Kind.DEFAULT  # a plain string: no kind


def test_what_a_plan_keeps_follows_the_kinds_not_the_words():
    spec = RunSpec(policy=PolicySpec("locret", budget=512), sources={
        "budget": Source(Kind.CARD), "chunk": Source(Kind.ENV, "LOCALCHAT_CHUNK"), "weights": Source.plan("int8"),
        "kv": Source(Kind.PROFILE, "profile mine (config.toml)")})
    assert resolve.fixed_fields(spec) == {"chunk", "kv"}
    # a profile whose name reads like another kind is still a profile
    odd = replace(spec, sources={**spec.sources, "budget": Source(Kind.PROFILE, "plan: a profile named so")})
    assert resolve.fixed_fields(odd) == {"budget", "chunk", "kv"}
    assert resolve.is_default(spec, "policy") and not resolve.is_default(spec, "budget")


def test_a_policy_module_is_imported_when_its_class_is_asked_for():
    code = ("import sys; from localchat.engine.policies import policy_class; policy_class('locret'); "
            "print(sorted(m.rsplit('.', 1)[1] for m in sys.modules if m.startswith('localchat.engine.policies.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["base", "catalog", "locret"]
    assert issubclass(POLICIES["locret"], Policy)
