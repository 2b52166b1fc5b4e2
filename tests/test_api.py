"""The Python API (oomtune/api.py): the commands as functions, on a model file's path or on a module or object with
the hooks. Devices: fake (estimate, check) and cpu (probe)."""

from __future__ import annotations

import pickle
import types

import pytest
import torch
from torch import nn

import oomtune
from oomtune.config.loading import load_config

from .conftest import EXAMPLES


class TinyMLP:
    """A model file as an object, as a notebook would write one."""

    DEFAULTS = {"batch": 16, "context": 8}

    def build_model(self):
        return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 32))

    def make_batch(self, batch_size, context_length, device):
        return torch.randn(batch_size, 32, device=device)

    def loss(self, model, batch):
        return model(batch).square().mean()


def test_estimate_takes_an_object_with_the_hooks_and_returns_plan_config_and_breakdown():
    result = oomtune.estimate(TinyMLP(), budget="600MiB")
    assert result.plan is not None and result.plan == result.config.plan
    assert result.breakdown.peak_bytes == result.config.found_by.peak_bytes
    assert result.config.found_by.card == "generic"  # no gpu given: the generic card, as the CLI assumes


def test_probe_on_a_path_writes_the_config_and_check_reads_it(tmp_path):
    out = tmp_path / "best.yaml"
    result = oomtune.probe(EXAMPLES / "mlp_dict.py", device="cpu", budget="16MiB", batch=20, out=out, prior=True)
    assert result.plan == load_config(out).plan
    assert result.prior is not None and result.prior.missing is None  # started from the estimate
    assert load_config(out).found_by.prior.startswith("certified from an estimate on fake tensors (")
    checked = oomtune.check(out)
    assert checked.fits and checked.plan == result.plan and checked.breakdown.tensor_peak_bytes > 0


def test_a_module_namespace_works_too():
    ns = types.ModuleType("notebook")
    for name in ("build_model", "make_batch", "loss"):
        setattr(ns, name, getattr(TinyMLP(), name))
    assert oomtune.estimate(ns, gpu="t4", batch=8, context=8).plan.micro_batch_size == 8


def test_bad_input_raises_the_one_line_error(tmp_path):
    with pytest.raises(oomtune.OomtuneError, match="say how much memory"):
        oomtune.estimate(TinyMLP())
    no_batch = types.SimpleNamespace(build_model=TinyMLP().build_model)
    with pytest.raises(oomtune.OomtuneError, match="missing required function make_batch"):
        oomtune.estimate(no_batch, budget="1GiB")
    with pytest.raises(oomtune.OomtuneError, match="not a file a config can name"):
        oomtune.estimate(TinyMLP(), budget="600MiB", out=tmp_path / "x.yaml")
    assert not (tmp_path / "x.yaml").exists()


def test_what_if_and_the_memory_snapshot_are_the_estimate_commands_too(tmp_path):
    from oomtune import api

    one = api.what_if(TinyMLP(), 8, context=8, budget="600MiB", precision="bf16")
    assert one.fits is True and one.plan.micro_batch_size == 8 and one.plan.precision == "bf16"
    assert api.what_if(TinyMLP(), 8, context=8).fits is None  # no budget: the breakdown alone
    snap = tmp_path / "mem.pickle"
    result = oomtune.estimate(TinyMLP(), budget="600MiB", memory_snapshot=snap)
    with snap.open("rb") as f:
        data = pickle.load(f)
    assert data["device_traces"][0] and result.plan is not None
    with pytest.raises(oomtune.OomtuneError, match="is a folder"):
        oomtune.estimate(TinyMLP(), budget="600MiB", memory_snapshot=tmp_path)


def test_what_if_and_prior_mistakes_are_named_before_the_model_is_loaded(tmp_path):
    from oomtune import api

    missing = tmp_path / "not-written-yet.py"  # loading it would fail: each error below comes first
    with pytest.raises(oomtune.OomtuneError, match="--micro-batch must be at least 1, got 0"):
        api.what_if(missing, 0, gpu="t4")
    with pytest.raises(oomtune.OomtuneError, match="--precision 'fp8'"):
        api.what_if(missing, 4, precision="fp8", gpu="t4")
    with pytest.raises(oomtune.OomtuneError, match="not on the fake device"):
        oomtune.probe(missing, device="fake", gpu="t4", prior=True)


def test_a_dict_of_hooks_works_and_the_api_module_is_an_attribute():
    import subprocess
    import sys

    hooks = {"build_model": TinyMLP().build_model, "make_batch": TinyMLP().make_batch, "loss": TinyMLP().loss}
    assert oomtune.estimate(hooks, gpu="t4", batch=8, context=8).plan.micro_batch_size == 8
    with pytest.raises(oomtune.OomtuneError, match="missing required function build_model"):
        oomtune.estimate({"make_batch": TinyMLP().make_batch}, budget="1GiB")
    fresh = subprocess.run([sys.executable, "-c", "import oomtune; print(oomtune.api.__name__)"],
                           capture_output=True, text=True, timeout=120)  # (no earlier call imported it)
    assert fresh.returncode == 0 and fresh.stdout.strip() == "oomtune.api", fresh.stderr


