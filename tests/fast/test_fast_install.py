"""``fullshard.install()`` (NOTE [Routing torch's FSDP2 names]): torch's public FSDP2 names
become fullshard's, in torch's modules and in modules that imported them earlier; the handle
(or the ``with`` block) puts back exactly torch's objects; nested installs restore once."""

from __future__ import annotations

import sys
import types

import pytest
import torch.distributed._composable.fsdp as composable
import torch.distributed.fsdp as tfsdp

import fullshard
from fullshard.engine import api

pytestmark = pytest.mark.fast


def test_install_routes_torchs_names_and_uninstall_restores_them() -> None:
    theirs = {n: getattr(tfsdp, n) for n in ("fully_shard", "FSDPModule", "CPUOffloadPolicy")}
    # a framework module that imported fully_shard before the swap (torchtitan, Lightning)
    early = types.ModuleType("early_framework")
    early.fs = theirs["fully_shard"]  # type: ignore[attr-defined]
    sys.modules["early_framework"] = early
    try:
        handle = fullshard.install()
        assert tfsdp.fully_shard is api.fully_shard
        assert tfsdp.FSDPModule is api.FSDPModule
        assert tfsdp.CPUOffloadPolicy is fullshard.CPUOffloadPolicy
        assert composable.fully_shard is api.fully_shard
        assert early.fs is api.fully_shard  # type: ignore[attr-defined]
        with fullshard.install() as inner:  # nested: nothing more to change
            assert not inner.active
        assert tfsdp.fully_shard is api.fully_shard  # the inner exit restored nothing
        handle.uninstall()
        for name, obj in theirs.items():
            assert getattr(tfsdp, name) is obj
        assert early.fs is theirs["fully_shard"]  # type: ignore[attr-defined]
        assert composable.fully_shard is theirs["fully_shard"]
    finally:
        del sys.modules["early_framework"]


def test_install_as_a_context_manager() -> None:
    theirs = tfsdp.fully_shard
    with fullshard.install():
        from torch.distributed.fsdp import fully_shard

        assert fully_shard is api.fully_shard
    assert tfsdp.fully_shard is theirs


def test_fully_shard_takes_torchs_policy_objects() -> None:
    # a framework may build torch's policies before install(): they mean the same here
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    mp, off = api._our_policies(
        MixedPrecisionPolicy(param_dtype=torch.bfloat16), CPUOffloadPolicy(pin_memory=False)
    )
    assert mp == fullshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert off == fullshard.CPUOffloadPolicy(pin_memory=False)
