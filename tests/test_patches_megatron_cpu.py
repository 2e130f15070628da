"""The patch framework (pure unit tests on fake modules) and the megatron-core CPU shim.

The shim tests import megatron-core once (a few seconds, more on a loaded machine), hence the
looser timeout on them; each test's own work is well under a second.
"""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch

from pitstop.errors import PatchError
from pitstop.patches import Patch, PatchSet

FAST = pytest.mark.timeout(10)
MEGATRON = pytest.mark.timeout(60)  # first use imports megatron-core


# --------------------------------------------------------------------- fake module
FAKE = "pitstop_test_fake_upstream"


def _make_fake() -> types.ModuleType:
    mod = types.ModuleType(FAKE)

    def func(a, b, c=1):
        # the body the source check looks at: x.cuda()
        return a + b + c

    class Base:
        def inherited(self, x):
            return ("base", x)

    class Klass(Base):
        def method(self, x, y):
            return ("method", x, y)

        @staticmethod
        def static(x):
            return ("static", x)

        @classmethod
        def klass(cls, x):
            return ("klass", cls.__name__, x)

    mod.func = func
    mod.Klass = Klass
    mod.Base = Base
    return mod


@pytest.fixture
def fake(monkeypatch):
    mod = _make_fake()
    monkeypatch.setitem(sys.modules, FAKE, mod)
    return mod


def _patch(name="fake.func", attr="func", params=("a", "b", "c"), requires=">=0",
           replacement=None, **kw) -> Patch:
    if replacement is None:
        def replacement(orig):
            @functools.wraps(orig)
            def new(*args, **kwargs):
                return ("patched", orig(*args, **kwargs))
            return new
    return Patch(name=name, module=FAKE, attr=attr, replacement=replacement, params=params,
                 requires=requires, dist="pytest", **kw)


# ------------------------------------------------------------------- Patch.check()
@FAST
def test_check_passes_on_matching_target(fake):
    _patch().check()


@FAST
def test_missing_attribute_raises_with_name(fake):
    with pytest.raises(PatchError, match=r"'fake\.gone'.*missing attribute 'nope'"):
        _patch(name="fake.gone", attr="nope").check()


@FAST
def test_missing_nested_attribute_raises_with_name(fake):
    with pytest.raises(PatchError, match=r"'fake\.nested'.*missing attribute 'Nope'"):
        _patch(name="fake.nested", attr="Nope.method", params=None).check()
    with pytest.raises(PatchError, match=r"'fake\.nested2'.*missing attribute 'gone'"):
        _patch(name="fake.nested2", attr="Klass.gone", params=None).check()


@FAST
def test_missing_module_raises_with_name(monkeypatch):
    monkeypatch.delitem(sys.modules, FAKE, raising=False)
    with pytest.raises(PatchError, match=r"'fake\.mod'.*does not import"):
        _patch(name="fake.mod").check()


@FAST
def test_signature_change_raises_with_both_signatures(fake):
    with pytest.raises(PatchError) as info:
        _patch(name="fake.sig", params=("a", "b", "d")).check()
    msg = str(info.value)
    assert "'fake.sig'" in msg and f"{FAKE}.func" in msg
    assert "signature changed: expected (a, b, d) got (a, b, c)" in msg


@FAST
def test_version_out_of_spec_raises(fake):
    with pytest.raises(PatchError, match=r"'fake\.ver'.*pytest version .* not in '<0'"):
        _patch(name="fake.ver", requires="<0").check()


@FAST
def test_missing_distribution_raises(fake):
    p = _patch(name="fake.dist")
    p.dist = "no-such-distribution-pitstop"
    with pytest.raises(PatchError, match=r"'fake\.dist'.*not installed"):
        p.check()


@FAST
def test_source_fragment_missing_raises(fake):
    _patch(source_contains=("x.cuda()",)).check()
    with pytest.raises(PatchError, match=r"'fake\.src'.*no longer contains \['y\.cuda\(\)'\]"):
        _patch(name="fake.src", source_contains=("y.cuda()",)).check()


@FAST
def test_check_does_not_modify_anything(fake):
    before = dict(vars(fake))
    with pytest.raises(PatchError):
        _patch(params=("z",)).check()
    assert vars(fake) == before


# ------------------------------------------------------------ Patch.apply/revert()
@FAST
def test_apply_revert_function_identity(fake):
    orig = fake.func
    p = _patch()
    p.apply()
    assert fake.func is not orig and fake.func(1, 2) == ("patched", 4)
    assert p.applied and p.original is orig
    p.apply()  # idempotent: no double wrapping
    assert fake.func(1, 2) == ("patched", 4)
    p.revert()
    assert fake.func is orig and not p.applied
    p.revert()  # idempotent
    assert fake.func is orig