@pytest.mark.parametrize("kw, said", [
    ({"batch": "16"}, "--batch must be a whole number, got '16' (str)"),
    ({"batch": 8.5}, "--batch must be a whole number, got 8.5 (float)"),
    ({"context": True}, "--context must be a whole number, got True (bool)"),
    ({"steps": "2"}, "--steps must be a whole number, got '2' (str)"),
    ({"steps": 1}, "--steps must be at least 2"),
    ({"headroom": "0.1"}, "--headroom must be a number in [0, 1), got '0.1' (str)"),
    ({"levers": 5}, "levers must be names like 'amp,checkpointing' (or a list of them), got 5"),
    ({"levers": ["amp", "x"]}, "--levers 'amp,x': unknown x"),
])
def test_a_wrong_type_is_the_one_line_error_naming_the_value(kw, said):
    with pytest.raises(oomtune.OomtuneError) as e:
        oomtune.estimate(TinyMLP(), **({"budget": "600MiB"} | kw))
    assert said in str(e.value)


def test_a_numpy_integer_is_a_whole_number(tmp_path):
    np = pytest.importorskip("numpy")
    out = tmp_path / "best.yaml"
    result = oomtune.estimate(EXAMPLES / "mlp_dict.py", budget="600MiB", batch=np.int64(8), out=out)
    assert result.plan.global_batch_size == 8 and load_config(out).found_by.target_batch == 8  # (YAML: a plain int)


def test_the_functions_leave_the_callers_random_stream_where_it_was():
    """device: cpu (probe) and fake (estimate, check): trials build models and draw batches."""
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    oomtune.probe(TinyMLP(), device="cpu", budget="16MiB", batch=4, context=8)
    oomtune.estimate(TinyMLP(), budget="600MiB", batch=4, context=8)
    assert torch.equal(torch.rand(3), expected)


def test_levers_as_a_list_and_a_check_of_no_path_are_what_a_notebook_gives():
    """levers=["amp"] raised AttributeError ('list' has no strip), check(None) a TypeError from pathlib."""
    from oomtune.search.options import parse_levers

    assert parse_levers(["amp", "accumulation"]) == parse_levers("amp,accumulation") == {"amp", "accumulation"}
    assert parse_levers([]) == parse_levers("none") == frozenset()
    listed = oomtune.estimate(TinyMLP(), budget="600MiB", levers=["amp", "accumulation"])
    assert listed.plan == oomtune.estimate(TinyMLP(), budget="600MiB", levers="amp,accumulation").plan
    with pytest.raises(oomtune.OomtuneError, match="check's config must be a config file's path or a Config, got None"):
        oomtune.check(None)


SCRIPT = '''
import sys
import torch
from torch import nn

import oomtune

def build_model():
    return nn.Linear(8, 8)

def make_batch(batch_size, context_length, device):
    return torch.randn(batch_size, 8, device=device)

def loss(model, batch):
    return model(batch).square().mean()

{call}
'''


@pytest.mark.parametrize("guarded", [False, True])
def test_a_script_that_probes_itself_at_its_top_level_gets_no_config_that_would_probe_again(guarded, tmp_path):
    """The script running now (`__main__`), handed to estimate(out=...): `oomtune train` imports the file the config
    names, which runs its top level again; where that calls oomtune, the call is refused before any trial, with the
    line; under `if __name__ == "__main__":` the config is written."""
    call = "oomtune.estimate(sys.modules[__name__], budget='600MiB', batch=4, context=1, out='best.yaml')"
    source = SCRIPT.format(call=f'if __name__ == "__main__":\n    {call}' if guarded else f"result = {call}")
    script = tmp_path / "script.py"
    script.write_text(source)
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    exec(compile(source.replace(call, "None"), str(script), "exec"), main.__dict__)  # its hooks, not its call
    out = tmp_path / "best.yaml"
    if guarded:
        assert oomtune.estimate(main, budget="600MiB", batch=4, context=1, out=out).plan is not None
        assert load_config(out).model.source.endswith("script.py")
    else:
        line = source.splitlines().index(f"result = {call}") + 1
        with pytest.raises(oomtune.OomtuneError, match=rf"top level calls estimate\(\) \(line {line}\).*__main__"):
            oomtune.estimate(main, budget="600MiB", batch=4, context=1, out=out)
        assert not out.exists()


def test_check_of_another_model_than_the_config_names_says_so(tmp_path):
    out = tmp_path / "best.yaml"
    oomtune.estimate(EXAMPLES / "mlp_dict.py", budget="2GiB", batch=4, context=8, out=out)
    assert not [n for n in oomtune.check(out).notes if n.startswith("checked ")]
    other = oomtune.check(out, model=TinyMLP())
    assert f"with the plan of {out}, which names " in other.notes[-1] and other.notes[-1].endswith("mlp_dict.py")