@FAST
def test_apply_revert_static_class_and_plain_methods(fake):
    K = fake.Klass
    raw = {k: K.__dict__[k] for k in ("method", "static", "klass")}
    patches = [
        _patch(name="fake.method", attr="Klass.method", params=("self", "x", "y")),
        _patch(name="fake.static", attr="Klass.static", params=("x",)),
        _patch(name="fake.klass", attr="Klass.klass", params=("cls", "x")),
    ]
    for p in patches:
        p.apply()
    assert isinstance(K.__dict__["static"], staticmethod)
    assert isinstance(K.__dict__["klass"], classmethod)
    assert K().method(1, 2) == ("patched", ("method", 1, 2))
    assert K.static(3) == ("patched", ("static", 3))
    assert K.klass(4) == ("patched", ("klass", "Klass", 4))
    for p in reversed(patches):
        p.revert()
    for k, v in raw.items():
        assert K.__dict__[k] is v


@FAST
def test_inherited_attribute_is_removed_again_on_revert(fake):
    K = fake.Klass
    p = _patch(name="fake.inh", attr="Klass.inherited", params=("self", "x"))
    p.apply()
    assert "inherited" in K.__dict__ and K().inherited(1) == ("patched", ("base", 1))
    p.revert()
    assert "inherited" not in K.__dict__ and K.inherited is fake.Base.__dict__["inherited"]


@FAST
def test_revert_refuses_to_clobber_a_later_replacement(fake):
    p = _patch()
    p.apply()
    fake.func = lambda *a: "someone else"
    with pytest.raises(PatchError, match="replaced by someone else"):
        p.revert()


# ----------------------------------------------------------------------- PatchSet
@FAST
def test_patchset_applies_nothing_when_one_check_fails(fake):
    orig_func, orig_method = fake.func, fake.Klass.__dict__["method"]
    good = _patch(name="fake.good")
    good2 = _patch(name="fake.good2", attr="Klass.method", params=("self", "x", "y"))
    bad = _patch(name="fake.bad", attr="Klass.static", params=("nope",))
    ps = PatchSet("fakeset", [good, bad, good2])
    with pytest.raises(PatchError) as info:
        ps.apply()
    assert "fake.bad" in str(info.value) and "nothing applied" in str(info.value)
    assert not ps.applied and not good.applied and not good2.applied
    assert fake.func is orig_func and fake.Klass.__dict__["method"] is orig_method


@FAST
def test_patchset_rolls_back_when_a_replacement_factory_raises(fake):
    orig = fake.func

    def boom(_orig):
        raise RuntimeError("factory failed")

    ps = PatchSet("fakeset", [_patch(name="fake.ok"),
                              _patch(name="fake.boom", attr="Klass.static", params=("x",),
                                     replacement=boom)])
    with pytest.raises(RuntimeError, match="factory failed"):
        ps.apply()
    assert not ps.applied and fake.func is orig


@FAST
def test_patchset_reverts_in_reverse_order(fake):
    # Two patches stacked on one attribute only unwind cleanly in reverse order.
    orig = fake.func
    first = _patch(name="fake.first")
    second = _patch(name="fake.second")
    ps = PatchSet("stack", [first, second])
    ps.apply()
    assert ps.applied and fake.func(1, 2) == ("patched", ("patched", 4))
    ps.apply()  # idempotent
    ps.revert()
    assert not ps.applied and fake.func is orig


@FAST
def test_patchset_rejects_duplicate_names(fake):
    with pytest.raises(PatchError, match="duplicate"):
        PatchSet("dup", [_patch(), _patch()])


# ------------------------------------------------------------------ the CPU shim
@pytest.fixture(scope="module")
def shim():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pitstop.patches import megatron_cpu

        for p in megatron_cpu.PATCHES:  # import every target module once
            p._owner_and_leaf()
    yield megatron_cpu
    megatron_cpu.revert()


@pytest.fixture
def reverted(shim):
    shim.revert()
    yield shim
    shim.revert()


def _raw_targets(shim):
    out = {}
    for p in shim.PATCHES:
        owner, leaf = p._owner_and_leaf()
        out[p.name] = (owner, leaf, owner.__dict__[leaf])
    return out


def _shim_patch_names():
    from pitstop.patches import megatron_cpu

    return [p.name for p in megatron_cpu.PATCHES]


@MEGATRON
@pytest.mark.parametrize("name", _shim_patch_names())
def test_shim_patch_fits_installed_megatron(reverted, name):
    (patch,) = [p for p in reverted.PATCHES if p.name == name]
    patch.check()


@MEGATRON
def test_shim_patches_have_signatures_or_source_pins(shim):
    for p in shim.PATCHES:
        assert p.params is not None or p.source_contains, p.name
        assert p.requires and p.dist == "megatron-core"


@MEGATRON
def test_shim_apply_revert_restores_identical_objects(reverted):
    shim = reverted
    before = _raw_targets(shim)
    assert shim.apply(force=True) is True
    assert shim.is_applied()
    for name, (owner, leaf, raw) in before.items():
        assert owner.__dict__[leaf] is not raw, name
    assert shim.apply(force=True) is True  # idempotent
    shim.revert()
    assert not shim.is_applied()
    for name, (owner, leaf, raw) in before.items():
        assert owner.__dict__[leaf] is raw, name
    shim.revert()  # idempotent


@MEGATRON
def test_shim_is_noop_when_cuda_is_available(reverted, monkeypatch):
    shim = reverted
    before = _raw_targets(shim)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert shim.apply() is False
    assert not shim.is_applied()
    for name, (owner, leaf, raw) in before.items():
        assert owner.__dict__[leaf] is raw, name


@MEGATRON
def test_shim_applies_without_cuda(reverted, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert reverted.apply() is True and reverted.is_applied()


@MEGATRON
def test_shim_leaves_global_torch_alone(reverted):
    real = {k: getattr(torch.cuda, k) for k in ("current_device", "synchronize",
                                                 "get_rng_state", "manual_seed")}
    real_zeros, real_tensor, real_type = torch.zeros, torch.tensor, torch.Tensor.type
    reverted.apply(force=True)
    assert {k: getattr(torch.cuda, k) for k in real} == real
    assert torch.zeros is real_zeros and torch.tensor is real_tensor
    assert torch.Tensor.type is real_type


@MEGATRON
def test_torch_redirect_is_scoped_to_listed_names(reverted):
    import megatron.core.pipeline_parallel.p2p_communication as p2p
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.utils as mutils

    reverted.apply(force=True)
    t = mutils.torch
    assert t is not torch and t.Tensor is torch.Tensor and t.distributed is torch.distributed
    assert t.cuda.current_device() == torch.device("cpu")
    assert t.tensor([1.0], device="cuda").device.type == "cpu"
    assert t.cuda.is_available is torch.cuda.is_available  # not listed: the real one
    assert p2p.torch.cuda.synchronize() is None
    # schedules only redirects torch.zeros(device="cuda"), not torch.cuda.*
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert schedules.torch.cuda.current_device is torch.cuda.current_device
    # GlobalMemoryBuffer allocates on current_device()
    buf = mutils.GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "test")
    assert buf.device.type == "cpu" and buf.shape == (2, 3)


@MEGATRON
def test_rng_tracker_forks_the_cpu_generator(reverted):
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    reverted.apply(force=True)
    torch.manual_seed(0)
    outer = torch.get_rng_state()
    tracker = CudaRNGStatesTracker()
    tracker.add("mp", 1234)
    assert torch.equal(torch.get_rng_state(), outer)  # add() leaves the default state alone
    with tracker.fork("mp"):
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outer)  # fork() restores it
    tracker2 = CudaRNGStatesTracker()
    tracker2.add("mp", 1234)
    with tracker2.fork("mp"):
        b = torch.rand(4)
    assert torch.equal(a, b)
    with tracker.fork("mp"):  # the tracked stream advanced
        c = torch.rand(4)
    assert not torch.equal(a, c)


@FAST
def test_reporting_cuda_type_is_scoped():
    from pitstop.patches.megatron_cpu import _reporting_cuda_type

    p = torch.nn.Parameter(torch.zeros(3))
    g = torch.zeros(3, dtype=torch.bfloat16)
    with _reporting_cuda_type([p, g]):
        assert p.type() == "torch.cuda.FloatTensor"
        assert g.type() == "torch.cuda.BFloat16Tensor"
        assert p.type(torch.float64).dtype == torch.float64  # conversion untouched
    assert p.type() == "torch.FloatTensor" and "type" not in p.__dict__
    assert g.type() == "torch.BFloat16Tensor"


@MEGATRON
def test_embedding_setup_wrapper_hides_cuda_copy(reverted):
    """The wrapped upstream sees _is_in_embd_group() False; the override does not outlive it."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    seen = []

    class FakeLM:
        def _is_in_embd_group(self):
            return True

    wrapper = reverted.PATCHES.patches[
        [p.name for p in reverted.PATCHES].index(
            "megatron_cpu.language_module.setup_embeddings_and_output_layer")
    ].replacement(lambda self: seen.append(self._is_in_embd_group()))
    lm = FakeLM()
    assert not torch.distributed.is_initialized()
    wrapper(lm)
    assert seen == [False]
    assert "_is_in_embd_group" not in lm.__dict__ and lm._is_in_embd_group() is True
    assert callable(LanguageModule.setup_embeddings_and_output_layer)
